"""ModelRunner: one rank's model and KV cache; turns a SchedulerOutput into a flat batch, runs it and samples it
(vLLM v1's `v1/worker/gpu_model_runner.py`: `execute_model`, then `sample_tokens`).

Owns: this rank's weights, its share of the KV cache, the flat-batch inputs of each step and, on rank 0, what
becomes of the logits: the grammars' masks, the sampler and the rejection sampler (speculative drafts), the
logprobs (logprobs.py), the sampler's random state (`get_rng_state` / `set_rng_state`) and the next drafts
(`propose_draft_token_ids`). It reads requests (their tokens, `num_computed_tokens`, block tables) but changes none
of them (a seeded request's generator aside); the scheduler and the engine do that with what it returns. Which
ranks exist and how inputs reach them is the executor's business (executor.py); the batch's data is input_batch.py's.

    rank 0, one step:    prepare_inputs(sched) -> ModelInput     (sent to the other ranks by the executor)
                         execute_model(mi) -> logits             (every rank; rank 0 keeps the logits)
                         sample_tokens(batch) -> requests, tokens, logprobs
    async scheduling:    sample_on_device(batch) as it is issued; sample_tokens(batch) only reads the host copy

Flat batch for requests A (prefill, 3 new tokens, nothing cached) and B (decode at position 20):
    input_ids     [a0 a1 a2 b20]
    positions     [ 0  1  2  20]
    slot_mapping  [slot(A,0) slot(A,1) slot(A,2) slot(B,20)]     slot = block_table[p // bs] * bs + p % bs
    cu_seqlens_q  [0 3 4]        seq_lens [3 21]
    logits rows   [2 3]          (the last new token of each request that samples)

A request with SamplingParams.prompt_logprobs also gets logits at its prompt rows (A's rows 0 and 1 score prompt
tokens 1 and 2: `prompt_logprob_spans`); requests that don't ask add no rows.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from minivllm.model.attention import AttentionMetadata, get_attention_backend, model_input_tensors
from minivllm.config import EngineConfig
from minivllm.worker.cuda_graph import DecodeGraphs, capture_decode_graphs
from minivllm.model.layers import PPStage, TPGroup
from minivllm.model.llama import ModelConfig
from minivllm.model.loader import load_model, load_tokenizer, resolve_dtype
from minivllm.model._kernels import kernels
from minivllm.platforms.cpu import empty_on_huge_pages, settle_on_huge_pages
from minivllm.worker.pipeline_stage import PipelineStageMixin
from minivllm.worker.warm_up import warm_up
from minivllm.worker.encoder_runner import EncoderRunner, MultiModalBatch, image_spans
from minivllm.core.request import Request
from minivllm.worker.input_batch import (GrammarBitmaskFn, InFlightBatch, ModelInput, copy_to_host, first_rows,
                                         prev_token_inputs)
from minivllm.worker.logprobs import PromptLogprobsSpan, StepLogprobs, score_step
from minivllm.worker.rejection_sampler import RejectionSampler
from minivllm.worker.sampler import Sampler, apply_grammar_bitmask
from minivllm.spec_decode import make_proposer, propose_drafts
from minivllm.core.scheduler import SchedulerOutput


def pick_rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden[rows] -> (len(rows), hidden) without waiting for the GPU: indexing a CUDA tensor with a Python
    list copies the list to the device synchronously. Consecutive rows (every decode step) are a view."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return hidden[rows[0]:rows[0] + len(rows)]
    index = torch.tensor(rows, dtype=torch.int64).to(hidden.device, non_blocking=True)
    return hidden.index_select(0, index)


class ModelRunner(PipelineStageMixin):
    """One rank's model, KV cache share and step execution. Rank 0's runner also builds the inputs
    (`prepare_inputs`) and samples; the others only run `execute_model` on what rank 0 sent them.

    Lifecycle (as vLLM's workers): __init__ loads this rank's weights; `profile_num_blocks()` says how
    many KV blocks fit here; `allocate_kv_cache(n)` with the smallest answer over all ranks."""

    def __init__(self, config: EngineConfig, model_path, model_cfg: ModelConfig, device: torch.device,
                 tp: TPGroup = TPGroup(), pp: PPStage = PPStage()):
        self.config = config
        self.device = device
        self.model_cfg = model_cfg
        self.tp = tp
        self.dtype = resolve_dtype(config.dtype, model_cfg, device)
        self.pp = pp
        self.model = load_model(model_path, model_cfg, self.dtype, device, tp, pp, quantization=config.quantization)
        self.num_layers = len(self.model.layers)                         # this pipeline stage's
        self.backend = get_attention_backend(config.attention_backend, device)
        self.sampler = Sampler(config.seed)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.model_path = model_path
        self.block_size = config.block_size               # (read by a draft-model proposer)
        # Speculative decoding's proposer (spec_decode/): rank 0 only; None when speculation is off.
        # (n-gram drafts on every rank: under torchrun every rank schedules, so every rank must draft the same.)
        spec = config.speculative
        ngram = spec is not None and spec.method == "ngram"
        self.proposer = make_proposer(spec, self) if ngram or (tp.rank == 0 and pp.rank == 0) else None
        self.num_kv_heads = model_cfg.num_key_value_heads // tp.size     # this rank's share
        self.num_kv_blocks = 0                                           # set by allocate_kv_cache
        # The KV cache's dtype: the model's, or fp8 e4m3 (kv_cache_dtype="fp8"; scales from worker/kv_scales.py)
        self.kv_cache_dtype = (kernels.reference.FP8_DTYPE if config.kv_cache_dtype in ("fp8", "fp8_e4m3")
                               else self.dtype)
        self.kv_scales: list[tuple[float, float]] | None = None          # (k_scale, v_scale) per layer, fp8 only
        if self.kv_cache_dtype != self.dtype and self.backend.name == "triton":
            kernels.triton_ops.check_fp8_supported(device)                # before any memory is spent on it
        # Pipeline parallelism (pipeline_stage.py): sends still under way (the works and the tensors they read).
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        # (step id, start, end) of this rank's stage work, wall-clock seconds; the lesson draws the pipeline from it
        self.stage_times: list[tuple[int, float, float]] = []
        self.record_stage_times = False
        self.graphs: DecodeGraphs | None = None                          # set by allocate_kv_cache on CUDA
        self.kv_connector = None         # KV transfer's worker side (kv_transfer/base.py), set by the engine
        self.encoder_runner = EncoderRunner(self.model) if model_cfg.vision else None   # images (encoder_runner.py)

    def allocate_kv_cache(self, num_kv_blocks: int) -> None:
        c = self.model_cfg
        self.num_kv_blocks = num_kv_blocks
        # One tensor for this rank's cache: (2, num_layers, num_blocks, block_size, kv_heads / tp, head_dim).
        # Every rank has the same blocks (same block ids, same slots); only the KV heads differ.
        # Zeroed once, so a slot that was never written holds 0, not NaN: masked slots get zero weight,
        # and 0 * NaN would still poison a matmul.
        # (Under pipeline parallelism, the layers of this stage only: more blocks fit per stage.)
        if self.kv_cache_dtype != self.dtype and self.kv_scales is None:
            # fp8: scales first, from a prefill of a fixed text on a temporary cache in the model's dtype.
            from minivllm.worker.kv_scales import calibrate_kv_scales, calibration_token_ids
            self.kv_scales = calibrate_kv_scales(self, calibration_token_ids(load_tokenizer(self.model_path)))
        shape = (2, self.num_layers, num_kv_blocks, self.block_size, self.num_kv_heads, c.head_dim)
        if self.device.type == "cpu":          # on 2 MB pages: every decode step reads the whole context from it
            buf = empty_on_huge_pages(math.prod(shape) * self.kv_cache_dtype.itemsize)
            self.kv_cache = buf.view(self.kv_cache_dtype).view(shape).zero_()
            settle_on_huge_pages(buf)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(self.num_layers)]
        # The CPU pool that preemption_mode="swap" copies whole blocks to and from (same layout).
        self.num_cpu_blocks = (int(self.config.swap_space * 1024 ** 3 // self.bytes_per_block)
                               if self.config.preemption_mode == "swap" else 0)
        self.cpu_kv_cache = torch.empty((2, self.num_layers, self.num_cpu_blocks)
                                        + tuple(self.kv_cache.shape[3:]), dtype=self.kv_cache_dtype,
                                        pin_memory=self.device.type == "cuda" and self.num_cpu_blocks > 0)
        self.graphs = capture_decode_graphs(self)       # cuda_graph.py; None off CUDA
        if hasattr(self.proposer, "allocate_kv_cache"):           # a draft model: its KV under the same block ids
            self.proposer.allocate_kv_cache(num_kv_blocks)

    def warm_up(self, num_tokens: int, tokens_per_seq: int = 128) -> None:
        """One prefill of `num_tokens` dummy tokens on a scratch cache before serving (warm_up.py)."""
        warm_up(self, num_tokens, tokens_per_seq)

    def release_memory(self) -> None:
        """At shutdown: drop the weights, the KV caches and the CUDA graphs, so the next engine in this process
        gets the memory (on a GPU the default budget is a fraction of what is free). Safe to call twice; the
        runner runs no step afterwards (executor_base.py refuses with a clear error)."""
        self.graphs = None
        self.model = None
        self.kv_cache = self.cpu_kv_cache = None
        self.kv_caches = []
        if hasattr(self.proposer, "release_memory"):
            self.proposer.release_memory()
        if self.device.type == "cuda":
            import gc
            gc.collect()                                  # cycles through the model's modules
            torch.cuda.empty_cache()                      # hand the cached blocks back to the device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The model on this rank's KV cache: hidden (num_tokens, hidden_size). What a CUDA graph captures.
        `inputs_embeds` (images): the step's embeddings, instead of the token table's."""
        return self.model(input_ids, positions, self.kv_caches, meta, self.backend, inputs_embeds=inputs_embeds)

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block on this rank (its share of the KV heads, every layer, K and V)."""
        c = self.model_cfg
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * c.head_dim * self.kv_cache_dtype.itemsize

    def profile_num_blocks(self) -> int:
        """How many KV blocks fit on this rank: config.num_kv_blocks if given, else from the memory budget."""
        if self.config.num_kv_blocks:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1 - self.config.gpu_memory_utilization)
            budget -= 2 * 1024 ** 3 // self.tp.size       # activations and logits of the largest step
        else:
            budget = self.config.kv_cache_memory_gb * 1024 ** 3      # per rank
        # A draft model (speculative decoding) keeps its KV under the same block ids: a block costs both.
        per_block = self.bytes_per_block + (self.proposer.bytes_per_block()
                                            if hasattr(self.proposer, "bytes_per_block") else 0)
        num_blocks = int(budget // per_block)
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache (budget {budget / 2**20:.0f} MiB, one block "
                             f"needs {per_block / 2**20:.2f} MiB); pass num_kv_blocks explicitly.")
        return num_blocks

    # ------------------------------------------------------------------ inputs (rank 0)
    def prepare_inputs(self, out: SchedulerOutput, prev_rows: dict[str, int] | None = None
                       ) -> tuple[ModelInput, list[Request]]:
        """The flat batch of one step, and the requests that sample a token at its end (in row order).

        Async scheduling: a request the batch still in flight samples for (`out.num_output_placeholders`) takes
        that token as its next input; `prev_rows` (request_id -> its row among that batch's sampled tokens) says
        where it is."""
        bs = self.block_size
        prev_token_rows: list[tuple[int, int]] = []
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sampling_requests: list[Request] = []
        spans: list[PromptLogprobsSpan] = []
        mm_spans: list[tuple[int, str, int, int]] = []
        for req in out.scheduled:
            n = out.num_scheduled_tokens[req.request_id]
            drafts = out.scheduled_spec_decode_tokens.get(req.request_id, [])
            placeholders = out.num_output_placeholders.get(req.request_id, 0)
            start = req.num_computed_tokens + out.num_computed_ahead.get(req.request_id, 0)
            end = start + n
            # Rows at positions < num_prompt_tokens - 1 score the next prompt token. Once a request has output
            # tokens its prompt logprobs were delivered: a recompute after preemption does not score them again.
            last = min(end, req.num_prompt_tokens - 1)
            if req.sampling_params.prompt_logprobs is not None and req.num_output_tokens == 0 and start < last:
                spans.append(PromptLogprobsSpan(req.request_id, len(input_ids), last - start, start + 1))
            known = req.all_token_ids[start:end - len(drafts)]
            if end - len(drafts) > req.num_tokens:       # async: the last input is still being sampled
                prev_token_rows.append((len(input_ids) + len(known), prev_rows[req.request_id]))
                known = known + [0]
            if req.mm_features:                          # images: which rows take encoder output
                mm_spans += image_spans(req, start, end, len(input_ids))
            input_ids += known + drafts                  # drafts go after the last token
            positions += range(start, end)
            table = req.block_table
            slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, end)]
            q_lens.append(n)
            seq_lens.append(end)
            if end - len(drafts) == req.num_tokens + placeholders:   # all of it computed: sample the next token
                # (with drafts: one row per draft position too; row j checks draft j, the last row gives one more)
                sample_rows += range(len(input_ids) - len(drafts) - 1, len(input_ids))
                sampling_requests.append(req)
        max_blocks = max((len(r.block_table) for r in out.scheduled), default=0)
        block_tables = [r.block_table + [0] * (max_blocks - len(r.block_table)) for r in out.scheduled]
        model_input = ModelInput(input_ids, positions, slot_mapping, q_lens, seq_lens, block_tables, sample_rows,
                                 list(out.blocks_to_swap_out), list(out.blocks_to_swap_in), spans,
                                 prev_token_rows=prev_token_rows, kv_connector_metadata=out.kv_connector_metadata,
                                 mm=None if self.encoder_runner is None else MultiModalBatch(
                                     out.free_encoder_hashes, out.encoder_inputs, mm_spans))
        return model_input, sampling_requests

    # ------------------------------------------------------------------ the step (every rank)
    def swap_blocks(self, mi: ModelInput) -> None:
        """Copy whole blocks (every layer, K and V) between the device cache and the CPU pool.
        Swap-outs go first: a block freed by a swap-out may be handed to another request this step."""
        # As bytes (uint8 views): PyTorch has no indexed copy for fp8 on a CPU; a copy of bytes is the same copy.
        device_cache, cpu_cache = self.kv_cache.view(torch.uint8), self.cpu_kv_cache.view(torch.uint8)
        if mi.blocks_to_swap_out:
            src, dst = (list(x) for x in zip(*mi.blocks_to_swap_out))
            cpu_cache[:, :, dst] = device_cache[:, :, src].cpu()
        if mi.blocks_to_swap_in:
            src, dst = (list(x) for x in zip(*mi.blocks_to_swap_in))
            device_cache[:, :, dst] = cpu_cache[:, :, src].to(self.device)

    @torch.inference_mode()
    def execute_model(self, mi: ModelInput, prev_sampled: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run one step on this rank. Returns (logits of the sampled rows, (num_sampling, vocab) fp32, or None when
        no request samples; logits of the prompt-logprob spans' rows, (sum of num_rows, vocab) fp32, or None when
        there are none). Under TP every rank must call this with the same ModelInput: the layers' all-reduces and
        the logits' all-gather pair up across ranks. `prev_sampled`: async scheduling's previous batch's tokens
        (see ModelInput.prev_token_rows)."""
        self.swap_blocks(mi)
        if self.kv_connector is not None:          # KV transfer: copy in the blocks another instance computed
            self.kv_connector.start_load_kv(mi.kv_connector_metadata, self.kv_cache)
        if not mi.q_lens:
            return None, None
        if self.pp.size > 1:
            return self._execute_stage(mi)
        prev = prev_token_inputs(mi, prev_sampled, self.device) if mi.prev_token_rows else None   # async
        images = mi.mm is not None and self.encoder_runner.run(mi.mm)       # encode; True if rows take their output
        if not images and self.graphs is not None and self.graphs.can_run(mi.q_lens, mi.block_tables):
            hidden = self.graphs.run(mi.input_ids, mi.positions, mi.slot_mapping, mi.seq_lens, mi.block_tables, prev)
        else:
            if self.graphs is not None:
                self.graphs.stats.eager_steps += 1
            input_ids, positions, meta = model_input_tensors(mi, self.device)
            if prev is not None:
                input_ids.index_copy_(0, *prev)
            embeds = self.encoder_runner.inputs_embeds(mi.mm, input_ids) if images else None
            hidden = self.forward(input_ids, positions, meta, embeds)          # (num_tokens, hidden)
        if self.kv_connector is not None:          # KV transfer: save this step's blocks, layer by layer
            for layer, (key_cache, value_cache) in enumerate(self.kv_caches):
                self.kv_connector.save_kv_layer(layer, key_cache, value_cache)
            self.kv_connector.wait_for_save()
        prompt_rows = [r for s in mi.prompt_logprob_spans for r in range(s.first_row, s.first_row + s.num_rows)]
        if not mi.sample_rows and not prompt_rows:
            return None, None
        # One LM head (and under TP one all-gather) for both kinds of rows.
        logits = self.model.compute_logits(pick_rows(hidden, mi.sample_rows + prompt_rows))
        num_sampling = len(mi.sample_rows)
        return (logits[:num_sampling] if num_sampling else None), (logits[num_sampling:] if prompt_rows else None)

    # ------------------------------------------------------------------ sampling (rank 0)
    def get_rng_state(self, requests: list[Request]) -> list:
        """The random state a step over `requests` may consume: the sampler's shared generator and every seeded
        request's. A failed step puts it back (`set_rng_state`), so its retry draws what the step would have."""
        return self.sampler.get_rng_state(requests)

    def set_rng_state(self, state: list) -> None:
        self.sampler.set_rng_state(state)

    def sample_on_device(self, batch: InFlightBatch, grammar_bitmask: GrammarBitmaskFn | None = None) -> None:
        """Async scheduling, as `batch` is issued: sample its rows (grammar masks applied) and score the logprobs
        asked for, where the logits are, and start copying both to the host. Nothing here waits for the device:
        the next batch's inputs read `batch.sampled` there, and `sample_tokens` reads the host's copies."""
        logits, requests = batch.logits, batch.sampling_requests
        if grammar_bitmask is not None:
            bitmask = grammar_bitmask(requests, {})                    # (rows, vocab / 32)
            if bitmask is not None:
                logits = apply_grammar_bitmask(logits, bitmask)
        batch.sampled = self.sampler.sample(logits, requests)          # (rows,) int64, on the device
        batch.logprobs_ahead = score_step(logits, batch.sampled, requests, [[]] * len(requests), [1] * len(requests),
                                          batch.prompt_logits, batch.model_input.prompt_logprob_spans,
                                          batch.sched.scheduled)
        extra = batch.logprobs_ahead.tensors() if batch.logprobs_ahead is not None else []
        batch.host, batch.ready = copy_to_host([batch.sampled] + extra)

    def sample_tokens(self, batch: InFlightBatch, grammar_bitmask: GrammarBitmaskFn | None = None,
                      keep_logits: bool = False) -> tuple[list[Request], list[list[int]], StepLogprobs | None]:
        """The requests that sample in `batch` (its logits received), their new tokens (one each, or with drafts the
        accepted drafts and one more) and the step's logprobs by request id (None when nobody asked). Rows of
        requests finished (stopped, aborted) since the batch was issued are dropped. `keep_logits`: leave
        batch.logits intact (the masks and the sampler write in place) for a retry of a failed step.

        `grammar_bitmask(sampling_requests, drafts)` is called only now: on a GPU the forward may still be running
        while the CPU fills the grammars' masks. After `sample_on_device` this only waits for the host's copy."""
        if batch.sampled is not None:
            return self._read_sampled(batch)
        sched, requests, logits = batch.sched, batch.sampling_requests, batch.logits
        drafts = [sched.scheduled_spec_decode_tokens.get(r.request_id, []) for r in requests]   # [] for most
        if any(r.is_finished for r in requests):          # aborted while the batch was in flight: drop its rows
            first_row = first_rows(drafts)
            keep = [i for i, r in enumerate(requests) if not r.is_finished]
            logits = logits[[row for i in keep for row in range(first_row[i], first_row[i + 1])]]
            requests, drafts = [requests[i] for i in keep], [drafts[i] for i in keep]
        elif logits is not None and keep_logits:
            logits = logits.clone()
        if grammar_bitmask is not None and requests:
            bitmask = grammar_bitmask(requests, sched.scheduled_spec_decode_tokens)   # (rows, vocab / 32)
            if bitmask is not None:
                logits = apply_grammar_bitmask(logits, bitmask)
        tokens = self._sample(logits, requests, drafts) if requests else []
        # The token each row of logits chose, for the logprobs (a draft row past the first rejection: 0, unscored).
        asked = any(r.sampling_params.logprobs is not None for r in requests)
        row_tokens = [t for kept, d in zip(tokens, drafts) for t in kept + [0] * (len(d) + 1 - len(kept))] if asked \
            else []
        if not asked and not batch.model_input.prompt_logprob_spans:
            return requests, tokens, None                   # logprobs off: nothing to score
        on_device = torch.tensor(row_tokens).to(logits.device, non_blocking=True) if asked else None
        scored = score_step(logits, on_device, requests, drafts, [len(t) for t in tokens], batch.prompt_logits,
                            batch.model_input.prompt_logprob_spans, sched.scheduled)
        return requests, tokens, (scored.read(row_tokens) if scored is not None else None)

    @staticmethod
    def _read_sampled(batch: InFlightBatch) -> tuple[list[Request], list[list[int]], StepLogprobs | None]:
        """sample_tokens after sample_on_device: the host's copies of the tokens and scores (waits for them)."""
        if batch.ready is not None:
            batch.ready.synchronize()       # for this batch's tokens only, not for the batch issued after it
        tokens, requests = batch.host[0].tolist(), batch.sampling_requests
        finished = {r.request_id for r in requests if r.is_finished}        # stopped or aborted since: dropped
        ahead = batch.logprobs_ahead
        logprobs = ahead.with_tensors(batch.host[1:]).read(tokens, finished) if ahead is not None else None
        keep = [i for i, r in enumerate(requests) if r.request_id not in finished]
        return [requests[i] for i in keep], [[tokens[i]] for i in keep], logprobs

    def _sample(self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]) -> list[list[int]]:
        """Plain rows through the sampler, rows with drafts through the rejection sampler (rejection_sampler.py)."""
        if not any(drafts):
            return [[t] for t in self.sampler(logits, requests)]
        first_row = first_rows(drafts)
        plain = [i for i, d in enumerate(drafts) if not d]
        spec = [i for i, d in enumerate(drafts) if d]
        out: list[list[int]] = [[] for _ in requests]
        if plain:
            for i, t in zip(plain, self.sampler(logits[[first_row[i] for i in plain]], [requests[i] for i in plain])):
                out[i] = [t]
        rows = [r for i in spec for r in range(first_row[i], first_row[i + 1])]
        for i, kept in zip(spec, self.rejection_sampler(logits[rows], [requests[i] for i in spec],
                                                        [drafts[i] for i in spec])):
            out[i] = kept
        return out

    # ------------------------------------------------------------------ speculative decoding (rank 0)
    def propose_draft_token_ids(self, requests: list[Request], max_model_len: int) -> dict[str, list[int]]:
        """The next step's drafts for these (running, just sampled) requests, by request id; {} when speculation is
        off. Which requests get how many: spec_decode.propose_drafts."""
        if self.proposer is None:                           # speculation off: nothing to propose
            return {}
        return propose_drafts(self.proposer, requests, max_model_len)
