"""The fp8 KV cache's scales: one for K and one for V per layer, calibrated once when the cache is allocated.

Owns: the calibration (which text, which statistic, how much headroom) and nothing else; the quantization itself
is `quantize_fp8` in kernels/reference.py (and the store kernel in kernels/triton_ops.py), and the scales live on
each attention layer (`LlamaAttention.k_scale / v_scale`), as vLLM keeps `_k_scale` / `_v_scale` on its layers.

An e4m3 number has 3 mantissa bits whatever its size, from 2^-6 up to 448, so a scale only decides which
window of magnitudes is stored well: too small and large K/V values saturate at 448, too large and small ones
fall below 2^-6 into the coarse subnormals. Here, as vLLM's `calculate_kv_scales` does on its first batch,
    scale = amax(x over a calibration prompt) / (448 / HEADROOM)
so the calibration's largest value lands at 448 / HEADROOM, leaving room for inputs with larger values. The
calibration prompt is fixed public-domain prose (bench/passages.py), so the scales, and so every output, are
the same on every run, and it attends through the PyTorch reference whichever backend serves (the C++ or
Triton kernels sum in other orders, and a max of K over 512 tokens moves with them), so they are the same on
every backend too. It runs this rank's layers only (its TP share of the KV heads: each rank measures its own
heads, and the ranks agree on the largest, so a TP run stores the same bytes as one rank would; under pipeline
parallelism the stages pass the hidden states on, as in a step), on a temporary cache in
the model's dtype, before the fp8 cache exists: nothing it does is visible to a request.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minivllm.model.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend

HEADROOM = 2.0              # the calibration's amax maps to 448 / 2 = 224


def calibration_token_ids(tokenizer, max_tokens: int = 512) -> list[int]:
    """The fixed calibration prompt: a few passages of public-domain prose, at most max_tokens tokens."""
    from minivllm.bench.passages import PASSAGES

    text = "\n\n".join(PASSAGES[name] for name in ("gettysburg", "austen", "darwin") if name in PASSAGES)
    return tokenizer.encode(text)[:max_tokens]


class _AmaxRecorder(AttentionBackend):
    """Attends through `inner` and notes the largest |K| and |V| of each call: call i is layer i of this rank."""

    name = "amax-recorder"

    def __init__(self, inner: AttentionBackend):
        self.inner = inner
        self.amax: list[tuple[float, float]] = []

    def forward(self, q, k, v, key_cache, value_cache, meta, scale, k_scale=1.0, v_scale=1.0):
        self.amax.append((float(k.abs().max()), float(v.abs().max())))
        return self.inner.forward(q, k, v, key_cache, value_cache, meta, scale)


@torch.inference_mode()
def calibrate_kv_scales(runner, token_ids: list[int]) -> list[tuple[float, float]]:
    """Set every attention layer's (k_scale, v_scale) of `runner`'s model from one prefill of `token_ids`; returns
    them. Every rank must call it at the same point (the forward's collectives, the stages' sends pair up)."""
    model, pp, device = runner.model, runner.pp, runner.device
    n, bs = len(token_ids), runner.block_size
    num_blocks = -(-n // bs)
    cache = torch.zeros(2, runner.num_layers, num_blocks, bs, runner.num_kv_heads, runner.model_cfg.head_dim,
                        dtype=runner.dtype, device=device)                   # the model's dtype, freed on return
    kv_caches = [(cache[0, i], cache[1, i]) for i in range(runner.num_layers)]
    # One sequence, prefilled from position 0 into blocks 0 .. num_blocks - 1 of the temporary cache.
    def t(x, dtype):
        return torch.tensor(x, dtype=dtype, device=device)
    input_ids, positions = t(token_ids, torch.int64), t(list(range(n)), torch.int64)
    meta = AttentionMetadata(slot_mapping=t(list(range(n)), torch.int64), cu_seqlens_q=t([0, n], torch.int32),
                             seq_lens=t([n], torch.int32), block_tables=t([list(range(num_blocks))], torch.int32),
                             max_q_len=n, max_seq_len=n, q_lens_cpu=[n], seq_lens_cpu=[n])
    recorder = _AmaxRecorder(TorchAttentionBackend())           # the reference: scales independent of the backend
    intermediate = None
    if pp.size > 1 and not pp.is_first:
        hidden = torch.empty(n, runner.model_cfg.hidden_size, dtype=runner.dtype, device=device)
        residual = torch.empty_like(hidden)
        dist.recv(hidden, pp.prev_rank)
        dist.recv(residual, pp.prev_rank)
        intermediate = (hidden, residual)
    out = model(input_ids, positions, kv_caches, meta, recorder, intermediate)
    if pp.size > 1 and not pp.is_last:
        dist.send(out[0].contiguous(), pp.next_rank)
        dist.send(out[1].contiguous(), pp.next_rank)
    layers = [layer.self_attn for layer in model.layers]
    assert len(recorder.amax) == len(layers), (len(recorder.amax), len(layers))
    amax = torch.tensor(recorder.amax, dtype=torch.float32, device=device)      # (layers, 2): K, V
    if runner.tp.size > 1:                # one scale per layer over all heads: TP runs store what one rank would
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=runner.tp.group)
    scales = []
    for attn, (k_amax, v_amax) in zip(layers, amax.tolist()):
        # A layer whose K (or V) is all zeros gets scale 1: any scale stores zeros exactly.
        attn.k_scale = k_amax * HEADROOM / 448.0 if k_amax > 0 else 1.0
        attn.v_scale = v_amax * HEADROOM / 448.0 if v_amax > 0 else 1.0
        scales.append((attn.k_scale, attn.v_scale))
    return scales
