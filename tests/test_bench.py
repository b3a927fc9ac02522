"""The benchmark CLI: it runs both engines on the same tiny workload and reports honest counts."""

import json

import pytest
import torch

from minivllm.bench import kernels
from minivllm.bench.cli import main
from minivllm.bench.workload import TOKEN_ID_HIGH, TOKEN_ID_LOW, Workload


@pytest.mark.slow
def test_bench_compare_hf_gives_every_request_its_tokens_in_both_engines(tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["--num-requests", "3", "--input-len-min", "8", "--input-len-max", "16",
                     "--output-len-min", "4", "--output-len-max", "8", "--compare", "hf", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())

    asked = report["workload"]["output_lens"]
    assert len(asked) == 3 and all(4 <= n <= 8 for n in asked)
    assert all(8 <= n <= 16 for n in report["workload"]["prompt_lens"])
    for engine in ("minivllm", "hf"):
        assert report[engine]["output_tokens_per_request"] == asked, engine
        assert report[engine]["output_tokens"] == sum(asked)
        assert report[engine]["output_tokens_per_s"] > 0
    assert report["ratio_minivllm_over_hf"] > 0
    assert 0 < report["minivllm"]["ttft_p50"] <= report["minivllm"]["ttft_p99"]
    # 3 requests of at most 24 tokens in 16-token blocks: utilization = tokens / (blocks * 16) per step
    assert 0.3 < report["minivllm"]["kv_slot_utilization"] <= 1.0
    # The hardware, measured in the same run: the roofline of the run's own steps is at most the matmul
    # ceiling (memory-bound decode steps only make it slower). Whether the run stays under its roofline is a
    # measurement, not asserted: on a loaded machine the hardware can measure slower than it runs.
    hw = report["hardware"]
    assert hw["matmul_flops_per_s"] > 1e9 and hw["copy_bandwidth_bytes_per_s"] > 1e8
    assert 0 < hw["roofline_output_tokens_per_s"] <= hw["matmul_ceiling_output_tokens_per_s"]
    assert hw["decode"]["batch"] == 3 and hw["decode"]["median_floor_s"] > 0


@pytest.mark.slow
def test_prefix_mode_computes_the_shared_prefix_once(tmp_path):
    out = tmp_path / "prefix.json"
    assert main(["prefix", "--num-requests", "4", "--shared-prefix-len", "64", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["outputs_equal"]
    assert r["prefill_tokens_off"] - r["prefill_tokens_on"] == 3 * 64     # requests 2-4 hit all 4 shared blocks
    assert r["shared_tokens_computed_on"] == 64 and r["shared_reduction"] == 0.75


@pytest.mark.slow
def test_disagg_mode_moves_the_prompts_and_the_consumer_computes_one_token_each(tmp_path):
    out = tmp_path / "disagg.json"
    assert main(["disagg", "--num-requests", "2", "--input-len-min", "40", "--input-len-max", "40", "--rounds", "1",
                 "--num-kv-blocks", "32", "--json", str(out)]) == 0
    for r in json.loads(out.read_text())["results"]:
        assert r["first_tokens_equal"] and r["consumer_tokens_computed"] == 2 and r["prompt_tokens"] == 80
        assert r["bytes_moved"] > 0 and len(r["prefill_s"]) == len(r["load_s"]) == 1


def test_same_seed_gives_the_same_workload_and_ids_avoid_special_tokens():
    a = Workload.random(5, (8, 16), (4, 8), vocab_size=49152, seed=7)
    b = Workload.random(5, (8, 16), (4, 8), vocab_size=49152, seed=7)
    assert a == b
    assert all(TOKEN_ID_LOW <= t < TOKEN_ID_HIGH for p in a.prompt_token_ids for t in p)


@pytest.mark.parametrize("argv", [["--num-requests", "0"], ["--input-len-min", "9", "--input-len-max", "8"],
                                  ["--compare", "vllm"], ["serve", "--request-rate", "0"],
                                  ["serve", "--base-url", "http://127.0.0.1:9"]])
def test_bad_arguments_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_mode_runs_from_the_command_line():
    """As `python -m minivllm.bench serve`: main_serve must be defined before the module runs main()."""
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-m", "minivllm.bench", "serve", "--base-url", "http://127.0.0.1:9"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "cannot reach http://127.0.0.1:9" in run.stderr, run.stderr[-500:]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_kernels_mode_without_cuda_is_a_usage_error_that_names_cuda(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["kernels"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "the kernels benchmark needs a CUDA GPU" in err


def test_kernel_decode_bytes_count_kv_once_plus_query_and_output():
    # The shape in bf16: batch 64, context 2048, 32 query / 8 KV heads of 128.
    kv = 2 * 64 * 2048 * 8 * 128 * 2           # K and V: 536_870_912 bytes
    q_and_out = 2 * 64 * 32 * 128 * 2          # query read + output written: 1_048_576 bytes
    assert kv + q_and_out == 537_919_488
    assert kernels.decode_bytes(64, 2048, 32, 8, 128, itemsize=2) == 537_919_488
    assert kernels.decode_bytes(1, 512, 32, 32, 128, itemsize=4) == 2 * 512 * 32 * 128 * 4 + 2 * 32 * 128 * 4


def test_kernel_rows_report_bandwidth_and_mark_the_target_row():
    row = kernels.DecodeRow(batch=64, context=2048, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                          dtype="bfloat16", num_splits=1, bytes_moved=537_919_488, triton_s=1e-3, triton_call_s=1e-3, torch_s=4e-3,
                          copy_bandwidth_gbs=1000.0)
    assert row.bandwidth_gbs == pytest.approx(537.919488)
    assert row.fraction_of_copy == pytest.approx(0.537919488)
    assert row.speedup_over_torch == pytest.approx(4.0) and row.is_target
    assert not kernels.DecodeRow(**{**row.__dict__, "num_kv_heads": 4}).is_target
    assert kernels.CopyResult(bytes_moved=2 * 10**9, time_s=0.5).bandwidth_gbs == pytest.approx(4.0)


def test_workload_flops_count_every_fed_token_and_every_sampled_row():
    from minivllm.bench import roofline
    from tests.test_model_loading import TINY
    from minivllm.model.llama import ModelConfig

    cfg = ModelConfig("LlamaForCausalLM", TINY["vocab_size"], TINY["hidden_size"], TINY["intermediate_size"],
                      TINY["num_hidden_layers"], TINY["num_attention_heads"], TINY["num_key_value_heads"],
                      TINY["head_dim"], 1e-6, 1e4, None, 256, False, False, False, "float32", ())
    h, d, L = 64, 16, 2
    linear = (h * (4 + 2 * 2) * d) + (4 * d * h) + (h * 2 * 128) + (128 * h)       # qkv, o, gate_up, down
    # one request: 3 prompt tokens, 2 output tokens -> 4 tokens fed at positions 0..3, 2 rows sampled
    expected = 4 * 2 * L * linear + sum(4 * L * 4 * d * (t + 1) for t in range(4)) + 2 * 2 * h * 320
    assert roofline.workload_flops(cfg, [3], [2]) == expected
    # A decode step of 2 rows is memory-bound, a 4096-token prefill is compute-bound.
    rate, bw = 1e11, 1e10
    decode = roofline.step_floor_s(cfg, 4, rate, bw, num_tokens=2, attention_pairs=200, num_sampled=2,
                                   kv_tokens_read=200)
    assert decode == (roofline.weight_bytes(cfg, 4) + roofline.kv_bytes_per_token(cfg, 4) * 200) / bw
    prefill = roofline.step_floor_s(cfg, 4, rate, bw, num_tokens=4096, attention_pairs=4096 * 4097 // 2,
                                    num_sampled=1, kv_tokens_read=4096)
    assert prefill > (roofline.weight_bytes(cfg, 4) + roofline.kv_bytes_per_token(cfg, 4) * 4096) / bw


@pytest.mark.parametrize("quantization,fraction", [("int8", 0.5), ("int4", 0.375), ("w8a8_int8", 0.5),
                                                    ("w4a8_int8", 0.375)])
def test_a_quantized_run_is_measured_against_its_own_bytes_and_kernels(quantization, fraction):
    """measure_quantized packs the model's shapes in the format and times its own kernels: int8 weights are about
    half of bf16's bytes, int4 about 3/8 (4 bits plus d and m in fp32 per 32); the floor of a decode step uses
    those bytes."""
    from minivllm.bench import roofline
    from minivllm.platforms.cpu import quantization as quant
    from minivllm.model.llama import ModelConfig
    if quantization == "w4a8_int8" and not quant.own_w8a8_kernel():
        pytest.skip("w4a8_int8 needs AVX-512 VNNI and BF16")
    # every out a multiple of the kernels' 48-column panels, so no padding columns count
    cfg = ModelConfig("LlamaForCausalLM", 480, 96, 192, 2, 6, 3, 16, 1e-6, 1e4, None, 256, False, False, False,
                      "bfloat16", ())
    if quantization == "int4" and not quant.own_quantized_kernels():
        fraction = 0.3125        # PyTorch's int4 pack instead: 4 bits plus d and m in bf16 per 32
    rate, weights = roofline.measure_quantized(cfg, quantization, torch.bfloat16, min_time_s=0.05)
    assert rate > 0
    assert weights == pytest.approx(fraction * roofline.weight_bytes(cfg, 2), rel=0.12)
    floor = roofline.step_floor_s(cfg, 2, 1e12, 1e10, 2, 200, 2, 200, weights)
    assert floor == (weights + roofline.kv_bytes_per_token(cfg, 2) * 200) / 1e10


@pytest.mark.slow
def test_spec_mode_compares_speculation_off_and_on_with_identical_greedy_outputs(tmp_path, capsys):
    out = tmp_path / "spec.json"
    rc = main(["spec", "--workload", "repeat", "--num-requests", "1", "--output-len-max", "12", "--max-num-seqs", "1",
               "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    for field in ("spec off:", "spec on:", "spec on / off:", "acceptance rate:", "mean acceptance length:",
                  "greedy outputs equal:   True", "load average (1 min):", "round 3 off / on:"):
        assert field in printed, field
    r = json.loads(out.read_text())
    assert r["outputs_equal"] and r["rounds"] == 3 and len(r["off_wall_s"]) == len(r["on_wall_s"]) == 3
    assert r["speculative_config"]["method"] == "ngram"                  # the default when none is given
    assert r["output_tokens"] == 12                                      # the copy is longer than 12 tokens
    assert r["speedup"] == pytest.approx(r["on_tokens_per_s"] / r["off_tokens_per_s"])
    # The answer copies the prompt, so n-gram lookup drafts and the model accepts: each verification step
    # gains more than one token, and speculation takes fewer engine steps for the same tokens.
    assert r["num_drafts"] > 0 and 0 < r["num_accepted_tokens"] <= r["num_draft_tokens"]
    assert r["mean_acceptance_length"] == pytest.approx(1 + r["num_accepted_tokens"] / r["num_drafts"])
    assert r["mean_acceptance_length"] > 1.5 and r["steps_on"] < r["steps_off"]
    assert sum(r["accepted_per_position"]) == r["num_accepted_tokens"]


@pytest.mark.slow
def test_spec_mode_on_the_random_workload_gives_every_request_its_tokens(tmp_path):
    out = tmp_path / "spec.json"
    rc = main(["spec", "--num-requests", "2", "--input-len-min", "8", "--input-len-max", "16", "--output-len-min", "6",
               "--output-len-max", "6", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
               "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["workload"] == "random" and r["outputs_equal"] and r["output_tokens"] == 2 * 6
    assert r["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    assert len(r["accepted_per_position"]) <= 2 and r["num_draft_tokens"] <= 2 * r["num_drafts"]


@pytest.mark.slow
def test_repeat_workload_prompts_are_chat_prompts_the_model_answers_by_copying():
    """The repeat workload is only useful if the model copies: its greedy answers start with the text's words."""
    from minivllm import LLM
    from minivllm.bench.workload import REPEAT_TASKS, repeat_task

    llm = LLM(max_num_seqs=1)
    w = Workload.repeat(llm.get_tokenizer(), len(REPEAT_TASKS) + 1, max_tokens=20)
    assert not w.ignore_eos and w.output_lens == [20] * (len(REPEAT_TASKS) + 1)
    assert w.prompt_token_ids[-1] == w.prompt_token_ids[0]                # the tasks cycle
    rows = [i for i, (how, _) in enumerate(REPEAT_TASKS) if how == "repeat"][:2]
    outs = llm.generate([{"prompt_token_ids": w.prompt_token_ids[i]} for i in rows],
                        [w.sampling_params()[i] for i in rows], use_tqdm=False)
    for i, o in zip(rows, outs):
        message, reference = repeat_task(*REPEAT_TASKS[i])
        assert llm.get_tokenizer().decode(w.prompt_token_ids[i]).count(reference) == 1   # the text is in the prompt
        def words(text):                                                  # the model may drop a comma
            return [w.strip(".,;:\"") for w in text.split()]
        got = words(o.outputs[0].text)[:-1]                               # the last word may be cut
        assert len(o.outputs[0].token_ids) == 20 and got == words(reference)[:len(got)], got


def test_spec_workload_flag_is_for_the_spec_mode(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["offline", "--workload", "repeat"])
    assert exc.value.code == 2 and "--workload repeat is for the spec mode" in capsys.readouterr().err


@pytest.mark.slow
def test_pipeline_mode_overlaps_the_stages_only_with_batches_in_flight(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "17,13")     # for PP 2 (b, c); engine a is built without it
    out = tmp_path / "pipeline.json"
    threads = torch.get_num_threads()
    try:            # 1 thread: a 2-thread PP 1 stalls on a busy 2-core machine, and the test must stay short
        rc = main(["pipeline", "--num-requests", "4", "--input-len-min", "8", "--input-len-max", "16",
                   "--output-len-min", "12", "--output-len-max", "12", "--rounds", "1", "--threads", "1",
                   "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    printed = capsys.readouterr().out
    for line in ("c / b:", "c / a:", "identical greedy outputs: yes", "load average (1 min):"):
        assert line in printed, line
    r = json.loads(out.read_text())
    assert set(r["configs"]) == {"a", "b", "c"} and r["outputs_identical"] and r["pipeline_parallel_size"] == 2
    assert r["layer_partition"] == "17,13"
    a, b, c = (r["configs"][k] for k in "abc")
    assert (a["pipeline_parallel_size"], b["max_concurrent_batches"], c["max_concurrent_batches"]) == (1, 1, 2)
    for cfg in (a, b, c):
        assert cfg["median_tokens_per_s"] > 0 and cfg["steps"][0] > 0
    for cfg in (b, c):
        assert set(cfg["busy_fraction"]) == {"0", "1"}
        assert all(0 < f <= 1 for f in cfg["busy_fraction"].values()), cfg["busy_fraction"]
    # One batch in flight: stage 0 waits for the last stage every time. Two: it runs the next batch meanwhile.
    assert b["total_overlap"] == 0 and c["total_overlap"] > 0
    assert r["c_over_b"] == pytest.approx(c["median_tokens_per_s"] / b["median_tokens_per_s"])
