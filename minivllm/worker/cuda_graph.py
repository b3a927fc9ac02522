"""CUDA graphs for decode steps: capture the model's forward once per batch size, then replay it.

Owns: the static input buffers a captured graph reads, the graphs themselves (one per capture size), and
the choice, each step, between replaying one and running eagerly. It does not build inputs (model_runner.py)
or compute logits (outside the graph, as in vLLM).

Why: a decode step of a small model launches a few hundred small kernels, and on a GPU the CPU's time to
launch them can exceed the GPU's time to run them. A CUDA graph records the launches once and replays
them with one call. A replay repeats the captured kernels on the same memory, so:
    - the inputs live in static buffers, and each step copies its inputs into them;
    - the shapes are frozen: a batch of n runs the graph of the smallest capture size >= n, with rows
      n.. padded (slot -1: nothing is stored; seq_len 1 on block 0: a harmless read), and rows n.. of the
      output are dropped;
    - the block table has a fixed width (max_model_len / block_size blocks), and the attention kernel
      reads each sequence's length from device memory, so one graph serves any context length.
Prefill and mixed steps, batches above the largest capture size, and `enforce_eager=True` run eagerly.

    static buffers (max_batch rows)        graph for size 8 reads rows 0..7 of each buffer
    input_ids     [t0 t1 t2 .. t4 | 0 0 0]      a batch of 5: rows 5..7 are padding
    positions     [p0 p1 p2 .. p4 | 0 0 0]
    slot_mapping  [s0 s1 s2 .. s4 |-1-1-1]
    seq_lens      [l0 l1 l2 .. l4 | 1 1 1]
    block_tables  (max_batch, max_model_len / block_size), rows 5..7 all block 0

On a CPU there is nothing to capture; `capture=False` runs the same padded static-buffer path eagerly,
which is how the CPU tests check the padding and the bucketing against the plain eager path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.model.attention import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's batch sizes to capture: 1, 2, 4, then every multiple of 8, up to max_num_seqs (at most 512)."""
    top = min(max_num_seqs, 512)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] < top:
        sizes.append(top)                 # e.g. max_num_seqs 12: sizes 1, 2, 4, 8, 12
    return sizes


@dataclass
class GraphStats:
    replays: int = 0                      # decode steps that ran a captured graph (or its CPU emulation)
    eager_steps: int = 0                  # steps that ran eagerly (prefill, mixed, too big)
    padded_rows: int = 0                  # rows of padding replayed, summed over replays


class DecodeGraphs:
    """One rank's captured decode graphs and their static buffers.

    forward_fn(input_ids, positions, meta) -> hidden (num_tokens, hidden_size) is the model's forward on
    this rank's KV cache (model_runner.py passes it in)."""

    def __init__(self, forward_fn, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device, capture: bool = True):
        self.forward_fn = forward_fn
        self.sizes = capture_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.capture = capture
        self.stats = GraphStats()
        n, i32, i64 = self.max_batch, torch.int32, torch.int64
        self.input_ids = torch.zeros(n, dtype=i64, device=device)
        self.positions = torch.zeros(n, dtype=i64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=i64, device=device)
        self.seq_lens = torch.ones(n, dtype=i32, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=i32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}        # size -> the graph's output (size, hidden)

    def _meta(self, size: int, seq_lens_cpu: list[int]) -> AttentionMetadata:
        """Metadata over the first `size` rows of the static buffers (views: a replay sees new values)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], cu_seqlens_q=torch.arange(size + 1, dtype=torch.int32,
                                                                              device=self.device),
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size], max_q_len=1,
            max_seq_len=max(seq_lens_cpu), q_lens_cpu=[1] * size, seq_lens_cpu=seq_lens_cpu)

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture one graph per size, largest first, all sharing one memory pool (as vLLM does: a smaller
        graph's activations fit in the memory the larger one already took)."""
        if not self.capture:
            return
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            meta = self._meta(size, [1] * size)
            args = (self.input_ids[:size], self.positions[:size], meta)
            self.forward_fn(*args)                        # warm up: Triton compiles, allocator settles
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward_fn(*args)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def check_against_eager(self, size: int, seq_len: int, atol: float) -> float:
        """Replay the graph of `size` on a dummy decode batch and compare with an eager forward on the same
        inputs (slot -1, so nothing is stored). Returns the max abs difference; raises past atol."""
        self._fill([1 + i % 100 for i in range(size)], [seq_len - 1] * size, [-1] * size, [seq_len] * size,
                   [[0] * -(-seq_len // self.block_size)] * size, size)
        got = self._run_static(size, [seq_len] * size).clone()
        want = self.forward_fn(self.input_ids[:size], self.positions[:size], self._meta(size, [seq_len] * size))
        diff = (got.float() - want.float()).abs().max().item()
        if not diff <= atol:
            raise RuntimeError(f"the CUDA graph of batch size {size} disagrees with the eager forward "
                               f"(max abs difference {diff:.3g} > {atol:g}).")
        return diff

    # ------------------------------------------------------------------ each step
    def can_run(self, q_lens: list[int], block_tables: list[list[int]]) -> bool:
        """A pure decode batch that fits the largest graph and the static block table."""
        return (0 < len(q_lens) <= self.max_batch and max(q_lens) == 1
                and all(len(t) <= self.max_blocks for t in block_tables))

    def _fill(self, input_ids, positions, slot_mapping, seq_lens, block_tables, size: int) -> None:
        """Copy one step's inputs into rows 0..n-1 of the static buffers and pad rows n..size-1."""
        n = len(input_ids)
        pad = size - n
        self.input_ids[:size].copy_(torch.tensor(input_ids + [0] * pad), non_blocking=True)
        self.positions[:size].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        self.slot_mapping[:size].copy_(torch.tensor(slot_mapping + [-1] * pad), non_blocking=True)
        self.seq_lens[:size].copy_(torch.tensor(seq_lens + [1] * pad, dtype=torch.int32), non_blocking=True)
        width = max(len(t) for t in block_tables)
        rows = [t + [0] * (width - len(t)) for t in block_tables] + [[0] * width] * pad   # one host tensor
        self.block_tables[:size, :width].copy_(torch.tensor(rows, dtype=torch.int32), non_blocking=True)
        self.block_tables[:size, width:].zero_()       # columns a longer earlier batch left behind

    def _run_static(self, size: int, seq_lens_cpu: list[int]) -> torch.Tensor:
        if self.capture:
            self.graphs[size].replay()
            return self.outputs[size]
        return self.forward_fn(self.input_ids[:size], self.positions[:size], self._meta(size, seq_lens_cpu))

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], slot_mapping: list[int], seq_lens: list[int],
            block_tables: list[list[int]], prev_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> torch.Tensor:
        """One decode step through the graph of the smallest capture size that holds it. `prev_tokens`: (rows,
        tokens) on the device, written over those input ids (async scheduling: tokens not on the host yet).
        Returns hidden (num_seqs, hidden_size), a view of the graph's output: use it before the next step."""
        n = len(input_ids)
        size = next(s for s in self.sizes if s >= n)
        self._fill(input_ids, positions, slot_mapping, seq_lens, block_tables, size)
        if prev_tokens is not None:
            self.input_ids.index_copy_(0, *prev_tokens)
        hidden = self._run_static(size, seq_lens + [1] * (size - n))
        self.stats.replays += 1
        self.stats.padded_rows += size - n
        return hidden[:n]


def capture_decode_graphs(runner) -> DecodeGraphs | None:
    """A ModelRunner's decode graphs, checked against its eager forward before use. None (every step eager) off
    CUDA, with enforce_eager, under tensor or pipeline parallelism (NCCL inside a graph was never tried here), with
    the PyTorch reference attention (it reads host-side lengths), or when capture or the check fails (with a
    warning)."""
    config = runner.config
    if (runner.device.type != "cuda" or config.enforce_eager or runner.tp.size > 1 or runner.pp.size > 1
            or runner.backend.name != "triton"):
        return None
    max_model_len = config.max_model_len or runner.model_cfg.max_position_embeddings
    graphs = DecodeGraphs(runner.forward, config.max_num_seqs, max_model_len, runner.block_size, runner.device)
    try:
        graphs.capture_all()
        atol = 1e-3 if runner.dtype == torch.float32 else 5e-2
        for size in (graphs.sizes[0], graphs.sizes[-1]):
            graphs.check_against_eager(size, seq_len=2 * runner.block_size + 3, atol=atol)
    except Exception as exc:
        import warnings
        warnings.warn(f"CUDA graphs are off, decode steps run eagerly: {type(exc).__name__}: {exc}")
        return None
    return graphs
