"""Tensor parallelism on CPU (gloo): the same greedy tokens as one rank, each rank holding only its
shard, and no process left behind however the engine ends.

The oracle is tensor_parallel_size=1 (itself checked against Hugging Face in test_parity.py).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model.layers import TPGroup
from minivllm.model.llama import ModelConfig
from tests.oracle import PROMPTS
from tests.test_model_loading import write_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]


def greedy(n=16):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def processes_with_tag(tag: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries MINIVLLM_TEST_TAG=tag."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if f"MINIVLLM_TEST_TAG={tag}".encode() in (d / "environ").read_bytes().split(b"\0"):
                if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(d.name))
        except OSError:
            pass
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout=10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.fixture(scope="module")
def reference(llm):
    """TP 1: the plain engine's greedy tokens for the six shared prompts."""
    return token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False))


@pytest.mark.slow
def test_tp3_matches_tp1_on_the_default_model(model_dir, reference):
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256, tensor_parallel_size=3)
    try:
        engine = llm.llm_engine
        # TP really ran: two worker processes, and rank 0 holds a third of the heads and of the vocabulary.
        assert len(engine.executor.worker_pids) == 2 and all(map(alive, engine.executor.worker_pids))
        attn = engine.model_runner.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (3, 1)              # of 9 and 3
        assert engine.model_runner.kv_cache.shape[-2] == 1                 # one KV head per rank
        assert engine.model_runner.model.lm_head.weight.shape[0] == 49152 // 3
        assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference
    finally:
        pids = llm.llm_engine.executor.worker_pids
        llm.llm_engine.shutdown()
    assert wait_gone(pids) == []


@pytest.mark.slow
def test_tp2_matches_tp1_on_a_tiny_llama(tmp_path, model_dir):
    write_tiny_checkpoint(tmp_path, "LlamaForCausalLM", model_dir, num_attention_heads=4, num_key_value_heads=2)
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 42, 7, 99, 3, 250, 31], [9, 8, 7], list(range(40, 80)))]
    tp1 = LLM(str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=64)
    expected = token_ids(tp1.generate(prompts, greedy(24), use_tqdm=False))
    with LLM(str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=64, tensor_parallel_size=2) as tp2:
        assert len(tp2.llm_engine.executor.worker_pids) == 1
        assert token_ids(tp2.generate(prompts, greedy(24), use_tqdm=False)) == expected
        pids = tp2.llm_engine.executor.worker_pids
    assert wait_gone(pids) == []


@pytest.mark.slow
def test_features_fire_and_leave_outputs_unchanged_under_tp(model_dir, prompt_ids_with_shared_prefix):
    """Prefix caching, chunked prefill and preemption at once, on 3 ranks, against the same engine on 1."""
    prompts = [{"prompt_token_ids": p} for p in prompt_ids_with_shared_prefix]
    kw = dict(device="cpu", dtype="float32", max_num_batched_tokens=32, max_num_seqs=32, num_kv_blocks=14)
    tp1 = LLM(str(model_dir), **kw)
    expected = token_ids(tp1.generate(prompts, greedy(16), use_tqdm=False))
    with LLM(str(model_dir), tensor_parallel_size=3, **kw) as tp3:
        engine = tp3.llm_engine
        with engine.record_traces() as traces:
            got = token_ids(tp3.generate(prompts, greedy(16), use_tqdm=False))
        stats = engine.get_stats()
        assert got == expected
        assert stats.prefix_cache_hits > 0
        assert stats.num_preemptions > 0
        chunks = max(sum(1 for t in traces if t.by_id.get(rid) and t.by_id[rid].kind == "prefill")
                     for rid in {r.request_id for t in traces for r in t.requests})
        assert chunks > 1
        assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


@pytest.fixture(scope="module")
def prompt_ids_with_shared_prefix(tokenizer):
    system = tokenizer.encode("You are a helpful assistant who answers in one sentence. " * 4,
                              add_special_tokens=False)
    return [system + tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


def test_tp_size_that_does_not_divide_the_heads_is_refused_before_any_process_starts(model_dir):
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ValueError) as e:
        LLM(str(model_dir), device="cpu", tensor_parallel_size=2)
    msg = str(e.value)
    assert "tensor_parallel_size 2" in msg and "9 query heads" in msg and "3 KV heads" in msg
    assert "sizes that work for this model: 1, 3" in msg
    assert {p.pid for p in multiprocessing.active_children()} == before


def test_each_rank_reads_only_its_own_shard(model_dir, monkeypatch):
    """Count the elements read from the safetensors files: a rank reads exactly what it holds."""
    import minivllm.model.loader as loader
    from minivllm.model.loader import load_model

    read = []
    real_safe_open = loader.safe_open

    class CountingSlice:
        def __init__(self, s):
            self.s = s

        def get_shape(self):
            return self.s.get_shape()

        def __getitem__(self, index):
            t = self.s[index]
            read.append(t.numel())
            return t

    class CountingFile:
        def __init__(self, *a, **kw):
            self.f = real_safe_open(*a, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name):
            return CountingSlice(self.f.get_slice(name))

    monkeypatch.setattr(loader, "safe_open", CountingFile)
    cfg = ModelConfig.from_dir(model_dir)
    full = load_model(model_dir, cfg, torch.float32, torch.device("cpu"))
    for rank in range(3):
        read.clear()
        model = load_model(model_dir, cfg, torch.float32, torch.device("cpu"), TPGroup(rank, 3))
        held = sum(p.numel() for p in model.parameters())                # tied lm_head counted once
        assert sum(read) == held < sum(p.numel() for p in full.parameters()) / 2
        # and it is the right third: rank r's o_proj holds columns [r * 192, (r + 1) * 192) of the full one
        torch.testing.assert_close(model.layers[0].self_attn.o_proj.weight,
                                   full.layers[0].self_attn.o_proj.weight[:, rank * 192:(rank + 1) * 192])


@pytest.mark.slow
def test_workers_stop_on_garbage_collection_and_after_a_worker_dies(model_dir):
    llm = LLM(str(model_dir), device="cpu", num_kv_blocks=64, tensor_parallel_size=3)
    pids = llm.llm_engine.executor.worker_pids
    del llm
    gc.collect()
    assert wait_gone(pids) == []

    llm = LLM(str(model_dir), device="cpu", num_kv_blocks=64, tensor_parallel_size=3)
    pids = llm.llm_engine.executor.worker_pids
    os.kill(pids[1], signal.SIGKILL)                    # rank 2 dies between steps
    with pytest.raises(RuntimeError, match="tensor-parallel worker failed"):
        llm.generate(["Hello"], greedy(4), use_tqdm=False)
    assert wait_gone(pids) == []
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["Hello"], greedy(4), use_tqdm=False)
    # The process group was left, so a new TP engine can start in this process.
    with LLM(str(model_dir), device="cpu", num_kv_blocks=64, tensor_parallel_size=3) as again:
        assert again.generate(["Hello"], greedy(4), use_tqdm=False)[0].outputs[0].token_ids


def _cli(tag, *args, **kw):
    env = {**os.environ, "MINIVLLM_TEST_TAG": tag, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "minivllm.generate", *args], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.slow
def test_cli_with_tp3_exits_cleanly_and_leaves_no_process(llm):
    tag = uuid.uuid4().hex
    proc = _cli(tag, "--tensor-parallel-size", "3", "--temperature", "0", "--max-tokens", "12",
                "--ignore-eos", "The capital of France is")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    expected = llm.generate(["The capital of France is"], greedy(12), use_tqdm=False)[0].outputs[0].text
    assert out.strip() == expected.strip()
    assert wait_gone(processes_with_tag(tag)) == []


@pytest.mark.slow
def test_cli_interrupted_with_ctrl_c_leaves_no_process():
    tag = uuid.uuid4().hex
    # Ctrl-C in a terminal signals the whole foreground process group: the driver and its workers.
    proc = _cli(tag, "--tensor-parallel-size", "3", "--temperature", "0", "--max-tokens", "2000",
                "--ignore-eos", "--stream", "Tell me a long story.", start_new_session=True)
    first = proc.stdout.read(1)                           # generation has started on all three ranks
    assert first
    assert len(processes_with_tag(tag)) >= 3
    os.killpg(proc.pid, signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert wait_gone(processes_with_tag(tag)) == []


@pytest.mark.slow
def test_torchrun_launch_matches_tp1(tmp_path, model_dir):
    """torchrun starts both ranks (as it would across machines); every rank runs the engine in lockstep."""
    write_tiny_checkpoint(tmp_path, "LlamaForCausalLM", model_dir, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=49152)                     # the real tokenizer's vocabulary: text in, text out
    args = ["--model", str(tmp_path), "--temperature", "0", "--max-tokens", "16", "--ignore-eos", "--device", "cpu",
            "hello world"]
    tp1 = LLM(str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=64)
    expected = tp1.generate(["hello world"], greedy(16), use_tqdm=False)[0].outputs[0].text
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "minivllm.generate", "--tensor-parallel-size", "2", *args],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == expected.strip()          # printed once, by rank 0


def test_a_shard_that_would_drop_rows_is_refused():
    """check_tp_size refuses such a model first; the loader's own split never drops a remainder silently."""
    from minivllm.model.layers import _shard
    assert _shard(torch.arange(12).view(6, 2), 0, 1, 3).tolist() == [[4, 5], [6, 7]]
    with pytest.raises(ValueError, match=r"shape \(7, 2\) does not split into 3 equal shards along dimension 0"):
        _shard(torch.arange(14).view(7, 2), 0, 1, 3)
