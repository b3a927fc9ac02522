// Linear layers on a CPU with AVX-512, fp32 and bf16: y = x @ W^T (+ bias), from a weight packed once at load.
//
//   pack_linear(weight)                weight (out, in) fp32, or bf16 with an even `in` -> packed (panels,
//                                      words, 48) of 32-bit words: fp32 (words = in), or int32 holding bf16
//                                      pairs (words = in / 2)
//   packed_linear(x, packed, out, bias)  x (rows, in) in the weight's dtype -> y (rows, out), same dtype;
//                                      bias (out,) in that dtype, or None
//   pack_int8_linear(q), int8_linear(x, packed, scale, out, bias)   weight-only int8 (bf16 x; see below)
//   pack_int4_linear(q, d, m) -> (packed, dm), int4_linear(x, packed, dm, out, bias)    int4, groups of 32
//   pack_w8a8_linear(q) -> (packed, offset), w8a8_linear(x, packed, offset, scale, out, bias)    int8 weights
//                                      and int8 activations, integer dot products (vpdpbusd; see below)
//   pack_w4a8_linear(q, d, m) -> (packed, dm), w4a8_linear(x, packed, dm, out, bias)    int4 weights (groups
//                                      of 32 with a minimum) and int8 activations in groups of 32 (see below)
//   silu_and_mul=True (all three)      a gated MLP's gate/up weight packed from interleave_gate_up (cpu_ops.py):
//                                      y = silu(x gate^T) * (x up^T), (rows, out_features = n), in the epilogue
//   fp32_linear_available()            whether this build has the fp32 kernel (the CPU has AVX-512F)
//   bf16_linear_available()            whether it has the bf16, int8 and int4 ones (AVX-512 BF16)
//   vnni_linear_available()            whether it has the w8a8 and w4a8 ones (AVX-512 VNNI and BF16)
//
// Why: a decode step multiplies a few rows (the batch) by every weight of the model, and those weights stream
// from memory every step (the default model's 538 MB in fp32, 269 MB in bf16, against this CPU's 32 MB of L3).
// oneDNN's packed matmul (model/cpu_gemm.py) runs that at 32 rows here at about 70% of the two cores' fp32
// peak (one 16-lane FMA a cycle a core, about 230 GFLOP/s) and 60% of their bf16 peak (one vdpbf16ps a cycle,
// 64 flops, about 455 GFLOP/s). This kernel is the plain outer-product form, with the weight read in the
// order it is stored. A "word" is 32 bits: one fp32 weight, or a bf16 pair (W[n][2 k2], W[n][2 k2 + 1]),
// which vdpbf16ps multiplies by a pair of x and adds into one fp32 lane.
//
//   packed[p][k][c] = word k of weight row 48 p + c: panel p holds 48 output columns, and one word row of it
//                     is three registers of 16 columns;
//   a tile is kRowTile rows of x by one panel: 8 x 3 accumulators (fp32); for each word k, three loads of the
//   panel row, and for each x row one broadcast of its word k and three FMAs (fp32) or vdpbf16ps (bf16).
//
// So 24 multiply-adds of 16 lanes per 3 loads and 8 broadcasts, the panel streams from memory front to back
// (asked for ahead with prefetches) and stays in L2 for the other row tiles. Those later tiles compute from
// cache, so each also asks for a third of the thread's next panel into L2 (Panel::next), and that panel's first
// tile does not wait on memory. In bf16 a product of two bf16 values is exact in fp32, so the sums are fp32 sums of
// exact products, as oneDNN's are; only their order differs. The bias is added in fp32, and a bf16 result is
// rounded once, to nearest even (vcvtneps2bf16).
//
// Why it exists: at decode batch sizes oneDNN's packed GEMM leaves memory bandwidth unused on these cores; this
// kernel streams each weight panel once per step. Its times against oneDNN, per format and row count, are in
// docs/benchmarks.md; tests/test_cpu_gemm.py checks it against torch's matmul.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanelCols = 48;            // output columns per panel: three registers of 16
constexpr int64_t kGateCols = kPanelCols / 2; // silu_and_mul: gate/up pairs per panel (interleave_gate_up)
constexpr int64_t kRowTile = 8;               // x rows per tile: 8 x 3 accumulators
constexpr int64_t kInt4RowTile = 4;           // int4: 4 x 3 accumulators and 4 x 3 group partial sums
constexpr int64_t kRowChunk = 512;            // rows of x per pass over the weight (a chunk of x stays in L2)
constexpr int64_t kPrefetchAhead = 16;        // panel rows asked for ahead of their use
constexpr int64_t kInt4Group = 32;            // int4: weights per (d, m) along `in` (quantization.GROUP_SIZE)
constexpr int64_t kInt4PairsPerGroup = kInt4Group / 2;

bool fp32_linear_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

bool bf16_linear_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

bool vnni_linear_available() {
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// Weight elements per 32-bit word: 1 in fp32, 2 (a pair along `in`) in bf16.
int64_t per_word(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 2 : 1; }

// dst[p][k][c] = src[48 p + c][k] for rows of `words` elements of `Elem` (zero columns pad the last panel).
template <typename Elem>
void to_panels(const Elem* src, int64_t out, int64_t words, Elem* dst) {
  for (int64_t n = 0; n < out; ++n)
    for (int64_t k = 0; k < words; ++k)
      dst[((n / kPanelCols) * words + k) * kPanelCols + n % kPanelCols] = src[n * words + k];
}

int64_t num_panels(int64_t out) { return (out + kPanelCols - 1) / kPanelCols; }

at::Tensor pack_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat ||
                                    (weight.scalar_type() == at::kBFloat16 && weight.size(1) % 2 == 0)),
              "pack_linear: an fp32 (out, in) weight, or a bf16 one with an even `in`, expected, got ",
              weight.sizes(), " ", weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  const int64_t out = w.size(0), words = w.size(1) / per_word(w.scalar_type());
  const at::ScalarType word_type = w.scalar_type() == at::kBFloat16 ? at::kInt : at::kFloat;
  at::Tensor packed = at::zeros({num_panels(out), words, kPanelCols}, w.options().dtype(word_type));
  to_panels(static_cast<const uint32_t*>(w.data_ptr()), out, words, static_cast<uint32_t*>(packed.data_ptr()));
  return packed;
}

// Weight-only int8 and int4 (model/quantization.py), with bf16 x. The first row tile of a panel widens each
// quantized pair to a bf16 pair in registers as it reads it (panel_row), and, when more row tiles follow, keeps
// the widened panel in a buffer of the thread's own (in L2) for them, so only the quantized bytes come from
// memory: half of bf16's (int8), a quarter plus the groups' d and m (int4).
//   int8: w[n][k] = scale[n] q[n][k], q in [-128, 127]. An int8 value is exact in bf16, so the products q x are
//         exact; the per-column scale multiplies the fp32 sums at the end.
//   int4: w[n][k] = d[n][g] q[n][k] + m[n][g], q in [0, 15], g = k / 32. Also exact integers in bf16: a tile
//         sums x q over a group in fp32, then adds d times that and m times the group's sum of x (x_sum),
//         so sum_k x[k] w[n][k] = sum_g d[n][g] (sum_{k in g} x[k] q[n][k]) + m[n][g] x_sum[g].
// Either way the products are exact and only the order of fp32 sums differs from x @ w^T in float64.
at::Tensor pack_int8_linear(const at::Tensor& qweight) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.size(1) % 2 == 0,
              "pack_int8_linear: an int8 (out, in) weight with an even `in` expected, got ", qweight.sizes(), " ",
              qweight.scalar_type());
  const at::Tensor q = qweight.contiguous();
  const int64_t out = q.size(0), pairs = q.size(1) / 2;
  at::Tensor packed = at::zeros({num_panels(out), pairs, kPanelCols}, q.options().dtype(at::kShort));  // pairs
  to_panels(static_cast<const uint16_t*>(q.data_ptr()), out, pairs, static_cast<uint16_t*>(packed.data_ptr()));
  return packed;
}

// The int4 packers' checks: q (out, in) uint8 of values 0..15, `in` a multiple of 32; d, m (out, in / 32) fp32.
void check_int4_groups(const char* op, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.size(1) % kInt4Group == 0,
              op, ": a uint8 (out, in) weight of values 0..15 with `in` a multiple of ", kInt4Group,
              " expected, got ", q.sizes(), " ", q.scalar_type());
  TORCH_CHECK(q.numel() == 0 || q.max().item<uint8_t>() <= 15, op, ": values must be 0..15");
  const int64_t out = q.size(0), groups = q.size(1) / kInt4Group;
  for (const at::Tensor* t : {&d, &m})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == out && t->size(1) == groups,
                op, ": d and m must be fp32 (", out, ", ", groups, "), got ", t->sizes());
}

// d, m (out, groups) -> (panels, groups, 2, 48) fp32: each group's d then m for the panel's columns (zero past `out`).
at::Tensor dm_panels(const at::Tensor& d, const at::Tensor& m) {
  const int64_t out = d.size(0), groups = d.size(1);
  const at::Tensor both = at::stack({d, m}, 2).contiguous();          // (out, groups, 2): (groups * 2) a column
  at::Tensor dm = at::zeros({num_panels(out), groups, 2, kPanelCols}, d.options());
  to_panels(both.data_ptr<float>(), out, groups * 2, dm.data_ptr<float>());
  return dm;
}

// q (out, in) uint8 values 0..15, `in` a multiple of 32; d, m (out, in / 32) fp32 ->
//   packed (panels, in / 2, 48) uint8: q[n][2 k2] in the low nibble, q[n][2 k2 + 1] in the high one;
//   dm (panels, in / 32, 2, 48) fp32: each group's d then m for the panel's columns (zero past `out`).
std::tuple<at::Tensor, at::Tensor> pack_int4_linear(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m) {
  check_int4_groups("pack_int4_linear", q, d, m);
  const int64_t out = q.size(0), pairs = q.size(1) / 2;
  const at::Tensor qc = q.contiguous();
  const at::Tensor q2 = qc.view({out, pairs, 2});
  const at::Tensor nibbles = at::bitwise_or(q2.select(2, 0), at::bitwise_left_shift(q2.select(2, 1), 4)).contiguous();
  at::Tensor packed = at::zeros({num_panels(out), pairs, kPanelCols}, qc.options());
  to_panels(nibbles.data_ptr<uint8_t>(), out, pairs, packed.data_ptr<uint8_t>());
  return {packed, dm_panels(d, m)};
}

// W8A8 (model/quantization.py, quantization="w8a8_int8"): int8 weights per output channel and int8 activations
// per row (token), quantized as they arrive, multiplied as integers. vpdpbusd multiplies 4 unsigned bytes by 4
// signed bytes and adds the four products into a 32-bit lane: 64 multiply-adds an instruction, twice
// vdpbf16ps's 32, and these cores run one of either a cycle (measured on two cores: 920 G integer operations a
// second against 459 G bf16 flops), so a matmul bound by arithmetic (a decode step at batch 32) can run twice as
// fast.
//   w[n][k] = scale[n] q[n][k]            q in [-128, 127] (a word: 4 consecutive k of one column)
//   x[r][k] = s[r] (u[r][k] - 128)        u in [1, 255]: the activation's int8 value plus 128, as vpdpbusd's
//                                         unsigned operand
//   y[r][n] = s[r] scale[n] (sum_k u[r][k] q[n][k] - 128 sum_k q[n][k])
// The sums are exact in int32 (|sum| < 2^31 up to in = 65,536); offset[n] = -128 sum_k q[n][k] is packed with
// the weight. Only the quantization of x and the final fp32 scaling round.
// q (out, in) int8, `in` a multiple of 4 -> packed (panels, in / 4, 48) int32 of 4 int8 each, offset (panels, 48)
std::tuple<at::Tensor, at::Tensor> pack_w8a8_linear(const at::Tensor& qweight) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.size(1) % 4 == 0,
              "pack_w8a8_linear: an int8 (out, in) weight with `in` a multiple of 4 expected, got ", qweight.sizes(),
              " ", qweight.scalar_type());
  const at::Tensor q = qweight.contiguous();
  const int64_t out = q.size(0), words = q.size(1) / 4;
  at::Tensor packed = at::zeros({num_panels(out), words, kPanelCols}, q.options().dtype(at::kInt));
  to_panels(static_cast<const uint32_t*>(q.data_ptr()), out, words, static_cast<uint32_t*>(packed.data_ptr()));
  at::Tensor offset = at::zeros({num_panels(out) * kPanelCols}, q.options().dtype(at::kInt));
  offset.narrow(0, 0, out).copy_(q.to(at::kInt).sum(1).mul(-128));
  return {packed, offset.view({num_panels(out), kPanelCols})};
}

// W4A8 (quantization="w4a8_int8"): int4's weights (w = d q + m per group of 32 along `in`, q in 0..15) times x
// rounded to int8 in groups of 32 too, each with its own scale (llama.cpp's Q4_1 times Q8_1):
//   x[r][k] = s[r][g] qx[r][k]        qx in [-127, 127], s[r][g] = max over the group |x| / 127
//   y[r][n] = sum_g s[r][g] (d[n][g] sum_{k in g} q[n][k] qx[r][k] + m[n][g] sum_{k in g} qx[r][k])
// q is unsigned and qx signed, exactly vpdpbusd's operands, so the group's dot product is exact in int32 with no
// offset; each group then costs a conversion, a product d s and two FMAs per 16 lanes, against 8 vpdpbusd.
// q (out, in) uint8 0..15, `in` a multiple of 32; d, m (out, in / 32) fp32 ->
//   packed (panels, in / 8, 192) uint8: chunk j holds word rows 2j (low nibbles) and 2j + 1 (high nibbles), a
//          word row being 48 columns x 4 consecutive k (192 bytes, vpdpbusd's layout), so that one AND and one
//          shift make two registers of unsigned bytes;
//   dm (panels, in / 32, 2, 48) fp32: each group's d then m for the panel's columns (as pack_int4_linear's).
std::tuple<at::Tensor, at::Tensor> pack_w4a8_linear(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m) {
  check_int4_groups("pack_w4a8_linear", q, d, m);
  const int64_t out = q.size(0), words = q.size(1) / 4;
  // word rows as pack_w8a8_linear lays them out: (panels, words, 48) words of 4 bytes
  at::Tensor rows = at::zeros({num_panels(out), words, kPanelCols * 4}, q.options());
  const at::Tensor qc = q.contiguous();
  to_panels(static_cast<const uint32_t*>(qc.data_ptr()), out, words, static_cast<uint32_t*>(rows.data_ptr()));
  const at::Tensor pairs = rows.view({num_panels(out), words / 2, 2, kPanelCols * 4});
  at::Tensor packed = at::bitwise_or(pairs.select(2, 0), at::bitwise_left_shift(pairs.select(2, 1), 4)).contiguous();
  return {packed, dm_panels(d, m)};
}

#if defined(__AVX512F__)
// Where a panel's word rows come from: pack_linear's words as they are, or quantized pairs widened to bf16
// pairs as they are read (int8: pack_int8_linear's; int4: pack_int4_linear's nibble pairs).
enum class Source { kWords, kInt8, kInt4 };

// One panel as a tile sees it.
struct Panel {
  const void* rows;        // the panel's rows: words, int8 pairs or nibble pairs
  uint32_t* widened;       // quantized sources: where to keep the widened rows for later tiles, or null
  const float* scale;      // int8: the columns' scales, or null
  const float* dm;         // int4: (groups, 2, 48) d and m of the columns
  const int32_t* offset;   // w8a8: the columns' -128 sum_k q, or null
  int64_t cols;            // output columns: those that exist (fewer than 48 in the last panel), or, with
                           // silu_and_mul, the gate/up pairs (24, fewer in the last panel)
  bool silu_and_mul;       // a gate/up panel: the output is silu(gate) * up (store_rows)
  const char* next = nullptr;   // bytes of the thread's next panel to ask for into L2, 64 a word row, or null
};

// Word row k of a panel, as three registers of 16 columns' words. kWords: three loads. kInt8: 96 bytes, each
// int8 pair widened to a bf16 pair (exact: |q| <= 128). kInt4: 48 bytes; each byte (a nibble pair) becomes the
// 32-bit lane lo | hi << 16, and a 16-bit table lookup (vpermw) turns each nibble into bf16 0.0..15.0 (exact).
// Widened rows are also stored to `widened` (pack_linear's bf16 layout) unless it is null.
template <Source S>
inline void panel_row(const void* rows, int64_t k, uint32_t* widened, __m512i w[3]) {
  if constexpr (S == Source::kWords) {
    const uint32_t* row = static_cast<const uint32_t*>(rows) + k * kPanelCols;
    const char* ahead = reinterpret_cast<const char*>(row + kPrefetchAhead * kPanelCols);
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    _mm_prefetch(ahead + 128, _MM_HINT_T0);
    for (int c = 0; c < 3; ++c) w[c] = _mm512_loadu_si512(row + 16 * c);
    return;
  }
#if defined(__AVX512BF16__)
  if constexpr (S == Source::kInt8) {
    const int8_t* row = static_cast<const int8_t*>(rows) + k * 2 * kPanelCols;
    const char* ahead = reinterpret_cast<const char*>(row + kPrefetchAhead * 2 * kPanelCols);
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    for (int c = 0; c < 3; ++c) {                                  // 16 columns = 32 int8 -> 32 bf16
      const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * c));
      const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * c + 16));
      w[c] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)),
                                          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
    }
  } else {                                                         // kInt4
    const uint8_t* row = static_cast<const uint8_t*>(rows) + k * kPanelCols;
    _mm_prefetch(reinterpret_cast<const char*>(row + 2 * kPrefetchAhead * kPanelCols), _MM_HINT_T0);
    const __m512i bf16_of = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,   // bf16(15) .. bf16(0)
                                             0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
                                             0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
    const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
    for (int c = 0; c < 3; ++c) {                                  // 16 columns = 16 bytes -> 32 bf16
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c)));
      const __m512i lanes = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), nibbles, 0xA8);   // (b | b << 12) & mask
      w[c] = _mm512_permutexvar_epi16(lanes, bf16_of);
    }
  }
  if (widened != nullptr)
    for (int c = 0; c < 3; ++c) _mm512_storeu_si512(widened + k * kPanelCols + 16 * c, w[c]);
#endif
}

// The first n (1 ... 16) lanes of v rounded to T and stored (bf16: to nearest even, as the store below).
template <typename T>
inline void store_lanes(T* y, __m512 v, int64_t n) {
  const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
  if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(__AVX512BF16__)
    _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(v));
#endif
  } else {
    _mm512_mask_storeu_ps(y, mask, v);
  }
}

// acc[r][c] (+ bias), rounded to T, and the first `cols` columns stored to y (rows ldy apart). A gate/up panel
// (silu_and_mul) holds, by register, gate 0-15 | up 0-15 | gate 16-23 and up 16-23 of its 24 outputs
// (interleave_gate_up): it stores silu(gate) * up of the first `cols`, rounded as silu_and_mul rounds it.
template <int R, typename T>
inline void store_rows(__m512 (&acc)[R][3], const T* bias, T* y, int64_t ldy, int64_t cols, bool silu_and_mul) {
  __m512 b[3] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  if (bias != nullptr) {
    float fb[kPanelCols] = {};
    for (int64_t c = 0; c < cols; ++c) fb[c] = static_cast<float>(bias[c]);
    for (int c = 0; c < 3; ++c) b[c] = _mm512_loadu_ps(fb + 16 * c);
  }
  if (silu_and_mul) {
    for (int r = 0; r < R; ++r) {
      using minivllm_cpu::round16;
      using minivllm_cpu::silu_and_mul_reg;
      const __m512 tail = round16<T>(acc[r][2]);                        // gate 16-23 | up 16-23
      const __m512 out0 = silu_and_mul_reg<T>(round16<T>(acc[r][0]), round16<T>(acc[r][1]));
      const __m512 out1 = silu_and_mul_reg<T>(tail, _mm512_shuffle_f32x4(tail, tail, _MM_SHUFFLE(3, 2, 3, 2)));
      store_lanes(y + r * ldy, out0, std::min<int64_t>(cols, 16));
      if (cols > 16) store_lanes(y + r * ldy + 16, out1, cols - 16);
    }
    return;
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) T row[kPanelCols];
    for (int c = 0; c < 3; ++c) {
      if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(__AVX512BF16__)
        _mm256_store_si256(reinterpret_cast<__m256i*>(row + 16 * c), (__m256i)_mm512_cvtneps_pbh(acc[r][c] + b[c]));
#endif
      } else {
        _mm512_store_ps(row + 16 * c, acc[r][c] + b[c]);
      }
    }
    std::memcpy(y + r * ldy, row, cols * sizeof(T));
  }
}

// acc[r][c] += x word (r, k) . w[c]: an FMA of one fp32 value, or vdpbf16ps of one bf16 pair.
template <typename T>
inline __m512 multiply_add(__m512 acc, __m512i xr, __m512i w) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(__AVX512BF16__)
    return _mm512_dpbf16_ps(acc, (__m512bh)xr, (__m512bh)w);
#else
    return acc;
#endif
  } else {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(xr), _mm512_castsi512_ps(w), acc);
  }
}

// y[r][c] = sum over words k of x word (r, k) . panel word (k, c), for R rows of x (`words` apart) and one
// panel; then times scale[c] (int8), + bias, rounded to T (fp32 or bf16). S: where the panel's rows come from.
template <int R, typename T, Source S>
void tile(const uint32_t* x, int64_t words, const Panel& panel, const float* /*x_sum*/, const T* bias, T* y,
          int64_t ldy) {
  __m512 acc[R][3];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < words; ++k) {
    __m512i w[3];
    panel_row<S>(panel.rows, k, panel.widened, w);
    if (panel.next != nullptr) _mm_prefetch(panel.next + 64 * k, _MM_HINT_T1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i xr = _mm512_set1_epi32(static_cast<int>(x[r * words + k]));
      for (int c = 0; c < 3; ++c) acc[r][c] = multiply_add<T>(acc[r][c], xr, w[c]);
    }
  }
  if (panel.scale != nullptr) {
    float fs[kPanelCols] = {};
    std::memcpy(fs, panel.scale, (panel.silu_and_mul ? kPanelCols : panel.cols) * sizeof(float));   // gate/up: all 48
    for (int c = 0; c < 3; ++c) {
      const __m512 sc = _mm512_loadu_ps(fs + 16 * c);
      for (int r = 0; r < R; ++r) acc[r][c] = acc[r][c] * sc;
    }
  }
  store_rows<R, T>(acc, bias, y, ldy, panel.cols, panel.silu_and_mul);
}

// int4: for each group of 16 pairs, part[r][c] = sum of x pair (r, k2) . q pair (k2, c) (exact products, fp32
// sums), then acc += d[g][c] part + m[g][c] x_sum[r][g]. x_sum: (R, groups), rows `groups` apart.
template <int R, Source S>
void int4_tile(const uint32_t* x, int64_t pairs, const Panel& panel, const float* x_sum, const at::BFloat16* bias,
               at::BFloat16* y, int64_t ldy) {
  const int64_t groups = pairs / kInt4PairsPerGroup;
  __m512 acc[R][3];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[R][3];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 3; ++c) part[r][c] = _mm512_setzero_ps();
    for (int64_t k = g * kInt4PairsPerGroup; k < (g + 1) * kInt4PairsPerGroup; ++k) {
      __m512i w[3];
      panel_row<S>(panel.rows, k, panel.widened, w);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512i xr = _mm512_set1_epi32(static_cast<int>(x[r * pairs + k]));
        for (int c = 0; c < 3; ++c) part[r][c] = multiply_add<at::BFloat16>(part[r][c], xr, w[c]);
      }
    }
    const float* d = panel.dm + g * 2 * kPanelCols;
    for (int c = 0; c < 3; ++c) {
      const __m512 dc = _mm512_loadu_ps(d + 16 * c), mc = _mm512_loadu_ps(d + kPanelCols + 16 * c);
      for (int r = 0; r < R; ++r)
        acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(x_sum[r * groups + g]), mc,
                                    _mm512_fmadd_ps(part[r][c], dc, acc[r][c]));
    }
  }
  store_rows<R, at::BFloat16>(acc, bias, y, ldy, panel.cols, panel.silu_and_mul);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
// acc += vpdpbusd(u, q), per 32-bit lane: the 4 unsigned bytes of u times the 4 signed bytes of q, summed.
// The int32 accumulators live in __m512 (fp32-typed) registers: with __m512i ones GCC 12 kept a tile's 24 on the
// stack (a load and a store around every vpdpbusd: 43% of the cores' VNNI rate at 512 rows).
inline __m512 dot_add_u8s8(__m512 acc, __m512i u, __m512i q) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(q));
  return acc;
}

// w8a8: acc[r][c] = sum over words k of vpdpbusd(x word (r, k): 4 bytes u, panel word (k, c): 4 int8 q), in
// int32 (exact); then y = s[r] scale[c] (acc + offset[c]) (+ bias), rounded to T. x_scale: s of the R rows.
template <int R, typename T>
void w8a8_tile(const uint32_t* x, int64_t words, const Panel& panel, const float* x_scale, const T* bias, T* y,
               int64_t ldy) {
  __m512 acc[R][3];                                                 // int32 lanes
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < words; ++k) {
    __m512i w[3];
    panel_row<Source::kWords>(panel.rows, k, nullptr, w);
    if (panel.next != nullptr) _mm_prefetch(panel.next + 64 * k, _MM_HINT_T1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i xr = _mm512_set1_epi32(static_cast<int>(x[r * words + k]));
      for (int c = 0; c < 3; ++c) acc[r][c] = dot_add_u8s8(acc[r][c], xr, w[c]);
    }
  }
  __m512 out[R][3];
  float fs[kPanelCols] = {};
  std::memcpy(fs, panel.scale, (panel.silu_and_mul ? kPanelCols : panel.cols) * sizeof(float));   // gate/up: all 48
  for (int c = 0; c < 3; ++c) {
    const __m512i off = _mm512_loadu_si512(panel.offset + 16 * c);
    const __m512 sc = _mm512_loadu_ps(fs + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512i sum = _mm512_add_epi32(_mm512_castps_si512(acc[r][c]), off);
      out[r][c] = _mm512_cvtepi32_ps(sum) * (sc * _mm512_set1_ps(x_scale[r]));
    }
  }
  store_rows<R, T>(out, bias, y, ldy, panel.cols, panel.silu_and_mul);
}

// w4a8: for each group g, part[r][c] = sum over its 8 word rows of vpdpbusd(q word (k, c): 4 unsigned bytes,
// x word (r, k): 4 signed bytes), exact in int32; then acc += d[g][c] s[r][g] part + m[g][c] (s sum qx)[r][g].
// x_sm: (R, groups, 2) per row: s and s times the sum of qx, of each group.
template <int R, typename T>
void w4a8_tile(const uint32_t* x, int64_t words, const Panel& panel, const float* x_sm, const T* bias, T* y,
               int64_t ldy) {
  const int64_t groups = words / (kInt4Group / 4);
  const uint8_t* chunks = static_cast<const uint8_t*>(panel.rows);
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R][3];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[R][3];                                             // int32 lanes (dot_add_u8s8)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 3; ++c) part[r][c] = _mm512_setzero_ps();
    for (int64_t j = 4 * g; j < 4 * g + 4; ++j) {                  // a chunk: word rows 2j and 2j + 1
      const uint8_t* chunk = chunks + j * 4 * kPanelCols;
      _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetchAhead * 4 * kPanelCols), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetchAhead * 4 * kPanelCols + 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetchAhead * 4 * kPanelCols + 128), _MM_HINT_T0);
      if (panel.next != nullptr) _mm_prefetch(panel.next + 64 * j, _MM_HINT_T1);
      __m512i lo[3], hi[3];
      for (int c = 0; c < 3; ++c) {
        const __m512i v = _mm512_loadu_si512(chunk + 64 * c);
        lo[c] = _mm512_and_si512(v, low);
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512i x0 = _mm512_set1_epi32(static_cast<int>(x[r * words + 2 * j]));
        const __m512i x1 = _mm512_set1_epi32(static_cast<int>(x[r * words + 2 * j + 1]));
        for (int c = 0; c < 3; ++c) part[r][c] = dot_add_u8s8(dot_add_u8s8(part[r][c], lo[c], x0), hi[c], x1);
      }
    }
    const float* dm = panel.dm + g * 2 * kPanelCols;
    for (int c = 0; c < 3; ++c) {
      const __m512 dc = _mm512_loadu_ps(dm + 16 * c), mc = _mm512_loadu_ps(dm + kPanelCols + 16 * c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const float* sm = x_sm + (r * groups + g) * 2;
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_castps_si512(part[r][c]));
        acc[r][c] = _mm512_fmadd_ps(dot, dc * _mm512_set1_ps(sm[0]),
                                    _mm512_fmadd_ps(mc, _mm512_set1_ps(sm[1]), acc[r][c]));
      }
    }
  }
  store_rows<R, T>(acc, bias, y, ldy, panel.cols, panel.silu_and_mul);
}
#endif

template <typename T>
using TileFn = void (*)(const uint32_t*, int64_t, const Panel&, const float*, const T*, T*, int64_t);
template <typename T, Source S = Source::kWords>
constexpr TileFn<T> kTiles[kRowTile + 1] = {nullptr, tile<1, T, S>, tile<2, T, S>, tile<3, T, S>, tile<4, T, S>,
                                            tile<5, T, S>, tile<6, T, S>, tile<7, T, S>, tile<8, T, S>};
template <Source S = Source::kWords>
constexpr TileFn<at::BFloat16> kInt4Tiles[kInt4RowTile + 1] = {nullptr, int4_tile<1, S>, int4_tile<2, S>,
                                                               int4_tile<3, S>, int4_tile<4, S>};
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
template <typename T>
constexpr TileFn<T> kW4A8Tiles[kInt4RowTile + 1] = {nullptr, w4a8_tile<1, T>, w4a8_tile<2, T>, w4a8_tile<3, T>,
                                                    w4a8_tile<4, T>};
template <typename T>
constexpr TileFn<T> kW8A8Tiles[kRowTile + 1] = {nullptr, w8a8_tile<1, T>, w8a8_tile<2, T>, w8a8_tile<3, T>,
                                                w8a8_tile<4, T>, w8a8_tile<5, T>, w8a8_tile<6, T>, w8a8_tile<7, T>,
                                                w8a8_tile<8, T>};
#endif

// What a weight format needs from the driver: the tiles for the first row tile of a panel (reading the packed
// bytes) and for the others (quantized formats: reading the widened panel), by row count.
template <typename T>
struct Format {
  const TileFn<T>* first;
  const TileFn<T>* rest;
  int64_t row_tile;
};

// The row chunks of x, each a pass over the weight with the panels split among the threads (each thread a run
// of whole panels). packed + p * panel_bytes is panel p; quantized formats widen it in the first row tile.
// Panel p writes y's columns from p * 48, or with silu_and_mul (gate/up panels) from p * 24.
template <typename T>
void run_tiles(const at::Tensor& x, const uint8_t* packed, int64_t panel_bytes, int64_t panels, const Format<T>& f,
               bool quantized, const float* scale, const float* dm, int64_t dm_panel, const float* x_sum,
               int64_t groups, const T* bias, bool silu_and_mul, at::Tensor& y, const int32_t* offset = nullptr) {
  const int64_t rows = x.size(0), words = x.size(1) / per_word(x.scalar_type()), out = y.size(1);
  const uint32_t* xs = static_cast<const uint32_t*>(x.data_ptr());
  T* ys = static_cast<T*>(y.data_ptr());
  for (int64_t m0 = 0; m0 < rows; m0 += kRowChunk) {
    const int64_t m1 = std::min(rows, m0 + kRowChunk);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      const bool reused = quantized && m1 - m0 > f.row_tile;
      std::vector<uint32_t> wide(reused ? words * kPanelCols : 0);   // the panel widened, for the later tiles
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t width = silu_and_mul ? kGateCols : kPanelCols, col0 = p * width;
        Panel panel{packed + p * panel_bytes, reused ? wide.data() : nullptr,
                    scale == nullptr ? nullptr : scale + p * kPanelCols, dm == nullptr ? nullptr : dm + p * dm_panel,
                    offset == nullptr ? nullptr : offset + p * kPanelCols, std::min(width, out - col0), silu_and_mul};
        const T* bc = bias == nullptr ? nullptr : bias + col0;
        for (int64_t r = m0; r < m1; r += f.row_tile) {
          const int64_t n = std::min(f.row_tile, m1 - r);
          if (r == m0) {
            f.first[n](xs + r * words, words, panel, x_sum + r * groups, bc, ys + r * out + col0, out);
          } else {
            Panel later = quantized ? Panel{wide.data(), nullptr, panel.scale, panel.dm, nullptr, panel.cols,
                                            silu_and_mul}
                                    : panel;
            // While the later row tiles compute from cache, each asks for 64 bytes a word row of the next panel
            // into L2, so that panel's first tile does not wait on memory (a panel is 192 bytes a word row:
            // three tiles ask for all of it).
            const int64_t ahead = (r - m0) / f.row_tile - 1;         // 0 for the second row tile
            if (!quantized && p + 1 < p1 && ahead < 3)
              later.next = reinterpret_cast<const char*>(packed + (p + 1) * panel_bytes) + ahead * (panel_bytes / 3);
            f.rest[n](xs + r * words, words, later, x_sum + r * groups, bc, ys + r * out + col0, out);
          }
        }
      }
    });
  }
}
#endif

// Panels of a weight with out_features outputs: 48 columns each, or with silu_and_mul 24 gate/up pairs each.
int64_t panels_for(int64_t out_features, bool silu_and_mul) {
  return silu_and_mul ? (out_features + kGateCols - 1) / kGateCols : num_panels(out_features);
}

void check_silu_and_mul(const char* op, bool silu_and_mul, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(!silu_and_mul || !bias.has_value(), op, ": silu_and_mul takes no bias (a gated MLP's gate/up has none)");
}

// Checks shared by the quantized linears; returns x contiguous.
at::Tensor check_quantized(const char* op, const at::Tensor& x, const at::Tensor& packed, at::ScalarType packed_type,
                           int64_t out_features, const c10::optional<at::Tensor>& bias, bool silu_and_mul) {
  TORCH_CHECK(bf16_linear_available(), op, ": this build has no AVX-512 BF16 (bf16_linear_available() is False)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": x (rows, in) bf16 expected, got ", x.sizes(),
              " ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == packed_type && packed.size(2) == kPanelCols &&
              packed.size(1) * 2 == x.size(1) && packed.size(0) == panels_for(out_features, silu_and_mul), op,
              ": `packed` (", packed.sizes(), ") is not pack_", op, "'s layout of a (", out_features, ", ", x.size(1),
              ") weight", silu_and_mul ? " with gate/up panels (silu_and_mul)" : "");
  check_silu_and_mul(op, silu_and_mul, bias);
  TORCH_CHECK(!bias.has_value() || (bias->numel() == out_features && bias->scalar_type() == at::kBFloat16), op,
              ": bias must be bf16 (", out_features, ",)");
  return x.contiguous();
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       int64_t out_features, const c10::optional<at::Tensor>& bias, bool silu_and_mul) {
  const at::Tensor xc = check_quantized("int8_linear", x, packed, at::kShort, out_features, bias, silu_and_mul);
  const int64_t scales = silu_and_mul ? packed.size(0) * kPanelCols : out_features;   // one per packed column
  TORCH_CHECK(scale.numel() == scales && scale.scalar_type() == at::kFloat,
              "int8_linear: scale must be fp32 (", scales, ",)");
  const at::Tensor sc = scale.contiguous(), b = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty({xc.size(0), out_features}, xc.options());
#if defined(__AVX512BF16__)
  const Format<at::BFloat16> f{kTiles<at::BFloat16, Source::kInt8>, kTiles<at::BFloat16>, kRowTile};
  run_tiles<at::BFloat16>(xc, static_cast<const uint8_t*>(packed.data_ptr()), packed.size(1) * 2 * kPanelCols,
                          packed.size(0), f, true, sc.data_ptr<float>(), nullptr, 0, nullptr, 0,
                          b.defined() ? b.data_ptr<at::BFloat16>() : nullptr, silu_and_mul, y);
#endif
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dm, int64_t out_features,
                       const c10::optional<at::Tensor>& bias, bool silu_and_mul) {
  const at::Tensor xc = check_quantized("int4_linear", x, packed, at::kByte, out_features, bias, silu_and_mul);
  const int64_t groups = x.size(1) / kInt4Group;
  TORCH_CHECK(x.size(1) % kInt4Group == 0 && dm.dim() == 4 && dm.scalar_type() == at::kFloat &&
              dm.size(0) == packed.size(0) && dm.size(1) == groups && dm.size(2) == 2 && dm.size(3) == kPanelCols,
              "int4_linear: dm (", dm.sizes(), ") is not pack_int4_linear's d and m of a (", out_features, ", ",
              x.size(1), ") weight");
  const at::Tensor dmc = dm.contiguous(), b = bias.has_value() ? bias->contiguous() : at::Tensor();
  // x_sum[r][g]: the sum of x over group g (fp32), for the m terms
  const at::Tensor x_sum = xc.to(at::kFloat).view({xc.size(0), groups, kInt4Group}).sum(2).contiguous();
  at::Tensor y = at::empty({xc.size(0), out_features}, xc.options());
#if defined(__AVX512BF16__)
  const Format<at::BFloat16> f{kInt4Tiles<Source::kInt4>, kInt4Tiles<>, kInt4RowTile};
  run_tiles<at::BFloat16>(xc, packed.data_ptr<uint8_t>(), packed.size(1) * kPanelCols, packed.size(0), f, true,
                          nullptr, dmc.data_ptr<float>(), groups * 2 * kPanelCols, x_sum.data_ptr<float>(), groups,
                          b.defined() ? b.data_ptr<at::BFloat16>() : nullptr, silu_and_mul, y);
#endif
  return y;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
// x (rows, in) fp32 or bf16, `in` a multiple of 16 -> u (rows, in) bytes: round(x / s) + 128 (to nearest even,
// as torch.round), with s[r] = max(max_k |x[r][k]| / 127, 1e-12) (quantization.quantize_activations: the same
// fp32 operations, so the same bytes). |x / s| <= 127, so u is 1..255.
// Divisions with their rounding named: -ffast-math would turn a plain a / b into a times 1 / b, which rounds
// differently now and then, and the bytes must be quantize_activations' own.
constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

template <typename T>
void quantize_rows(const at::Tensor& x, uint8_t* u, float* s) {
  const int64_t in = x.size(1);
  const T* xs = x.data_ptr<T>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = xs + r * in;
      __m512 amax = _mm512_setzero_ps();
      for (int64_t k = 0; k < in; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(minivllm_cpu::load16(row + k)));
      const __m128 scale = _mm_div_round_ss(_mm_set_ss(_mm512_reduce_max_ps(amax)), _mm_set_ss(127.0f), kNearest);
      s[r] = std::max(_mm_cvtss_f32(scale), 1e-12f);
      const __m512 sr = _mm512_set1_ps(s[r]);
      for (int64_t k = 0; k < in; k += 16) {
        const __m512 v = _mm512_div_round_ps(minivllm_cpu::load16(row + k), sr, kNearest);
        const __m512i q = _mm512_cvt_roundps_epi32(v, kNearest);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(u + r * in + k),
                         _mm512_cvtepi32_epi8(_mm512_add_epi32(q, _mm512_set1_epi32(128))));
      }
    }
  });
}

// x (rows, in) fp32 or bf16, `in` a multiple of 32 -> qx (rows, in) int8 and sm (rows, in / 32, 2) fp32: per group
// of 32, s = max(max |x| / 127, 1e-12), qx = round(x / s) (to nearest even) and s times the sum of qx
// (quantization.quantize_activation_groups: the same fp32 operations, so the same bytes).
template <typename T>
void quantize_groups(const at::Tensor& x, int8_t* qx, float* sm) {
  const int64_t in = x.size(1), groups = in / kInt4Group;
  const T* xs = x.data_ptr<T>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t k = r * in + g * kInt4Group;
        const __m512 a = minivllm_cpu::load16(xs + k), b = minivllm_cpu::load16(xs + k + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float s = std::max(_mm_cvtss_f32(_mm_div_round_ss(_mm_set_ss(amax), _mm_set_ss(127.0f), kNearest)),
                                 1e-12f);
        const __m512 sv = _mm512_set1_ps(s);
        const __m512i qa = _mm512_cvt_roundps_epi32(_mm512_div_round_ps(a, sv, kNearest), kNearest);
        const __m512i qb = _mm512_cvt_roundps_epi32(_mm512_div_round_ps(b, sv, kNearest), kNearest);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + k), _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + k + 16), _mm512_cvtepi32_epi8(qb));
        sm[(r * groups + g) * 2] = s;
        sm[(r * groups + g) * 2 + 1] = s * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
      }
  });
}
#endif

// y = x @ w^T (+ bias) in x's dtype (fp32 or bf16), w[n][k] = d[n][k / 32] q[n][k] + m[n][k / 32] from
// pack_w4a8_linear, with x rounded to int8 in groups of 32 here.
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dm, int64_t out_features,
                       const c10::optional<at::Tensor>& bias, bool silu_and_mul) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(vnni_linear_available(), "w4a8_linear: this build has no AVX-512 VNNI and BF16 "
              "(vnni_linear_available() is False)");
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16) && x.size(1) % kInt4Group == 0,
              "w4a8_linear: x (rows, in) fp32 or bf16 with `in` a multiple of ", kInt4Group, " expected, got ",
              x.sizes(), " ", dtype);
  const int64_t groups = x.size(1) / kInt4Group;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == 4 * kPanelCols &&
              packed.size(1) * 8 == x.size(1) && packed.size(0) == panels_for(out_features, silu_and_mul),
              "w4a8_linear: `packed` (", packed.sizes(), ") is not pack_w4a8_linear's layout of a (", out_features,
              ", ", x.size(1), ") weight", silu_and_mul ? " with gate/up panels (silu_and_mul)" : "");
  TORCH_CHECK(dm.dim() == 4 && dm.scalar_type() == at::kFloat && dm.size(0) == packed.size(0) &&
              dm.size(1) == groups && dm.size(2) == 2 && dm.size(3) == kPanelCols,
              "w4a8_linear: dm (", dm.sizes(), ") is not pack_w4a8_linear's d and m of a (", out_features, ", ",
              x.size(1), ") weight");
  check_silu_and_mul("w4a8_linear", silu_and_mul, bias);
  TORCH_CHECK(!bias.has_value() || (bias->numel() == out_features && bias->scalar_type() == dtype),
              "w4a8_linear: bias must be (", out_features, ",) in ", dtype);
  const at::Tensor xc = x.contiguous(), dmc = dm.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty({xc.size(0), out_features}, xc.options());
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
  at::Tensor qx = at::empty({xc.size(0), xc.size(1) / 4}, xc.options().dtype(at::kInt));   // 4 int8 a word
  at::Tensor sm = at::empty({xc.size(0), groups, 2}, xc.options().dtype(at::kFloat));
  const int64_t panel_bytes = packed.size(1) * 4 * kPanelCols;
  if (dtype == at::kBFloat16) {
    quantize_groups<at::BFloat16>(xc, static_cast<int8_t*>(qx.data_ptr()), sm.data_ptr<float>());
    const Format<at::BFloat16> f{kW4A8Tiles<at::BFloat16>, kW4A8Tiles<at::BFloat16>, kInt4RowTile};
    run_tiles<at::BFloat16>(qx, packed.data_ptr<uint8_t>(), panel_bytes, packed.size(0), f, false, nullptr,
                            dmc.data_ptr<float>(), groups * 2 * kPanelCols, sm.data_ptr<float>(), groups * 2,
                            b.defined() ? b.data_ptr<at::BFloat16>() : nullptr, silu_and_mul, y);
  } else {
    quantize_groups<float>(xc, static_cast<int8_t*>(qx.data_ptr()), sm.data_ptr<float>());
    const Format<float> f{kW4A8Tiles<float>, kW4A8Tiles<float>, kInt4RowTile};
    run_tiles<float>(qx, packed.data_ptr<uint8_t>(), panel_bytes, packed.size(0), f, false, nullptr,
                     dmc.data_ptr<float>(), groups * 2 * kPanelCols, sm.data_ptr<float>(), groups * 2,
                     b.defined() ? b.data_ptr<float>() : nullptr, silu_and_mul, y);
  }
#endif
  return y;
}

// y = x @ w^T (+ bias) in x's dtype (fp32 or bf16), with x quantized per row to int8 here and w from
// pack_w8a8_linear (q, its offset) and the columns' fp32 scales (out,), or with silu_and_mul one per packed
// column (interleave_gate_up's).
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offset,
                       const at::Tensor& scale, int64_t out_features, const c10::optional<at::Tensor>& bias,
                       bool silu_and_mul) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(vnni_linear_available(), "w8a8_linear: this build has no AVX-512 VNNI and BF16 "
              "(vnni_linear_available() is False)");
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16) && x.size(1) % 16 == 0,
              "w8a8_linear: x (rows, in) fp32 or bf16 with `in` a multiple of 16 expected, got ", x.sizes(), " ",
              dtype);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kInt && packed.size(2) == kPanelCols &&
              packed.size(1) * 4 == x.size(1) && packed.size(0) == panels_for(out_features, silu_and_mul),
              "w8a8_linear: `packed` (", packed.sizes(), ") is not pack_w8a8_linear's layout of a (", out_features,
              ", ", x.size(1), ") weight", silu_and_mul ? " with gate/up panels (silu_and_mul)" : "");
  const int64_t scales = silu_and_mul ? packed.size(0) * kPanelCols : out_features;   // one per packed column
  TORCH_CHECK(offset.scalar_type() == at::kInt && offset.numel() == packed.size(0) * kPanelCols,
              "w8a8_linear: offset must be pack_w8a8_linear's int32 (", packed.size(0), ", ", kPanelCols, ")");
  TORCH_CHECK(scale.numel() == scales && scale.scalar_type() == at::kFloat,
              "w8a8_linear: scale must be fp32 (", scales, ",)");
  check_silu_and_mul("w8a8_linear", silu_and_mul, bias);
  TORCH_CHECK(!bias.has_value() || (bias->numel() == out_features && bias->scalar_type() == dtype),
              "w8a8_linear: bias must be (", out_features, ",) in ", dtype);
  const at::Tensor xc = x.contiguous(), off = offset.contiguous(), sc = scale.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty({xc.size(0), out_features}, xc.options());
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
  at::Tensor u = at::empty({xc.size(0), xc.size(1) / 4}, xc.options().dtype(at::kInt));   // 4 bytes a word
  at::Tensor s = at::empty({xc.size(0)}, xc.options().dtype(at::kFloat));
  const uint8_t* w = static_cast<const uint8_t*>(packed.data_ptr());
  const int64_t panel_bytes = packed.size(1) * kPanelCols * 4;
  if (dtype == at::kBFloat16) {
    quantize_rows<at::BFloat16>(xc, static_cast<uint8_t*>(u.data_ptr()), s.data_ptr<float>());
    const Format<at::BFloat16> f{kW8A8Tiles<at::BFloat16>, kW8A8Tiles<at::BFloat16>, kRowTile};
    run_tiles<at::BFloat16>(u, w, panel_bytes, packed.size(0), f, false, sc.data_ptr<float>(), nullptr, 0,
                            s.data_ptr<float>(), 1, b.defined() ? b.data_ptr<at::BFloat16>() : nullptr, silu_and_mul,
                            y, off.data_ptr<int32_t>());
  } else {
    quantize_rows<float>(xc, static_cast<uint8_t*>(u.data_ptr()), s.data_ptr<float>());
    const Format<float> f{kW8A8Tiles<float>, kW8A8Tiles<float>, kRowTile};
    run_tiles<float>(u, w, panel_bytes, packed.size(0), f, false, sc.data_ptr<float>(), nullptr, 0,
                     s.data_ptr<float>(), 1, b.defined() ? b.data_ptr<float>() : nullptr, silu_and_mul, y,
                     off.data_ptr<int32_t>());
  }
#endif
  return y;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const c10::optional<at::Tensor>& bias, bool silu_and_mul) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16),
              "packed_linear: x (rows, in) fp32 or bf16 expected, got ", x.sizes(), " ", dtype);
  TORCH_CHECK(dtype == at::kBFloat16 ? bf16_linear_available() : fp32_linear_available(),
              "packed_linear: this build has no ", dtype == at::kBFloat16 ? "AVX-512 BF16" : "AVX-512F",
              " for ", dtype, " (see fp32_linear_available() and bf16_linear_available())");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == (dtype == at::kBFloat16 ? at::kInt : at::kFloat) &&
              packed.size(2) == kPanelCols && packed.size(1) * per_word(dtype) == x.size(1) &&
              packed.size(0) == panels_for(out_features, silu_and_mul), "packed_linear: `packed` (", packed.sizes(),
              ") is not pack_linear's layout of a ", dtype, " (", out_features, ", ", x.size(1), ") weight",
              silu_and_mul ? " with gate/up panels (silu_and_mul)" : "");
  check_silu_and_mul("packed_linear", silu_and_mul, bias);
  TORCH_CHECK(!bias.has_value() || (bias->numel() == out_features && bias->scalar_type() == dtype),
              "packed_linear: bias must be (", out_features, ",) in ", dtype);
  const at::Tensor xc = x.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty({xc.size(0), out_features}, xc.options());
#if defined(__AVX512F__)
  const uint8_t* w = static_cast<const uint8_t*>(packed.data_ptr());
  const int64_t panel_bytes = packed.size(1) * kPanelCols * 4;
  if (dtype == at::kBFloat16) {
    const Format<at::BFloat16> f{kTiles<at::BFloat16>, kTiles<at::BFloat16>, kRowTile};
    run_tiles<at::BFloat16>(xc, w, panel_bytes, packed.size(0), f, false, nullptr, nullptr, 0, nullptr, 0,
                            b.defined() ? b.data_ptr<at::BFloat16>() : nullptr, silu_and_mul, y);
  } else {
    const Format<float> f{kTiles<float>, kTiles<float>, kRowTile};
    run_tiles<float>(xc, w, panel_bytes, packed.size(0), f, false, nullptr, nullptr, 0, nullptr, 0,
                     b.defined() ? b.data_ptr<float>() : nullptr, silu_and_mul, y);
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("pack_linear(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias, bool silu_and_mul=False) -> Tensor");
  m.def("pack_int8_linear(Tensor qweight) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, int out_features, Tensor? bias, "
        "bool silu_and_mul=False) -> Tensor");
  m.def("pack_int4_linear(Tensor q, Tensor d, Tensor m) -> (Tensor, Tensor)");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor dm, int out_features, Tensor? bias, "
        "bool silu_and_mul=False) -> Tensor");
  m.def("pack_w8a8_linear(Tensor qweight) -> (Tensor, Tensor)");
  m.def("w8a8_linear(Tensor x, Tensor packed, Tensor offset, Tensor scale, int out_features, Tensor? bias, "
        "bool silu_and_mul=False) -> Tensor");
  m.def("pack_w4a8_linear(Tensor q, Tensor d, Tensor m) -> (Tensor, Tensor)");
  m.def("w4a8_linear(Tensor x, Tensor packed, Tensor dm, int out_features, Tensor? bias, "
        "bool silu_and_mul=False) -> Tensor");
  m.def("fp32_linear_available", &fp32_linear_available);        // no tensor argument: catch-all kernels
  m.def("bf16_linear_available", &bf16_linear_available);
  m.def("vnni_linear_available", &vnni_linear_available);
}

TORCH_LIBRARY_IMPL(minivllm_cpu, CPU, m) {
  m.impl("pack_linear", &pack_linear);
  m.impl("packed_linear", &packed_linear);
  m.impl("pack_int8_linear", &pack_int8_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("pack_int4_linear", &pack_int4_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("pack_w8a8_linear", &pack_w8a8_linear);
  m.impl("w8a8_linear", &w8a8_linear);
  m.impl("pack_w4a8_linear", &pack_w4a8_linear);
  m.impl("w4a8_linear", &w4a8_linear);
}
