"""What a CPU does to a model once its weights are loaded: the one call the model loader makes.

Owns: the order of the load-time steps, each owned by its module:

    1. mark the gated MLPs, so packing may put gate/up in gate/up panels       (gemm.py)
    2. quantize the linear layers (`quantization=...`), or pack their weights   (quantization.py, gemm.py)
       for minivllm's GEMM or oneDNN, or else store them column-major for MKL
    3. bind each gated MLP's forward: SiLU in the matmul, or rows in slices     (gemm.py)
    4. move the streamed weights onto 2 MB pages                               (huge_pages.py)

Must never: run per step. After this the model's layers run what was chosen here, with no further checks.
"""

from __future__ import annotations

import torch

from minivllm.platforms.cpu import gemm, huge_pages, quantization


def process_weights_after_loading(model: torch.nn.Module, dtype: torch.dtype, quantization_name: str | None = None,
                                  ) -> None:
    """Prepare a loaded CPU model in `dtype` (the model's) to run fast; see the module docstring for the steps."""
    gemm.mark_gated_mlps(model)
    if quantization_name is not None:
        quantization.quantize_linear_weights(model, quantization_name, torch.device("cpu"), dtype)
    elif not gemm.prepack_linear_weights(model):
        gemm.use_column_major_linear_weights(model)
    gemm.bind_mlp_forwards(model)
    huge_pages.put_streamed_weights_on_huge_pages(model)
