"""The CPU sampler's argmax (kernels/cpu_sampling.cpp, argmax_rows) against torch.argmax, and proof that greedy
sampling on a CPU calls it. Greedy parity with Hugging Face through it is tests/test_parity.py's (it is the CPU
default)."""

from __future__ import annotations

import pytest
import torch

from minivllm.model._kernels import kernels
from minivllm.worker import sampler

cpu_ops = kernels.cpu_ops
pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler: the CPU kernels are not built")


@pytest.mark.parametrize("vocab", [1, 7, 16, 49152, 151_936])
def test_argmax_rows_equals_torch_argmax(vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(33, vocab) * 5
    assert torch.equal(cpu_ops.argmax_rows(logits), logits.argmax(dim=-1))


def test_argmax_rows_breaks_ties_and_treats_nan_as_torch_does():
    """Ties: the first index of the maximum; -inf rows: index 0; a NaN: the row's first NaN (PyTorch counts NaN
    as the largest); -0.0 and 0.0 are equal; a strided view of rows."""
    rows = torch.full((8, 300), -1.0)
    rows[0, [5, 70, 299]] = 3.0                                   # a three-way tie
    rows[1] = float("-inf")
    rows[2, [10, 200]] = float("nan"); rows[2, 50] = float("inf")
    rows[3, 250] = float("inf"); rows[3, 251] = float("inf")
    rows[4] = -0.0; rows[4, 100] = 0.0
    rows[5, 0] = float("nan")
    rows[6, 299] = 1e30
    rows[7] = torch.linspace(-1, 1, 300).flip(0)                 # the maximum at index 0
    want = rows.argmax(dim=-1)
    assert want.tolist() == [5, 0, 10, 250, 0, 0, 299, 0]
    assert torch.equal(cpu_ops.argmax_rows(rows), want)
    wide = torch.randn(6, 600)
    assert torch.equal(cpu_ops.argmax_rows(wide[:, :300]), wide[:, :300].argmax(dim=-1))   # rows strided


def test_argmax_rows_refuses_what_it_does_not_handle():
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_ops.argmax_rows(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        cpu_ops.argmax_rows(torch.randn(8, 2).t())


def test_the_samplers_greedy_rows_go_through_it(monkeypatch):
    """All-greedy and mixed batches both take their greedy tokens from argmax_rows (counted)."""
    from minivllm.core.request import Request
    from minivllm.core.sampling_params import SamplingParams

    calls = []
    real = cpu_ops.argmax_rows
    monkeypatch.setattr(cpu_ops, "argmax_rows", lambda x: calls.append(x.shape[0]) or real(x))
    logits = torch.randn(3, 100)
    greedy = [Request(f"g{i}", [1, 2], SamplingParams(temperature=0)) for i in range(3)]
    assert sampler.Sampler()(logits, greedy) == logits.argmax(dim=-1).tolist()
    mixed = greedy[:2] + [Request("s", [1, 2], SamplingParams(temperature=1.0, seed=3))]
    got = sampler.Sampler()(logits, mixed)
    assert got[:2] == logits[:2].argmax(dim=-1).tolist()
    assert calls == [3, 3]
