"""The process groups of tensor and pipeline parallelism: which sizes a model allows, the layers of each pipeline
stage, and joining / leaving the group.

Owns: torch.distributed's default process group for this engine (gloo on a CPU, NCCL on CUDA). The
layers only ever see a `TPGroup(rank, size)` (layers.py); the executor decides who starts which rank.

Two ways in, as in vLLM:
    mp (the default)      the engine starts tp_size - 1 worker processes on this machine and picks a
                          free port for their rendezvous: tcp://127.0.0.1:<port>
    external_launcher     torchrun started every rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
                          LOCAL_RANK in the environment), possibly on several machines: env://
"""

from __future__ import annotations

import math
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from minivllm.model.llama import ModelConfig


def get_open_port() -> int:
    """A TCP port nobody is listening on right now (the OS picks it), so two engines never collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or all(
        k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def check_tp_size(cfg: ModelConfig, tp_size: int) -> None:
    """Every sharded dimension must split evenly: query heads, KV heads, vocabulary and MLP width."""
    dims = {"query heads": cfg.num_attention_heads, "KV heads": cfg.num_key_value_heads,
            "vocab size": cfg.vocab_size, "intermediate size": cfg.intermediate_size}
    bad = {name: n for name, n in dims.items() if n % tp_size}
    if bad:
        g = math.gcd(*dims.values())
        works = [d for d in range(1, g + 1) if g % d == 0]
        found = " and ".join(f"{n} {name}" for name, n in bad.items())
        raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's {found}; "
                         f"sizes that work for this model: {', '.join(map(str, works))}.")


def pp_layer_partition(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Each pipeline stage's decoder layers [start, end): as even as possible, the earlier stages taking one fewer
    when they do not divide (the first stage also embeds, the last also runs the LM head), as vLLM does.
    VLLM_PP_LAYER_PARTITION="5,5,4" (vLLM's variable) sets the counts instead."""
    if pp_size < 1 or num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size is {pp_size} but the model has {num_layers} layers; each stage "
                         f"needs at least one: use at most {num_layers} stages.")
    custom = os.environ.get("VLLM_PP_LAYER_PARTITION")
    if custom:
        try:
            counts = [int(x) for x in custom.split(",")]
        except ValueError:
            raise ValueError(f"VLLM_PP_LAYER_PARTITION is {custom!r}; it must be comma-separated layer counts, "
                             f"one per stage, e.g. '15,15'.") from None
        if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(f"VLLM_PP_LAYER_PARTITION is {custom!r}: it needs {pp_size} counts of at least 1 "
                             f"that add up to the model's {num_layers} layers.")
    else:
        base, extra = divmod(num_layers, pp_size)
        counts = [base + (1 if i >= pp_size - extra else 0) for i in range(pp_size)]
    bounds, start = [], 0
    for n in counts:
        bounds.append((start, start + n))
        start += n
    return bounds


def make_groups(tp_size: int, pp_size: int, rank: int, num_layers: int):
    """(TPGroup, PPStage) of global `rank` in a world of tp_size x pp_size ranks: rank = stage x tp_size + TP rank.
    Every rank must call this: torch.distributed creates groups collectively."""
    from minivllm.model.layers import PPStage, TPGroup

    tp_rank, pp_rank = rank % tp_size, rank // tp_size
    group = None
    if pp_size > 1 and tp_size > 1:
        for stage in range(pp_size):            # every rank creates every stage's group, in the same order
            g = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
            if stage == pp_rank:
                group = g
    start, end = pp_layer_partition(num_layers, pp_size)[pp_rank]
    stage = PPStage(pp_rank, pp_size, start, end,
                    prev_rank=rank - tp_size if pp_rank > 0 else None,
                    next_rank=rank + tp_size if pp_rank < pp_size - 1 else None,
                    driver_rank=0)
    return TPGroup(tp_rank, tp_size, group), stage


def tp_device(device: torch.device, rank: int) -> torch.device:
    """Rank r of a CUDA engine uses GPU r (of this machine); a CPU engine keeps the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def init_distributed(rank: int, world_size: int, init_method: str, device: torch.device) -> None:
    """Join the default process group. gloo on a CPU, NCCL on CUDA."""
    if dist.is_initialized():
        raise RuntimeError("this process is already in a torch.distributed group (another engine with "
                           "tensor_parallel_size > 1 is alive here); shut it down first (engine.shutdown()).")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(minutes=10))


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
