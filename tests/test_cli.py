"""`python -m minivllm.generate`, as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "minivllm.generate", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_chat_question_is_answered_with_paris(model_dir):
    r = run_cli("--chat", "--temperature", "0", "--max-tokens", "16", "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "1 request(s)" in r.stderr and "output tokens/s" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--top-p", "2", "hi"], "top_p is 2.0"),
    (["--max-tokens", "0", "hi"], "max_tokens is 0"),
    (["--temperature", "-1", "hi"], "temperature is -1.0"),
    (["--max-tokens", "lots", "hi"], "invalid int value"),
    ([], "give at least one prompt"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "No such file"),
    (["--model", "/nonexistent/model", "hi"], "is not a local directory"),
])
def test_bad_arguments_exit_2_without_traceback(args, message):
    r = run_cli(*args)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_prompts_file_stream_and_stop(tmp_path, capsys, model_dir):
    from minivllm.generate import main

    f = tmp_path / "prompts.txt"
    f.write_text("Count: 1, 2, 3, 4,\n\nThe capital of France is\n")
    assert main(["--prompts-file", str(f), "--temperature", "0", "--max-tokens", "8", "--stop", " 7",
                 "--model", str(model_dir)]) == 0
    out = capsys.readouterr()
    assert out.out.count("--- [") == 2 and " 7" not in out.out.split("--- [1]")[0]
    assert "2 request(s)" in out.err
    assert main(["--stream", "--temperature", "0", "--max-tokens", "6", "--ignore-eos", "--model", str(model_dir),
                 "Once upon a time"]) == 0
    out = capsys.readouterr()
    assert "6 output tokens" in out.err and out.out.strip()
