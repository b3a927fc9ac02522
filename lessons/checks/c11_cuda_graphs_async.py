"""Lesson 11's checks: `pad_decode_batch` on hand-made batches with known answers, against the static buffers
minivllm's DecodeGraphs fills for the same batch, and inside the engine: its decode steps run through the
static-buffer path with your padding, and the tokens must be the eager path's."""

import random

import torch

from course import ExerciseFailed, a_kind, expect_equal

_ENGINE = {}
SIZES = [1, 2, 4, 8, 16]


def _case(fn, batch, sizes, expected, what):
    actual = fn(*[list(map(list, x)) if x and isinstance(x[0], list) else list(x) for x in batch], list(sizes))
    if not (isinstance(actual, (tuple, list)) and len(actual) == 6):
        raise ExerciseFailed(f"expected six things, (size, input_ids, positions, slot_mapping, seq_lens, "
                             f"block_tables), got {actual!r}: {what}")
    names = ("size", "input_ids", "positions", "slot_mapping", "seq_lens", "block_tables")
    for name, a, e in zip(names, actual, expected):
        expect_equal(a if name == "size" else [list(r) if isinstance(r, (list, tuple)) else int(r) for r in a],
                     e, f"{what}: {name}")


def _static(batch, max_num_seqs=16, max_model_len=64, block_size=4):
    """What minivllm's DecodeGraphs puts in its static buffers for this batch: (size, the five padded lists)."""
    from minivllm.worker.cuda_graph import DecodeGraphs
    g = DecodeGraphs(None, max_num_seqs, max_model_len, block_size, torch.device("cpu"), capture=False)
    n = len(batch[0])
    size = next(s for s in g.sizes if s >= n)
    g._fill(*batch, size)
    width = max(len(t) for t in batch[4])
    return (size, g.input_ids[:size].tolist(), g.positions[:size].tolist(), g.slot_mapping[:size].tolist(),
            g.seq_lens[:size].tolist(), g.block_tables[:size, :width].tolist())


def _engine():
    if "llm" not in _ENGINE:
        from minivllm import LLM, SamplingParams
        llm = LLM(device="cpu", dtype="float32", num_kv_blocks=64, seed=0)
        prompts = [{"prompt_token_ids": [100 + i] * (8 + 4 * i)} for i in range(5)]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 8, 12, 16, 20)]
        _ENGINE.update(llm=llm, prompts=prompts, params=params,
                       eager=[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    return _ENGINE


def check_pad_decode_batch(fn):
    one = ([5], [9], [37], [10], [[2, 7, 9]])
    _case(fn, one, SIZES, (1, [5], [9], [37], [10], [[2, 7, 9]]), "a batch of 1: no padding")
    three = ([5, 6, 7], [9, 4, 2], [37, 17, 10], [10, 5, 3], [[2, 7, 9], [4, 3], [8]])
    _case(fn, three, SIZES, (4, [5, 6, 7, 0], [9, 4, 2, 0], [37, 17, 10, -1], [10, 5, 3, 1],
                             [[2, 7, 9], [4, 3, 0], [8, 0, 0], [0, 0, 0]]),
          "a batch of 3 runs the graph of 4")
    _case(fn, three, [1, 2, 3, 8], (3, [5, 6, 7], [9, 4, 2], [37, 17, 10], [10, 5, 3],
                                    [[2, 7, 9], [4, 3, 0], [8, 0, 0]]),
          "a batch of 3 when 3 is a capture size: no padding rows, tables still padded to one width")
    yield "the smallest capture size that holds the batch; padding rows: token 0, position 0, slot -1, context 1"
    rng = random.Random(0)
    for i in range(100):
        n = rng.randrange(1, 17)
        tables = [rng.sample(range(1, 60), rng.randrange(1, 6)) for _ in range(n)]
        seq_lens = [rng.randrange(4 * len(t) - 3, 4 * len(t) + 1) for t in tables]
        batch = ([rng.randrange(1, 50000) for _ in range(n)], [s - 1 for s in seq_lens],
                 [t[(s - 1) // 4] * 4 + (s - 1) % 4 for t, s in zip(tables, seq_lens)], seq_lens, tables)
        _case(fn, batch, SIZES, _static(batch), f"random batch {i} of {n}: as DecodeGraphs' static buffers")
    yield "100 random decode batches pad exactly as minivllm's DecodeGraphs fills its static buffers"

    from minivllm.worker.cuda_graph import DecodeGraphs
    e = _engine()
    llm = e["llm"]
    runner = llm.llm_engine.model_runner
    graphs = DecodeGraphs(runner.forward, max_num_seqs=16, max_model_len=llm.llm_engine.max_model_len,
                          block_size=runner.block_size, device=runner.device, capture=False)
    sizes_seen = []

    def fill(input_ids, positions, slot_mapping, seq_lens, block_tables, size):   # the engine's copy, your padding
        got = fn(list(input_ids), list(positions), list(slot_mapping), list(seq_lens),
                 [list(t) for t in block_tables], list(graphs.sizes))
        expect_equal(got[0], size, f"an engine decode step of {len(input_ids)} requests: the capture size")
        sizes_seen.append(size)
        _, ids, pos, slots, lens, tables = got
        graphs.input_ids[:size].copy_(torch.tensor(ids))
        graphs.positions[:size].copy_(torch.tensor(pos))
        graphs.slot_mapping[:size].copy_(torch.tensor(slots))
        graphs.seq_lens[:size].copy_(torch.tensor(lens, dtype=torch.int32))
        width = len(tables[0])
        graphs.block_tables[:size, :width].copy_(torch.tensor(tables, dtype=torch.int32))
        graphs.block_tables[:size, width:].zero_()

    graphs._fill = fill
    runner.graphs = graphs
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(e["prompts"], e["params"], use_tqdm=False)]
    finally:
        runner.graphs = None
    if not sizes_seen:
        raise ExerciseFailed("no decode step went through the static buffers (a bug of the check, not yours)")
    expect_equal(tokens, e["eager"], "the greedy tokens of 5 requests decoded through your padded batches")
    yield (f"inside the engine: {len(sizes_seen)} decode steps through graphs of sizes {sorted(set(sizes_seen))}, "
           f"{graphs.stats.padded_rows} padding rows, the eager path's tokens")


def _async_engines():
    """Greedy tokens of a few requests through a synchronous engine (chunked prefill: a 16-token budget), and an
    engine of the same shape with async scheduling, kept for every run of the check."""
    if "async_llm" not in _ENGINE:
        from minivllm import LLM, SamplingParams
        prompts = [{"prompt_token_ids": [200 + i] * (5 + 9 * i)} for i in range(4)]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        kw = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
        with LLM(**kw) as llm:
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        _ENGINE.update(sync_tokens=tokens, async_prompts=prompts, async_params=params,
                       async_llm=LLM(async_scheduling=True, **kw))
    return _ENGINE


def check_plan_ahead(fn):
    cases = [((10, 4, 6), (10, 1), "a prompt of 10, 4 computed, a chunk of 6 in flight: it samples, 1 left"),
             ((10, 4, 3), (7, 3), "a prompt of 10, 4 computed, a chunk of 3 in flight: the rest of the prompt"),
             ((21, 20, 0), (20, 1), "a decode with nothing in flight"),
             ((21, 20, 1), (21, 1), "a decode whose last decode is in flight: the next one reads its token"),
             ((30, 0, 0), (0, 30), "a new prompt of 30")]
    for args, want, what in cases:
        expect_equal(tuple(fn(*args)), want, what)
    yield "start after the tokens in flight; one more token when that batch samples"
    from minivllm.core.async_scheduler import plan_ahead
    rng = random.Random(1)
    for i in range(200):
        num_tokens = rng.randrange(1, 60)
        computed = rng.randrange(0, num_tokens)
        in_flight = rng.choice([0, rng.randrange(1, num_tokens - computed + 1)])
        expect_equal(tuple(fn(num_tokens, computed, in_flight)), plan_ahead(num_tokens, computed, in_flight),
                     f"random case {i}: plan_ahead({num_tokens}, {computed}, {in_flight}) as minivllm's")
    yield "200 random requests plan as minivllm's scheduler does"

    import minivllm.core.async_scheduler as scheduler
    e = _async_engines()
    llm = e["async_llm"]
    engine = llm.llm_engine
    real = scheduler.plan_ahead
    placeholders = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        placeholders.append(len(out.num_output_placeholders))
        return out

    scheduler.plan_ahead = lambda *a: tuple(fn(*a))            # the scheduler plans with your function
    engine.scheduler.schedule = spy
    engine.reset_prefix_cache()                                # every run schedules the same steps
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(e["async_prompts"], e["async_params"],
                                                                 use_tqdm=False)]
    except ExerciseFailed:
        raise
    except Exception as exc:
        _ENGINE.pop("async_llm")                               # a step failed midway: the next run builds anew
        raise ExerciseFailed(f"inside an async engine, a step failed with your plan: {type(exc).__name__}: "
                             f"{exc}") from None
    finally:
        scheduler.plan_ahead = real
        del engine.scheduler.schedule                          # the class's method again
    if not sum(placeholders):
        raise ExerciseFailed("no batch ran ahead of the one in flight (a bug of the check, not yours)")
    expect_equal(tokens, e["sync_tokens"], "the greedy tokens of 4 requests scheduled ahead with your plan")
    yield (f"inside an async engine: {sum(placeholders)} decodes read a token still on the device, "
           f"the synchronous engine's tokens")


# ---------------------------------------------------------------------- 11.quantize_activations (W8A8)
def _quantized(fn, x, what):
    got = fn(x.clone())
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise ExerciseFailed(f"expected two tensors, (q, s), got {a_kind(got)}: {what}")
    q, s = got
    expect_equal((q.dtype, tuple(q.shape), s.dtype, tuple(s.shape)),
                 (torch.int8, tuple(x.shape), torch.float32, (x.shape[0],)),
                 f"{what}: (q dtype, q shape, s dtype, s shape)")
    return q, s


def _w8a8_engine():
    """A w8a8_int8 engine on the int8_matmul path (which rounds x with quantize_activations at every linear
    layer), built once, and its greedy tokens for 4 requests with minivllm's own rounding."""
    if "w8a8" not in _ENGINE:
        from minivllm import LLM, SamplingParams
        from minivllm.platforms.cpu import quantization
        prompts = [{"prompt_token_ids": [100 + i] * (8 + 4 * i)} for i in range(4)]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        real_own = quantization.own_w8a8_kernel
        quantization.own_w8a8_kernel = lambda: False          # chosen when the weights load: int8_matmul
        try:
            llm = LLM(device="cpu", dtype="float32", quantization="w8a8_int8", num_kv_blocks=64, seed=0)
        finally:
            quantization.own_w8a8_kernel = real_own
        _ENGINE.update(w8a8=llm, w8a8_prompts=prompts, w8a8_params=params,
                       w8a8_tokens=_generate_tokens(llm, prompts, params))
    return _ENGINE


def _generate_tokens(llm, prompts, params):
    llm.llm_engine.reset_prefix_cache()
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def check_quantize_activations(fn):
    x = torch.tensor([[127.0, 2.5, -3.5, 0.5, 1.5, -0.5, 0.0, 126.5],
                      [-2.0, 1.0, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0]])
    q, s = _quantized(fn, x, "two hand-made rows")
    expect_equal(q[0].tolist(), [127, 2, -4, 0, 2, 0, 0, 126],
                 "a row with max |x| = 127 (s = 1): ties go to the even integer, as torch.round")
    expect_equal(q[1].tolist(), [-127, 64, 16, 0, 0, 0, 0, 0], "a row of its own scale (max |x| = 2)")
    expect_equal(s.tolist(), [1.0, float(torch.tensor(2.0) / 127)], "the scales, one per row: max|x| / 127")
    q, s = _quantized(fn, torch.zeros(1, 16), "a row of zeros")
    expect_equal((q.tolist(), float(s[0])), ([[0] * 16], float(torch.tensor(1e-12))),
                 "a row of zeros: q all 0, s the floor 1e-12 (no division by zero)")
    yield "per row, round half to even, and a floor under the scale"

    from minivllm.platforms.cpu.quantization import quantize_activations
    g = torch.Generator().manual_seed(0)
    for i in range(100):
        rows, cols = int(torch.randint(1, 40, (1,), generator=g)), 16 * int(torch.randint(1, 40, (1,), generator=g))
        x = torch.randn(rows, cols, generator=g) * 10 ** float(torch.empty(1).uniform_(-3, 3, generator=g))
        if i % 2:
            x = x.bfloat16()
        q, s = _quantized(fn, x, f"random case {i}")
        want_q, want_s = quantize_activations(x)
        if not (torch.equal(q, want_q) and torch.equal(s, want_s)):
            bad = (q != want_q).nonzero()[:3].tolist()
            raise ExerciseFailed(f"random case {i} ({x.dtype}, {rows} x {cols}): q or s differ from minivllm's "
                                 f"quantize_activations (q at {bad}; s equal: {torch.equal(s, want_s)})")
    yield "100 random matrices (fp32 and bf16) give minivllm's bytes and scales exactly"

    from minivllm.platforms.cpu import quantization
    e = _w8a8_engine()
    real_fn = quantization.quantize_activations
    quantization.quantize_activations = lambda x: fn(x)
    try:
        got = _generate_tokens(e["w8a8"], e["w8a8_prompts"], e["w8a8_params"])
    except ExerciseFailed:
        raise
    except Exception as exc:
        _ENGINE.pop("w8a8")                                    # a step failed midway: the next run builds anew
        raise ExerciseFailed(f"inside the engine, a linear layer failed on your (q, s): {type(exc).__name__}: "
                             f"{exc}") from None
    finally:
        quantization.quantize_activations = real_fn
    expect_equal(got, e["w8a8_tokens"], "greedy tokens of 4 requests with every linear layer rounding x with your "
                                        "function")
    yield "inside the engine (quantization='w8a8_int8' on int8_matmul): minivllm's tokens"
