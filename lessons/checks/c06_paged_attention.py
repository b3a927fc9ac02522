"""Lesson 06's checks: `paged_attention_one` on hand-made paged caches, each against dense attention
(F.scaled_dot_product_attention) over the same K/V held in one contiguous tensor, then random cases, then inside
the real engine: every layer's attention at every step, read from the engine's own KV cache and compared with its
reference backend, and the engine generating with your attention in place of its own."""

import random

import torch
import torch.nn.functional as F

from course import ExerciseFailed, expect_equal

TOL = 1e-4            # fp32 attention summed in another order differs by ~1e-7; a wrong answer by ~1e-1
_ENGINE = {}          # one small engine for every run of this check (loading the model takes seconds)


def _fmt(x):
    return "[" + ", ".join(f"{v:.4f}" for v in x.tolist()) + ", ...]"


def _compare(actual, expected, what):
    """actual must be expected (num_heads, head_dim) within TOL; else say where and by how much."""
    if not isinstance(actual, torch.Tensor):
        raise ExerciseFailed(f"{what}: expected a tensor of shape {tuple(expected.shape)}, got a "
                             f"{type(actual).__name__}")
    if tuple(actual.shape) != tuple(expected.shape):
        raise ExerciseFailed(f"{what}: expected an output of shape {tuple(expected.shape)} (num_heads, head_dim), "
                             f"got {tuple(actual.shape)}")
    err = (actual.detach().float() - expected.float()).abs().nan_to_num(float("inf"))   # (heads, head_dim)
    worst = err.max().item()
    if worst > TOL:
        h = int(err.max(dim=1).values.argmax())
        raise ExerciseFailed(f"{what}: max error {worst:.2e} (tolerance {TOL:g}); query head {h}: expected "
                             f"{_fmt(expected[h, :4].float())}, got {_fmt(actual[h, :4].detach().float())}")


def _near(actual, other):
    if not (isinstance(actual, torch.Tensor) and actual.shape == other.shape):
        return False
    return (actual.detach().double() - other).abs().nan_to_num(float("inf")).max().item() <= TOL


def _case(fn, what, num_heads, num_kv_heads, head_dim, block_size, num_blocks, table, seq_len, seed):
    """A pool of random values (slots the sequence does not own hold finite garbage, as a used cache does) with
    the sequence's K/V written at its slots through `table`; the answer is computed from K/V kept contiguous."""
    g = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    K = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)       # the sequence's K/V, contiguous
    V = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)
    q = torch.randn(num_heads, head_dim, generator=g)
    for t in range(seq_len):
        key_cache[table[t // block_size], t % block_size] = K[t]
        value_cache[table[t // block_size], t % block_size] = V[t]
    scale = head_dim ** -0.5

    def dense(K, V, scale):                                             # in fp64: the answer, not an estimate
        return F.scaled_dot_product_attention(q[:, None].double(), K.transpose(0, 1).double(),
                                              V.transpose(0, 1).double(), scale=scale,
                                              enable_gqa=True)[:, 0]   # (heads, 1, d) -> (heads, d)

    expected = dense(K, V, scale)
    caches = (key_cache.clone(), value_cache.clone())
    actual = fn(q.clone(), caches[0], caches[1], torch.tensor(table, dtype=torch.int32), seq_len, scale)
    try:
        _compare(actual, expected, f"{what} (block table {table}, seq_len {seq_len}, block_size {block_size}, "
                                   f"{num_heads} query heads over {num_kv_heads} KV heads)")
    except ExerciseFailed as failed:                                   # a known slip? say which
        group = num_heads // num_kv_heads
        for other, hint in [
                (dense(K, V, 1.0), "it equals attention without the scale: multiply q . k by scale"),
                (dense(K.repeat(1, group, 1), V.repeat(1, group, 1), scale),
                 f"it equals query head h reading KV head h % {num_kv_heads}: with GQA, query head h reads KV head "
                 f"h // {group} (repeat_interleave, not repeat)")]:
            if _near(actual, other):
                raise ExerciseFailed(f"{failed} ({hint})") from None
        raise
    if not (torch.equal(caches[0], key_cache) and torch.equal(caches[1], value_cache)):
        raise ExerciseFailed(f"{what}: your function changed the KV cache; it must only read it")


def _engine():
    """A float32 CPU engine on the PyTorch reference backend, blocks of 4 tokens, and a fixed workload of three
    prompts (5, 10 and 3 tokens) generating 6 greedy tokens each; its tokens, computed with its own attention."""
    if not _ENGINE:
        from minivllm import LLM, SamplingParams
        llm = LLM(device="cpu", dtype="float32", attention_backend="torch", num_kv_blocks=48, block_size=4,
                  max_num_seqs=4, seed=0)
        rng = random.Random(4)
        prompts = [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(n)]} for n in (5, 10, 3)]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        _ENGINE.update(llm=llm, prompts=prompts, params=params)
        _ENGINE["reference"] = _generate(llm, prompts, params)
    return _ENGINE


def _generate(llm, prompts, params):
    """Every run starts from a clean pool whose free blocks are in one fixed shuffled order (as after a long run
    of requests coming and going), so the block tables are scattered, and the same in every run."""
    engine = llm.llm_engine
    engine.reset_prefix_cache()
    pool = engine.kv_cache_manager.block_pool
    assert len(pool.clean_free) == pool.num_blocks, "the check's engine should hold no blocks between runs"
    order = list(range(pool.num_blocks))
    random.Random(40).shuffle(order)
    pool.clean_free.clear()
    pool.clean_free.extend(order)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def check_paged_attention_one(fn):
    #        what                     heads, kv_heads, head_dim, block_size, num_blocks, block table, seq_len
    _case(fn, "a single block", 2, 2, 8, 4, 6, [0], 4, seed=1)
    yield "one block: softmax(q . k * scale) weighs the values"
    _case(fn, "a partial last block", 2, 2, 8, 4, 6, [0, 1, 2], 10, seed=3)
    yield "a partial last block: only its first seq_len % block_size slots are the sequence's"
    _case(fn, "a scrambled block table", 2, 2, 8, 4, 8, [5, 2, 7], 10, seed=4)
    _case(fn, "one token, in block 3", 2, 2, 8, 4, 6, [3], 1, seed=2)
    _case(fn, "a block table padded past the sequence's blocks (as the engine pads it, with 0s)",
          2, 2, 8, 4, 8, [6, 3, 0, 0, 0], 7, seed=5)
    yield "token t is read from block block_table[t // block_size], slot t % block_size"
    _case(fn, "GQA", 4, 2, 8, 4, 8, [1, 6, 4], 11, seed=6)
    _case(fn, "GQA at SmolLM2's shape (head_dim 64)", 9, 3, 64, 16, 6, [4, 1], 20, seed=7)
    yield "GQA: query head h reads KV head h // (num_heads // num_kv_heads)"
    rng = random.Random(0)
    for i in range(40):
        kv_heads = rng.choice([1, 2, 3])
        heads = kv_heads * rng.choice([1, 2, 3])
        block_size = rng.choice([1, 2, 4, 16])
        num_blocks = rng.randrange(2, 12)
        used = rng.randrange(1, num_blocks + 1)
        table = rng.sample(range(num_blocks), used) + [0] * rng.randrange(0, 3)
        seq_len = rng.randrange((used - 1) * block_size + 1, used * block_size + 1)
        _case(fn, f"random case {i}", heads, kv_heads, rng.choice([4, 8, 32]), block_size, num_blocks, table,
              seq_len, seed=100 + i)
    yield "40 random pools, block tables and lengths against dense attention"
    # The real engine. Each layer's attention runs as usual (it stores the step's K/V in the cache and attends);
    # then, for each sequence, your function reads that same cache for the step's last query row (a decode's one
    # row; a prompt's last row, which sees the whole prompt) and must give the backend's answer. Your answer
    # then replaces the backend's, so the engine generates with your attention: the tokens must not change.
    e = _engine()
    runner = e["llm"].llm_engine.model_runner
    backend = runner.backend
    real = backend.forward
    seen = {"calls": 0, "compared": 0, "tables": []}

    def forward(q, k, v, key_cache, value_cache, meta, scale, k_scale=1.0, v_scale=1.0):
        out = real(q, k, v, key_cache, value_cache, meta, scale, k_scale, v_scale)   # (tokens, heads, head_dim)
        step, layer = divmod(seen["calls"], runner.num_layers)
        seen["calls"] += 1
        block_size = key_cache.shape[1]
        for i, (end, seq_len) in enumerate(zip(meta.cu_seqlens_q[1:].tolist(), meta.seq_lens_cpu)):
            table = meta.block_tables[i]
            used = table[:-(-seq_len // block_size)].tolist()
            mine = fn(q[end - 1].clone(), key_cache, value_cache, table.clone(), seq_len, scale)
            _compare(mine, out[end - 1], f"against the real engine's KV cache, step {step + 1}, layer {layer}, "
                                         f"sequence {i} (block table {used}, seq_len {seq_len}, block_size "
                                         f"{block_size}), compared with its reference backend")
            out[end - 1] = mine.to(out.dtype)
            seen["compared"] += 1
            if layer == 0 and used not in seen["tables"] and any(b != a + 1 for a, b in zip(used, used[1:])):
                seen["tables"].append(used)
        return out

    backend.forward = forward
    try:
        tokens = _generate(e["llm"], e["prompts"], e["params"])
    except ExerciseFailed:
        raise
    except Exception as exc:
        raise ExerciseFailed(f"the engine failed with your attention inside: {type(exc).__name__}: {exc}") from None
    finally:
        del backend.forward                                 # the class's method again
        for rid in list(e["llm"].llm_engine.requests):
            e["llm"].llm_engine.abort_request(rid)
        e["llm"].llm_engine.reset_prefix_cache()
    steps = seen["calls"] // runner.num_layers
    yield (f"{seen['compared']} attention rows in {steps} live engine steps x {runner.num_layers} layers, read "
           f"from the engine's own KV cache, equal its reference backend's (block tables such as "
           f"{seen['tables'][:2]})")
    for i, (want, got) in enumerate(zip(e["reference"], tokens)):
        expect_equal(got, want, f"request {i}'s greedy tokens with your attention in every layer")
    yield "the engine generated with your attention: the same greedy tokens"
