"""Shared fixtures. The default model is loaded once per test session (about a second from the cache).
The shared prompts and the HF greedy oracle live in tests/oracle.py, which test files import."""

from __future__ import annotations

import ctypes
import gc
import os
import sys

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Under pytest-xdist (the README's `-n 2`) the workers share the machine's cores: each takes its share of torch
# threads, and so do the processes it starts (notebook kernels, tensor-parallel ranks) through OMP_NUM_THREADS.
# More OpenMP threads than cores spin against each other at every parallel region.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    torch.set_num_threads(_THREADS)
if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run on Triton's CPU interpreter; @triton.jit reads this when it
    # decorates, so it must be set before anything imports triton (notebook kernels inherit it too).
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The slowest modules, slowest first (worker-seconds under `-n 2` on the 2-core AVX2 machine, 2026-11-28: the AOT
# grid 375, the fuzzers 235, speculative decoding 216, pipeline parallelism 190, Ray 170, tensor parallelism 152).
# Under `--dist loadscope` a module goes to one worker whole, and xdist by default hands out the modules with the
# most tests first, which left the few-test heavy ones to the end: one worker ran them for minutes while the other
# idled. They go first instead (the rest keep their order): a longest-first schedule.
SLOWEST_MODULES = ("tests/test_kernels_aot.py", "tests/test_fault_injection.py", "tests/test_spec_decode.py",
                   "tests/test_pipeline_parallel.py", "tests/test_ray_executor.py", "tests/test_tensor_parallel.py",
                   "tests/test_kv_cache_fp8.py", "tests/test_app_ui.py", "tests/test_async_scheduling.py",
                   "tests/test_api_server.py", "tests/test_invariance.py", "tests/test_bench.py",
                   "lessons/11_cuda_graphs_async.ipynb", "tests/test_structured_output.py",
                   "lessons/07_tensor_parallel.ipynb", "lessons/08_pipeline_parallel.ipynb",
                   "tests/test_w8a8.py", "lessons/13_spec_decode.ipynb",
                   "lessons/04_preemption.ipynb")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):      # pytest-xdist: keep the order below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(SLOWEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))     # stable: the rest in order


@pytest.fixture(scope="session")
def model_dir():
    from minivllm.model.default_model import default_model_dir
    return default_model_dir()


@pytest.fixture(scope="session")
def llm(model_dir):
    from minivllm import LLM
    return LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=512)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(llm):
    return llm.get_tokenizer()


@pytest.fixture(autouse=True, scope="module")
def _return_memory_after_each_module():
    """One process runs 900 tests: after each module, drop the lessons' checks' cached engines and hand freed
    memory back to the OS (glibc keeps it otherwise), so the suite's peak stays far below the machine's 24 GiB."""
    yield
    if "course" in sys.modules:
        sys.modules["course"].release_cached()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:        # not glibc (macOS): nothing to trim
        pass
