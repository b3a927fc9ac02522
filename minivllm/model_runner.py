"""ModelRunner: turns a SchedulerOutput into tensors, runs the model, and samples.

Owns: the model's weights, the KV cache tensors, and the flat-batch inputs of each step. It reads
requests (their tokens, `num_computed_tokens`, block tables) but changes none of them; the scheduler
and the engine do that with what it returns.

Flat batch for requests A (prefill, 3 new tokens, nothing cached) and B (decode at position 20):
    input_ids     [a0 a1 a2 b20]
    positions     [ 0  1  2  20]
    slot_mapping  [slot(A,0) slot(A,1) slot(A,2) slot(B,20)]     slot = block_table[p // bs] * bs + p % bs
    cu_seqlens_q  [0 3 4]        seq_lens [3 21]
    logits rows   [2 3]          (the last new token of each request that samples)
"""

from __future__ import annotations

import torch

from minivllm.attention import AttentionMetadata, get_attention_backend
from minivllm.config import EngineConfig
from minivllm.layers import TPGroup
from minivllm.model import ModelConfig
from minivllm.model_loader import load_model, resolve_dtype
from minivllm.request import Request
from minivllm.sampler import Sampler
from minivllm.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path, model_cfg: ModelConfig, device: torch.device,
                 tp: TPGroup = TPGroup()):
        self.config = config
        self.device = device
        self.model_cfg = model_cfg
        self.tp = tp
        self.dtype = resolve_dtype(config.dtype, model_cfg, device)
        self.model = load_model(model_path, model_cfg, self.dtype, device, tp)
        self.backend = get_attention_backend(config.attention_backend, device)
        self.sampler = Sampler(config.seed)
        self.block_size = config.block_size
        self.num_kv_heads = model_cfg.num_key_value_heads // tp.size     # this rank's share
        self.num_kv_blocks = config.num_kv_blocks or self._auto_num_blocks()
        # One tensor for the whole cache: (2, num_layers, num_blocks, block_size, kv_heads, head_dim).
        # Zeroed once, so a slot that was never written holds 0, not NaN: masked slots get zero weight,
        # and 0 * NaN would still poison a matmul.
        self.kv_cache = torch.zeros(2, model_cfg.num_hidden_layers, self.num_kv_blocks, self.block_size,
                                    self.num_kv_heads, model_cfg.head_dim, dtype=self.dtype, device=device)
        self.kv_caches = [(self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(model_cfg.num_hidden_layers)]
        # The CPU pool that preemption_mode="swap" copies whole blocks to and from (same layout).
        self.num_cpu_blocks = (int(config.swap_space * 1024 ** 3 // self.bytes_per_block)
                               if config.preemption_mode == "swap" else 0)
        self.cpu_kv_cache = torch.empty((2, model_cfg.num_hidden_layers, self.num_cpu_blocks)
                                        + tuple(self.kv_cache.shape[3:]), dtype=self.dtype,
                                        pin_memory=device.type == "cuda" and self.num_cpu_blocks > 0)

    @property
    def bytes_per_block(self) -> int:
        c = self.model_cfg
        return 2 * c.num_hidden_layers * self.block_size * self.num_kv_heads * c.head_dim * self.dtype.itemsize

    def _auto_num_blocks(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1 - self.config.gpu_memory_utilization)
            budget -= 2 * 1024 ** 3 // self.tp.size       # activations and logits of the largest step
        else:
            budget = self.config.kv_cache_memory_gb * 1024 ** 3
        num_blocks = int(budget // self.bytes_per_block)
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache (budget {budget / 2**20:.0f} MiB, one block "
                             f"needs {self.bytes_per_block / 2**20:.2f} MiB); pass num_kv_blocks explicitly.")
        return num_blocks

    # ------------------------------------------------------------------ inputs
    def prepare_inputs(self, out: SchedulerOutput):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sampling_requests: list[Request] = []
        for req in out.scheduled:
            n = out.num_scheduled_tokens[req.request_id]
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            input_ids += req.all_token_ids[start:end]
            positions += range(start, end)
            table = req.block_table
            slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, end)]
            q_lens.append(n)
            seq_lens.append(end)
            if end == req.num_tokens:               # the whole sequence is now computed: sample its next token
                sample_rows.append(len(input_ids) - 1)
                sampling_requests.append(req)
        max_blocks = max(len(r.block_table) for r in out.scheduled)
        block_tables = [r.block_table + [0] * (max_blocks - len(r.block_table)) for r in out.scheduled]
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=t(slot_mapping, torch.int64), cu_seqlens_q=t(cu, torch.int32),
            seq_lens=t(seq_lens, torch.int32), block_tables=t(block_tables, torch.int32),
            max_q_len=max(q_lens), max_seq_len=max(seq_lens), q_lens_cpu=q_lens, seq_lens_cpu=seq_lens)
        return t(input_ids, torch.int64), t(positions, torch.int64), meta, sample_rows, sampling_requests

    # ------------------------------------------------------------------ the step
    def swap_blocks(self, out: SchedulerOutput) -> None:
        """Copy whole blocks (every layer, K and V) between the device cache and the CPU pool.
        Swap-outs go first: a block freed by a swap-out may be handed to another request this step."""
        if out.blocks_to_swap_out:
            src, dst = (list(x) for x in zip(*out.blocks_to_swap_out))
            self.cpu_kv_cache[:, :, dst] = self.kv_cache[:, :, src].cpu()
        if out.blocks_to_swap_in:
            src, dst = (list(x) for x in zip(*out.blocks_to_swap_in))
            self.kv_cache[:, :, dst] = self.cpu_kv_cache[:, :, src].to(self.device)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> tuple[list[Request], list[int]]:
        """Run one step. Returns the requests that sampled a token and their tokens, in batch order."""
        self.swap_blocks(out)
        if not out.scheduled:
            return [], []
        input_ids, positions, meta, sample_rows, sampling_requests = self.prepare_inputs(out)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)   # (num_tokens, hidden)
        if not sampling_requests:
            return [], []
        logits = self.model.compute_logits(hidden[sample_rows])                     # (num_sampling, vocab)
        return sampling_requests, self.sampler(logits, sampling_requests)
