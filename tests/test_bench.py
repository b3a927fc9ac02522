"""The benchmark CLI: it runs both engines on the same tiny workload and reports honest counts."""

import json

import pytest

from minivllm import bench


def test_bench_compare_hf_gives_every_request_its_tokens_in_both_engines(tmp_path):
    out = tmp_path / "bench.json"
    rc = bench.main(["--num-requests", "3", "--input-len-min", "8", "--input-len-max", "16",
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


def test_prefix_mode_computes_the_shared_prefix_once(tmp_path):
    out = tmp_path / "prefix.json"
    assert bench.main(["prefix", "--num-requests", "4", "--shared-prefix-len", "64", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["outputs_equal"]
    assert r["prefill_tokens_off"] - r["prefill_tokens_on"] == 3 * 64     # requests 2-4 hit all 4 shared blocks
    assert r["shared_tokens_computed_on"] == 64 and r["shared_reduction"] == 0.75


def test_same_seed_gives_the_same_workload_and_ids_avoid_special_tokens():
    a = bench.Workload.random(5, (8, 16), (4, 8), vocab_size=49152, seed=7)
    b = bench.Workload.random(5, (8, 16), (4, 8), vocab_size=49152, seed=7)
    assert a == b
    assert all(bench.TOKEN_ID_LOW <= t < bench.TOKEN_ID_HIGH for p in a.prompt_token_ids for t in p)


@pytest.mark.parametrize("argv", [["--num-requests", "0"], ["--input-len-min", "9", "--input-len-max", "8"],
                                  ["--compare", "vllm"], ["serve"]])
def test_bad_arguments_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err
