"""The PyTorch attention backend on mixed steps: decodes beside prefill chunks (minivllm/model/attention.py)."""

from __future__ import annotations

import torch

from minivllm.model.attention import AttentionMetadata, TorchAttentionBackend
from minivllm.model._kernels import kernels

ref = kernels.reference


def test_mixed_step_batches_its_decodes_and_matches_the_prefill_path(monkeypatch):
    """Sequences with one new token go through the batched decode path, the rest through the prefill loop,
    and the answer is the one the prefill loop gives for the whole step."""
    torch.manual_seed(0)
    num_blocks, bs, heads, kv_heads, d = 64, 16, 6, 2, 32
    key_cache = torch.randn(num_blocks, bs, kv_heads, d)
    value_cache = torch.randn(num_blocks, bs, kv_heads, d)
    q_lens = [5, 1, 20, 1, 1]                       # prefill, decode, prefill chunk, decode, decode
    seq_lens = [5, 40, 37, 3, 17]                   # the chunk of 20 has 17 tokens of context before it
    tables = torch.randperm(num_blocks)[:5 * 3].view(5, 3).to(torch.int32)
    n = sum(q_lens)
    q, k, v = torch.randn(n, heads, d), torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
    slots = []
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        slots += [int(tables[i, p // bs]) * bs + p % bs for p in range(sl - ql, sl)]
    cu = torch.tensor([0, 5, 6, 26, 27, 28], dtype=torch.int32)
    meta = AttentionMetadata(torch.tensor(slots), cu, torch.tensor(seq_lens, dtype=torch.int32), tables,
                             max_q_len=20, max_seq_len=40, q_lens_cpu=q_lens, seq_lens_cpu=seq_lens)

    decode_calls = []
    real_decode = ref.paged_decode_attention
    monkeypatch.setattr(ref, "paged_decode_attention",
                        lambda query, *a, **kw: decode_calls.append(query.shape[0]) or real_decode(query, *a, **kw))
    kc, vc = key_cache.clone(), value_cache.clone()
    got = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, d ** -0.5)
    assert decode_calls == [3]                      # the three decodes, in one batched call

    ref.store_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping)
    want = ref.paged_prefill_attention(q, key_cache, value_cache, tables, cu, meta.seq_lens, d ** -0.5,
                                       q_lens_cpu=q_lens, seq_lens_cpu=seq_lens)
    assert torch.equal(kc, key_cache) and torch.equal(vc, value_cache)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
