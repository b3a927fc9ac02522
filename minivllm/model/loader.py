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

from minivllm.model.layers import PPStage, TPGroup
from minivllm.model.llama import LlamaForCausalLM, ModelConfig
from minivllm.model.llava import LlavaForConditionalGeneration
from minivllm.platforms import process_weights_after_loading
from minivllm.platforms.cpu import has_bf16_arithmetic

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
    """This rank's part of the model: its TP shard of its pipeline stage's layers (each rank reads only those).
    A LLaVA checkpoint gives a LlavaForConditionalGeneration (one rank, unquantized; its vision tower and projector
    in `dtype` too)."""
    check_checkpoint_files(path)
    files = sorted(path.glob("*.safetensors"))
    multimodal = cfg.architecture == "LlavaForConditionalGeneration"
    if multimodal and quantization is not None:
        raise ValueError(f"quantization={quantization!r} with a {cfg.architecture} checkpoint: minivllm quantizes "
                         "text models only; leave quantization unset for LLaVA.")
    with torch.device(device):
        model = (LlavaForConditionalGeneration if multimodal else LlamaForCausalLM)(cfg, tp, pp)
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
    process_weights_after_loading(model, device, dtype, quantization)    # the platform's own layouts and kernels
    if quantization is not None:
        for p in model.parameters():                                      # the embedding and norms in `dtype`
            p.data = p.data.to(dtype)
    expected = {_checkpoint_name(n) for n, _ in model.named_parameters()}
    missing = sorted(expected - {_checkpoint_name(n) for n in loaded})
    if missing:
        raise ValueError(f"{path} is missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''}.")
    return model.eval()


def _checkpoint_name(name: str) -> str:
    """Map a fused parameter name back to one of the names it is loaded from (for the missing check)."""
    return name.replace("qkv_proj", "q_proj").replace("gate_up_proj", "gate_proj")
