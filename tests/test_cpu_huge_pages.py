"""2 MB pages under the weights and the KV cache (platforms/cpu/huge_pages.py): the same values and the same
outputs, and the pages really are 2 MB ones where Linux offers them."""

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.platforms import cpu
from minivllm.platforms.cpu import gemm

needs_huge_pages = pytest.mark.skipif(not cpu.huge_pages_available(),
                                      reason="transparent huge pages are off on this machine (or not Linux)")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1000, 577, generator=g),                                   # not a multiple of 4 KB
            torch.randint(-2 ** 15, 2 ** 15, (3, 1024, 48), generator=g, dtype=torch.int32).to(torch.int16),
            torch.randn(7, generator=g).to(torch.bfloat16),
            torch.randn(2048, 1024, generator=g)]                                     # 8 MB


def test_gather_copies_exactly_into_one_buffer():
    tensors = _tensors()
    moved = cpu.gather_on_huge_pages(tensors)
    for a, b in zip(tensors, moved):
        assert b.dtype == a.dtype and b.shape == a.shape and b.is_contiguous() and torch.equal(a, b)
    if cpu.huge_pages_available():
        assert len({t.untyped_storage().data_ptr() for t in moved}) == 1               # one buffer
        assert all(t.data_ptr() % 4096 == 0 for t in moved)
        assert moved[0].data_ptr() % cpu.HUGE_PAGE_BYTES == 0


@needs_huge_pages
def test_the_buffer_is_on_2mb_pages():
    moved = cpu.gather_on_huge_pages(_tensors())
    assert cpu.huge_page_bytes(moved[-1]) >= 4 << 20
    buf = cpu.empty_on_huge_pages(16 << 20)
    assert buf.data_ptr() % cpu.HUGE_PAGE_BYTES == 0
    buf.fill_(1)
    cpu.settle_on_huge_pages(buf)
    assert cpu.huge_page_bytes(buf) >= 16 << 20
    assert "2 MB pages" in cpu.describe_runtime() and cpu.huge_page_bytes() >= 16 << 20


@needs_huge_pages
def test_gather_refuses_a_strided_tensor():
    with pytest.raises(ValueError, match="contiguous \\(strided\\) CPU tensors"):
        cpu.gather_on_huge_pages([torch.randn(8, 8).t()])
    with pytest.raises(ValueError, match="layout torch._mkldnn"):               # oneDNN's opaque packed weight
        cpu.gather_on_huge_pages([torch.randn(8, 8).to_mkldnn()])


def test_the_opt_out_keeps_plain_tensors(monkeypatch):
    monkeypatch.setenv(cpu.HUGE_PAGES_OPT_OUT, "0")
    assert not cpu.huge_pages_available()
    tensors = _tensors()
    assert all(a is b for a, b in zip(tensors, cpu.gather_on_huge_pages(tensors)))


def _greedy(monkeypatch, huge: str, **kwargs):
    monkeypatch.setenv(cpu.HUGE_PAGES_OPT_OUT, huge)
    llm = LLM(dtype="bfloat16", seed=0, num_kv_blocks=64, **kwargs)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_the_engine_gives_the_same_tokens_on_2mb_pages(monkeypatch, quantization):
    _, plain = _greedy(monkeypatch, "0", quantization=quantization)
    llm, huge = _greedy(monkeypatch, "1", quantization=quantization)
    assert huge == plain
    if not cpu.huge_pages_available():
        pytest.skip("transparent huge pages are off: the tokens matched, the pages are plain")
    runner = llm.llm_engine.model_runner
    assert runner.kv_cache.data_ptr() % cpu.HUGE_PAGE_BYTES == 0 and cpu.huge_page_bytes(runner.kv_cache) > 0
    name = "qweight" if quantization else "packed_weight"
    streamed = [getattr(m, name) for m in runner.model.modules() if getattr(m, name, None) is not None]
    if quantization is None and gemm.prepack(torch.zeros(2, 2, dtype=torch.bfloat16)) is None:
        # a CPU whose oneDNN cannot pack bf16 (AVX2 only) keeps F.linear on the loaded weights: nothing to stream
        assert streamed == []
        return
    assert len(streamed) == 30 * 4 + 1                              # 4 linear layers a decoder layer, the LM head
    assert len({t.untyped_storage().data_ptr() for t in streamed}) == 1          # all in the one buffer
    assert cpu.huge_page_bytes(streamed[0]) >= sum(t.nbytes for t in streamed) // 2
