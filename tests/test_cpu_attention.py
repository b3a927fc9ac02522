"""The C++ CPU decode kernel (kernels/cpu_attention.cpp via kernels/cpu_ops.py) against the PyTorch reference,
and the serving path that uses it (attention_backend 'cpu', the CPU default when a compiler is there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minivllm.model._kernels import kernels
from oracle import PROMPTS, hf_greedy

ref = kernels.reference
cpu_ops = kernels.cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler: the CPU kernels are not built")


def _case(num_seqs, heads, kv_heads, head_dim, block_size, dtype, max_len=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-max_len // block_size)
    num_blocks = num_seqs * max_blocks + 7
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    # Scattered, non-repeating blocks, and ragged lengths that include 1 and a full last block.
    tables = torch.randperm(num_blocks, generator=g)[:num_seqs * max_blocks].view(num_seqs, max_blocks)
    lens = torch.randint(1, max_len + 1, (num_seqs,), generator=g)
    lens[0] = 1
    if num_seqs > 1:
        lens[1] = block_size * 2
    query = torch.randn(num_seqs, heads, head_dim, generator=g).to(dtype)
    return query, key_cache, value_cache, tables.to(torch.int32), lens.to(torch.int32)


@pytest.mark.parametrize("num_seqs", [1, 3, 37])            # 1 and 3: one KV head per work item; 37: whole sequences
# head_dim 40 and 36: the kernel's 8-lane registers with one register left over, and with 4 scalar lanes left over
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (8, 2, 64), (4, 1, 32), (4, 2, 40),
                                                      (6, 2, 36)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_decode_kernel_equals_the_reference_fp32(num_seqs, heads, kv_heads, head_dim, block_size):
    query, kc, vc, tables, lens = _case(num_seqs, heads, kv_heads, head_dim, block_size, torch.float32)
    want = ref.paged_decode_attention(query, kc, vc, tables, lens, head_dim ** -0.5)
    got = cpu_ops.paged_decode_attention(query, kc, vc, tables, lens, head_dim ** -0.5)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_seqs", [2, 33])
# head_dim 32, 64, 128: one, two and four 32-value registers a row in the bf16 path (its even/odd split of V);
# block 32: two runs of 16 scores a block
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 32), (4, 1, 32, 16)])
def test_decode_kernel_half_precision_is_within_one_rounding_of_fp32(dtype, num_seqs, heads, kv_heads, head_dim,
                                                                     block_size):
    """bf16/fp16 in, fp32 inside: the answer is the fp32 attention over the same rounded inputs, rounded once."""
    query, kc, vc, tables, lens = _case(num_seqs, heads, kv_heads, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    got = cpu_ops.paged_decode_attention(query, kc, vc, tables, lens, scale)
    exact = ref.paged_decode_attention(query.float(), kc.float(), vc.float(), tables, lens, scale)
    assert got.dtype == dtype
    eps = torch.finfo(dtype).eps
    assert ((got.float() - exact).abs() <= eps * exact.abs() + 1e-6).all()


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs", [2, 17])
# the AVX-512 path's shapes (it widens each fp8 block slice first), and head_dim 40, which takes the generic path
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 32), (4, 1, 32, 16),
                                                                (4, 2, 40, 16)])
def test_decode_kernel_over_an_fp8_cache_equals_the_reference(model_dtype, num_seqs, heads, kv_heads, head_dim,
                                                              block_size):
    query, kc, vc, tables, lens = _case(num_seqs, heads, kv_heads, head_dim, block_size, torch.float32)
    k_scale, v_scale = 0.05, 0.02
    kq, vq = ref.quantize_fp8(kc, k_scale), ref.quantize_fp8(vc, v_scale)
    query = query.to(model_dtype)
    want = ref.paged_decode_attention(query, kq, vq, tables, lens, 0.125, k_scale=k_scale, v_scale=v_scale,
                                      compute_dtype=torch.float32)
    got = cpu_ops.paged_decode_attention(query, kq, vq, tables, lens, 0.125, k_scale=k_scale, v_scale=v_scale)
    tol = 2e-5 if model_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_widens_every_fp8_value_exactly(model_dtype):
    """All 256 e4m3 bit patterns (subnormals, both zeros and NaN included) read back through V: each sequence
    holds one token, so its softmax weight is exactly 1 and the output is its V row times v_scale (a power of
    two: exact in bf16 too). The AVX-512 path widens them with a table lookup (widen_e4m3)."""
    heads, kv_heads, head_dim, block_size = 3, 1, 64, 16
    num_seqs = 256 // head_dim
    bits = torch.zeros(num_seqs, block_size, kv_heads, head_dim, dtype=torch.uint8)
    bits[:, 0, 0] = torch.arange(256, dtype=torch.uint8).view(num_seqs, head_dim)
    vc = bits.view(torch.float8_e4m3fn)
    kc = torch.zeros_like(vc)
    tables = torch.arange(num_seqs, dtype=torch.int32).view(num_seqs, 1)
    lens = torch.ones(num_seqs, dtype=torch.int32)
    query = torch.randn(num_seqs, heads, head_dim).to(model_dtype)
    got = cpu_ops.paged_decode_attention(query, kc, vc, tables, lens, 0.125, k_scale=1.0, v_scale=0.5)
    want = (vc[:, 0].float() * 0.5).expand(num_seqs, heads, head_dim)
    assert got.dtype == model_dtype and torch.isnan(want).sum() == 2 * heads
    torch.testing.assert_close(got.float(), want, rtol=0, atol=0, equal_nan=True)


def test_decode_kernel_refuses_bad_input_with_a_clear_error():
    query, kc, vc, tables, lens = _case(2, 9, 3, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="cache's dtype"):
        cpu_ops.paged_decode_attention(query, kc.half(), vc.half(), tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        cpu_ops.paged_decode_attention(torch.randn(2, 8, 64), kc, vc, tables, lens, 0.125)


@pytest.mark.slow
def test_loading_the_kernels_does_not_flush_denormals():
    """The library is compiled with -ffast-math but not linked with it; linked, GCC adds crtfastmath.o, which
    sets flush-to-zero for the whole process and would change every fp32 op in torch."""
    cpu_ops.load()
    tiny = torch.tensor([1e-39])
    assert (tiny * 1.0).item() > 0
    code = ("import torch; from minivllm.model._kernels import kernels; kernels.cpu_ops.load(); "
            "print((torch.tensor([1e-39]) * 1.0).item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert float(out.stdout.strip()) > 0, out.stderr


@pytest.mark.slow
def test_the_cpu_default_serves_through_the_kernel_and_matches_hf_and_the_reference(model_dir, hf_model,
                                                                                     monkeypatch):
    """auto on a CPU picks 'cpu'; its decode steps call the C++ kernel (counted), and greedy output equals
    Hugging Face's and the PyTorch reference backend's, token for token."""
    from minivllm import LLM, SamplingParams

    calls, stores, argmaxes = [], [], []
    real, real_store, real_argmax = cpu_ops.paged_decode_attention, cpu_ops.store_kv_cache, cpu_ops.argmax_rows
    monkeypatch.setattr(cpu_ops, "paged_decode_attention",
                        lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw))
    monkeypatch.setattr(cpu_ops, "store_kv_cache", lambda k, *a: stores.append(k.shape[0]) or real_store(k, *a))
    monkeypatch.setattr(cpu_ops, "argmax_rows", lambda x: argmaxes.append(x.shape[0]) or real_argmax(x))
    params = SamplingParams(temperature=0, max_tokens=24)
    outs = {}
    for backend in ("auto", "torch"):
        llm = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=256, attention_backend=backend)
        assert llm.llm_engine.model_runner.backend.name == ("cpu" if backend == "auto" else "torch")
        outs[backend] = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
        llm.shutdown()
        if backend == "auto":
            assert max(calls) == len(PROMPTS)          # the batched decode steps ran in C++
            assert len(stores) >= 30 * 24 and max(stores) > len(PROMPTS)   # every layer's store, prefill's too
            seen, stored = len(calls), len(stores)
    assert len(calls) == seen                          # ...and the reference backend never called them
    assert len(stores) == stored
    assert len(argmaxes) >= 2 * 24 and max(argmaxes) == len(PROMPTS)   # greedy rows, both backends (the sampler)
    assert outs["auto"] == outs["torch"]
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for prompt, got in zip(PROMPTS, outs["auto"]):
        ids = tokenizer(prompt)["input_ids"]
        want = hf_greedy(hf_model, ids, 24)
        n = want.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in want else 24
        assert got == want[:n]


@pytest.mark.slow
def test_without_the_kernels_the_cpu_serves_with_the_reference_and_says_why(model_dir):
    """MINIVLLM_CPU_KERNELS=0 (as a machine without a C++ compiler): auto falls back to 'torch'; asking for
    'cpu' by name is refused with the reason and the fix."""
    code = (
        "from minivllm import LLM\n"
        f"llm = LLM({str(model_dir)!r}, dtype='float32', num_kv_blocks=64)\n"
        "print(llm.llm_engine.model_runner.backend.name)\n"
        "try:\n"
        f"    LLM({str(model_dir)!r}, dtype='float32', num_kv_blocks=64, attention_backend='cpu')\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n")
    env = dict(os.environ, MINIVLLM_CPU_KERNELS="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "torch", out.stderr[-2000:]
    assert "MINIVLLM_CPU_KERNELS=0" in lines[1] and "attention_backend='torch'" in lines[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prompts_attend_to_their_own_kv_and_equal_the_reference(dtype, monkeypatch):
    """A mixed step: two fresh prompts, a chunk with cached context, two decodes. The cpu backend attends the fresh
    prompts from the step's own K/V in one C++ call (the reference's prefill runs only for the chunk with context:
    both counted); every row equals the torch backend's up to the order of fp32 sums (and, in bf16, one rounding
    of the output), and the chunk's rows are the reference's own numbers; the same over an fp8 cache."""
    from minivllm.model.attention import AttentionMetadata, CpuAttentionBackend, TorchAttentionBackend
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, bs = 9, 3, 64, 16
    q_lens, seq_lens = [37, 5, 1, 64, 1], [37, 40, 90, 64, 17]          # fresh, context, decode, fresh, decode
    tables = torch.arange(5 * 8, dtype=torch.int32).view(5, 8)
    slots = torch.cat([tables[i, torch.arange(s - n, s) // bs].long() * bs + torch.arange(s - n, s) % bs
                       for i, (n, s) in enumerate(zip(q_lens, seq_lens))])
    meta = AttentionMetadata(slot_mapping=slots, cu_seqlens_q=torch.tensor([0] + q_lens).cumsum(0).to(torch.int32),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
                             max_q_len=max(q_lens), max_seq_len=max(seq_lens), q_lens_cpu=q_lens,
                             seq_lens_cpu=seq_lens)
    tokens = sum(q_lens)
    q, k, v = (torch.randn(tokens, h, d, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    cache = torch.randn(2, 40, bs, kv_heads, d, generator=g).to(dtype)
    prefills, fresh_calls = [], []
    real = ref.paged_prefill_attention
    monkeypatch.setattr(ref, "paged_prefill_attention",
                        lambda q, *a, **kw: prefills.append(q.shape[0]) or real(q, *a, **kw))
    real_fresh = cpu_ops.prefill_attention
    monkeypatch.setattr(cpu_ops, "prefill_attention",
                        lambda q, k, v, starts, lens, scale: fresh_calls.append((starts, lens))
                        or real_fresh(q, k, v, starts, lens, scale))
    want = TorchAttentionBackend().forward(q, k, v, cache[0].clone(), cache[1].clone(), meta, scale=0.125)
    assert prefills == [37 + 5 + 64]                                       # the reference: all prefill rows at once
    prefills.clear()
    got = CpuAttentionBackend().forward(q, k, v, cache[0].clone(), cache[1].clone(), meta, scale=0.125)
    assert prefills == [5]                                                 # only the chunk with context
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    assert fresh_calls == [([0, 42], [37, 64])]       # both fresh prompts in one call (rows of the prefill batch)
    assert torch.equal(got[37:42], want[37:42])           # the chunk with context: the reference's own numbers
    # An fp8 cache: the fresh prompts attend in C++ to this step's K and V rounded to the cache's bytes (the
    # reference reads them back from the cache); the stored bytes are the reference's own.
    fp8 = ref.quantize_fp8(cache.float(), 0.5)
    scales = dict(k_scale=0.5, v_scale=0.25)
    want_cache, got_cache = fp8.clone(), fp8.clone()
    prefills.clear()
    want = TorchAttentionBackend().forward(q, k, v, want_cache[0], want_cache[1], meta, scale=0.125, **scales)
    assert prefills == [37 + 5 + 64]
    prefills.clear(), fresh_calls.clear()
    got = CpuAttentionBackend().forward(q, k, v, got_cache[0], got_cache[1], meta, scale=0.125, **scales)
    assert prefills == [5] and fresh_calls == [([0, 42], [37, 64])]
    assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got[37:42], want[37:42])


def _causal_attention_fp64(q, k, v, scale):
    """The oracle: one whole prompt, (n, heads, d) and (n, kv_heads, d), written out in float64."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("ihd,jhd->hij", q, k) * scale
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hij,jhd->ihd", scores.softmax(-1), v)


def _prompts(heads, kv_heads, head_dim, lens, dtype, seed=0):
    """Prompts laid end to end, with k and v strided views of one qkv projection output, as the model's are."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lens), (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.contiguous().view(-1, heads, head_dim)                  # the rotary output is contiguous; v is a view
    return q, k.contiguous().view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)


# lens: 1, 7, 8, 9 keys (a short, a full and a one-over tile of 8) and long prompts; 11 prompts of mixed lengths
# keep both threads taking items from the shared queue.
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (4, 1, 32), (4, 2, 40), (6, 2, 36)])
@pytest.mark.parametrize("lens", [[1, 7, 8, 9, 130], [64, 3, 191, 17, 100, 1, 33, 72, 5, 160, 12]])
def test_prefill_kernel_equals_causal_attention(heads, kv_heads, head_dim, lens):
    q, k, v = _prompts(heads, kv_heads, head_dim, lens, torch.float32)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    scale = head_dim ** -0.5
    got = cpu_ops.prefill_attention(q, k, v, starts, lens, scale)
    assert got.shape == q.shape and got.dtype == torch.float32
    for start, n in zip(starts, lens):
        rows = slice(start, start + n)
        want = _causal_attention_fp64(q[rows], k[rows], v[rows], scale)
        torch.testing.assert_close(got[rows].double(), want, atol=2e-6, rtol=2e-5)


def test_prefill_kernel_rows_of_a_sequence_do_not_depend_on_the_others_given():
    lens = [20, 9, 30]
    q, k, v = _prompts(9, 3, 64, lens, torch.float32)
    got = cpu_ops.prefill_attention(q, k, v, [0, 29], [20, 30], 0.125)        # the middle prompt is not fresh
    full = cpu_ops.prefill_attention(q, k, v, [0, 20, 29], lens, 0.125)
    assert torch.equal(got[:20], full[:20]) and torch.equal(got[29:], full[29:])


# bf16 on a CPU with AVX-512 BF16 takes its scores from bf16 pairs (vdpbf16ps) when head_dim is even; 33 is odd
# and takes the fp32 tiles. 300 rows: five work items per KV head.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,lens", [(9, 3, 64, [50, 1, 77]), (4, 1, 33, [20, 3]),
                                                          (8, 2, 128, [300, 17])])
def test_prefill_kernel_half_precision_is_within_one_rounding_of_fp32(dtype, heads, kv_heads, head_dim, lens):
    q, k, v = _prompts(heads, kv_heads, head_dim, lens, dtype)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    scale = head_dim ** -0.5
    got = cpu_ops.prefill_attention(q, k, v, starts, lens, scale)
    exact = cpu_ops.prefill_attention(q.float(), k.float(), v.float(), starts, lens, scale)
    assert got.dtype == dtype
    eps = torch.finfo(dtype).eps
    assert ((got.float() - exact).abs() <= eps * exact.abs() + 1e-6).all()
    for start, n in zip(starts, lens):                   # and the fp32 answer is the true one, from float64
        rows = slice(start, start + n)
        torch.testing.assert_close(exact[rows].double(), _causal_attention_fp64(q[rows], k[rows], v[rows], scale),
                                   atol=2e-6, rtol=2e-5)


def test_prefill_kernel_refuses_bad_input_with_a_clear_error():
    q, k, v = _prompts(9, 3, 64, [10], torch.float32)
    with pytest.raises(RuntimeError, match=r"sequence 0 \(rows 5 \.\.\. 14\) is outside the 10 rows"):
        cpu_ops.prefill_attention(q, k, v, [5], [10], 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_ops.prefill_attention(q, k.double(), v, [0], [10], 0.125)
    with pytest.raises(RuntimeError, match="heads must be contiguous"):
        cpu_ops.prefill_attention(q.transpose(1, 2), k, v, [0], [10], 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv_cache_equals_the_reference_and_skips_padding(dtype):
    """Strided K and V (views of a fused qkv row, as the model passes them), scattered slots and -1 padding:
    the caches end up byte for byte as the reference's index_copy_ leaves them."""
    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, head_dim, tokens = 12, 16, 3, 64, 40
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * head_dim).to(dtype)
    _, k, v = qkv.split([9 * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    slots[[3, 17, 39]] = -1
    caches = [torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    kernels.reference.store_kv_cache(k, v, want[0], want[1], slots)
    cpu_ops.store_kv_cache(k, v, caches[0], caches[1], slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    assert not torch.equal(want[0], torch.zeros_like(want[0]))
    with pytest.raises(RuntimeError, match="slot 192 of token 0 is past the cache's 192 slots"):
        cpu_ops.store_kv_cache(k, v, caches[0], caches[1], torch.full((tokens,), num_blocks * block_size))
    with pytest.raises(RuntimeError, match="share one dtype"):
        cpu_ops.store_kv_cache(k.float() if dtype != torch.float32 else k.double(), v, caches[0], caches[1], slots)


def test_a_build_killed_half_way_does_not_make_the_next_load_wait_forever():
    """torch's cpp_extension leaves its `lock` file behind when a build is killed (Ctrl-C, a timeout); its next load
    would wait on it forever. cpu_ops takes an flock of its own first, so a lock file found then is stale."""
    from torch.utils import cpp_extension
    build_dir = Path(cpp_extension._get_build_directory(cpu_ops._build_name(), verbose=False))
    (build_dir / "lock").touch()                      # what a killed build leaves
    code = "from minivllm.model._kernels import kernels; kernels.cpu_ops.load(); print('loaded')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr[-2000:]
    assert not (build_dir / "lock").exists()
