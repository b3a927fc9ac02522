"""Ops with one implementation per platform, chosen once when the op is built (vLLM's `CustomOp`).

Owns: the dispatch rule. An op (RMSNorm, SiluAndMul, RotaryEmbedding in layers.py) writes `forward_native`, the
plain PyTorch code every device runs and the test oracle, and may add `forward_cuda` (a Triton kernel) and
`forward_cpu` (a C++ kernel of `minivllm_kernels.cpu_ops`). `__init__` picks one for the device the op is built
on (the model is built under `with torch.device(...)`) and binds it as the op's `forward`: nothing is decided
per call, and a call goes straight from `nn.Module.__call__` to the implementation.

    CUDA  forward_cuda where the op is in CUSTOM_OPS (MINIVLLM_CUSTOM_OPS), else forward_native
    CPU   forward_cpu where the C++ kernels build (a compiler is there, MINIVLLM_CPU_KERNELS is not 0),
          else forward_native

Must never: change a result beyond rounding (tests/test_kernels.py and tests/test_cpu_layers.py compare every
kernel with forward_native).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from minivllm import envs
from minivllm.model._kernels import kernels

CUSTOM_OP_NAMES = frozenset({"rms_norm"})      # the model's ops that have a fused CUDA kernel


def _custom_ops(spec: str) -> frozenset[str]:
    """MINIVLLM_CUSTOM_OPS, read as vLLM reads `custom_ops`: a comma list starting from "all" (the default,
    also when unset or empty) or "none", then "+op" turns one on and "-op" turns one off.

    On by default: the fused RMSNorm shortens a CUDA-graph decode step and keeps fp32 greedy tokens equal to
    HF's (tests/test_gpu.py). "none" or "-rms_norm" gives the plain PyTorch ops back. Only ops built on CUDA
    use these kernels; a CPU has its own (`forward_cpu`).
    """
    names = [part.strip() for part in spec.split(",") if part.strip()]
    on = set() if "none" in names else set(CUSTOM_OP_NAMES)
    bad = [n for n in names if n not in ("all", "none") and (n[:1] not in "+-" or n[1:] not in CUSTOM_OP_NAMES)]
    if bad or ("all" in names and "none" in names):
        raise ValueError(f"MINIVLLM_CUSTOM_OPS is {spec!r}; give 'all' (the default) or 'none', then +op to turn "
                         f"one on or -op to turn one off, from: {', '.join(sorted(CUSTOM_OP_NAMES))}.")
    for n in names:
        if n[0] == "+":
            on.add(n[1:])
        elif n[0] == "-":
            on.discard(n[1:])
    return frozenset(on)


CUSTOM_OPS = _custom_ops(envs.MINIVLLM_CUSTOM_OPS)      # read once, at import


class CustomOp(nn.Module):
    """An op whose `forward` is the implementation for the device it was built on (see the module docstring).
    `name`: its entry in CUSTOM_OP_NAMES where it has a CUDA kernel behind that switch."""

    name: str | None = None

    def __init__(self):
        super().__init__()
        # An instance attribute: `nn.Module.__call__` calls `self.forward`, so this is what every call runs.
        self.forward = self.dispatch_forward(torch.get_default_device())

    def dispatch_forward(self, device: torch.device) -> Callable:
        if device.type == "cuda":
            return self.forward_cuda if self.name in CUSTOM_OPS else self.forward_native
        if device.type == "cpu" and kernels.cpu_ops.available():
            return self.forward_cpu
        return self.forward_native

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_cuda(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_cpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)
