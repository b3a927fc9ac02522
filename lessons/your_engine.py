r"""Your engine: the functions you wrote in the lessons, plugged into the real minivllm engine through one switch.

    from your_engine import your_engine

    reference = llm.generate(prompts, params)                  # minivllm's own functions
    with your_engine(llm, longest_cached_prefix, slot_mapping, paged_attention_one, ...) as yours:
        mine = llm.generate(prompts, params)                   # the same engine, running on yours
    yours.compare(mine, reference)                             # token for token, or an error that says where
    print(yours.report())                                      # how often the engine called each of yours

Pass functions by position (their name, or the exercise name `@exercise` gave them, says which seam) or by
keyword; each is optional, and every seam left out stays minivllm's. The switch patches one engine (its
scheduler, KV cache manager, model runner, layer 0's hooks) and, for the two seams that are module functions
(the sampler's top-k/top-p, async scheduling's plan), the module, only inside the `with`; leaving it puts
everything back. Your functions take the exercises' plain arguments; the switch builds them from the engine's
state at the seam.

A function **drives** the engine when its answer is what the engine goes on with; the switch still asks minivllm
the same question, and keeps the first disagreement to explain a wrong token (`compare` raises on either; for
`preempt`, a different victim changes the schedule, not the tokens, so only the disagreement can tell).
A function is **checked beside** the engine when its inputs are simpler than the real method's (the exercise
leaves out part of what the real one handles): it runs on the same inputs at every call, and the first
disagreement raises YourEngineError at once, naming the step.

  exercise                  seam                                              role
  00 blocks_held            each running request's block table after a step   beside (decoding requests)
  01 longest_cached_prefix  KVCacheManager.get_computed_blocks                drives (prefix-cache hits)
  02 take_blocks            KVCacheManager.allocate_slots: the fresh blocks,  beside (allocations from clean
                            taken and rolled back on a scratch journal        free blocks)
  03 schedule_step          Scheduler.schedule: tokens per request            beside (steps without preemption,
                                                                              drafts, or a KV shortage)
  04 preempt                Scheduler._choose_victim: who is preempted        drives; the queues and the freed
                            Scheduler._preempt: what it leaves                blocks checked beside
  05 slot_mapping           ModelRunner.prepare_inputs: the slot of each      drives (K/V are written there)
                            new token
  06 paged_attention_one    the attention backend's output: the last query    drives (the layer goes on with it)
                            row of each sequence, every layer
  07 tp_linear              layer 0's QKV (column) and output (row)           beside (simulated ranks: 3 on
                            projections, on each step's activations           SmolLM2, whose heads split in 3)
  08 stage_layers           worker/distributed.pp_layer_partition for this    beside (when the switch opens)
                            engine's model, 1 to 4 stages
  09 stream_deltas          each finished DELTA stream with stop strings      beside
  10 decode_memory_floor_ms bench/roofline.py for this engine's model         beside (when the switch opens)
  11 pad_decode_batch       DecodeGraphs._fill: a decode batch padded to a    drives (decode steps run on the
                            graph's size                                      static buffers you filled)
  11 plan_ahead             async_scheduler.plan_ahead (async scheduling)     drives
  11 quantize_activations   the activations entering layer 0's QKV projection beside (W8A8's rounding)
  12 top_p_filter           sampler.apply_top_k_top_p: the top-p part         drives (sampled rows)
  13 ngram_propose          NgramProposer.propose (speculative decoding)      drives (the drafts verified)
  14 get_num_new_matched_tokens  the KV connector's answer (disaggregation)   beside; its answer used if equal
  15 fit                    EncoderCacheManager.fit (images)                  drives

A seam the engine does not have (no speculative decoding, no connector, no images, synchronous scheduling) is
never called; `report()` shows 0 calls there.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import math
from collections.abc import Callable, Iterator

import torch

from course import ExerciseFailed

NAMES = ("blocks_held", "longest_cached_prefix", "take_blocks", "schedule_step", "preempt", "slot_mapping",
         "paged_attention_one", "tp_linear", "stage_layers", "stream_deltas", "decode_memory_floor_ms",
         "pad_decode_batch", "plan_ahead", "quantize_activations", "top_p_filter", "ngram_propose",
         "get_num_new_matched_tokens", "fit")
ROLES = {"blocks_held": "beside", "take_blocks": "beside", "schedule_step": "beside", "tp_linear": "beside",
         "stage_layers": "beside", "stream_deltas": "beside", "decode_memory_floor_ms": "beside",
         "quantize_activations": "beside", "get_num_new_matched_tokens": "beside"}
TOL = 1e-4            # attention rows: fp32 sums in another order differ by ~1e-7, a wrong answer by ~1e-1


class YourEngineError(ExerciseFailed):
    """Your function and minivllm's disagreed inside the engine, or the outputs differ; the message says where."""


@dataclasses.dataclass
class YourEngine:
    """What the switch saw: how often the engine called each of your functions, and the first disagreements of
    the functions that drive it (each says which call, what minivllm answered and what yours did)."""
    functions: dict[str, Callable]
    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    disagreements: list[str] = dataclasses.field(default_factory=list)

    def disagree(self, message: str) -> None:
        if len(self.disagreements) < 5:
            self.disagreements.append(message)

    def compare(self, outputs, reference, what: str = "the held prompts") -> None:
        """Raise YourEngineError unless every output's tokens equal the reference's and no function disagreed."""
        for i, (mine, ref) in enumerate(zip(outputs, reference, strict=True)):
            a, b = list(mine.outputs[0].token_ids), list(ref.outputs[0].token_ids)
            if a != b:
                at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                hint = f"; first disagreement: {self.disagreements[0]}" if self.disagreements else ""
                raise YourEngineError(f"{what}, request {i}: your engine's tokens differ from the reference's at "
                                      f"output token {at} (yours {a[at:at + 4]}, reference {b[at:at + 4]}){hint}")
        if self.disagreements:
            raise YourEngineError(f"{what}: the same tokens, but your function disagreed with minivllm's: "
                                  f"{self.disagreements[0]}")

    def report(self) -> str:
        lines = [f"{'your function':28} {'role':7} {'calls':>6}"]
        for name in self.functions:
            lines.append(f"{name:28} {ROLES.get(name, 'drives'):7} {self.calls[name]:6}")
        return "\n".join(lines)


def _keyed(functions, named) -> dict[str, Callable]:
    """{seam name: function}, from functions passed by position (named by `@exercise` or their own name)."""
    out = {}
    for fn in functions:
        name = getattr(fn, "exercise_name", fn.__name__).split(".")[-1]
        out[name] = fn
    out.update(named)
    unknown = sorted(set(out) - set(NAMES))
    if unknown:
        raise ValueError(f"your_engine: no seam for {unknown}; the seams are {list(NAMES)}")
    return {name: out[name] for name in NAMES if name in out}


@contextlib.contextmanager
def your_engine(llm, *functions: Callable, **named: Callable) -> Iterator[YourEngine]:
    """Plug `functions` into `llm` (an LLM) for the duration of the `with`; see the module's docstring."""
    yours = YourEngine(_keyed(functions, named))
    with contextlib.ExitStack() as stack:
        patch = _Patcher(stack)
        engine = llm.llm_engine
        for name, fn in yours.functions.items():
            PLUGS[name](engine, _counted(yours, name, fn), yours, patch)
        try:
            yield yours
        except YourEngineError:
            raise
        except Exception as e:
            if yours.disagreements:
                raise YourEngineError(f"the engine failed ({type(e).__name__}: {e}); first disagreement: "
                                      f"{yours.disagreements[0]}") from e
            raise


def _counted(yours: YourEngine, name: str, fn: Callable) -> Callable:
    def call(*args):
        yours.calls[name] += 1
        try:
            return fn(*args)
        except NotImplementedError:
            raise YourEngineError(f"{name} is not written yet: write it in its cell, or leave it out of "
                                  f"your_engine(...)") from None
    return call


def written(functions) -> list[Callable]:
    """The functions whose cell holds more than the `raise NotImplementedError` it came with."""
    def stub(fn) -> bool:
        try:
            lines = inspect.getsource(inspect.unwrap(fn)).strip().splitlines()
        except (OSError, TypeError):
            return False
        return lines[-1].strip() == "raise NotImplementedError"
    return [fn for fn in functions if not stub(fn)]


class _Patcher:
    """setattr now, the old value (or the class's, or the module's) back when the switch closes."""

    def __init__(self, stack: contextlib.ExitStack):
        self.stack = stack

    def __call__(self, obj, attr: str, value) -> None:
        missing = object()
        old = vars(obj).get(attr, missing)
        setattr(obj, attr, value)
        self.stack.callback(lambda: delattr(obj, attr) if old is missing else setattr(obj, attr, old))


# ---------------------------------------------------------------------------------------------------- the plugs
def plug_longest_cached_prefix(engine, fn, yours, patch):
    kv = engine.kv_cache_manager
    real = kv.get_computed_blocks

    def lookup(block_hash, chunk):          # the pool's cached blocks, then those this very step computes
        block_id = kv.block_pool.lookup(block_hash, chunk)
        if block_id is None and kv.pending.get(block_hash, (None, None))[1] == chunk:
            block_id = kv.pending[block_hash][0]
        return block_id

    def get_computed_blocks(req):
        expected = real(req)
        if not kv.enable_prefix_caching or req.block_table or req.sampling_params.prompt_logprobs is not None \
                or req.cache_salt is not None or req.mm_features:
            return expected                 # a key with more than tokens (salt, images), or no lookup at all
        hits = list(fn(list(req.all_token_ids), kv.block_size, lookup))
        if hits != expected:
            yours.disagree(f"longest_cached_prefix for request {req.request_id} ({req.num_tokens} tokens, "
                           f"block_size {kv.block_size}): minivllm found the blocks {expected}, yours {hits}")
        return hits
    patch(kv, "get_computed_blocks", get_computed_blocks)


def plug_take_blocks(engine, fn, yours, patch):
    from collections import deque

    from minivllm.core.journal import StepJournal
    kv = engine.kv_cache_manager
    pool, real = kv.block_pool, kv.allocate_slots

    def allocate_slots(req, num_new_tokens, computed_blocks=()):
        free_before, table_before = list(pool.clean_free), list(req.block_table) + list(computed_blocks)
        if not real(req, num_new_tokens, computed_blocks):
            return False
        n = len(req.block_table) - len(table_before)
        if n == 0 or len(free_before) < n or list(pool.clean_free) != free_before[n:]:
            return True                     # nothing fresh, or a block evicted from the prefix cache
        free, table, journal = deque(free_before), list(table_before), StepJournal()
        journal.begin()
        what = (f"take_blocks, engine step {engine.num_steps + 1}: {n} fresh blocks for request {req.request_id} "
                f"(table {table_before}, free queue {free_before[:n + 2]}...)")
        if fn(free, table, n, journal) is not True or table != list(req.block_table) \
                or list(free) != list(pool.clean_free):
            raise YourEngineError(f"{what}: the engine's table became {list(req.block_table)}, yours {table}")
        journal.rollback()
        if list(free) != free_before or table != table_before:
            raise YourEngineError(f"{what}: after a rollback your free queue is {list(free)[:n + 2]}..., table "
                                  f"{table}; they should be as before")
        return True
    patch(kv, "allocate_slots", allocate_slots)


def plug_schedule_step(engine, fn, yours, patch):
    sched = engine.scheduler
    real = sched.schedule
    cap = sched.long_prefill_token_threshold

    def schedule():
        running = [(r.request_id, r.num_tokens - r.num_computed_tokens) for r in sched.running]
        waiting, swapped = list(sched.waiting), any(r.status.value == "swapped" for r in sched.waiting)
        out = real()
        budget_left = sched.max_num_batched_tokens - sum(out.num_scheduled_tokens.values())
        left_out = [r for r in waiting if r.request_id not in out.num_scheduled_tokens]
        short = left_out and budget_left > 0 and len(sched.running) < sched.max_num_seqs   # the pool said no
        if (out.preempted or out.scheduled_spec_decode_tokens or short or swapped or sched.async_scheduling
                or sched.encoder_cache_manager is not None or 0 < cap < sched.max_num_batched_tokens):
            return out                      # outside the exercise's model (its pool is never short)
        # After schedule() an admitted request's num_computed_tokens is its prefix-cache hit: its need is the rest.
        waiting = [(r.request_id, r.num_tokens - r.num_computed_tokens) for r in waiting]
        mine = dict(fn(list(running), list(waiting), sched.max_num_batched_tokens, sched.max_num_seqs))
        if mine != dict(out.num_scheduled_tokens):
            raise YourEngineError(f"schedule_step, engine step {engine.num_steps + 1} (running {running}, waiting "
                                  f"{waiting}, budget {sched.max_num_batched_tokens}, max_num_seqs "
                                  f"{sched.max_num_seqs}): the scheduler ran {dict(out.num_scheduled_tokens)}, "
                                  f"yours says {mine}")
        return out
    patch(sched, "schedule", schedule)


def plug_preempt(engine, fn, yours, patch):
    from checks.c04_preemption import Seq, _compare
    sched, pool = engine.scheduler, engine.kv_cache_manager.block_pool
    real_preempt, real_choose_victim, planned = sched._preempt, sched._choose_victim, {}

    def seqs(queue):                        # arrival: the order the scheduler admits equals in (ties broken)
        rank = {rid: i for i, rid in enumerate(sorted(sched._keys, key=sched._keys.get))}
        return [Seq(r.request_id, r.priority, rank[r.request_id], r.status.value, r.num_computed_tokens,
                    tuple(r.block_table)) for r in queue]

    def choose_victim(req):
        before = (seqs(sched.running), seqs(sched.waiting))
        result = fn(list(before[0]), list(before[1]))
        kept = {s.request_id for s in result[0]} if isinstance(result, tuple) and len(result) == 3 else set()
        gone = [r for r in sched.running if r.request_id not in kept]
        if len(gone) != 1:
            raise YourEngineError(f"preempt, engine step {engine.num_steps + 1} (running {before[0]}): your running "
                                  f"queue after should lack exactly one request, the victim; it lacks "
                                  f"{[r.request_id for r in gone]}")
        expected = real_choose_victim(req)
        if gone[0] is not expected:
            yours.disagree(f"preempt, engine step {engine.num_steps + 1} (running {before[0]}): minivllm "
                           f"preempts {expected.request_id}, yours {gone[0].request_id}")
        planned[gone[0].request_id] = result
        return gone[0]

    def preempt(victim):
        result = planned.pop(victim.request_id, None)
        if result is None:                  # a preemption that did not come through _choose_victim
            result = fn(seqs(sched.running), seqs(sched.waiting))
        freed, real_free = [], pool.free
        pool.free = lambda block_id: (freed.append(block_id), real_free(block_id))[1]
        try:
            swap_out = real_preempt(victim)
        finally:
            del pool.free
        if not swap_out:                    # recompute: the exercise's kind (a swap keeps the KV)
            try:
                _compare(result, (seqs(sched.running), seqs(sched.waiting), freed),
                         f"preempt inside the engine, step {engine.num_steps + 1}")
            except ExerciseFailed as e:
                raise YourEngineError(str(e)) from None
        return swap_out
    patch(sched, "_choose_victim", choose_victim)
    patch(sched, "_preempt", preempt)


def plug_slot_mapping(engine, fn, yours, patch):
    runner = engine.model_runner
    real = runner.prepare_inputs

    def prepare_inputs(out, prev_rows=None):
        mi, sampling = real(out, prev_rows)
        slots, row = [], 0
        for req in out.scheduled:
            n = out.num_scheduled_tokens[req.request_id]
            start = req.num_computed_tokens + out.num_computed_ahead.get(req.request_id, 0)
            mine = list(fn(list(req.block_table), start, start + n, runner.block_size))
            if mine != mi.slot_mapping[row:row + n]:
                yours.disagree(f"slot_mapping for request {req.request_id} (block_table {list(req.block_table)}, "
                               f"positions {start}..{start + n - 1}): minivllm's {mi.slot_mapping[row:row + n]}, "
                               f"yours {mine}")
            slots += mine
            row += n
        return dataclasses.replace(mi, slot_mapping=slots), sampling
    patch(runner, "prepare_inputs", prepare_inputs)


def plug_paged_attention_one(engine, fn, yours, patch):
    backend = engine.model_runner.backend
    real = backend.forward

    def forward(q, k, v, key_cache, value_cache, meta, scale, k_scale=1.0, v_scale=1.0):
        out = real(q, k, v, key_cache, value_cache, meta, scale, k_scale, v_scale)   # (tokens, heads, head_dim)
        for i, (end, seq_len) in enumerate(zip(meta.cu_seqlens_q[1:].tolist(), meta.seq_lens_cpu)):
            mine = fn(q[end - 1].clone(), key_cache, value_cache, meta.block_tables[i].clone(), seq_len, scale)
            err = (mine.float() - out[end - 1].float()).abs().max().item()
            if not err <= TOL:
                yours.disagree(f"paged_attention_one, sequence {i} of a step (seq_len {seq_len}): max error "
                               f"{err:.2e} against the attention backend (tolerance {TOL:g})")
            out[end - 1] = mine.to(out.dtype)
        return out
    patch(backend, "forward", forward)


def plug_tp_linear(engine, fn, yours, patch):
    cfg = engine.model_config
    tp_size = math.gcd(cfg.num_attention_heads, cfg.num_key_value_heads)    # 3 for SmolLM2's 9 and 3 heads
    layer = engine.model_runner.model.layers[0].self_attn

    def beside(kind):
        def hook(module, args, output):
            if getattr(module, "weight", None) is None:
                return                      # a quantized layer keeps no plain weight to shard
            x = args[0].reshape(-1, args[0].shape[-1])                 # (tokens, in)
            _, y = fn(x, module.weight, tp_size, kind)
            err = (y - output.reshape(y.shape)).abs().max().item()
            if not err <= 1e-4 * max(1.0, output.abs().max().item()):
                raise YourEngineError(f"tp_linear, {kind} parallel over {tp_size} ranks, layer 0's "
                                      f"{'QKV' if kind == 'column' else 'output'} projection at engine step "
                                      f"{engine.num_steps + 1}: max error {err:.2e} against the layer's output")
        return hook
    for module, kind in ((layer.qkv_proj, "column"), (layer.o_proj, "row")):
        patch.stack.callback(module.register_forward_hook(beside(kind)).remove)


def plug_stage_layers(engine, fn, yours, patch):
    import os

    from minivllm.worker.distributed import pp_layer_partition
    if os.environ.get("VLLM_PP_LAYER_PARTITION"):
        return                              # counts set by hand: not the rule the exercise computes
    num_layers = engine.model_config.num_hidden_layers
    for pp_size in range(1, min(4, num_layers) + 1):
        mine, expected = [tuple(b) for b in fn(num_layers, pp_size)], pp_layer_partition(num_layers, pp_size)
        if mine != [tuple(b) for b in expected]:
            raise YourEngineError(f"stage_layers for this engine's {num_layers} layers on {pp_size} stages: "
                                  f"minivllm's pp_layer_partition gives {expected}, yours {mine}")


def plug_top_p_filter(engine, fn, yours, patch):
    import minivllm.worker.sampler as sampler
    real = sampler.apply_top_k_top_p

    def apply_top_k_top_p(logits, top_k, top_p):
        expected = real(logits, top_k, top_p)
        out = real(logits, top_k, [1.0] * len(top_p))                  # top-k by minivllm, then your top-p
        rows = [i for i, p in enumerate(top_p) if p < 1.0]
        if rows:
            out[rows] = fn(out[rows], [top_p[i] for i in rows]).to(out.dtype)
        mine, want = torch.isfinite(out), torch.isfinite(expected)
        for row in (mine != want).any(dim=1).nonzero()[:, 0].tolist():
            if not _borderline(logits[row], top_k[row], (mine[row] != want[row]).nonzero()[:, 0], top_p[row]):
                yours.disagree(f"top_p_filter, row {row} (top_p {top_p[row]}): minivllm keeps "
                               f"{int(want[row].sum())} tokens, yours {int(mine[row].sum())}")
                break
        return out
    patch(sampler, "apply_top_k_top_p", apply_top_k_top_p)


def _borderline(row: torch.Tensor, top_k: int, tokens: torch.Tensor, p: float) -> bool:
    """Whether the tokens kept by one filter and not the other sit on the edge of the nucleus: the mass of the
    tokens more likely than each is top_p to within float rounding (the two sum the probabilities in another
    order)."""
    if len(tokens) > 4:
        return False                        # more than the few tokens at the edge
    kept = row.topk(top_k).values if 0 < top_k < row.numel() else row
    probs = (row[tokens].double() - kept.double().logsumexp(0)).exp()               # the tokens' probabilities
    all_probs = (kept.double() - kept.double().logsumexp(0)).exp()
    before = torch.stack([all_probs[all_probs > q].sum() for q in probs])          # mass more likely than each
    return bool(((before - p).abs() < 1e-4).all())         # fp32 sums of ~1,000 probabilities drift ~1e-5


def plug_ngram_propose(engine, fn, yours, patch):
    proposer = engine.model_runner.proposer
    if proposer is None or not hasattr(proposer, "min_n"):
        return                              # no n-gram speculation in this engine
    real = proposer.propose

    def propose(token_ids, max_tokens=None):
        k = proposer.k if max_tokens is None else min(proposer.k, max_tokens)
        mine = [int(t) for t in fn(list(token_ids), k, proposer.min_n, proposer.max_n)]
        expected = real(token_ids, max_tokens)
        if mine != expected:
            yours.disagree(f"ngram_propose after {len(token_ids)} tokens (k={k}): minivllm proposed {expected}, "
                           f"yours {mine}")
        return mine
    patch(proposer, "propose", propose)


def plug_pad_decode_batch(engine, fn, yours, patch):
    from minivllm.worker.cuda_graph import DecodeGraphs
    runner = engine.model_runner
    graphs = runner.graphs or DecodeGraphs(runner.forward, max_num_seqs=engine.config.max_num_seqs,
                                           max_model_len=engine.max_model_len, block_size=runner.block_size,
                                           device=runner.device, capture=False)
    real_fill = graphs._fill
    names = ("input_ids", "positions", "slot_mapping", "seq_lens")

    def fill(input_ids, positions, slot_mapping, seq_lens, block_tables, size):
        real_fill(input_ids, positions, slot_mapping, seq_lens, block_tables, size)    # minivllm's, to compare
        width = max(len(t) for t in block_tables)
        expected = [size] + [getattr(graphs, b)[:size].tolist() for b in names]
        expected.append(graphs.block_tables[:size, :width].tolist())
        got = fn(list(input_ids), list(positions), list(slot_mapping), list(seq_lens),
                 [list(t) for t in block_tables], list(graphs.sizes))
        mine = [got[0]] + [[int(x) for x in col] for col in got[1:5]] + [[list(t) for t in got[5]]]
        if mine != expected:
            yours.disagree(f"pad_decode_batch, a decode batch of {len(input_ids)}: minivllm filled {expected}, "
                           f"yours {mine}")
        if mine[0] != size:
            raise YourEngineError(f"pad_decode_batch: a decode batch of {len(input_ids)} runs the graph of {size} "
                                  f"(capture sizes {graphs.sizes}); yours chose {mine[0]}")
        for buf, col in zip(names, mine[1:5]):
            getattr(graphs, buf)[:size].copy_(torch.tensor(col, dtype=getattr(graphs, buf).dtype))
        graphs.block_tables[:size, :len(mine[5][0])].copy_(torch.tensor(mine[5], dtype=torch.int32))
    patch(graphs, "_fill", fill)
    patch(runner, "graphs", graphs)


def plug_plan_ahead(engine, fn, yours, patch):
    import minivllm.core.async_scheduler as async_scheduler
    real = async_scheduler.plan_ahead

    def plan_ahead(num_tokens, num_computed_tokens, num_in_flight):
        mine, expected = tuple(fn(num_tokens, num_computed_tokens, num_in_flight)), real(
            num_tokens, num_computed_tokens, num_in_flight)
        if mine != tuple(expected):
            yours.disagree(f"plan_ahead({num_tokens}, {num_computed_tokens}, {num_in_flight}): minivllm "
                           f"{tuple(expected)}, yours {mine}")
        return mine
    patch(async_scheduler, "plan_ahead", plan_ahead)


def plug_quantize_activations(engine, fn, yours, patch):
    from minivllm.model.layers import QKVParallelLinear
    from minivllm.platforms.cpu.quantization import quantize_activations
    qkv = next(m for m in engine.model_runner.model.modules() if isinstance(m, QKVParallelLinear))

    def beside(module, args):
        x = args[0].reshape(-1, args[0].shape[-1])                     # (tokens, hidden)
        q, s = fn(x.clone())
        want_q, want_s = quantize_activations(x)
        if not (torch.equal(q, want_q) and torch.equal(s, want_s)):
            raise YourEngineError(f"quantize_activations on layer 0's QKV input, engine step {engine.num_steps + 1} "
                                  f"({x.shape[0]} tokens): q or s differ from minivllm's (s equal: "
                                  f"{torch.equal(s, want_s)})")
    patch.stack.callback(qkv.register_forward_pre_hook(beside).remove)


def plug_get_num_new_matched_tokens(engine, fn, yours, patch):
    from minivllm.kv_transfer import decode_block
    connector = engine.scheduler.connector
    if connector is None:
        return                              # no KV transfer in this engine
    real = connector.get_num_new_matched_tokens

    def intact(key):
        frame = connector.store.get(key)
        return frame is not None and decode_block(frame, key, connector.block_shape, connector.dtype) is not None

    def get_num_new_matched_tokens(req, num_computed_tokens):
        expected = real(req, num_computed_tokens)                      # stages the blocks it found
        if not connector.is_consumer or req.sampling_params.prompt_logprobs is not None:
            return expected
        mine = fn(list(req.prompt_token_ids), num_computed_tokens, connector.block_size, connector.tag, intact)
        if mine != expected:
            raise YourEngineError(f"get_num_new_matched_tokens for a prompt of {req.num_prompt_tokens} tokens "
                                  f"(num_computed_tokens {num_computed_tokens}): the connector loads {expected}, "
                                  f"yours says {mine!r}")
        return expected
    patch(connector, "get_num_new_matched_tokens", get_num_new_matched_tokens)


def plug_fit(engine, fn, yours, patch):
    from checks.c15_multimodal import _real
    ecm = engine.scheduler.encoder_cache_manager
    if ecm is None:
        return                              # a text-only model

    def fit(req, start, num_tokens, out):
        expected, plan = _real(ecm, req, start, num_tokens, out)
        mine = fn(ecm, req, start, num_tokens, out)
        if mine != expected:
            yours.disagree(f"fit for request {req.request_id}, chunk [{start}, {start + num_tokens}): minivllm lets "
                           f"{expected} tokens run, yours {mine}")
        return mine
    patch(ecm, "fit", fit)


def plug_blocks_held(engine, fn, yours, patch):
    _after_each_step(engine, patch, blocks_held=fn)


def plug_stream_deltas(engine, fn, yours, patch):
    _after_each_step(engine, patch, stream_deltas=fn)


def _after_each_step(engine, patch, **fns):
    """The checks that read a step's result: engine.step wrapped once, whichever of them is plugged."""
    from checks.c09_serving import _pieces
    from minivllm.core.sampling_params import RequestOutputKind
    wrapped = vars(engine).get("step")
    if wrapped is not None and hasattr(wrapped, "fns"):
        wrapped.fns.update(fns)
        return
    real, streams, sched = engine.step, {}, engine.scheduler

    def step(*args, **kwargs):
        for rid, req in engine.requests.items():      # stop strings are in the params; finished ones leave
            sp = req.sampling_params
            if rid not in streams and sp.output_kind is RequestOutputKind.DELTA and sp.stop:
                streams[rid] = (list(sp.stop), [], [])
        outputs = real(*args, **kwargs)
        if "blocks_held" in step.fns and engine.config.speculative_config is None:
            for r in sched.running:
                if r.num_output_tokens and r.num_computed_tokens == r.num_tokens - 1 and r not in sched.in_flight:
                    n = step.fns["blocks_held"](r.num_prompt_tokens, r.num_output_tokens, sched.block_size)
                    if n != len(r.block_table):
                        raise YourEngineError(
                            f"blocks_held, after engine step {engine.num_steps}: request {r.request_id}, a "
                            f"{r.num_prompt_tokens}-token prompt with {r.num_output_tokens} output tokens (block "
                            f"size {sched.block_size}), holds {len(r.block_table)} blocks; yours says {n}")
        for out in outputs if "stream_deltas" in step.fns else ():
            if out.request_id not in streams:
                continue
            stop, token_ids, texts = streams[out.request_id]
            token_ids += out.outputs[0].token_ids
            texts.append(out.outputs[0].text)
            if out.finished:
                del streams[out.request_id]
                pieces = _pieces(engine.tokenizer, token_ids)
                mine = step.fns["stream_deltas"](pieces, stop)
                if mine != texts:
                    raise YourEngineError(f"stream_deltas, request {out.request_id} with stop={stop!r}: the "
                                          f"detokenizer's pieces {pieces}; the engine streamed {texts}, yours gives "
                                          f"{mine}")
        return outputs
    step.fns = dict(fns)
    patch(engine, "step", step)


def plug_decode_memory_floor_ms(engine, fn, yours, patch):
    from minivllm.bench import roofline
    cfg, itemsize = engine.model_config, engine.model_runner.dtype.itemsize
    for batch, context in ((1, 0), (engine.config.max_num_seqs, 256)):
        expected = (roofline.weight_bytes(cfg, itemsize)
                    + roofline.kv_bytes_per_token(cfg, itemsize) * batch * context) / 20e9 * 1e3
        mine = fn(cfg, itemsize, batch, context, 20e9)
        if not isinstance(mine, (int, float)) or not abs(mine - expected) <= 1e-9 * expected:
            raise YourEngineError(f"decode_memory_floor_ms for this engine's model ({itemsize}-byte weights), batch "
                                  f"{batch}, context {context}, 20 GB/s: bench/roofline.py says {expected:.4f} ms, "
                                  f"yours {mine!r}")


PLUGS = {name: globals()[f"plug_{name}"] for name in NAMES}
