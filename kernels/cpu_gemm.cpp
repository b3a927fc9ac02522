// bf16 linear layers on a CPU with AVX-512 BF16: y = x @ W^T (+ bias), from a weight packed once at load.
//
//   pack_bf16_linear(weight)                 weight (out, in) bf16, in even -> packed (panels, in / 2, 48) int32
//   bf16_linear(x, packed, out, bias)        x (rows, in) bf16 -> y (rows, out) bf16; bias (out,) bf16 or None
//   bf16_linear_available()                  whether this build has them (the CPU has AVX-512 BF16)
//
// Why: a decode step multiplies a few rows (the batch) by every weight of the model, and those weights stream
// from memory every step (the default model's 269 MB in bf16 is eight times this CPU's L3). oneDNN's packed
// matmul (model/cpu_gemm.py) runs that at 280-300 GFLOP/s at 32 rows here, about 60% of the two cores' bf16
// peak (vdpbf16ps: 1 a cycle a core, 64 flops, about 455 GFLOP/s); with the weights in cache it reaches 360-400.
// This kernel is the plain outer-product form, with the weight read in the order it is stored:
//
//   packed[p][k2][c] = the bf16 pair (W[48p + c][2 k2], W[48p + c][2 k2 + 1]) as one 32-bit word: panel p holds
//                      48 output columns, and one k2 row of it is three registers of 16 columns;
//   a tile is kRowTile rows of x by one panel: 8 x 3 accumulators (fp32); for each k2, three loads of the panel
//   row, and for each x row one broadcast of its pair (x[r][2 k2], x[r][2 k2 + 1]) and three vdpbf16ps.
//
// So 24 multiply-adds of 16 lanes per 3 loads and 8 broadcasts, the panel streams from memory front to back
// (asked for ahead with prefetches) and stays in L2 for the other row tiles. A product of two bf16 values is
// exact in fp32, so the sums are fp32 sums of exact products, as oneDNN's are; only their order differs. The
// result is rounded to bf16 once, to nearest even (vcvtneps2bf16), after the bias is added in fp32.
//
// Measured on 2 cores (AMD EPYC, Zen 4), the default model's four matmuls of all 30 layers (weights from
// memory): 32 rows 18 ms against oneDNN's 24 ms; 1 row 7.2 against 11.5 ms (28 GB/s: the memory's bandwidth);
// equal from 2,048 rows up. The README's "Measured" has the table.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanelCols = 48;            // output columns per panel: three registers of 16
constexpr int64_t kRowTile = 8;               // x rows per tile: 8 x 3 accumulators
constexpr int64_t kRowChunk = 512;            // rows of x per pass over the weight (a chunk of x stays in L2)
constexpr int64_t kPrefetchAhead = 16;        // panel rows asked for ahead of their use

at::Tensor pack_bf16_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.size(1) % 2 == 0,
              "pack_bf16_linear: a bf16 (out, in) weight with an even `in` expected, got ", weight.sizes(), " ",
              weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  const int64_t out = w.size(0), pairs = w.size(1) / 2, panels = (out + kPanelCols - 1) / kPanelCols;
  at::Tensor packed = at::zeros({panels, pairs, kPanelCols}, w.options().dtype(at::kInt));   // zero columns pad
  const uint32_t* src = reinterpret_cast<const uint32_t*>(w.data_ptr<at::BFloat16>());     // (out, pairs) words
  uint32_t* dst = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  for (int64_t n = 0; n < out; ++n)
    for (int64_t k2 = 0; k2 < pairs; ++k2)
      dst[((n / kPanelCols) * pairs + k2) * kPanelCols + n % kPanelCols] = src[n * pairs + k2];
  return packed;
}

#if defined(__AVX512BF16__)
// y[r][c] = sum over k2 of x pair (r, k2) . panel pair (k2, c), for R rows of x (`pairs` words apart) and one
// panel; then + bias, rounded to bf16, and the first `cols` columns stored (y rows ldy apart).
template <int R>
void tile(const uint32_t* x, int64_t pairs, const uint32_t* panel, const at::BFloat16* bias, at::BFloat16* y,
          int64_t ldy, int64_t cols) {
  __m512 acc[R][3];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < pairs; ++k2) {
    const uint32_t* w = panel + k2 * kPanelCols;
    const char* ahead = reinterpret_cast<const char*>(w + kPrefetchAhead * kPanelCols);
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    _mm_prefetch(ahead + 128, _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 16),
                   w2 = (__m512bh)_mm512_loadu_si512(w + 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * pairs + k2]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xr, w2);
    }
  }
  __m512 b[3] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  if (bias != nullptr) {
    float fb[kPanelCols] = {};
    for (int64_t c = 0; c < cols; ++c) fb[c] = static_cast<float>(bias[c]);
    for (int c = 0; c < 3; ++c) b[c] = _mm512_loadu_ps(fb + 16 * c);
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) at::BFloat16 row[kPanelCols];
    for (int c = 0; c < 3; ++c)
      _mm256_store_si256(reinterpret_cast<__m256i*>(row + 16 * c), (__m256i)_mm512_cvtneps_pbh(acc[r][c] + b[c]));
    std::memcpy(y + r * ldy, row, cols * sizeof(at::BFloat16));
  }
}

using TileFn = void (*)(const uint32_t*, int64_t, const uint32_t*, const at::BFloat16*, at::BFloat16*, int64_t,
                        int64_t);
constexpr TileFn kTiles[kRowTile + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>,
                                         tile<8>};
#endif

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16_linear: x (rows, in) bf16 expected, got ",
              x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kInt && packed.size(2) == kPanelCols &&
              packed.size(1) * 2 == x.size(1) && packed.size(0) * kPanelCols >= out_features &&
              packed.size(0) * kPanelCols < out_features + kPanelCols, "bf16_linear: `packed` (", packed.sizes(),
              ") is not pack_bf16_linear's layout of a (", out_features, ", ", x.size(1), ") weight");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == out_features && bias->scalar_type() == at::kBFloat16),
              "bf16_linear: bias must be bf16 (", out_features, ",)");
  const at::Tensor xc = x.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t rows = xc.size(0), pairs = xc.size(1) / 2, panels = packed.size(0);
  at::Tensor y = at::empty({rows, out_features}, xc.options());
  const uint32_t* xs = reinterpret_cast<const uint32_t*>(xc.data_ptr<at::BFloat16>());
  const uint32_t* w = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  const at::BFloat16* bp = b.defined() ? b.data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* ys = y.data_ptr<at::BFloat16>();
  for (int64_t m0 = 0; m0 < rows; m0 += kRowChunk) {
    const int64_t m1 = std::min(rows, m0 + kRowChunk);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {    // each thread: a run of whole panels
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t col0 = p * kPanelCols, cols = std::min(kPanelCols, out_features - col0);
        for (int64_t r = m0; r < m1; r += kRowTile) {
          const int64_t n = std::min(kRowTile, m1 - r);
          kTiles[n](xs + r * pairs, pairs, w + p * pairs * kPanelCols, bp == nullptr ? nullptr : bp + col0,
                    ys + r * out_features + col0, out_features, cols);
        }
      }
    });
  }
  return y;
#else
  TORCH_CHECK(false, "bf16_linear: this build has no AVX-512 BF16 (bf16_linear_available() is False)");
#endif
}

bool bf16_linear_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("pack_bf16_linear(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("bf16_linear_available", &bf16_linear_available);        // no tensor argument: a catch-all kernel
}

TORCH_LIBRARY_IMPL(minivllm_cpu, CPU, m) {
  m.impl("pack_bf16_linear", &pack_bf16_linear);
  m.impl("bf16_linear", &bf16_linear);
}
