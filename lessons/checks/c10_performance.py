"""Lesson 10's checks: `decode_memory_floor_ms` against the loaded model's own parameters and against
bench/roofline.py's formula, on the default model and on other shapes."""

import dataclasses

from course import ExerciseFailed
from minivllm.bench import roofline

_ENGINE = {}          # the default model's config and its parameter bytes, read from one small engine, once


def _default_model():
    if not _ENGINE:
        from minivllm import LLM
        llm = LLM(num_kv_blocks=16)
        _ENGINE.update(cfg=llm.llm_engine.model_config,
                       param_bytes=sum(p.numel() for p in llm.llm_engine.model_runner.model.parameters()) * 4)
    return _ENGINE["cfg"], _ENGINE["param_bytes"]


def _close(actual, expected, what):
    def near(x):
        return abs(x - expected) <= 1e-9 * max(1.0, abs(expected))
    if not isinstance(actual, (int, float)) or isinstance(actual, bool):
        raise ExerciseFailed(f"expected a number of milliseconds (a float), got {actual!r}: {what}")
    if not near(actual):
        hint = " (that is the time in seconds: the answer is in milliseconds)" if near(actual * 1e3) else ""
        raise ExerciseFailed(f"{what}: expected {expected!r} ms, got {actual!r}{hint}")


def check_decode_memory_floor_ms(fn, cfg=None, model=None):
    if cfg is None:
        cfg, param_bytes = _default_model()
    else:
        param_bytes = sum(p.numel() for p in model.parameters()) * 4
    gb = 1e9
    # The weights alone (no context): the bytes of the model's own parameters. Tied embeddings are one tensor
    # (the LM head), so counting each parameter once counts exactly what a decode step reads.
    _close(fn(cfg, 4, 1, 0, 10 * gb), param_bytes / (10 * gb) * 1e3,
           f"the default model in fp32, batch 1, no context, 10 GB/s (its parameters are {param_bytes:,} bytes)")
    _close(fn(cfg, 2, 1, 0, 10 * gb), param_bytes / 2 / (10 * gb) * 1e3, "the same in bf16 (2 bytes a weight)")
    yield "every weight once: the loaded model's own parameter bytes"
    for batch, context, itemsize, bw in [(32, 300, 4, 23 * gb), (1, 4096, 2, 3.35e12), (64, 2048, 2, 2e12)]:
        expected = (roofline.weight_bytes(cfg, itemsize)
                    + roofline.kv_bytes_per_token(cfg, itemsize) * batch * context) / bw * 1e3
        _close(fn(cfg, itemsize, batch, context, bw), expected,
               f"batch {batch}, {context} tokens of context each, {itemsize}-byte elements, {bw / gb:g} GB/s "
               "(K and V of every cached token, every layer)")
    yield "plus the K and V of every cached token of the batch, every layer"
    other = dataclasses.replace(cfg, num_hidden_layers=4, num_key_value_heads=1, intermediate_size=1000,
                                vocab_size=5000)
    expected = (roofline.weight_bytes(other, 2) + roofline.kv_bytes_per_token(other, 2) * 8 * 100) / gb * 1e3
    _close(fn(other, 2, 8, 100, gb), expected, "another shape: 4 layers, 1 KV head, MLP 1000, vocabulary 5000")
    yield "other shapes too (GQA, MLP width, vocabulary)"
