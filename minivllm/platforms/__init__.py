"""What minivllm adapts to the machine it runs on (vLLM's `vllm/platforms/`).

    cpu/    the CPU platform: its runtime (tcmalloc, Intel's OpenMP, 2 MB pages) and everything that makes its
            matmuls and MLPs fast (packed and quantized weights, SiLU in the matmul, MLP slices)

A CUDA device needs nothing at load time: its kernels are chosen by the ops themselves
(minivllm/model/custom_op.py). Must never: import torch when imported (the CPU runtime's re-start comes first).
"""


def process_weights_after_loading(model, device, dtype, quantization: str | None = None) -> None:
    """What `device`'s platform does to a model once its weights are loaded, before its first step."""
    if device.type == "cpu":
        from minivllm.platforms.cpu.loading import process_weights_after_loading as cpu_process
        cpu_process(model, dtype, quantization)
    elif quantization is not None:
        raise ValueError(f"quantization={quantization!r} is implemented for the CPU only (PyTorch's packed-int CPU "
                         "kernels); on a GPU use dtype='bfloat16' and leave quantization unset.")
