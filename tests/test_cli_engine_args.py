"""Every engine option is one EngineConfig field, and each of the three commands takes it as a flag.

`python -m minivllm.generate`, `python app.py` and `python -m minivllm.bench` build their engine flags
from EngineConfig (`add_engine_args`); these tests give every flag a value other than its default and
check that exactly those values reach the engine the command builds (the engine itself is replaced by a
stand-in that records its config and stops the command).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, fields

import pytest

from minivllm.config import EngineConfig, add_engine_args

# A value other than the default for every field, and the flags a user types for it.
VALUES = dict(model="/tmp/some-checkpoint", dtype="float16", quantization="int8", kv_cache_dtype="fp8", device="cpu", block_size=32, num_kv_blocks=7,
              kv_cache_memory_gb=0.5, gpu_memory_utilization=0.5, max_num_seqs=8, max_num_batched_tokens=512,
              long_prefill_token_threshold=64, max_model_len=128, enable_prefix_caching=False, preemption_mode="swap", swap_space=0.25,
              tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2, data_parallel_backend="ray",
              max_concurrent_batches=1,
              distributed_executor_backend="mp",
              attention_backend="torch",
              enforce_eager=True, seed=7, max_logprobs=-1, disable_log_stats=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              limit_mm_per_prompt={"image": 2}, encoder_cache_size=1024, allowed_local_media_path="/tmp/images",
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq"})
ARGV = ["--model", "/tmp/some-checkpoint", "--dtype", "float16", "--quantization", "int8", "--kv-cache-dtype", "fp8", "--device", "cpu", "--block-size", "32",
        "--num-kv-blocks", "7", "--kv-cache-memory-gb", "0.5", "--gpu-memory-utilization", "0.5",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--long-prefill-token-threshold", "64",
        "--max-model-len", "128",
        "--no-prefix-caching", "--preemption-mode", "swap", "--swap-space", "0.25",
        "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--data-parallel-size", "2",
        "--data-parallel-backend", "ray",
        "--max-concurrent-batches", "1",
        "--distributed-executor-backend", "mp",
        "--attention-backend", "torch",
        "--enforce-eager", "--seed", "7", "--max-logprobs", "-1", "--disable-log-stats",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
        "--limit-mm-per-prompt", '{"image": 2}', "--encoder-cache-size", "1024",
        "--allowed-local-media-path", "/tmp/images",
        "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq"}']


class Built(Exception):
    """Raised by the stand-in engine: the command got as far as building it, with `config`."""

    def __init__(self, config: EngineConfig):
        self.config = config


def run_generate(argv, monkeypatch):
    import minivllm.entrypoints.llm
    from minivllm.entrypoints.generate import main

    def fake_llm(**kwargs):
        raise Built(EngineConfig(**kwargs))
    monkeypatch.setattr(minivllm.entrypoints.llm, "LLM", fake_llm)
    return main([*argv, "a prompt"])


def run_app(argv, monkeypatch):
    import app

    def fake_build_app(config, **kwargs):
        raise Built(config)
    monkeypatch.setattr(app, "build_app", fake_build_app)
    monkeypatch.setattr(app, "serve_data_parallel", lambda config, args: fake_build_app(config))
    return app.main(argv)


def run_bench(argv, monkeypatch):
    from minivllm.bench import offline
    from minivllm.bench.cli import main

    def fake_llm(**kwargs):
        raise Built(EngineConfig(**kwargs))
    monkeypatch.setattr(offline, "LLM", fake_llm)
    return main(argv)


COMMANDS = {"generate": run_generate, "app": run_app, "bench": run_bench}


def config_built_by(command, argv, monkeypatch) -> EngineConfig:
    with pytest.raises(Built) as built:
        COMMANDS[command](argv, monkeypatch)
    return built.value.config


# Fields that cannot join the table's values (async scheduling refuses tp 2, pp 2 and speculation; KV transfer
# refuses tp 2 and pp 2; chunked prefill off refuses long_prefill_token_threshold and a budget below max_model_len):
# each has its own flag test below.
KV_TRANSFER = {"kv_connector": "TCPConnector", "kv_role": "kv_consumer", "kv_port": 14580}
ALONE = {"async_scheduling": [(True, ["--async-scheduling"]), (False, ["--no-async-scheduling"])],
         "kv_transfer_config": [(KV_TRANSFER, ["--kv-transfer-config", json.dumps(KV_TRANSFER)])],
         "enable_chunked_prefill": [(False, ["--no-enable-chunked-prefill"])]}


def test_the_table_covers_every_field_with_a_value_other_than_its_default():
    assert set(VALUES) | set(ALONE) == {f.name for f in fields(EngineConfig)}
    for f in fields(EngineConfig):
        if f.name in ALONE:
            assert all(value != f.default for value, _ in ALONE[f.name]) and f.metadata["help"], f.name
            continue
        assert VALUES[f.name] != f.default, f.name
        assert f.metadata["help"], f"{f.name} has no help text"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_engine_flag_reaches_the_config(command, monkeypatch):
    assert config_built_by(command, ARGV, monkeypatch) == EngineConfig(**VALUES)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name, value, argv", [(n, v, a) for n, cases in ALONE.items() for v, a in cases])
def test_a_flag_outside_the_table_reaches_the_config(command, name, value, argv, monkeypatch):
    assert config_built_by(command, argv, monkeypatch) == EngineConfig(**{name: value})


@pytest.mark.parametrize("command", COMMANDS)
def test_no_engine_flag_gives_the_default_config(command, monkeypatch):
    assert config_built_by(command, [], monkeypatch) == EngineConfig()


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("argv, message", [
    (["--max-num-seqs", "0"], "max_num_seqs is 0; it must be a positive int"),
    (["--attention-backend", "cuda"], "invalid choice: 'cuda'"),
    (["--num-kv-blocks", "many"], "invalid int value: 'many'"),
])
def test_a_bad_engine_flag_is_a_usage_error(command, argv, message, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        COMMANDS[command](argv, monkeypatch)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and message in err


@pytest.mark.parametrize("argv, want", [
    ([], dict(enable_chunked_prefill=True, enable_prefix_caching=True)),
    (["--no-enable-chunked-prefill"], dict(enable_chunked_prefill=False)),
    (["--no-enable-chunked-prefill", "--enable-chunked-prefill"], dict(enable_chunked_prefill=True)),
    (["--no-enable-prefix-caching"], dict(enable_prefix_caching=False)),
    (["--enable-prefix-caching"], dict(enable_prefix_caching=True)),
    (["--no-prefix-caching"], dict(enable_prefix_caching=False)),          # the older flag still works
])
def test_a_bool_that_defaults_to_true_takes_vllms_pair_of_flags(argv, want):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert EngineConfig.from_cli_args(parser.parse_args(argv)) == EngineConfig(**want)


@pytest.mark.parametrize("kwargs, message", [
    (dict(enable_chunked_prefill=False, max_model_len=4096, max_num_batched_tokens=2048),
     r"max_num_batched_tokens is 2048, below max_model_len \(4096\), and enable_chunked_prefill is False.*Raise "
     r"max_num_batched_tokens to at least 4096, lower max_model_len to 2048, or turn chunked prefill on"),
    (dict(enable_chunked_prefill=False, long_prefill_token_threshold=64),
     r"long_prefill_token_threshold is 64 but enable_chunked_prefill is False"),
    (dict(enable_chunked_prefill=False, max_model_len=512, encoder_cache_size=256),
     r"encoder_cache_size is 256, below max_model_len \(512\)"),
    (dict(enable_chunked_prefill="no"), r"enable_chunked_prefill is 'no'; it must be True or False"),
])
def test_chunked_prefill_off_refuses_a_step_that_cannot_hold_a_whole_prompt(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**kwargs)


def test_chunked_prefill_off_checks_the_models_own_max_model_len_too():
    config = EngineConfig.from_kwargs(enable_chunked_prefill=False, max_num_batched_tokens=1024)   # unset: later
    with pytest.raises(ValueError, match=r"max_num_batched_tokens is 1024, below max_model_len \(8192\)"):
        config.max_model_len_for(8192)                  # what the engine asks once it has read the model
    assert config.max_model_len_for(1024) == 1024
    assert EngineConfig(enable_chunked_prefill=False).long_prefill_token_threshold_on("cpu") == 0
    assert EngineConfig().long_prefill_token_threshold_on("cpu") > 0


def test_add_engine_args_excludes_what_it_is_told_and_refuses_unknown_names():
    parser = argparse.ArgumentParser()
    add_engine_args(parser, exclude=("seed", "model"))
    args = parser.parse_args(["--max-num-seqs", "4"])
    assert not hasattr(args, "seed") and not hasattr(args, "model")
    assert EngineConfig.from_cli_args(args) == EngineConfig(max_num_seqs=4)
    with pytest.raises(ValueError, match=r"exclude names \['sed'\], which are not EngineConfig fields"):
        add_engine_args(argparse.ArgumentParser(), exclude=("sed",))


def test_generate_seed_seeds_the_requests_and_the_engine(monkeypatch):
    """generate owns --seed (each request's seed, default None); given, it also becomes the engine's seed."""
    assert config_built_by("generate", ["--seed", "3"], monkeypatch).seed == 3
    assert asdict(config_built_by("generate", [], monkeypatch)) == asdict(EngineConfig())


def test_a_json_option_that_is_not_json_is_a_usage_error(capsys):
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "{ngram"])
    assert "--speculative-config: not valid JSON" in capsys.readouterr().err


def test_the_server_warms_up_512_tokens_unless_told_otherwise(monkeypatch, capsys):
    import app
    seen = []

    def fake_build_app(config, **kwargs):
        seen.append(kwargs["warmup_tokens"])
        raise Built(config)
    monkeypatch.setattr(app, "build_app", fake_build_app)
    monkeypatch.setattr(app, "serve_data_parallel", lambda config, args: fake_build_app(config))
    for argv in ([], ["--warmup-tokens", "0"], ["--warmup-tokens", "64"]):
        with pytest.raises(Built):
            app.main(argv)
    assert seen == [512, 0, 64]
    with pytest.raises(SystemExit) as exc:
        app.main(["--warmup-tokens", "-1"])
    assert exc.value.code == 2 and "--warmup-tokens is -1; it must be 0 (off)" in capsys.readouterr().err
