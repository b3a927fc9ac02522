"""The CPU platform: everything minivllm does differently on a CPU, one module per concern.

    runtime.py       tcmalloc and Intel's OpenMP preloaded by re-starting an entry point; what the CPU can do
    huge_pages.py    2 MB pages under the weights and the KV cache
    gemm.py          linear layers' weights packed once (oneDNN's layout, or minivllm's own GEMM's panels), and a
                     gated MLP's SiLU inside its gate/up matmul or its rows in cache-sized slices
    quantization.py  int8 / int4 / gguf / w8a8_int8 / w4a8_int8 weights and their CPU kernels
    loading.py       `process_weights_after_loading`: the one call the model loader makes, in that order

The model (minivllm/model/) knows none of this: its layers call `quant_method.apply` and their ops'
`forward_cpu`; what runs behind those is chosen here, once, when the weights are loaded (never per call).
Every switch (`MINIVLLM_CPU_*`) is read through minivllm/envs.py.

Must never: import torch when this package is imported (`reexec_with_cpu_runtime` runs before torch is; the
torch-using modules, gemm, quantization, mlp and loading, are imported by name), or change a result beyond
rounding: every path here is checked against the plain PyTorch one by tests/test_cpu_*.py.
`python -m minivllm.platforms.cpu` prints what the runtime found.
"""

from minivllm.platforms.cpu.huge_pages import (HUGE_PAGE_BYTES, HUGE_PAGES_OPT_OUT, MADV_COLLAPSE, MADV_HUGEPAGE,
                                               STREAMED_WEIGHTS, empty_on_huge_pages, gather_on_huge_pages,
                                               huge_page_bytes, huge_pages_available,
                                               put_streamed_weights_on_huge_pages, settle_on_huge_pages)
from minivllm.platforms.cpu.runtime import (OPT_OUT, REEXEC_MARKER, describe_runtime, find_iomp, find_tcmalloc,
                                            has_bf16_arithmetic, has_nvidia_driver, loaded_runtime, main,
                                            preload_plan, reexec_with_cpu_runtime)

__all__ = ["HUGE_PAGE_BYTES", "HUGE_PAGES_OPT_OUT", "MADV_COLLAPSE", "MADV_HUGEPAGE", "OPT_OUT", "REEXEC_MARKER",
           "STREAMED_WEIGHTS", "describe_runtime", "empty_on_huge_pages", "find_iomp", "find_tcmalloc",
           "gather_on_huge_pages", "has_bf16_arithmetic", "has_nvidia_driver", "huge_page_bytes",
           "huge_pages_available", "loaded_runtime", "main", "preload_plan", "put_streamed_weights_on_huge_pages",
           "reexec_with_cpu_runtime", "settle_on_huge_pages"]
