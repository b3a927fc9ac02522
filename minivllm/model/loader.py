"""Loading a checkpoint: resolve the model path, the dtype and the device, then read safetensors.

Owns: turning `model=None | path` and `dtype="auto" | ...` into a model with its weights on a device.
It reads only this rank's shard of each tensor (safetensors slices lazily) and never uses
transformers' modeling classes.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from minivllm.model.cpu_gemm import prepack_linear_weights
from minivllm.model.quantization import quantize_linear_weights
from minivllm.model.layers import PPStage, TPGroup
from minivllm.model.llama import LlamaForCausalLM, ModelConfig
from minivllm.platforms.cpu import gather_on_huge_pages, has_bf16_arithmetic

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_model_path(model: str | None) -> Path:
    if model is None:
        from minivllm.model.default_model import default_model_dir
        return default_model_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {model!r} is not a local directory. minivllm loads local Hugging Face checkpoints "
            "(config.json, *.safetensors, tokenizer files); it cannot download from a hub. "
            "Leave --model out to use the embedded SmolLM2-135M-Instruct.")
    return path


def check_checkpoint_files(path: Path) -> None:
    """Fail early, naming what is missing, before anything slow is loaded."""
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path} has no *.safetensors files; minivllm reads safetensors weights only "
                                "(convert .bin checkpoints with transformers' save_pretrained).")
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise FileNotFoundError(f"{path} has no tokenizer files (tokenizer.json, tokenizer.model or "
                                "vocab.json); copy them from the model's original repository.")


def load_tokenizer(path: Path):
    """The checkpoint's own tokenizer. With a tokenizer.json we skip AutoTokenizer, whose config probing
    imports most of transformers (seconds); the fast tokenizer class reads the same files."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (path / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device is {device!r}; minivllm runs on 'auto', 'cpu' or 'cuda' (or 'cuda:N').")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device is {device!r} but torch sees no CUDA GPU; use device='cpu' or 'auto'.")
    return dev


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """auto: fp32 on a CPU (fast there, and exact against Hugging Face); the checkpoint's own dtype on a
    GPU, with fp32 checkpoints served in bf16 (as vLLM does). bf16 asked for on a CPU that cannot multiply
    it natively is served, with a warning that says what it costs."""
    resolved = _resolve_dtype(dtype, cfg, device)
    if resolved == torch.bfloat16 and device.type == "cpu" and has_bf16_arithmetic() is False:
        logger.warning("dtype bfloat16 on a CPU without bf16 arithmetic (no avx512_bf16 or amx_bf16 among its "
                       "flags): oneDNN's bf16 matmuls run several times slower than float32 on such a CPU (11 vs "
                       "79 GFLOP/s measured on an AVX2-only AMD EPYC); dtype='float32' (the CPU's 'auto') is "
                       "faster here.")
    return resolved


def _resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        ckpt = DTYPES.get(cfg.torch_dtype.removeprefix("torch."), torch.bfloat16)
        return torch.bfloat16 if ckpt == torch.float32 else ckpt
    if dtype in ("half", "fp16"):
        dtype = "float16"
    if dtype in ("float", "fp32"):
        dtype = "float32"
    if dtype in ("bf16",):
        dtype = "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"dtype is {dtype!r}; choose one of auto, {', '.join(DTYPES)}.")
    return DTYPES[dtype]


def load_model(path: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               tp: TPGroup = TPGroup(), pp: PPStage = PPStage(), quantization: str | None = None) -> LlamaForCausalLM:
    """This rank's part of the model: its TP shard of its pipeline stage's layers (each rank reads only those)."""
    check_checkpoint_files(path)
    files = sorted(path.glob("*.safetensors"))
    with torch.device(device):
        model = LlamaForCausalLM(cfg, tp, pp)
    # weights in `dtype` (the rotary tables stay fp32); a quantized model is quantized from the checkpoint's own
    # values (gguf needs them exactly: bf16 would move them off the Q4_1 grid), then the rest is cast
    load_dtype = torch.float32 if quantization is not None else dtype
    for p in model.parameters():
        p.data = p.data.to(load_dtype)
    loaded: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                if "rotary_emb" in name:
                    continue
                if model.load_param(name, st.get_slice(name)):      # lazy: read on indexing
                    loaded.add(model.local_name(name))
    if quantization is not None:
        quantize_linear_weights(model, quantization, device, dtype)       # int8 / int4 (quantization.py)
        for p in model.parameters():                                      # the embedding and norms in `dtype`
            p.data = p.data.to(dtype)
    elif device.type == "cpu" and not prepack_linear_weights(model):     # oneDNN's layout (cpu_gemm.py),
        use_column_major_linear_weights(model)                            # else the best one for MKL
    if device.type == "cpu":
        put_streamed_weights_on_huge_pages(model)
    expected = {_checkpoint_name(n) for n, _ in model.named_parameters()}
    missing = sorted(expected - {_checkpoint_name(n) for n in loaded})
    if missing:
        raise ValueError(f"{path} is missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''}.")
    return model.eval()


# The weights a CPU step reads whole, where a layer has them: packed for minivllm's matmul (cpu_gemm.py) or
# quantized (quantization.py). A layer without them reads `weight` through F.linear. oneDNN's packed weights
# (MINIVLLM_CPU_OWN_GEMM=0, or no C++ kernels) are opaque tensors that only oneDNN may copy: they stay put.
STREAMED_WEIGHTS = ("packed_weight", "qweight", "qscale", "qscales_zeros")


def put_streamed_weights_on_huge_pages(model: torch.nn.Module) -> int:
    """Move every layer's STREAMED_WEIGHTS into one buffer on 2 MB pages (platforms/cpu.py says why); returns
    the bytes moved (0 where Linux offers no huge pages, or MINIVLLM_CPU_HUGE_PAGES=0). The values are copied
    exactly: only where they live changes."""
    slots = [(m, name) for m in model.modules() for name in STREAMED_WEIGHTS
             if isinstance(getattr(m, name, None), torch.Tensor) and getattr(m, name).layout == torch.strided
             and getattr(m, name).numel() > 0]
    unique = list({id(getattr(m, name)): getattr(m, name) for m, name in slots}.values())
    moved = dict(zip(map(id, unique), gather_on_huge_pages(unique)))
    for m, name in slots:
        setattr(m, name, moved[id(getattr(m, name))])
    return sum(t.numel() * t.element_size() for t in unique if moved[id(t)] is not t)


def use_column_major_linear_weights(model: torch.nn.Module) -> None:
    """Store each linear weight (out, in) column-major, i.e. as a contiguous (in, out) matrix seen through
    .t(). Same shape and values; F.linear(x, W) computes x @ W.t(), which is then a plain row-major matmul,
    and on a CPU MKL's kernel for that is 1.4-2x faster at decode's few rows than the transposed one
    (measured on the CI machines; equal at prefill sizes). The tied embedding / LM head keeps row-major
    rows, which the embedding lookup gathers."""
    from minivllm.model.layers import ColumnParallelLinear, RowParallelLinear

    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.weight.data = module.weight.data.t().contiguous().t()


def _checkpoint_name(name: str) -> str:
    """Map a fused parameter name back to one of the names it is loaded from (for the missing check)."""
    return name.replace("qkv_proj", "q_proj").replace("gate_up_proj", "gate_proj")
