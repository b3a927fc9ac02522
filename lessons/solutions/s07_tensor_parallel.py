"""Lesson 07's solution: a linear layer split over tp_size ranks, the ranks simulated in one process."""

import torch
import torch.nn.functional as F


def shard_weight(weight, tp_size, rank, kind):
    """Rank `rank`'s block of weight (out_features, in_features): column parallel cuts the output features (dim 0),
    row parallel the input features (dim 1), into tp_size equal contiguous blocks."""
    dim = {"column": 0, "row": 1}[kind]
    size = weight.shape[dim]
    if size % tp_size:
        raise ValueError(f"{kind} parallel: {size} features along dim {dim} do not split into {tp_size} equal shards")
    n = size // tp_size
    return weight.narrow(dim, rank * n, n)


def tp_linear(x, weight, tp_size, kind):
    """y = x @ weight.T computed by tp_size simulated ranks. Returns (shards, y): rank r's block of weight, and
    the ranks' results combined: column parallel concatenates the output slices (the all-gather), row parallel
    sums the partial sums (the all-reduce)."""
    shards = [shard_weight(weight, tp_size, r, kind) for r in range(tp_size)]
    if kind == "column":
        y = torch.cat([F.linear(x, w) for w in shards], dim=-1)           # tp x (n, out / tp) -> (n, out)
    else:
        xs = x.chunk(tp_size, dim=-1)                                     # rank r's input features
        y = sum(F.linear(xr, w) for xr, w in zip(xs, shards))            # tp x (n, out) partials -> (n, out)
    return shards, y
