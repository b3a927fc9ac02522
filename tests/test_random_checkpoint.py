"""Random-weight checkpoints with real models' shapes (minivllm/model/random_checkpoint.py), for speed runs:
they must load in minivllm and in Hugging Face alike, and give the same greedy tokens in both."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model.random_checkpoint import SHAPES, write_random_checkpoint
from tests.oracle import hf_greedy

PROMPTS = [[5, 17, 42, 7, 99, 3, 250, 31, 64, 8, 12, 200, 150, 4, 77, 19, 21], [9, 8, 7]]


def greedy_both(path, max_tokens: int):
    from transformers import AutoModelForCausalLM
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [o.outputs[0].token_ids for o in outs], [hf_greedy(hf, p, max_tokens) for p in PROMPTS]


@pytest.mark.slow
def test_tiny_qwen3_loads_in_both_and_matches(tmp_path):
    path = write_random_checkpoint("tiny-qwen3", tmp_path / "tiny", dtype="float32", init_std=0.2)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["num_hidden_layers"] == 2
    assert config["eos_token_id"] == 2                      # the embedded tokenizer's EOS
    mine, theirs = greedy_both(path, 16)
    assert mine == theirs
    assert len(set(mine[0])) > 3                            # varied tokens, so the comparison means something


@pytest.mark.slow
def test_qwen3_0_6b_shape_matches_hf(tmp_path):
    """The performance issue's GPU model, at its real shape (28 layers, 16 query / 8 KV heads of 128,
    vocabulary 151,936, tied embeddings, q/k norms), random weights, fp32 on the CPU: token for token."""
    path = write_random_checkpoint("qwen3-0.6b", tmp_path / "q", dtype="float32", init_std=0.05)
    config = json.loads((path / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "intermediate_size", "tie_word_embeddings"):
        assert config[key] == SHAPES["qwen3-0.6b"][key]
    n = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert 2.3e9 < n < 2.5e9                                # about 0.6 billion fp32 parameters
    mine, theirs = greedy_both(path, 12)
    assert mine == theirs
    assert len(set(mine[0])) > 3


@pytest.mark.slow
def test_errors_name_the_choice(tmp_path):
    with pytest.raises(ValueError, match="shape is 'qwen9'; choose one of qwen3-0.6b, tiny-qwen3"):
        write_random_checkpoint("qwen9", tmp_path / "x")
    with pytest.raises(ValueError, match="dtype is 'int8'"):
        write_random_checkpoint("tiny-qwen3", tmp_path / "x", dtype="int8")
    write_random_checkpoint("tiny-qwen3", tmp_path / "y")
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):
        write_random_checkpoint("tiny-qwen3", tmp_path / "y")
    cli = subprocess.run([sys.executable, "-m", "minivllm.model.random_checkpoint", "tiny-qwen3", str(tmp_path / "y")],
                         capture_output=True, text=True)
    assert cli.returncode == 2 and "already holds a checkpoint" in cli.stderr


@pytest.mark.slow
def test_bench_runs_hf_in_minivllm_dtype_and_device(tmp_path):
    from minivllm.bench.hf import hf_generate_batch, load_hf_model
    path = write_random_checkpoint("tiny-qwen3", tmp_path / "t")           # bf16 on disk
    model = load_hf_model(path, torch.float32, torch.device("cpu"))
    assert next(model.parameters()).dtype == torch.float32 and model.device.type == "cpu"
    assert hf_generate_batch(model, [[5, 6, 7], [8, 9]], 4) == [4, 4]
