"""Lesson 07's checks: `tp_linear` on labelled weights (each entry says which row and column of W it is) against
minivllm's own `_shard` and the dense x @ W.T, for TP 1 to 4, column and row parallel; sizes that do not divide;
then layer 0 of SmolLM2-135M on 3 ranks against what the real layers' weight_loaders put on each rank."""

import random

import torch
import torch.nn.functional as F

from course import ExerciseFailed
from minivllm.model import layers

DIM = {"column": 0, "row": 1}
FEATURES = {"column": "output", "row": "input"}
_REAL = {}            # layer 0 of the default model, full and as each of 3 ranks holds it (read once)


def _labelled(out_features, in_features):
    """W[i, j] = i * in_features + j: every entry says where in W it comes from (exact in float32)."""
    return torch.arange(out_features * in_features, dtype=torch.float32).reshape(out_features, in_features)


def _span(ids, total, noun):
    if ids == list(range(total)):
        return f"all {total} {noun}"
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"{noun} {ids[0]}..{ids[-1]}"
    return f"{noun} {ids}"


def _describe(t, W):
    """A shard of a labelled W in words: which rows and columns of W it holds."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.numel() == 0:
        return repr(t) if not isinstance(t, torch.Tensor) else f"a tensor of shape {tuple(t.shape)}"
    in_f = W.shape[1]
    rows = sorted(set((t // in_f).long().flatten().tolist()))
    cols = sorted(set((t % in_f).long().flatten().tolist()))
    shape = tuple(t.shape)
    if (0 <= rows[0] and rows[-1] < W.shape[0] and (len(rows), len(cols)) == shape
            and torch.equal(t.float(), W[rows][:, cols])):
        return f"{_span(rows, W.shape[0], 'rows')}, {_span(cols, in_f, 'columns')} of W {shape}"
    return f"a {shape} tensor that is not a block of W"


def _run(fn, x, W, tp, kind, what):
    """fn's (shards, y), checked for form; anything it raises (but NotImplementedError) fails the case."""
    try:
        out = fn(x.clone(), W.clone(), tp, kind)
    except (NotImplementedError, ExerciseFailed):
        raise
    except Exception as exc:
        raise ExerciseFailed(f"{what}: expected (shards, y), but your function raised "
                             f"{type(exc).__name__}: {exc}") from None
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ExerciseFailed(f"{what}: expected a pair (shards, y), got {type(out).__name__}")
    shards, y = out
    if not isinstance(shards, (list, tuple)) or len(shards) != tp:
        got = len(shards) if isinstance(shards, (list, tuple)) else type(shards).__name__
        raise ExerciseFailed(f"{what}: expected shards, a list of {tp} tensors (one per rank), got {got}")
    return list(shards), y


def _expect_y(y, x, W, what):
    dense = F.linear(x, W)                                   # (num_tokens, out_features)
    if not isinstance(y, torch.Tensor) or y.shape != dense.shape:
        got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        raise ExerciseFailed(f"{what}: y, the combined result: expected x @ W.T of shape {tuple(dense.shape)}, "
                             f"got shape {got}")
    if not torch.allclose(y.float(), dense, rtol=1e-4, atol=1e-4):
        def first(t):
            return [float(f"{v:.4g}") for v in t[0, :4].tolist()]
        raise ExerciseFailed(f"{what}: y, the combined result: expected x @ W.T (y[0, :4] = {first(dense)}), got "
                             f"y[0, :4] = {first(y.float())} (off by up to "
                             f"{(y.float() - dense).abs().max().item():.4g})")


def _case(fn, tp, kind, out_features, in_features, seed=0):
    W = _labelled(out_features, in_features)
    x = torch.randn(4, in_features, generator=torch.Generator().manual_seed(seed))
    what = f"{kind} parallel, tp {tp}, W {tuple(W.shape)}"
    shards, y = _run(fn, x, W, tp, kind, what)
    for r, shard in enumerate(shards):
        want = layers._shard(W, DIM[kind], r, tp)           # minivllm's own cut (model/layers.py)
        if not (isinstance(shard, torch.Tensor) and shard.shape == want.shape and torch.equal(shard.float(), want)):
            raise ExerciseFailed(f"{what}: rank {r}'s shard: expected {_describe(want, W)}, "
                                 f"got {_describe(shard, W)}")
    _expect_y(y, x, W, what)


def _refused(fn, tp, kind, out_features, in_features):
    W = _labelled(out_features, in_features)
    x = torch.randn(4, in_features, generator=torch.Generator().manual_seed(1))
    n = W.shape[DIM[kind]]
    what = (f"{kind} parallel, tp {tp}, W {tuple(W.shape)} ({n} {FEATURES[kind]} features do not split into {tp} "
            f"equal shards)")
    try:
        out = fn(x, W, tp, kind)
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as exc:
        raise ExerciseFailed(f"{what}: expected ValueError, got {type(exc).__name__}: {exc}") from None
    shards = out[0] if isinstance(out, (tuple, list)) and len(out) == 2 else out
    got = ([tuple(s.shape) for s in shards] if isinstance(shards, (list, tuple))
           and all(isinstance(s, torch.Tensor) for s in shards) else repr(shards)[:80])
    raise ExerciseFailed(f"{what}: expected ValueError, got shards of shapes {got}")


def _real(tp=3):
    """Layer 0 of the default model: its full linear weights, and each rank's weights as minivllm's own layers
    load them (weight_loader on a lazy safetensors slice: what the engine's loader does on rank r of a TP engine)."""
    if not _REAL:
        from safetensors import safe_open

        from minivllm.model.default_model import default_model_dir
        from minivllm.model.llama import ModelConfig

        path = default_model_dir()
        cfg = ModelConfig.from_dir(path)
        names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                 "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
        ranks = []
        with safe_open(str(sorted(path.glob("*.safetensors"))[0]), framework="pt", device="cpu") as st:
            def lazy(key):
                return st.get_slice(f"model.layers.0.{names[key]}.weight")
            full = {key: st.get_tensor(f"model.layers.0.{name}.weight").float() for key, name in names.items()}
            for r in range(tp):
                group = layers.TPGroup(r, tp)
                qkv = layers.QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                               cfg.num_key_value_heads, False, group)
                gate_up = layers.MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, group)
                o = layers.RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, False, group)
                down = layers.RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, group)
                with torch.no_grad():
                    for sid in ("q", "k", "v"):
                        qkv.weight_loader(qkv.weight, lazy(sid), sid)
                    for sid, key in enumerate(("gate", "up")):
                        gate_up.weight_loader(gate_up.weight, lazy(key), sid)
                    o.weight_loader(o.weight, lazy("o"))
                    down.weight_loader(down.weight, lazy("down"))
                ranks.append({"qkv": qkv.weight.detach().float(), "gate_up": gate_up.weight.detach().float(),
                              "o": o.weight.detach().float(), "down": down.weight.detach().float()})
        _REAL.update(cfg=cfg, full=full, ranks=ranks, tp=tp)
    return _REAL


def _heads(shard, full, head_dim):
    """Which heads of `full` (rows grouped head_dim at a time) the shard's row blocks are, as "[0, 1, 2]"; "?" for
    a block that is not a whole head."""
    whole = full.reshape(-1, head_dim, full.shape[1])
    if shard.dim() != 2 or shard.shape[0] % head_dim or shard.shape[1] != full.shape[1]:
        return f"(not whole heads: shape {tuple(shard.shape)})"
    found = [next((str(h) for h in range(whole.shape[0]) if torch.equal(block, whole[h])), "?")
             for block in shard.float().reshape(-1, head_dim, shard.shape[1])]
    return "[" + ", ".join(found) + "]"


def _check_real(fn):
    """Your tp_linear on layer 0's real weights: each rank's shards equal what minivllm's layers load on that rank,
    and y equals the dense layer."""
    e = _real()
    cfg, full, tp = e["cfg"], e["full"], e["tp"]
    mine = {}
    for key, kind in [("q", "column"), ("k", "column"), ("v", "column"), ("gate", "column"), ("up", "column"),
                      ("o", "row"), ("down", "row")]:
        W = full[key]                                                        # (out_features, in_features)
        x = torch.randn(3, W.shape[1], generator=torch.Generator().manual_seed(5))
        what = f"layer 0 of SmolLM2-135M, {key}_proj {tuple(W.shape)}, {kind} parallel, tp {tp}"
        mine[key], y = _run(fn, x, W, tp, kind, what)
        _expect_y(y, x, W, what)
    for r, real in enumerate(e["ranks"]):
        where = f"layer 0 of SmolLM2-135M, tp {tp}, rank {r}"
        qkv = torch.cat([mine[k][r].float() for k in ("q", "k", "v")])      # [q | k | v] rows, as on rank r
        if not (qkv.shape == real["qkv"].shape and torch.equal(qkv, real["qkv"])):
            want = [_heads(layers._shard(full[k], 0, r, tp), full[k], cfg.head_dim) for k in ("q", "k")]
            got = [_heads(mine[k][r], full[k], cfg.head_dim) for k in ("q", "k")]
            raise ExerciseFailed(f"{where}: your q, k and v shards, stacked, should be QKVParallelLinear's weight on "
                                 f"rank {r} {tuple(real['qkv'].shape)}: expected query heads {want[0]} and KV "
                                 f"heads {want[1]}, got query heads {got[0]} and KV heads {got[1]} "
                                 f"{tuple(qkv.shape)}")
        for name, got in [("gate_up", torch.cat([mine["gate"][r], mine["up"][r]]).float()),
                          ("o", mine["o"][r].float()), ("down", mine["down"][r].float())]:
            if not (got.shape == real[name].shape and torch.equal(got, real[name])):
                layer = "MergedColumnParallelLinear" if name == "gate_up" else "RowParallelLinear"
                raise ExerciseFailed(f"{where}: your {name}_proj shard should be {layer}'s weight on rank {r}: "
                                     f"expected shape {tuple(real[name].shape)}, got {tuple(got.shape)}"
                                     + (" with other values" if got.shape == real[name].shape else ""))


def check_tp_linear(fn):
    for kind in ("column", "row"):
        _case(fn, 1, kind, 5, 4)
    yield "tp 1: one shard, the whole W, and y = x @ W.T"
    for tp, out_features, in_features in [(2, 8, 6), (3, 9, 6), (4, 8, 12)]:
        _case(fn, tp, "column", out_features, in_features)
    yield ("column parallel, tp 2, 3, 4: rank r holds the r-th block of output features (rows of W), as "
           "minivllm's _shard cuts it; the outputs concatenated are x @ W.T")
    for tp, out_features, in_features in [(2, 5, 8), (3, 7, 9), (4, 8, 12)]:
        _case(fn, tp, "row", out_features, in_features)
    yield ("row parallel, tp 2, 3, 4: rank r holds the r-th block of input features (columns of W); the "
           "partial sums added up (the all-reduce) are x @ W.T")
    _refused(fn, 3, "column", 10, 6)
    _refused(fn, 2, "row", 6, 7)
    _refused(fn, 4, "column", 6, 8)
    yield "sizes that do not divide (10 rows on 3 ranks, 7 columns on 2, 6 rows on 4): ValueError"
    rng = random.Random(5)
    for i in range(12):
        tp, kind = rng.choice([1, 2, 3, 4]), rng.choice(["column", "row"])
        n = tp * rng.randint(1, 5)
        other = rng.randint(1, 10)
        _case(fn, tp, kind, *((n, other) if kind == "column" else (other, n)), seed=i)
    yield "12 random shapes against _shard and x @ W.T"
    _check_real(fn)
    yield ("layer 0 of SmolLM2-135M on 3 ranks: your q/k/v, gate/up, o and down shards are exactly what "
           "minivllm's layers load on each rank (query heads 3r..3r+2 with KV head r), and every y = x @ W.T")
