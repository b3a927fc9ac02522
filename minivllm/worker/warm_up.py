"""Warming a model runner up before it serves: one prefill of dummy tokens on a scratch KV cache, so that the first
real large step does not pay for the allocator's growth and oneDNN's first calls (vLLM warms its model up too)."""

from __future__ import annotations

import torch

from minivllm.model.attention import AttentionMetadata


@torch.inference_mode()
def warm_up(runner, num_tokens: int, tokens_per_seq: int = 128) -> None:
    """One prefill of `num_tokens` dummy tokens (prompts of `tokens_per_seq`) on a scratch cache, before
    serving: the first large step pays once for what later steps reuse (the allocator's growth, oneDNN's
    first calls), as vLLM warms its model up before serving. Touches no request, block or counter, and not the
    KV cache. One process only: under tensor or pipeline parallelism every rank would have to run it at the
    same point (the caller checks)."""
    if runner.tp.size > 1 or runner.pp.size > 1:
        raise RuntimeError("warm_up runs in a single process only (tensor_parallel_size and "
                           "pipeline_parallel_size 1)")
    max_len = runner.config.max_model_len or runner.model_cfg.max_position_embeddings
    lens = []
    while sum(lens) < num_tokens:
        lens.append(min(tokens_per_seq, max_len, num_tokens - sum(lens)))
    bs, device = runner.block_size, runner.device
    blocks = [-(-n // bs) for n in lens]
    width = max(blocks)
    cache = torch.zeros(2, runner.num_layers, sum(blocks), bs, runner.num_kv_heads, runner.model_cfg.head_dim,
                        dtype=runner.dtype, device=device)             # scratch, freed on return
    kv_caches = [(cache[0, i], cache[1, i]) for i in range(runner.num_layers)]
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
    input_ids = t([(100 + 7 * i) % runner.model_cfg.vocab_size for i in range(len(positions))], torch.int64)
    runner.model(input_ids, t(positions, torch.int64), kv_caches, meta, runner.backend)
