# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lesson 11: CUDA graphs, and what moved a CPU decode step
#
# Lesson 10 measured where a step's time goes and what the hardware allows: a decode step reads every weight,
# so it costs at least the bytes it reads over the memory bandwidth, at any batch. This lesson takes the two
# roads that lead on from there:
#
# 1. **CUDA graphs**, the GPU's answer to the other cost of a small model's step, launching hundreds of small
#    kernels from Python (`minivllm/worker/cuda_graph.py`), rehearsed on a CPU: capture sizes, static buffers
#    and padding rows. You write the padding yourself and run the engine's decode steps through it.
# 2. **What moved a CPU decode step, and what did not**: ideas tried inside the engine, and the ones that
#    stayed (oneDNN's prepacked layout, bf16, weight-only int8/int4, and int8 activations with integer dot
#    products: `minivllm/platforms/cpu/gemm.py`, `minivllm/platforms/cpu/quantization.py`), measured here on the model's
#    own matmuls. You write the rounding of a token's activations to int8, and the engine runs with it.
# 3. **Below the engine**: the memory allocator every op goes through (tcmalloc: `minivllm/platforms/cpu/runtime.py`),
#    and why a fresh 60 MB output costs more than its math.
# 4. **Decode attention in C++** (`kernels/cpu_attention.cpp`): the same bytes as the gather, read once and in
#    the order memory delivers them fastest.
# 5. **Async scheduling**, the GPU's answer to the host's own share of a step (the plan, the inputs, applying
#    the tokens, the text): schedule the next batch while the device runs this one. You write the scheduler's
#    plan for a request whose batch is still in flight, and an engine runs with it.
#
# As in lesson 10, every number is measured when the notebook runs; timings wobble on a busy machine.

# %%
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import time

import torch
import torch.nn.functional as F

from minivllm import LLM, SamplingParams
from minivllm.bench import roofline

torch.manual_seed(0)
torch.set_num_threads(1)     # one core's worth, as in lesson 10

llm = LLM(num_kv_blocks=256, seed=0)
engine = llm.llm_engine
cfg = engine.model_config
NUM_REQUESTS = 32
ITEMSIZE = engine.model_runner.dtype.itemsize                            # 4: fp32
bandwidth = roofline.measure_copy_bandwidth()                            # bytes/s, read + written
weights = roofline.weight_bytes(cfg, ITEMSIZE)
print(f"{cfg.num_hidden_layers} layers, weights {weights / 1e6:.0f} MB in {engine.model_runner.dtype}")


def decode_memory_floor_ms(cfg, itemsize, batch, context, bandwidth):
    """Lesson 10's exercise, from the engine's own roofline: the bytes one decode step of `batch` sequences of
    `context` tokens must read (every weight, and each sequence's K and V), over the bandwidth, in ms."""
    pairs = batch * context
    return 1e3 * roofline.step_floor_s(cfg, itemsize, float("inf"), bandwidth, batch, pairs, batch, pairs)


# %% [markdown]
# ## 1. CUDA graphs, rehearsed on a CPU
#
# On a GPU a decode step of a small model is a few hundred small kernels, and launching them from Python
# can take longer than running them. A **CUDA graph** records one step's launches once and replays them
# with a single call (`minivllm/worker/cuda_graph.py`, on by default on CUDA; `enforce_eager=True` turns it
# off, as in vLLM). A replay repeats the recorded kernels on the same memory with the same shapes, which
# shapes the whole design:
#
# - one graph per **capture size** (vLLM's 1, 2, 4, 8, 16, 24, ...); a batch of 5 runs the graph of 8;
# - the inputs live in **static buffers**; each step copies its inputs in, and the 3 rows of padding get slot
#   -1 (the KV store skips them) and a context of 1 on block 0 (a harmless read); their outputs are dropped;
# - the block table has a fixed width (`max_model_len / block_size`), and the attention kernel reads each
#   sequence's length from device memory, so one graph serves every context length;
# - prefill and mixed steps run eagerly.
#
# There is nothing to capture on a CPU, but everything else can be rehearsed: `capture=False` runs the same
# padded, static-buffer path eagerly. Below, five requests that finish one after another make decode batches
# of 5, 4, 3, 2 and 1, which run in the graphs of 8, 4, 4, 2 and 1, and the tokens must be the plain eager
# path's. (The test suite holds the same path against Hugging Face; on a GPU it also captures for real and
# compares with `enforce_eager=True`.)

# %%
from minivllm.worker.cuda_graph import DecodeGraphs, capture_sizes

print("capture sizes for max_num_seqs=256:", capture_sizes(256))
runner = engine.model_runner
graph_prompts = [[100 + i] * (8 + 4 * i) for i in range(5)]                  # 5 prompts of 8-24 tokens
graph_params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 8, 12, 16, 20)]
graph_requests = [{"prompt_token_ids": ids} for ids in graph_prompts]
eager_tokens = [o.outputs[0].token_ids for o in llm.generate(graph_requests, graph_params, use_tqdm=False)]
graphs = DecodeGraphs(runner.forward, max_num_seqs=16, max_model_len=engine.max_model_len,
                      block_size=runner.block_size, device=runner.device, capture=False)
runner.graphs = graphs                          # what allocate_kv_cache does on CUDA, with capture=True
try:
    graph_tokens = [o.outputs[0].token_ids for o in llm.generate(graph_requests, graph_params, use_tqdm=False)]
finally:
    runner.graphs = None
print(f"same tokens as the eager path: {graph_tokens == eager_tokens}")
print(f"decode steps through the static buffers: {graphs.stats.replays}, padding rows run: "
      f"{graphs.stats.padded_rows}, steps run eagerly (prefill): {graphs.stats.eager_steps}")

# %% [markdown]
# On a GPU, `python -m minivllm.bench` prints a `CUDA graphs:` line (how many decode steps were replayed);
# run it once more with `--enforce-eager` to see what the graphs are worth.
#
# Measured on an H200 (2026-11-26), random weights at Qwen3-0.6B's shape in bf16, 64 requests of 500-token
# prompts: a decode step takes **7.5 ms** with the graphs and **26.1 ms** without. The profiler shows why: an
# eager step launches about 1,750 kernels (RMSNorm alone is 8 small ones, 4 times a layer) and spends 29 ms of
# CPU time (under the profiler) issuing 4.7 ms of GPU work. The tokens are the same either way
# (`tests/test_cuda_graph.py`, and `tests/test_gpu.py` against Hugging Face on the same GPU).
#
# Even replayed, each of those kernels costs the GPU a few microseconds of its own, so the next step is fewer
# of them: `kernels.triton_ops.rms_norm` does an add + RMSNorm in one launch instead of 8. On an H100
# (2026-11-26, the same shape and batch) it took a replayed decode step from **8.65 ms to 7.35 ms**, and the
# GPU workload of 256 requests from 5,023-5,477 to 5,817 output tokens/s, with the fp32 tokens still equal to
# HF's. So it is on by default on CUDA; `MINIVLLM_CUSTOM_OPS=none` (vLLM's custom-op switch) turns it off, to
# see the difference yourself.

# %% [markdown]
# > **How vLLM v1 does it differently.** vLLM captures graphs for a list of batch sizes too
# > (`cudagraph_capture_sizes` in its compilation config) and pads a batch up to the next one, but by default it
# > captures *piecewise*: the model is compiled with `torch.compile`, split at the attention calls, and the pieces
# > between them are graphed while attention runs eagerly, so one set of graphs also serves prefill and mixed
# > batches; full graphs that include attention are an option for backends that support them
# > (`cudagraph_mode`). minivllm graphs whole decode steps only, the simplest case to read.

# %% [markdown]
# ### Exercise: pad a decode batch to its graph
#
# The heart of the replay path is `DecodeGraphs._fill`: a batch of n decodes goes to the graph of the smallest
# capture size that holds it, and rows n.. are padding. Write `pad_decode_batch(input_ids, positions,
# slot_mapping, seq_lens, block_tables, sizes)` on plain lists: return `(size, input_ids, positions,
# slot_mapping, seq_lens, block_tables)` with the padding rows as the list above says (token 0, position 0,
# slot -1, a context of 1, a table of block 0) and every table padded with block 0 to the widest one.
#
# The check runs hand-made batches, 100 random ones against the static buffers `DecodeGraphs` fills, and then the
# engine: its decode steps go through the static-buffer path with your padding, and the greedy tokens must be
# the eager path's.

# %%
from course import check, exercise


@exercise("11.pad_decode_batch")
def pad_decode_batch(input_ids, positions, slot_mapping, seq_lens, block_tables, sizes):
    # your code here
    raise NotImplementedError


check(pad_decode_batch)

# %%
# NBVAL_IGNORE_OUTPUT
import inspect

print(inspect.getsource(DecodeGraphs._fill))

# %% [markdown]
# ## 2. What did not help on these 2-core CPUs (and why)
#
# Each idea below was tried inside the engine, timed against the unchanged engine in alternating runs, and
# left out of minivllm; the dated numbers are in docs/benchmarks.md, not repeated here, since this
# lesson shows only what it measures itself. (The machine's noise is large: runs of the same command differ by
# up to 20%.)
#
# - **A C++ decode-attention kernel, the first time.** It walked the block table itself (no gather copy, no
#   padding), one (sequence, KV head) per work item. Alone, on a cache that fits in L3, it beat the
#   reference; inside the engine the whole benchmark did not get faster. The second try (section 5) kept the
#   kernel and changed only the order it reads memory in, and that one stayed.
# - **A small-batch matmul kernel** that reads each weight row once for all rows of the batch: faster than
#   MKL at about 8 rows, much slower at 32; at one row MKL already runs at the memory floor.
# - **MKL's packed weights** (`torch.ops.mkl._mkl_linear`): within the machine's noise, at 3x the weight
#   memory. (oneDNN's prepacked linear, tried later inside the engine, did help: next section.)
# - **Fused RMSNorm** (`F.rms_norm`): bit-identical here, but slower at 32 rows.
# - **Smaller token budgets** (prefill chunks riding along with the decodes' weight reads): no clear change.
#
# One thing found on the way did help: in a mixed step, the sequences with one new token now take the batched
# decode path together instead of going one at a time through the prefill loop.
#
# The reason for the rest is the one lesson 10 measured: a decode step reads every weight and the KV of its
# batch from memory, so it costs at least the floor computed below at any batch, and the 256-row matmul rate
# is out of reach at 1-32 rows.

# %%
# NBVAL_IGNORE_OUTPUT
floor_1 = decode_memory_floor_ms(cfg, ITEMSIZE, 1, 300, bandwidth)
floor_32 = decode_memory_floor_ms(cfg, ITEMSIZE, NUM_REQUESTS, 300, bandwidth)
print(f"weights {weights / 1e6:.0f} MB at {bandwidth / 1e9:.1f} GB/s: a decode step costs at least {floor_1:.1f} ms "
      f"at batch 1 and {floor_32:.1f} ms at batch {NUM_REQUESTS} (300 tokens of context each), however it is coded")

# %% [markdown]
# ## 3. What did help later: oneDNN's layout, bf16, and 4-bit weights
#
# Tried again inside the engine, one idea did move a decode step a lot: **prepacking each linear weight once
# for oneDNN** (`minivllm/platforms/cpu/gemm.py`, what vLLM's CPU backend does too). oneDNN rewrites the (out, in)
# matrix into the tiles its kernel streams through, once at load, instead of the matmul library adapting a
# plain layout on every call; on CPUs with AVX-512 BF16 it also packs bf16 (two products per lane with
# `vdpbf16ps`), while an AVX2-only CPU refuses bf16 packing and keeps `F.linear` (the table below says which
# this machine is). On a CPU with AVX-512, fp32 weights (and bf16 ones, with AVX-512 BF16) now go to
# minivllm's own kernel instead (`kernels/cpu_gemm.cpp`, next paragraph). **Weight-only int8 and int4**
# (`minivllm/platforms/cpu/quantization.py`) read 4-8x fewer bytes than fp32, which wins where a step only reads
# weights (one row). PyTorch's packed-int kernels lost at 32 rows (int8 64 ms, int4 43 ms against bf16's 22 on
# the machine of 2026-11-27): they spend their time dequantizing. minivllm's kernel runs them through the same
# bf16 tiles (after the next paragraph), so at 32 rows they cost about what bf16 does. The cell measures all of
# them on the model's own matmuls (30 layers' four linear layers), at 1 and 32 rows, here and now:

# %%
# NBVAL_IGNORE_OUTPUT

from minivllm.platforms.cpu import gemm as cpu_gemm, quantization
from minivllm.model._kernels import kernels
from minivllm.model.layers import ColumnParallelLinear, TPGroup

shapes = [((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim, cfg.hidden_size),
          (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim),
          (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]
g = torch.Generator().manual_seed(0)
layers = []
for out_f, in_f in shapes:
    layer = ColumnParallelLinear(in_f, out_f, False, TPGroup())
    layer.weight.data = torch.randn(out_f, in_f, generator=g) / in_f ** 0.5
    layers.append(layer)


def step_time(fn, rows, dtype=torch.float32, reps=3):
    """One decode step's linear layers (each shape 30 times), median of `reps`, in ms."""
    xs = [torch.randn(rows, l.weight.shape[1] if l.weight.numel() else l.in_features).to(dtype) for l in layers]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(cfg.num_hidden_layers):
            for l, x in zip(layers, xs):
                fn(l, x)
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2] * 1e3


results = {}
for rows in (1, 32):
    results[("F.linear fp32", rows)] = step_time(lambda l, x: F.linear(x, l.weight), rows)
    onednn32 = {id(l): torch.ops.mkldnn._reorder_linear_weight(l.weight, cpu_gemm.BATCH_HINT) for l in layers}
    results[("oneDNN fp32", rows)] = step_time(
        lambda l, x: torch.ops.mkldnn._linear_pointwise(x, onednn32[id(l)], None, "none", [], ""), rows)
    if cpu_gemm.own_gemm(torch.float32):             # minivllm's kernels/cpu_gemm.cpp (AVX-512)
        own32 = {id(l): kernels.cpu_ops.pack_linear(l.weight) for l in layers}
        results[("minivllm fp32 (cpu_gemm.cpp)", rows)] = step_time(
            lambda l, x: cpu_gemm.gemm(x, l.weight, None, own32[id(l)]), rows)
    w16 = {id(l): l.weight.bfloat16() for l in layers}
    if cpu_gemm.packable(torch.bfloat16):            # oneDNN's bf16 layout, as the engine packs it without AVX-512 BF16
        onednn16 = {id(l): torch.ops.mkldnn._reorder_linear_weight(w16[id(l)], cpu_gemm.BATCH_HINT) for l in layers}
        results[("oneDNN bf16", rows)] = step_time(
            lambda l, x: torch.ops.mkldnn._linear_pointwise(x, onednn16[id(l)], None, "none", [], ""), rows,
            torch.bfloat16)
    if cpu_gemm.own_gemm(torch.bfloat16):            # minivllm's kernels/cpu_gemm.cpp (AVX-512 BF16)
        own16 = {id(l): kernels.cpu_ops.pack_linear(w16[id(l)]) for l in layers}
        results[("minivllm bf16 (cpu_gemm.cpp)", rows)] = step_time(
            lambda l, x: cpu_gemm.gemm(x, w16[id(l)], None, own16[id(l)]), rows, torch.bfloat16)
    if not cpu_gemm.packable(torch.bfloat16):
        results[("F.linear bf16", rows)] = step_time(lambda l, x: F.linear(x, w16[id(l)]), rows, torch.bfloat16)
kernel = "minivllm's kernel" if quantization.own_quantized_kernels() else "PyTorch's kernel"
w8a8_kernel = "minivllm's kernel" if quantization.own_w8a8_kernel() else "int8_matmul"
for name, method in ((f"int8 ({kernel})", quantization.Int8WeightOnlyMethod()),
                     (f"int4 ({kernel})", quantization.Int4WeightOnlyMethod()),
                     (f"w8a8_int8 ({w8a8_kernel})", quantization.W8A8Int8Method())) + (
                    (("w4a8_int8 (minivllm's kernel)", quantization.W4A8Int8Method()),)
                    if quantization.own_w8a8_kernel() else ()):
    qlayers = []
    for l in layers:
        q = ColumnParallelLinear(l.weight.shape[1], l.weight.shape[0], False, TPGroup())
        q.weight.data = l.weight.clone()
        method.process_weights_after_loading(q)
        q.in_features = l.weight.shape[1]
        qlayers.append(q)
    saved, layers = layers, qlayers
    for rows in (1, 32):
        results[(name, rows)] = step_time(lambda l, x: method.apply(l, x, None), rows)
    layers = saved

print("oneDNN packs bf16 on this CPU:", cpu_gemm.packable(torch.bfloat16),
      "| minivllm's kernel, fp32 (AVX-512):", cpu_gemm.own_gemm(torch.float32),
      "bf16 (AVX-512 BF16):", cpu_gemm.own_gemm(torch.bfloat16))
print(f"{'matmuls of one decode step':32} {'1 row':>9} {'32 rows':>9}")
for name in dict.fromkeys(k[0] for k in results):
    print(f"{name:32} {results[(name, 1)]:7.1f} ms {results[(name, 32)]:7.1f} ms")

# %% [markdown]
# **Why write a matmul when oneDNN has one?** Profiled in bf16 at 32 rows, oneDNN's packed matmul ran at
# 280-300 GFLOP/s with the weights coming from memory, as they do in a decode step (269 MB of bf16 weights,
# eight times the L3), against about 455 GFLOP/s of peak for two cores (one 16-lane `vdpbf16ps` a cycle each,
# 64 flops). Nothing about 32 rows needs a clever kernel: the outer-product form is enough if the weight is
# read in the order it is stored. `pack_linear` rewrites W once into panels of 48 output columns, each row of
# a panel the 48 columns' 32-bit *words*: one fp32 weight W[n][k], or in bf16 a pair (W[n][2k], W[n][2k+1]);
# three registers. A tile is 8 rows of x by one panel: 24 fp32 accumulators; for each word index k, three loads
# of the panel row, and for each of the 8 rows a broadcast of its word (x[r][k], or the pair x[r][2k],
# x[r][2k+1]) and three FMAs (fp32) or `vdpbf16ps` (bf16). The panel streams from memory front to back
# (prefetched a few rows ahead) and stays in L2 for the other row tiles. Measured on the 2-core Zen 4 of
# 2026-11-27, the default model's matmuls of 30 layers with cold weights, bf16: 32 rows 18 ms against oneDNN's
# 24; 1 row 7.2 against 11.5 ms, which is 28 GB/s, the memory's bandwidth; the same from 2,048 rows up. fp32
# (the same kernel with FMAs): 1 row 11.1 against 20.6 ms, 32 rows 37.2 against 41.8 ms, and 2-4% ahead at
# 128-512 rows. A product of two bf16 values is exact in fp32, so the result is oneDNN's up to the order of the
# fp32 sums, rounded once (`tests/test_cpu_gemm.py` checks every element against float64).
#
# **Quantized weights through the same tiles.** Small integers are exact in bf16 (8 significant bits: every
# int8, and int4's 0..15), so an int8 or int4 weight can feed `vdpbf16ps` unchanged once it is widened to
# bf16, and the scales come after the sums: int8 multiplies each column's fp32 sum by its scale; int4
# (w = d q + m per group of 32) sums x q over a group, then adds d times that and m times the group's sum of x.
# The widening happens in registers as the first row tile of a panel reads the packed bytes (int8: sign-extend
# and convert; int4: each byte's two nibbles spread into the two halves of a 32-bit lane, then one `vpermw`
# looks up bf16(0..15) for all 32 of them), and the widened panel stays in L2 for the other row tiles. With
# both cores (the engine's setting; 2026-11-27), one row reads only the quantized bytes (int8 4.3 ms, int4 3.8
# ms against bf16's 8.1), and 32 rows run at the bf16 tiles' speed (int8 21.7, int4 25.4 ms against 22.2;
# int4's tile is 4 rows, since its group sums take registers too). The table above runs on one thread (this
# notebook sets `torch.set_num_threads(1)` at the top): one core cannot widen int8 as fast as memory delivers
# it, so there int8 at one row is slower than bf16, and int4 (a quarter of the bytes, and one table lookup for
# 32 weights) about equal.
#
# **Rounding the activations too (W8A8).** At 32 rows the tiles above are bound by arithmetic, not bytes: every
# weight format does bf16's `vdpbf16ps` work, 32 multiply-adds an instruction, so reading fewer bytes cannot make
# them faster there (int8 equals bf16 at 32 rows, int4 trails it). AVX-512 VNNI has an integer instruction
# with twice the work: `vpdpbusd` multiplies 4 unsigned bytes by 4 signed bytes and adds the four products into
# a 32-bit lane, 64 multiply-adds, at the same one a cycle on these cores (a register-only loop on two cores:
# 920 G integer operations a second against bf16's 459 G flops). To use it, x must be integers too:
# `quantization="w8a8_int8"` rounds each row of x (one token) to int8 with its own scale s = max|x| / 127 as it
# reaches the layer, vLLM's W8A8 scheme with dynamic per-token scales. The products and sums are then exact
# integers, and only the end rounds: y = s[r] scale[n] sum_k qx[r][k] q[n][k]. (`vpdpbusd` wants one side
# unsigned, so the kernel feeds qx + 128 and subtracts 128 sum_k q[n][k], stored with the weight, at the end.)
# On the 2-core Zen 4 of 2026-11-27 a bf16 model's decode step at batch 32 went from 34.5 ms (bf16) to 25.3 ms,
# its 4,096-token prefill from 2.5-2.7 s to 1.5 s, and an fp32 model's decode step at 32 from 59-67 to 30-35 ms.
# The price is quality, since x now carries 8 bits: the README's perplexity (its first 1,024 tokens on 2026-11-27) went from 45.81 (fp32) to 49.04,
# against int8's 46.16 and int4's 47.89. A scale per group of 32 inputs instead of per row follows the values
# more closely, at the cost of converting and scaling each group's integer sums: `quantization="w4a8_int8"`
# does that with int4's weights (llama.cpp's Q4_1 x Q8_1), whose groups need that treatment anyway, and whose
# unsigned 0..15 are exactly `vpdpbusd`'s unsigned operand. It kept int4's quality (47.87) and was the fastest
# format at one row (a decode step 7.6-7.8 ms against bf16's 11-16) and faster than bf16 at 32 (29-33 ms
# against 37.5-40 in the same run).
#
# **The activation in the matmul's epilogue.** The MLP's gate/up matmul writes (rows, 2 x intermediate) values
# that exist only to be read once by SiLU-and-mul, which writes half as many: in a 4,096-token bf16 prefill,
# 25 MB out and back in for every layer. A tile already holds its outputs in registers when it finishes, so it
# can apply the activation there, if the gate column and its up column land in the same tile.
# `interleave_gate_up` reorders the weight's rows so that each 48-column panel holds 24 gate columns and the
# same 24 up columns, a whole register of each (gate 0-15 | up 0-15 | gate 16-23 and up 16-23); the tile
# rounds its accumulators to the model's dtype, as the plain matmul's output would be, and computes
# silu(gate) * up with the same code the separate pass runs (`silu_and_mul_reg` in `kernels/cpu_vec.h`), so the
# numbers are equal bit for bit. One detail decided whether this paid at all: the epilogue's exp. glibc's
# vector `expf` is a function call, and a call makes the compiler save every live register around it, the
# tile's 24 accumulators included; the first version (a call per row) made the fused matmul *slower* than the
# matmul plus a separate pass. An inline polynomial exp (`exp16`: 2^n times a degree-7 series) made the
# epilogue free: a 4,096-row bf16 gate/up matmul plus SiLU, 42.0 ms separately, 38.2 ms fused (2026-11-27).
#
# Same answers, different layout: the packed matmul equals `F.linear` to fp32 rounding (a different order
# of additions), which is why greedy outputs still match Hugging Face token for token with it on. The cell also
# checks the fused activation against the separate pass.

# %%
# NBVAL_IGNORE_OUTPUT
x = torch.randn(32, layers[0].weight.shape[1])
assert torch.allclose(cpu_gemm.gemm(x, layers[0].weight, None, cpu_gemm.prepack(layers[0].weight)),
                      F.linear(x, layers[0].weight), rtol=1e-5, atol=1e-5)
print("packed == F.linear (to fp32 rounding)")
if cpu_gemm.own_gemm(torch.float32):
    ops = kernels.cpu_ops
    gate_up = layers[2].weight                                             # (2 x intermediate, hidden)
    n = gate_up.shape[0] // 2
    separate = ops.silu_and_mul(ops.packed_linear(x, ops.pack_linear(gate_up), 2 * n))
    fused = ops.packed_linear(x, ops.pack_linear(ops.interleave_gate_up(gate_up)), n, silu_and_mul=True)
    assert torch.equal(fused, separate)
    print("SiLU in the gate/up matmul == matmul, then SiLU-and-mul (bit for bit)")
else:
    print("this CPU has no AVX-512: minivllm's fp32 kernel is not built here, so F.linear (oneDNN) runs instead")

# %% [markdown]
# ### Exercise: round each token's activations to int8
#
# The heart of W8A8 is the rounding of x, done afresh for every row of every layer. Write
# `quantize_activations(x)`: x (rows, in), fp32 or bf16, to `(q, s)` with q (rows, in) int8 and s (rows,) fp32,
# such that x ~ s[:, None] * q, per row:
#
# - s = max|x[r]| / 127 in fp32, but never below 1e-12 (a row of zeros must not divide by zero);
# - q = x / s rounded to the nearest integer, ties to the even one (`torch.round`; C's `round` goes away from zero).
#
# The check runs hand-made rows (ties, a row of zeros, two rows of different scales), 100 random matrices
# against minivllm's bytes, and then the engine: with `quantization="w8a8_int8"` on its PyTorch path
# (`int8_matmul`), every linear layer rounds x with your function, and the greedy tokens must be minivllm's.
# The C++ kernel must make the same bytes too, which is why it spells its divisions with a named rounding
# (`_mm512_div_round_ps`): built with `-ffast-math`, a plain `x / s` became `x * (1 / s)`, which rounds
# differently now and then.

# %%
@exercise("11.quantize_activations")
def quantize_activations(x):
    # your code here
    raise NotImplementedError


check(quantize_activations)

# %% [markdown]
# The kernel on the model's own shapes, against the integer math written out with your rounding: the products
# and sums are exact, so the only difference is the final fp32 scaling.

# %%
# NBVAL_IGNORE_OUTPUT
if quantization.own_w8a8_kernel():
    w = layers[3].weight                                                   # down: (hidden, intermediate)
    qw, scale = quantization.Int8WeightOnlyMethod.quantize(w)
    x = torch.randn(32, w.shape[1])
    y = kernels.cpu_ops.w8a8_linear(x, *kernels.cpu_ops.pack_w8a8_linear(qw), scale, w.shape[0])
    qx, s = quantize_activations(x)
    exact = (qx.long() @ qw.long().t()).double() * s.double()[:, None] * scale.double()
    assert torch.allclose(y.double(), exact, rtol=1e-6, atol=1e-6)
    print("w8a8_linear == s * scale * (integer sums), to fp32 rounding;",
          f"x rounded costs {float((F.linear(x, w) - y).abs().mean() / F.linear(x, w).abs().mean()):.3%} "
          "of the output (mean relative)")
else:
    print("this CPU has no AVX-512 VNNI and BF16: w8a8_int8 runs int8_matmul here, not minivllm's kernel")

# %% [markdown]
# ## 4. Below the engine: the memory allocator
#
# Some time is spent under PyTorch, in a library every op uses. Each op allocates its output: in a
# 5,000-token prefill step those are 10-60 MB each. glibc's `malloc` serves a block that big with a fresh
# `mmap` and gives it back with `munmap` when the tensor dies, so the next step's op **page-faults and zeroes
# every page again**. tcmalloc keeps freed memory and hands it back out.
#
# You cannot swap a process's allocator once it runs, so `minivllm/platforms/cpu/runtime.py` (vLLM:
# `vllm/platforms/cpu.py`) makes the command-line entry points **re-start themselves** with tcmalloc in
# `LD_PRELOAD` when it is installed. This notebook's kernel was not re-started; the cell says what it runs
# with, times one prefill-sized op that allocates a fresh output against the same op writing into a buffer it
# reuses (`out=`), and, if tcmalloc is installed, runs the fresh-output loop again in a child process that
# preloads it.

# %%
# NBVAL_IGNORE_OUTPUT
import json
import subprocess
import sys

from minivllm.platforms import cpu as cpu_runtime

print("this kernel runs with:", cpu_runtime.describe_runtime())
act = torch.randn(5000, 3 * cfg.hidden_size)             # (tokens, features): a prefill step's activation
out_buf = torch.empty_like(act)
print(f"one activation: {act.numel() * 4 / 1e6:.0f} MB")


def per_op_ms(fn, n=20):
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


fresh_ms = per_op_ms(lambda: F.silu(act))                       # a new output tensor every time
reused_ms = per_op_ms(lambda: torch.ops.aten.silu.out(act, out=out_buf))     # the same buffer every time
print(f"SiLU, fresh output:  {fresh_ms:6.1f} ms  (allocator: {cpu_runtime.loaded_runtime()['malloc']})")
print(f"SiLU, reused buffer: {reused_ms:6.1f} ms  (the same math; the difference is the allocation)")

PROBE = f"""
import json, time, torch, torch.nn.functional as F
from minivllm.platforms.cpu import loaded_runtime
act = torch.randn(5000, {3 * cfg.hidden_size})
F.silu(act)
t0 = time.perf_counter()
for _ in range(20):
    F.silu(act)
print(json.dumps({{"ms": (time.perf_counter() - t0) / 20 * 1e3, **loaded_runtime()}}))
"""
tcmalloc = cpu_runtime.find_tcmalloc()
if tcmalloc:
    child = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                           env={**os.environ, "LD_PRELOAD": tcmalloc})
    preloaded = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"SiLU, fresh output, a child with {preloaded['malloc']}: {preloaded['ms']:6.1f} ms")
else:
    print("tcmalloc is not installed here (apt-get install libtcmalloc-minimal4); `python -m "
          "minivllm.platforms.cpu` says what is")

# %% [markdown]
# On the 2-core AMD EPYC this lesson was written on, the cell printed 66.5 ms for the fresh output under
# glibc, 14.5 ms for the reused buffer and 11.4 ms for the fresh output under tcmalloc: the allocation cost
# four times the math, and tcmalloc took it away. Inside the engine tcmalloc gained 11-20% on the bench's
# default workload, most of it in prefill (docs/benchmarks.md, 2026-11-25). Nothing in the model changed, and
# greedy output is identical: only where memory comes from.
#
# vLLM's CPU guide also asks for Intel's OpenMP with its threads bound to cores (`KMP_AFFINITY`). minivllm
# tried binding and left it out: binding pins the process's *main* thread to core 0, and every process it
# starts inherits that mask, so a tensor-parallel worker or a benchmark's child engine ran on one core.
# Intel's OpenMP *unbound* is preloaded with tcmalloc now, for what it does to a server: offline it measured
# the same as PyTorch's GNU OpenMP, but served online on 2 cores, where the server's HTTP thread runs beside
# the two OpenMP threads, the output throughput rose by about a third (89-117 -> 137-154 tokens/s in single
# runs) and the inter-token latency fell from about 170 to 120-133 ms (docs/benchmarks.md, history,
# 2026-11-26). The lesson's own process keeps what it started with; the report above names it.

# %% [markdown]
# ## 5. Decode attention in C++: the same bytes, read once and in order
#
# Lesson 10 made the reference's decode attention fast in PyTorch: gather each sequence's blocks with
# `index_select` into one buffer, then one call to PyTorch's attention. Every layer of every step still copies
# the whole batch's context (read it, write the copy, read the copy again), and that was about a quarter of a
# decode step at batch 32. vLLM's CPU backend has its own C++ kernel that reads the cache through the block
# table; minivllm's is `kernels/cpu_attention.cpp`, about a hundred lines, built on first use with the
# machine's compiler (`kernels/cpu_ops.py`) and used by `attention_backend="cpu"`, the CPU default when a
# compiler is there. For each work item it computes every score `q . k_t` (pass 1), the softmax, then
# `sum_t p_t v_t` (pass 2), reading token `t` of sequence `i` at block `block_tables[i, t // block_size]`,
# slot `t % block_size`, as lesson 06's kernels do.
#
# The first version of this kernel gave nothing inside the engine (section 2). Its work item was one
# (sequence, KV head), the natural unit of GQA. But a cached token's KV heads sit next to each other
# (`(num_blocks, block_size, num_kv_heads, head_dim)`), so an item reading one head takes 256 bytes and skips
# the next 512, and two threads read interleaved pieces of the same blocks. The version that stayed takes a
# whole sequence per item when there are enough sequences to keep every thread busy: each block is then read
# front to back, which the hardware prefetchers stream at full bandwidth. Same arithmetic, same bytes.
#
# A later pass (2026-11-26) took another 15-22% off, for two reasons that a profiler (`perf annotate`) showed
# and the arithmetic did not. The loop over tokens divided by the block size for every token (an integer
# division is some 40 cycles; the kernel now walks blocks, then slots). And the hardware prefetcher follows one
# address stream, which ends at every block boundary, since a sequence's blocks are scattered over the pool: the
# kernel now asks for the next block's token (`__builtin_prefetch`) while it reads the current block's. Running
# the same kernel with all the caches inside the L3 cache showed it was then near its arithmetic floor, so
# faster dot products (tried: eight keys per register tile) gained nothing against memory.
#
# The cell times both on a batch the shape of the bench's decode steps, with a cache far bigger than the
# CPU's caches (blocks shuffled, as a long-running server's are), and compares the bytes per second with
# the memory bandwidth measured at the top of the lesson.

# %%
# NBVAL_IGNORE_OUTPUT
from minivllm.model._kernels import kernels

ref = kernels.reference
heads, kv_heads, head_dim, block_size = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 16
batch, context = NUM_REQUESTS, 300
blocks_per_seq = -(-context // block_size)
num_blocks = 8192                                               # 8192 * 16 tokens * 3 heads * 64 * 4 B = 100 MB
key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
tables = torch.randperm(num_blocks)[:batch * blocks_per_seq].view(batch, -1).to(torch.int32)
seq_lens = torch.full((batch,), context, dtype=torch.int32)
query = torch.randn(batch, heads, head_dim)
scale = head_dim ** -0.5
kv_bytes = 2 * batch * context * kv_heads * head_dim * 4       # K and V of the batch's context, fp32
gather_buffer = torch.empty(2 * batch * blocks_per_seq * block_size * kv_heads * head_dim)


def reference_decode():
    return ref.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, scale,
                                      seq_lens_cpu=[context] * batch, kv_buffer=gather_buffer)


have_cpp = kernels.cpu_ops.available()
timings = {"gather + PyTorch attention": per_op_ms(reference_decode, n=30)}
if have_cpp:
    cpp_out = kernels.cpu_ops.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, scale)
    torch.testing.assert_close(cpp_out, reference_decode(), atol=2e-6, rtol=2e-5)
    timings["C++ kernel"] = per_op_ms(
        lambda: kernels.cpu_ops.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, scale), n=30)
else:
    print("no C++ kernel here:", kernels.cpu_ops.unavailable_reason())
for name, ms in timings.items():
    print(f"{name:28s} {ms:6.2f} ms per layer   {kv_bytes / ms / 1e6:5.1f} GB/s of K and V "
          f"(a large copy: {bandwidth / 1e9:.1f} GB/s read + written)")

# %% [markdown]
# On the 2-core AMD EPYC this was written on (one thread, as the whole lesson), the reference took 2.7 ms per
# layer and the kernel 1.3 ms (11.6 GB/s of K and V, against 19.7 GB/s read + written by a large copy). With
# the engine's two threads a decode step at batch 32 with 200 tokens of context went from about 141 ms to
# 110 ms, and the equality with Hugging Face held token for token (`tests/test_cpu_attention.py`; numbers in docs/benchmarks.md).
# The lesson of the first try: a kernel that reads the right bytes in the wrong order can be no faster than
# the copy it was meant to remove.
#
# A third pass (2026-11-27, on a CPU with AVX-512) took the kernel's AVX-512 path from 0.60 to 0.34 ms a layer
# (bf16, batch 32, contexts of 64-512 tokens, a scattered pool) and from 0.24 to 0.16 ms inside the engine,
# with three changes that each look small:
#
# - **No horizontal sum per score.** A score is the sum of 64 products; in 16-lane registers that is four
#   multiply-adds and then a horizontal sum of the register's 16 lanes, about 8 dependent instructions, for
#   every score. The kernel now keeps 16 tokens' registers of partial products and adds them *across* in one
#   transpose-and-add (`transpose_sum16`: pairs of registers interleaved and added, four times), which leaves
#   one register holding the 16 scores: about 3 instructions a score.
# - **Ask for the next blocks into L2, not L1.** `__builtin_prefetch(p, 0, 3)` (prefetcht0, into L1) holds one
#   of L1's few miss buffers per line until the line arrives; two blocks ahead is dozens of lines, so the
#   prefetches themselves made the loads wait. Into L2 (prefetcht1) the same requests cost 1.5x less time.
# - **2 MB pages.** A step reads the whole context, blocks scattered over a pool of hundreds of MB: in 4 KB
#   pages every block is a new page, and the CPU's TLB holds a few thousand of them, so reads wait on
#   page-table walks. `minivllm/platforms/cpu/huge_pages.py` asks Linux for 2 MB pages under the KV cache and the weights
#   (`madvise(MADV_HUGEPAGE)`, then `MADV_COLLAPSE` for memory already written): 4-9% off each of a decode
#   step's matmuls and attention, 6-10% off a whole decode step.
#
# The cell moves the cache above onto 2 MB pages (`gather_on_huge_pages`, where Linux allows it) and times the
# kernel on both copies.

# %%
# NBVAL_IGNORE_OUTPUT
if have_cpp:
    key_huge, value_huge = cpu_runtime.gather_on_huge_pages([key_cache, value_cache])
    on_huge = cpu_runtime.huge_page_bytes(key_huge)
    assert torch.equal(kernels.cpu_ops.paged_decode_attention(query, key_huge, value_huge, tables, seq_lens, scale),
                       cpp_out)
    times = {}
    for _ in range(3):                                          # alternating: the machine's speed drifts
        for name, (k_c, v_c) in {"4 KB pages": (key_cache, value_cache), "2 MB pages": (key_huge, value_huge)}.items():
            ms = per_op_ms(lambda: kernels.cpu_ops.paged_decode_attention(query, k_c, v_c, tables, seq_lens, scale),
                           n=30)
            times[name] = min(times.get(name, ms), ms)
    print(f"MB of the moved caches (K and V, one buffer) on 2 MB pages: {on_huge >> 20} "
          f"(huge pages available here: {cpu_runtime.huge_pages_available()})")
    for name, ms in times.items():
        print(f"C++ kernel, cache on {name}: {ms:6.2f} ms per layer")

# %% [markdown]
# Here (2026-11-27, one thread, fp32, two runs) the cell printed 0.61 -> 0.56 and 0.75 -> 0.73 ms: a few
# percent. One thread asks for less memory at a time than the engine's two, and the 100 MB cache here is
# smaller than the engine's 1 GB pool with the weights beside it; in the engine the pages took 6-10% off a
# whole decode step (docs/benchmarks.md). The second bullet above also revises the finding before it: faster
# dot products "gained nothing against memory" while the prefetches into L1 made the loads wait; once they
# stopped, the arithmetic showed again (the kernel with its caches inside L3: 0.145 -> 0.098 ms a layer).

# %% [markdown]
# The same file holds `prefill_attention`, for a prompt with no cached context: its queries attend causally to
# the step's own K and V, so there is nothing to read from the cache. There the work is arithmetic (a
# prompt's K and V fit in L2): two small matrix products per (sequence, head), scores = Q K^T and out = P V.
# The first version computed one query row at a time, a dot product and a horizontal sum per score, at about
# 40 GFLOP/s, no faster than PyTorch's SDPA called per prompt. The second treats both products the way a
# matmul kernel does, as register tiles where every multiply-add is a whole register of useful work:
#
#     scores:  12 query rows x 16 keys = 12 accumulators; per d: one load of K^T[d][16 keys],
#              12 multiply-adds by a broadcast q[row][d]                    (K^T written once per work item)
#     values:  6 query rows x 64 dims = 24 accumulators; per key j: four loads of V[j][64 dims],
#              24 multiply-adds by a broadcast p[row][j]
#
# with the exact softmax (max, exp, sum, in fp32) between them, row by row. In bf16 on a CPU with AVX-512 BF16
# the scores come straight from the bf16 pairs with `vdpbf16ps` (exact products, fp32 sums). One layer of the
# default model, 32 prompts of 128 tokens, bf16, two threads: about 5 ms, against 10 ms for per-prompt SDPA
# (2026-11-27); the bf16 prefill step of those prompts went from 2.8-3.0 s to 2.5-2.7 s. The cell below
# times one layer's attention for 8 prompts both ways (one thread, as the whole lesson) and checks them equal.

# %%
# NBVAL_IGNORE_OUTPUT
if have_cpp:
    lens = [128] * 8
    qkv = torch.randn(sum(lens), cfg.num_attention_heads + 2 * cfg.num_key_value_heads, cfg.head_dim)
    q_p, k_p, v_p = qkv.split([cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_key_value_heads], dim=1)
    q_p = q_p.contiguous()
    starts = [sum(lens[:i]) for i in range(len(lens))]

    def sdpa_per_prompt():
        out = torch.empty_like(q_p)
        for start, n in zip(starts, lens):
            qi, ki, vi = (t[start:start + n].transpose(0, 1)[None] for t in (q_p, k_p, v_p))
            out[start:start + n] = F.scaled_dot_product_attention(
                qi, ki, vi, is_causal=True, scale=cfg.head_dim ** -0.5, enable_gqa=True)[0].transpose(0, 1)
        return out

    tiles = kernels.cpu_ops.prefill_attention(q_p, k_p, v_p, starts, lens, cfg.head_dim ** -0.5)
    torch.testing.assert_close(tiles, sdpa_per_prompt(), atol=2e-5, rtol=2e-5)
    print(f"8 prompts x 128 tokens, one layer: SDPA per prompt {per_op_ms(sdpa_per_prompt, n=10):.2f} ms, "
          f"register tiles {per_op_ms(lambda: kernels.cpu_ops.prefill_attention(q_p, k_p, v_p, starts, lens, cfg.head_dim ** -0.5), n=10):.2f} ms")

# %% [markdown]
# Those matmuls had one more cost that is about memory, not arithmetic. A 4,096-token prefill's MLP writes a
# gate/up activation of 4,096 x 3,072 fp32 values, 50 MB, larger than this CPU's 32 MB L3, and the activation
# and the down projection then read it back from memory. `LlamaMLP` now runs a long prefill in row slices of
# at most 12 MiB of activation (`cpu_slice_rows` in `platforms/cpu/gemm.py`: 1,024 rows here), the same rows through
# the same weights, so the same numbers (`tests/test_cpu_mlp_slices.py` checks them equal, and the tokens
# against Hugging Face). One MLP alone, 4,096 rows: 185 ms whole, 141-153 ms in 1,024-row slices. A prefill
# step of 32 x 128 tokens: 7.3 s -> 6.8-7.1 s (four alternating rounds each way). A GPU gets the whole batch:
# its kernels want as many rows as they can get, and its caches are not what bounds them. Later the activation
# moved into the gate/up matmul itself (section 3): with no (rows, 2 x intermediate) tensor left to keep in the
# cache, the slices only cost, and the MLP runs whole where SiLU is fused (1-5% faster than slices, 2026-11-27).
#
# The cell runs layer 0's MLP of the lesson's model on 4,096 rows three ways (one thread, as the whole lesson):
# SiLU as a separate pass, whole and in slices (a copy of the MLP packed plainly, `MINIVLLM_CPU_FUSED_SILU=0`),
# and the model's own MLP, SiLU in its matmul where this CPU has the kernel.

# %%
# NBVAL_IGNORE_OUTPUT
from minivllm.model import layers, llama

model_mlp = runner.model.layers[0].mlp
mlp = llama.LlamaMLP(cfg, layers.TPGroup())                  # the same weights, SiLU as a separate pass
mlp.gate_up_proj.weight.data = model_mlp.gate_up_proj.weight.data.clone()
mlp.down_proj.weight.data = model_mlp.down_proj.weight.data.clone()
os.environ["MINIVLLM_CPU_FUSED_SILU"] = "0"
cpu_gemm.prepack_linear_weights(mlp)
cpu_gemm.bind_mlp_forwards(mlp)
del os.environ["MINIVLLM_CPU_FUSED_SILU"]
rows = cpu_gemm.cpu_slice_rows(torch.empty(0), sum(mlp.gate_up_proj.out_sizes))
x = torch.randn(4096, cfg.hidden_size) * 0.5
with torch.no_grad():
    whole, sliced, fused = llama.LlamaMLP.forward(mlp, x), mlp(x), model_mlp(x)
    assert torch.equal(whole, sliced) or torch.allclose(whole, sliced, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused, whole, rtol=1e-5, atol=1e-5)
    t_whole, t_sliced = per_op_ms(lambda: llama.LlamaMLP.forward(mlp, x), n=5), per_op_ms(lambda: mlp(x), n=5)
    t_fused = per_op_ms(lambda: model_mlp(x), n=5)
print(f"4,096 rows, gate/up activation {4096 * sum(mlp.gate_up_proj.out_sizes) * ITEMSIZE / 1e6:.0f} MB: "
      f"whole {t_whole:.0f} ms, in slices of {rows} rows {t_sliced:.0f} ms; "
      f"the model's MLP (SiLU in the matmul: {model_mlp.gate_up_proj.packed_silu_and_mul}) {t_fused:.0f} ms")

# %% [markdown]
# One more cost hid in the small kernels, and only in bf16. Every kernel in `kernels/cpu_layers.cpp` loads its
# inputs into fp32, computes, and rounds the result back to the model's dtype, and it did the rounding with
# c10's own `static_cast<c10::BFloat16>(float)`. That conversion tests for NaN with a branch, and GCC leaves
# a loop that contains one unvectorised: on a CPU with AVX-512 BF16 (2026-11-27), SiLU-and-mul on 32 rows ran
# 9x slower in bf16 than in fp32 (159 against 18 us), and at a 4,096-row prefill the bf16 SiLU-and-mul and the
# two RMSNorms took about 0.9 s of a 3.5 s step. bf16 is the top half of an fp32, so rounding to it is integer
# arithmetic: add `0x7fff` plus the lowest kept bit (ties go to even), shift right by 16, and pick the quiet NaN
# with a select instead of a branch (`kernels/cpu_dtype.h`). The compiler vectorises that, and the result is
# the same bits, which `tests/test_cpu_layers.py` checks on every one of the 65,536 bf16 values. The bf16
# kernels now cost about what the fp32 ones do, and the bf16 bench against vLLM's CPU backend went from 0.78x
# to 0.93x with this change alone (docs/benchmarks.md, history, 2026-11-27).
#
# The cell times SiLU-and-mul in both dtypes on a decode batch's rows (one thread): compare the two lines.

# %%
# NBVAL_IGNORE_OUTPUT
if have_cpp:
    for dtype in (torch.float32, torch.bfloat16):
        act16 = (torch.randn(NUM_REQUESTS, sum(mlp.gate_up_proj.out_sizes)) * 4).to(dtype)
        ms = per_op_ms(lambda: kernels.cpu_ops.silu_and_mul(act16), n=200)
        torch.testing.assert_close(kernels.cpu_ops.silu_and_mul(act16), layers.SiluAndMul.forward_native(act16))
        print(f"SiLU-and-mul, {NUM_REQUESTS} rows, {str(dtype):15s} {ms * 1e3:6.1f} us")

# %% [markdown]
# ## 6. Async scheduling: the host's work behind the GPU's
#
# CUDA graphs took the kernel launches out of a decode step. What is left on the host is Python per request:
# plan the batch, build its inputs, apply the sampled tokens to the core, detokenize. On this CPU, with a tiny
# model, a decode step of 256 requests spends about 2.7 ms planning, 1.5 ms on inputs, 2.2 ms updating the core
# and 1.8 ms on text. On an H100 a graph-replayed step at batch 64 takes 7.35 ms of GPU time: in a synchronous
# engine the GPU waits through every one of those host milliseconds, step after step.
#
# vLLM's answer is async scheduling (`--async-scheduling`, `LLM(async_scheduling=True)`): while batch N runs on
# the device, the host already plans and issues batch N + 1, and only then waits for N's tokens:
#
#     host:    [issue N] [plan N+1, issue N+1] [N's tokens -> host, update, text] [plan N+2, issue N+2] ...
#     device:  [forward N, sample N]           [forward N+1, sample N+1]          [forward N+2 ...]
#
# The catch: a request decoding in batch N needs, as batch N + 1's input, the very token N is sampling. So N is
# sampled on the device as it is issued, and N + 1's input for that request is read from N's sampled tokens on
# the device (`ModelInput.prev_token_rows`; the host writes a 0 there). The scheduler plans such a request
# without knowing its token: it starts after the tokens in flight, and counts the one being sampled as one more
# token to compute (vLLM calls it a placeholder). That plan is `plan_ahead` in `minivllm/core/async_scheduler.py`,
# and it is your exercise.
#
# Not every request may run ahead. One whose sampling reads its own output tokens (penalties, `bad_words`,
# `min_tokens`) or has a grammar would be sampled before the host knows its last token, so it waits for its
# batch; so does one that N's token would end by `max_tokens`. A request in flight is never preempted. A request
# that N's token stops (EOS, a stop string) has one wasted row in N + 1, dropped when it comes back.
#
# Left unset, vLLM turns it on wherever nothing in the configuration prevents it, and so does minivllm on CUDA
# with one rank and no speculative decoding (`EngineConfig.async_scheduling_on`). On a CPU minivllm leaves it
# off: the forward runs in the host's own thread, so there is nothing to hide it behind (0.95x measured). On an
# H100 it took nano-vllm's workload (256 requests, Qwen3-0.6B's shape) from 6,379 to 10,566 output tokens/s,
# the decode step at batch 63 from 13.3 to 6.4 ms (docs/benchmarks.md). The cells below turn it on by hand.

# %% [markdown]
# ### Exercise: plan a request whose batch is in flight
#
# Write `plan_ahead(num_tokens, num_computed_tokens, num_in_flight)`: the request has `num_tokens` tokens
# (prompt and outputs the host knows), KV for `num_computed_tokens` of them, and `num_in_flight` tokens in a
# batch still on the device (0 when none). Return `(start, num_left)`: the position batch N + 1 starts at, and
# how many tokens the request has left to compute from there. If the batch in flight computes the whole
# sequence, it also samples the next token, and that token must be computed too.
#
# The check runs hand-made cases, 200 random ones against minivllm's own `plan_ahead`, then an async engine
# whose scheduler plans with your function: its greedy tokens must be the synchronous engine's.

# %%
@exercise("11.plan_ahead")
def plan_ahead(num_tokens, num_computed_tokens, num_in_flight):
    # your code here
    raise NotImplementedError


check(plan_ahead)

# %% [markdown]
# Now the real thing on this CPU: the same requests through a synchronous and an async engine, counting the
# decodes that read a token still "on the device", and how many batches were in flight at once. On a CPU the
# forward runs in the host's own thread, so nothing overlaps and the time is the same: the point here is that the
# tokens are too.

# %%
# NBVAL_IGNORE_OUTPUT
prompts = ["The capital of France is", "A list of prime numbers: 2, 3, 5, 7,", "Hello, my name is"]
params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
async_tokens, async_counts = {}, {}
for async_scheduling in (False, True):
    with LLM(num_kv_blocks=64, async_scheduling=async_scheduling) as demo:
        demo_engine = demo.llm_engine
        counts = {"placeholders": 0, "most batches in flight": 0}
        schedule, issue = demo_engine.scheduler.schedule, demo_engine.executor.issue

        def spy_schedule():
            out = schedule()
            counts["placeholders"] += len(out.num_output_placeholders)
            return out

        def spy_issue(*args, **kwargs):          # the batch issued, and those still in flight
            counts["most batches in flight"] = max(counts["most batches in flight"], len(demo_engine.batch_queue) + 1)
            return issue(*args, **kwargs)
        demo_engine.scheduler.schedule, demo_engine.executor.issue = spy_schedule, spy_issue
        t0 = time.perf_counter()
        async_tokens[async_scheduling] = [o.outputs[0].token_ids for o in demo.generate(prompts, params,
                                                                                      use_tqdm=False)]
        counts["seconds"] = round(time.perf_counter() - t0, 2)
        async_counts[async_scheduling] = counts
    print(f"async_scheduling={async_scheduling}: {counts}")
print("same tokens:", async_tokens[True] == async_tokens[False])

# %% [markdown]
# How it plugs in. The base `Scheduler.schedule()` (lesson 03) never mentions batches in flight: it calls a few
# small methods, and `AsyncScheduler` (`minivllm/core/async_scheduler.py`) overrides exactly those. It leaves out
# of the batch a request whose batch in flight must come back first (`_runnable`), counts the tokens that batch
# computes and the placeholder (`_num_tokens_left`, with your `plan_ahead`), makes room after them (`_allocate`),
# never preempts a request in flight under async scheduling (`_choose_victim`; with pipeline batches it may, as
# vLLM: the victim is recomputed and gets its batch's token when that batch is back), and records where each
# request runs ahead
# (`_update_after_schedule`). The engine picks once, when it is built, the scheduler and the step: `execute_step`
# (schedule, run, apply: one batch) or `step_with_batch_queue` (issue the next batch, then apply the oldest).

# %%
from minivllm.core.async_scheduler import AsyncScheduler
from minivllm.core.scheduler import Scheduler

overrides = [n for n, v in vars(AsyncScheduler).items() if callable(v) and not n.startswith("__") and n in vars(Scheduler)]
print("AsyncScheduler overrides:", ", ".join(overrides))
for async_scheduling in (False, True):
    with LLM(num_kv_blocks=64, async_scheduling=async_scheduling) as demo:
        print(f"async_scheduling={async_scheduling}: {type(demo.llm_engine.scheduler).__name__}, "
              f"step_fn = {demo.llm_engine.step_fn.__name__}")

# %% [markdown]
# > **How vLLM v1 does it differently.** vLLM's `AsyncScheduler` moves `num_computed_tokens` forward when it
# > schedules (minivllm moves it when the tokens come back, so that a failed step can roll back) and keeps
# > `num_output_placeholders` on the request; its GPU model runner keeps the last step's sampled token ids on the
# > device and scatters them into the next input ids. Its detokenization also runs in another process, the
# > front end, beside the engine core. Newer versions let speculative decoding and structured output run ahead
# > too; minivllm keeps those requests waiting.

# %% [markdown]
# ## Check yourself

# %%
def self_check():
    # 1. the CUDA graphs' static path: same tokens, and it ran (with padding)
    assert graph_tokens == eager_tokens and graphs.stats.replays > 0 and graphs.stats.padded_rows > 0
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    # 2. the floor: a decode step reads at least every weight
    assert decode_memory_floor_ms(cfg, ITEMSIZE, 1, 300, bandwidth) >= 1e3 * weights / bandwidth
    # 3. the packed matmul is F.linear to fp32 rounding, and every method was timed at 1 and 32 rows
    assert all(results[(name, rows)] > 0 for name in dict.fromkeys(k[0] for k in results) for rows in (1, 32))
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    # 3b. W8A8: your rounding is minivllm's, per row
    q, s = quantize_activations(torch.tensor([[127.0, 2.5, -3.5], [1.0, 0.0, 0.5]]))
    assert q.tolist() == [[127, 2, -4], [127, 0, 64]] and s.shape == (2,)
    # 4. both SiLU loops were timed, and the runtime report names a malloc and an OpenMP
    assert fresh_ms > 0 and reused_ms > 0 and set(cpu_runtime.loaded_runtime()) == {"malloc", "openmp"}
    # 5. the C++ decode kernel (where it builds) equals the reference, and both were timed
    assert not have_cpp or torch.allclose(cpp_out, reference_decode(), atol=2e-6, rtol=2e-5)
    assert all(ms > 0 for ms in timings.values())
    # 6. async scheduling: the same tokens, and decodes really ran ahead of their batch
    assert async_tokens[True] == async_tokens[False]
    assert async_counts[True]["placeholders"] > 0 and async_counts[True]["most batches in flight"] == 2
    assert async_counts[False]["placeholders"] == 0 and async_counts[False]["most batches in flight"] == 1
    return "all checks passed"


self_check()

# %% [markdown]
# ## Where next
#
# On a GPU, `python -m minivllm.bench` prints how many decode steps were replayed from CUDA graphs; run it again
# with `--enforce-eager` to see what they are worth, and with `--no-async-scheduling` to see what hiding the
# host's work behind the GPU's is worth. On a CPU, `python -m minivllm.bench --dtype bfloat16` and
# `--quantization int8` or `--quantization w8a8_int8` show the last section's matmuls inside whole runs.
