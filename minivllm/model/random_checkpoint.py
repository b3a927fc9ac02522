"""Random-weight checkpoints with a real model's shape, for speed measurements.

    python -m minivllm.model.random_checkpoint qwen3-0.6b /tmp/qwen3-0.6b-random      # about 1.2 GB in bf16

Speed depends on a model's shape, not on its weights, so the performance issue's GPU workload (nano-vllm's:
256 requests of 100-1024 tokens in and out on Qwen3-0.6B) can run on random weights where the real
checkpoint cannot be downloaded. The checkpoint is written by transformers' own classes and initializer
(config.json + model.safetensors), so Hugging Face `generate` loads the same directory for the comparison.
The tokenizer is the embedded SmolLM2's (49,152 tokens): the benchmark's prompts are token ids below that,
and ids above it decode to nothing.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

# The architectures' published configs (Qwen/Qwen3-0.6B, config.json), and a tiny one for tests.
SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny-qwen3": dict(architecture="Qwen3ForCausalLM", vocab_size=49152, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def write_random_checkpoint(shape: str, out: str | Path, dtype: str = "bfloat16", seed: int = 0,
                            init_std: float | None = None) -> Path:
    """Write a random `shape` checkpoint to `out` (created; an existing checkpoint there is an error).
    init_std: None keeps transformers' initializer (std 0.02, which makes near-uniform logits and repetitive
    greedy text: fine for speed); a larger std redraws every matrix, for parity tests with varied tokens."""
    import transformers

    from minivllm.model.default_model import default_model_dir

    if shape not in SHAPES:
        raise ValueError(f"shape is {shape!r}; choose one of {', '.join(SHAPES)}.")
    if dtype not in DTYPES:
        raise ValueError(f"dtype is {dtype!r}; choose one of {', '.join(DTYPES)}.")
    out = Path(out)
    if (out / "config.json").exists():
        raise FileExistsError(f"{out} already holds a checkpoint (config.json); pick another directory "
                              "or delete it first.")
    spec = dict(SHAPES[shape])
    arch = spec.pop("architecture")
    tokenizer_dir = default_model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tokenizer.eos_token_id                          # the tokenizer's, so EOS means the same to all
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**spec, eos_token_id=eos,
                                                                            pad_token_id=eos)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config)          # transformers' own initializer (normal, std 0.02)
    if init_std is not None:
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() > 1:
                    param.normal_(0, init_std)
    model.to(DTYPES[dtype]).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copyfile(tokenizer_dir / name, out / name)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minivllm.model.random_checkpoint",
                                description="Write a random-weight checkpoint with a real model's shape.")
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out", help="directory to write (config.json, model.safetensors, tokenizer files)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-std", type=float, default=None,
                   help="redraw every weight matrix from N(0, std) (default: transformers' initializer)")
    args = p.parse_args(argv)
    try:
        path = write_random_checkpoint(args.shape, args.out, args.dtype, args.seed, args.init_std)
    except (ValueError, FileExistsError) as e:
        p.error(str(e))
    n = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"wrote {args.shape} ({args.dtype}, {n / 1e9:.2f} GB of weights) to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
