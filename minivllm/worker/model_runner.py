"""ModelRunner: one rank's model and KV cache; turns a SchedulerOutput into a flat batch and runs it.

Owns: this rank's weights, its share of the KV cache, and the flat-batch inputs of each step. It reads
requests (their tokens, `num_computed_tokens`, block tables) but changes none of them; the scheduler
and the engine do that with what it returns. Which ranks exist and how inputs reach them is the
executor's business (executor.py).

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
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minivllm.model.attention import AttentionMetadata, get_attention_backend
from minivllm.config import EngineConfig
from minivllm.worker.cuda_graph import DecodeGraphs
from minivllm.model.layers import PPStage, TPGroup
from minivllm.model.llama import ModelConfig
from minivllm.model.loader import load_model, load_tokenizer, resolve_dtype
from minivllm.model._kernels import kernels
from minivllm.platforms.cpu import empty_on_huge_pages, settle_on_huge_pages
from minivllm.core.request import Request
from minivllm.worker.logprobs import PromptLogprobsSpan
from minivllm.worker.rejection_sampler import RejectionSampler
from minivllm.worker.sampler import Sampler
from minivllm.spec_decode import make_proposer
from minivllm.core.scheduler import SchedulerOutput


@dataclass(frozen=True)
class ModelInput:
    """One step's inputs as plain lists. Rank 0 builds it from the SchedulerOutput; under tensor
    parallelism it is pickled to every other rank, and each rank turns it into tensors on its device."""
    input_ids: list[int]                       # (num_tokens,)
    positions: list[int]                       # (num_tokens,)
    slot_mapping: list[int]                    # (num_tokens,)
    q_lens: list[int]                          # (num_seqs,) new tokens per request
    seq_lens: list[int]                        # (num_seqs,) context after this step
    block_tables: list[list[int]]              # (num_seqs, max_blocks), padded with 0
    sample_rows: list[int]                     # rows of the flat batch whose logits are sampled (1 + drafts each)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, cpu block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)    # (cpu block, device block)
    prompt_logprob_spans: list[PromptLogprobsSpan] = field(default_factory=list)   # rows scoring prompt tokens
    step_id: int = 0                           # which batch this is (the executor numbers them; for timelines)
    # Async scheduling: (row of input_ids, row of the previous batch's sampled tokens). Those input ids are the
    # tokens the previous batch samples, still on the device: the host writes 0 there and the device fills them in.
    prev_token_rows: list[tuple[int, int]] = field(default_factory=list)


def model_input_tensors(mi: ModelInput, device: torch.device):
    """(input_ids, positions, AttentionMetadata) of a ModelInput, on `device`. cu_seqlens_q is the prefix sum of
    q_lens: request i's tokens are rows cu[i] .. cu[i + 1] - 1 of the flat batch."""
    def t(x, dtype):
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    cu = [0]
    for q in mi.q_lens:
        cu.append(cu[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=t(mi.slot_mapping, torch.int64), cu_seqlens_q=t(cu, torch.int32),
        seq_lens=t(mi.seq_lens, torch.int32), block_tables=t(mi.block_tables, torch.int32),
        max_q_len=max(mi.q_lens), max_seq_len=max(mi.seq_lens), q_lens_cpu=mi.q_lens, seq_lens_cpu=mi.seq_lens)
    return t(mi.input_ids, torch.int64), t(mi.positions, torch.int64), meta


class ModelRunner:
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
        # Pipeline parallelism: sends still under way (torch.distributed works and the tensors they read). A send
        # is waited for at this stage's next step, so a stage never blocks on a neighbour that is still busy with
        # an earlier batch (with several batches in flight, two blocking sends in a cycle would deadlock).
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        # (step id, start, end) of this rank's stage work, wall-clock seconds; the lesson draws the pipeline from it
        self.stage_times: list[tuple[int, float, float]] = []
        self.record_stage_times = False
        self.graphs: DecodeGraphs | None = None                          # set by allocate_kv_cache on CUDA

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
        self.graphs = self._capture_cuda_graphs()
        if hasattr(self.proposer, "allocate_kv_cache"):           # a draft model: its KV under the same block ids
            self.proposer.allocate_kv_cache(num_kv_blocks)

    @torch.inference_mode()
    def warm_up(self, num_tokens: int, tokens_per_seq: int = 128) -> None:
        """One prefill of `num_tokens` dummy tokens (prompts of `tokens_per_seq`) on a scratch cache, before
        serving: the first large step pays once for what later steps reuse (the allocator's growth, oneDNN's
        first calls). On the default model on a 2-core CPU the first 32-prompt prefill step took 7.3-7.8 s
        against 6.5-7.0 s for the next ones, and 6.6 s after a 512-token warm-up. vLLM warms its model up before
        serving too. Touches no request, block or counter, and not the KV cache. One process only: under tensor
        or pipeline parallelism every rank would have to run it at the same point (the caller checks)."""
        if self.tp.size > 1 or self.pp.size > 1:
            raise RuntimeError("warm_up runs in a single process only (tensor_parallel_size and "
                               "pipeline_parallel_size 1)")
        max_len = self.config.max_model_len or self.model_cfg.max_position_embeddings
        lens = []
        while sum(lens) < num_tokens:
            lens.append(min(tokens_per_seq, max_len, num_tokens - sum(lens)))
        bs, device = self.block_size, self.device
        blocks = [-(-n // bs) for n in lens]
        width = max(blocks)
        cache = torch.zeros(2, self.num_layers, sum(blocks), bs, self.num_kv_heads, self.model_cfg.head_dim,
                            dtype=self.dtype, device=device)             # scratch, freed on return
        kv_caches = [(cache[0, i], cache[1, i]) for i in range(self.num_layers)]
        firsts = [sum(blocks[:i]) for i in range(len(lens))]              # sequence i owns blocks firsts[i] ...
        tables = [[f + j for j in range(b)] + [0] * (width - b) for f, b in zip(firsts, blocks)]

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype, device=device)
        positions = [p for n in lens for p in range(n)]
        meta = AttentionMetadata(
            slot_mapping=t([f * bs + p for f, n in zip(firsts, lens) for p in range(n)], torch.int64),
            cu_seqlens_q=t([sum(lens[:i]) for i in range(len(lens) + 1)], torch.int32),
            seq_lens=t(lens, torch.int32), block_tables=t(tables, torch.int32), max_q_len=max(lens),
            max_seq_len=max(lens), q_lens_cpu=lens, seq_lens_cpu=lens)
        input_ids = t([(100 + 7 * i) % self.model_cfg.vocab_size for i in range(len(positions))], torch.int64)
        self.model(input_ids, t(positions, torch.int64), kv_caches, meta, self.backend)

    def release_memory(self) -> None:
        """At shutdown: drop the weights, the KV caches and the CUDA graphs, so the next engine in this process
        gets the memory (on a GPU the default budget is a fraction of what is free). Safe to call twice; the
        runner runs no step afterwards (executor.py refuses with a clear error)."""
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

    def _capture_cuda_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs for decode steps (cuda_graph.py), checked against the eager forward before use.
        None (every step eager) off CUDA, with enforce_eager, under tensor parallelism (NCCL inside a
        graph was never tried here), with the PyTorch reference attention (it reads host-side lengths),
        or when capture or the check fails (with a warning)."""
        if (self.device.type != "cuda" or self.config.enforce_eager or self.tp.size > 1 or self.pp.size > 1
                or self.backend.name != "triton"):
            return None
        max_model_len = self.config.max_model_len or self.model_cfg.max_position_embeddings
        graphs = DecodeGraphs(self.forward, self.config.max_num_seqs, max_model_len, self.block_size, self.device)
        try:
            graphs.capture_all()
            atol = 1e-3 if self.dtype == torch.float32 else 5e-2
            for size in (graphs.sizes[0], graphs.sizes[-1]):
                graphs.check_against_eager(size, seq_len=2 * self.block_size + 3, atol=atol)
        except Exception as exc:
            import warnings
            warnings.warn(f"CUDA graphs are off, decode steps run eagerly: {type(exc).__name__}: {exc}")
            return None
        return graphs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model on this rank's KV cache: hidden (num_tokens, hidden_size). What a CUDA graph captures."""
        return self.model(input_ids, positions, self.kv_caches, meta, self.backend)

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
                                 prev_token_rows=prev_token_rows)
        return model_input, sampling_requests

    def _to_tensors(self, mi: ModelInput):
        return model_input_tensors(mi, self.device)

    # ------------------------------------------------------------------ the step (every rank)
    def _execute_stage(self, mi: ModelInput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Pipeline parallelism, one step on this stage: receive (hidden, residual) from the previous stage, run this
        stage's layers, send them on; the last stage computes the logits and sends them to rank 0, which samples.

            rank 0 (stage 0)  --hidden, residual-->  stage 1  --> ... -->  last stage
                  ^                                                            |
                  +----------------------- logits (rows, vocab) --------------+
        Each message's shape follows from the ModelInput every rank has, so only tensors cross. Sends are
        non-blocking (waited for at the next step); on rank 0 the logits are received later, by `receive_logits`,
        so that rank 0 can run stage 0 of the next batch while the later stages work on this one."""
        pp, rank = self.pp, dist.get_rank()
        self._wait_sends()
        input_ids, positions, meta = self._to_tensors(mi)
        intermediate = None
        if not pp.is_first:
            shape = (len(mi.input_ids), self.model_cfg.hidden_size)
            hidden = torch.empty(shape, dtype=self.dtype, device=self.device)
            residual = torch.empty(shape, dtype=self.dtype, device=self.device)
            dist.recv(hidden, pp.prev_rank)
            dist.recv(residual, pp.prev_rank)
            intermediate = (hidden, residual)
        started = time.time()
        out = self.model(input_ids, positions, self.kv_caches, meta, self.backend, intermediate)
        prompt_rows = [r for s in mi.prompt_logprob_spans for r in range(s.first_row, s.first_row + s.num_rows)]
        rows = mi.sample_rows + prompt_rows
        logits = None
        last_stage_root = (pp.size - 1) * self.tp.size                   # the last stage's TP rank 0
        if pp.broadcast_logits:                                          # torchrun: every rank samples
            if not pp.is_last:
                dist.send(out[0].contiguous(), pp.next_rank)
                dist.send(out[1].contiguous(), pp.next_rank)
            if not rows:
                return None, None
            logits = (self.model.compute_logits(out[rows]) if pp.is_last else
                      torch.empty(len(rows), self.model_cfg.vocab_size, dtype=torch.float32, device=self.device))
            dist.broadcast(logits, last_stage_root)
            num_sampling = len(mi.sample_rows)
            return (logits[:num_sampling] if num_sampling else None), (logits[num_sampling:] if prompt_rows else None)
        if pp.is_last:
            # (rows, vocab) fp32, all-gathered under TP; with no rows a one-number answer, so that rank 0 always
            # knows when every stage is done with a batch (what "in flight" means)
            out = (self.model.compute_logits(out[rows]) if rows else
                   torch.zeros(1, dtype=torch.float32, device=self.device)),
        if self.record_stage_times:                  # noted before sending: the next stage cannot start earlier
            self.stage_times.append((mi.step_id, started, time.time()))
        if not pp.is_last:
            self._isend(out[0].contiguous(), pp.next_rank)
            self._isend(out[1].contiguous(), pp.next_rank)
        elif self.tp.rank == 0:
            self._isend(out[0].contiguous(), pp.driver_rank)
        return None, None

    def receive_logits(self, mi: ModelInput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Rank 0 under pipeline parallelism: the logits the last stage computed for `mi` (the same pair as
        `execute_model` returns). Batches come back in the order they were sent into the pipe."""
        prompt_rows = sum(s.num_rows for s in mi.prompt_logprob_spans)
        num_rows = len(mi.sample_rows) + prompt_rows
        if not mi.q_lens:                                                # only block copies: no stage computed
            return None, None
        shape = (num_rows, self.model_cfg.vocab_size) if num_rows else (1,)      # (1,): "done", nothing to sample
        logits = torch.empty(shape, dtype=torch.float32, device=self.device)
        dist.recv(logits, (self.pp.size - 1) * self.tp.size)             # the last stage's TP rank 0
        if not num_rows:
            return None, None
        num_sampling = len(mi.sample_rows)
        return (logits[:num_sampling] if num_sampling else None), (logits[num_sampling:] if prompt_rows else None)

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        self._sends.append((dist.isend(tensor, dst), tensor))

    def _wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

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

    def _pick_rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """hidden[rows] -> (len(rows), hidden) without waiting for the GPU: indexing a CUDA tensor with a Python
        list copies the list to the device synchronously. Consecutive rows (every decode step) are a view."""
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return hidden[rows[0]:rows[0] + len(rows)]
        index = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        return hidden.index_select(0, index)

    def _prev_tokens(self, mi: ModelInput, prev_sampled: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Async scheduling: (rows of input_ids, their tokens) to write on the device, from the previous batch's
        sampled tokens (num_sampling,) int64 on the device. None when no input comes from there."""
        if not mi.prev_token_rows:
            return None
        rows, prev = zip(*mi.prev_token_rows)
        def t(x):
            return torch.tensor(x, dtype=torch.int64).to(self.device, non_blocking=True)
        return t(rows), prev_sampled.index_select(0, t(prev))

    @torch.inference_mode()
    def execute_model(self, mi: ModelInput, prev_sampled: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run one step on this rank. Returns (logits of the sampled rows, (num_sampling, vocab) fp32, or None when
        no request samples; logits of the prompt-logprob spans' rows, (sum of num_rows, vocab) fp32, or None when
        there are none). Under TP every rank must call this with the same ModelInput: the layers' all-reduces and
        the logits' all-gather pair up across ranks. `prev_sampled`: async scheduling's previous batch's tokens
        (see ModelInput.prev_token_rows)."""
        self.swap_blocks(mi)
        if not mi.q_lens:
            return None, None
        if self.pp.size > 1:
            return self._execute_stage(mi)
        prev = self._prev_tokens(mi, prev_sampled)
        if self.graphs is not None and self.graphs.can_run(mi.q_lens, mi.block_tables):
            hidden = self.graphs.run(mi.input_ids, mi.positions, mi.slot_mapping, mi.seq_lens, mi.block_tables, prev)
        else:
            if self.graphs is not None:
                self.graphs.stats.eager_steps += 1
            input_ids, positions, meta = self._to_tensors(mi)
            if prev is not None:
                input_ids.index_copy_(0, *prev)
            hidden = self.forward(input_ids, positions, meta)                  # (num_tokens, hidden)
        prompt_rows = [r for s in mi.prompt_logprob_spans for r in range(s.first_row, s.first_row + s.num_rows)]
        if not mi.sample_rows and not prompt_rows:
            return None, None
        # One LM head (and under TP one all-gather) for both kinds of rows.
        logits = self.model.compute_logits(self._pick_rows(hidden, mi.sample_rows + prompt_rows))
        num_sampling = len(mi.sample_rows)
        return (logits[:num_sampling] if num_sampling else None), (logits[num_sampling:] if prompt_rows else None)
