"""2 MB pages under the tensors a CPU step reads whole: the weights and the KV cache.

Owns: asking Linux for 2 MB pages under a buffer (`empty_on_huge_pages`, `settle_on_huge_pages`), moving the
streamed weights of a loaded model onto them (`put_streamed_weights_on_huge_pages`), and reading back how
much memory sits on them (`huge_page_bytes`).

Why: a decode step reads all the weights and the whole KV context, a few hundred MB. In 4 KB pages that is tens
of thousands of pages, far more than the CPU's TLB holds (a few thousand entries on current cores), so reads
keep waiting on page-table walks, and the hardware prefetcher stops at every 4 KB boundary. Linux backs memory
with 2 MB pages ("transparent huge pages") where a program asks with `madvise(MADV_HUGEPAGE)`, the default
setting on most distributions (`/sys/kernel/mm/transparent_hugepage/enabled` = madvise), or everywhere
(= always). `empty_on_huge_pages` hands out a 2 MB-aligned buffer with that advice, and `settle_on_huge_pages`
asks (`MADV_COLLAPSE`, Linux 6.1+) for pages already filled with 4 KB ones to be merged. The README
("Measured") has what it saves on each of a decode step's matmuls and attention. `MINIVLLM_CPU_HUGE_PAGES=0`
keeps plain pages.

Must never: change a value (only where it lives changes; `tests/test_cpu_huge_pages.py` checks greedy output is
identical with and without), or import torch at module level (the CPU runtime's re-start imports this package
before torch).
"""

from __future__ import annotations

import sys

from minivllm import envs

# MINIVLLM_CPU_HUGE_PAGES=0: the weights and the KV cache stay on the allocator's plain 4 KB pages.
HUGE_PAGES_OPT_OUT = "MINIVLLM_CPU_HUGE_PAGES"
HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25          # <linux/mman.h>; MADV_COLLAPSE since Linux 6.1
# The weights a CPU step reads whole, where a layer has them: packed for minivllm's matmul (gemm.py) or quantized
# (quantization.py). A layer without them reads `weight` through F.linear. oneDNN's packed weights
# (MINIVLLM_CPU_OWN_GEMM=0, or no C++ kernels) are opaque tensors that only oneDNN may copy: they stay put.
STREAMED_WEIGHTS = ("packed_weight", "qweight", "qscale", "qscales_zeros")


def huge_pages_available() -> bool:
    """Whether this process may ask for 2 MB pages: Linux, transparent huge pages not `never`, no opt-out."""
    if not envs.MINIVLLM_CPU_HUGE_PAGES or not sys.platform.startswith("linux"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _madvise(address: int, length: int, advice: int) -> bool:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(address, length, advice) == 0


def empty_on_huge_pages(nbytes: int):
    """A (nbytes,) uint8 CPU tensor, uninitialised, starting on a 2 MB boundary, whose pages Linux is asked to
    make 2 MB ones when they are first written (a plain tensor when huge pages are unavailable). View it as the
    dtype and shape you need; fill it, then call settle_on_huge_pages."""
    import torch
    if not huge_pages_available():
        return torch.empty(nbytes, dtype=torch.uint8)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    buf = raw[start:start + nbytes]                 # keeps `raw`'s storage alive
    _madvise(buf.data_ptr(), nbytes - nbytes % HUGE_PAGE_BYTES, MADV_HUGEPAGE)
    return buf


def settle_on_huge_pages(buf) -> None:
    """After filling a buffer from empty_on_huge_pages: merges into 2 MB pages what still sits in 4 KB ones
    (memory the allocator had touched before it was advised). Best effort: an older kernel refuses, and then
    the advice alone applies."""
    if huge_pages_available():
        _madvise(buf.data_ptr(), buf.numel() - buf.numel() % HUGE_PAGE_BYTES, MADV_COLLAPSE)


def gather_on_huge_pages(tensors: list) -> list:
    """Copies of `tensors` (CPU, contiguous) side by side in one buffer on 2 MB pages, each starting on a 4 KB
    boundary; the same tensors when huge pages are unavailable."""
    import torch
    if not huge_pages_available() or not tensors:
        return list(tensors)
    offsets, total = [], 0
    for t in tensors:
        if t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous():
            raise ValueError(f"gather_on_huge_pages takes contiguous (strided) CPU tensors, got one of shape "
                             f"{tuple(t.shape)} on {t.device}, layout {t.layout}"
                             + ("" if t.layout != torch.strided else f", contiguous: {t.is_contiguous()}"))
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // 4096) * 4096
    buf = empty_on_huge_pages(total)
    out = []
    for t, off in zip(tensors, offsets):
        view = buf[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    settle_on_huge_pages(buf)
    return out


def huge_page_bytes(tensor=None) -> int:
    """Bytes of this process's memory on transparent huge pages (/proc/self/smaps); with `tensor`, of the
    memory mappings that hold it. 0 off Linux."""
    try:
        with open("/proc/self/smaps_rollup" if tensor is None else "/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    lo = hi = None
    if tensor is not None:
        lo = tensor.data_ptr()
        hi = lo + tensor.numel() * tensor.element_size()
    total, inside = 0, tensor is None
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):                 # a mapping's first line: start-end perms ...
            if tensor is not None:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start < hi and end > lo
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


def put_streamed_weights_on_huge_pages(model) -> int:
    """Move every layer's STREAMED_WEIGHTS into one buffer on 2 MB pages; returns the bytes moved (0 where Linux
    offers no huge pages, or MINIVLLM_CPU_HUGE_PAGES=0). The values are copied exactly: only where they live
    changes."""
    import torch
    slots = [(m, name) for m in model.modules() for name in STREAMED_WEIGHTS
             if isinstance(getattr(m, name, None), torch.Tensor) and getattr(m, name).layout == torch.strided
             and getattr(m, name).numel() > 0]
    unique = list({id(getattr(m, name)): getattr(m, name) for m, name in slots}.values())
    moved = dict(zip(map(id, unique), gather_on_huge_pages(unique)))
    for m, name in slots:
        setattr(m, name, moved[id(getattr(m, name))])
    return sum(t.numel() * t.element_size() for t in unique if moved[id(t)] is not t)
