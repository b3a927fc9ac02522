// Linear layers on a CPU with AVX-512, fp32 and bf16: y = x @ W^T (+ bias), from a weight packed once at load.
//
//   pack_linear(weight)                weight (out, in) fp32, or bf16 with an even `in` -> packed (panels,
//                                      words, 48) of 32-bit words: fp32 (words = in), or int32 holding bf16
//                                      pairs (words = in / 2)
//   packed_linear(x, packed, out, bias)  x (rows, in) in the weight's dtype -> y (rows, out), same dtype;
//                                      bias (out,) in that dtype, or None
//   fp32_linear_available()            whether this build has the fp32 kernel (the CPU has AVX-512F)
//   bf16_linear_available()            whether it has the bf16 kernel (the CPU has AVX-512 BF16)
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
// (asked for ahead with prefetches) and stays in L2 for the other row tiles. In bf16 a product of two bf16
// values is exact in fp32, so the sums are fp32 sums of exact products, as oneDNN's are; only their order
// differs. The bias is added in fp32, and a bf16 result is rounded once, to nearest even (vcvtneps2bf16).
//
// Measured on 2 cores (AMD EPYC, Zen 4), the default model's four matmuls of all 30 layers (weights from
// memory), bf16: 32 rows 18 ms against oneDNN's 24 ms; 1 row 7.2 against 11.5 ms (28 GB/s: the memory's
// bandwidth); equal from 2,048 rows up. fp32: see the README's "Measured".

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanelCols = 48;            // output columns per panel: three registers of 16
constexpr int64_t kRowTile = 8;               // x rows per tile: 8 x 3 accumulators
constexpr int64_t kRowChunk = 512;            // rows of x per pass over the weight (a chunk of x stays in L2)
constexpr int64_t kPrefetchAhead = 16;        // panel rows asked for ahead of their use

// Weight elements per 32-bit word: 1 in fp32, 2 (a pair along `in`) in bf16.
int64_t per_word(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 2 : 1; }

at::Tensor pack_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat ||
                                    (weight.scalar_type() == at::kBFloat16 && weight.size(1) % 2 == 0)),
              "pack_linear: an fp32 (out, in) weight, or a bf16 one with an even `in`, expected, got ",
              weight.sizes(), " ", weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  const int64_t out = w.size(0), words = w.size(1) / per_word(w.scalar_type());
  const int64_t panels = (out + kPanelCols - 1) / kPanelCols;
  const at::ScalarType word_type = w.scalar_type() == at::kBFloat16 ? at::kInt : at::kFloat;
  at::Tensor packed = at::zeros({panels, words, kPanelCols}, w.options().dtype(word_type));   // zero columns pad
  const uint32_t* src = static_cast<const uint32_t*>(w.data_ptr());                          // (out, words)
  uint32_t* dst = static_cast<uint32_t*>(packed.data_ptr());
  for (int64_t n = 0; n < out; ++n)
    for (int64_t k = 0; k < words; ++k)
      dst[((n / kPanelCols) * words + k) * kPanelCols + n % kPanelCols] = src[n * words + k];
  return packed;
}

#if defined(__AVX512F__)
// Word row k of a panel, as three registers of 16 columns' words. From pack_linear's panels: three loads. From
// pack_int8_linear's (kInt8): 96 bytes, each int8 pair widened to a bf16 pair (exact: |q| <= 128), and stored
// to `widened` (the panel in pack_linear's bf16 layout, for the row tiles after this one) unless it is null.
template <bool kInt8>
inline void panel_row(const void* panel, int64_t k, uint32_t* widened, __m512i w[3]) {
  if constexpr (kInt8) {
#if defined(__AVX512BF16__)
    const int8_t* row = static_cast<const int8_t*>(panel) + k * 2 * kPanelCols;
    const char* ahead = reinterpret_cast<const char*>(row + kPrefetchAhead * 2 * kPanelCols);
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    for (int c = 0; c < 3; ++c) {                                  // 16 columns = 32 int8 -> 32 bf16
      const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * c));
      const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * c + 16));
      w[c] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)),
                                          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
      if (widened != nullptr) _mm512_storeu_si512(widened + k * kPanelCols + 16 * c, w[c]);
    }
#endif
  } else {
    const uint32_t* row = static_cast<const uint32_t*>(panel) + k * kPanelCols;
    const char* ahead = reinterpret_cast<const char*>(row + kPrefetchAhead * kPanelCols);
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    _mm_prefetch(ahead + 128, _MM_HINT_T0);
    for (int c = 0; c < 3; ++c) w[c] = _mm512_loadu_si512(row + 16 * c);
  }
}

// y[r][c] = sum over words k of x word (r, k) . panel word (k, c), for R rows of x (`words` apart) and one
// panel; then times scale[c] (int8 weights; nullptr: 1), + bias, (bf16: rounded), and the first `cols` columns
// stored (y rows ldy apart). T is the dtype: float (FMA of one value) or at::BFloat16 (vdpbf16ps of one pair);
// kInt8: the panel is pack_int8_linear's, widened as it is read (panel_row).
template <int R, typename T, bool kInt8>
void tile(const uint32_t* x, int64_t words, const void* panel, uint32_t* widened, const float* scale,
          const T* bias, T* y, int64_t ldy, int64_t cols) {
  constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;
  __m512 acc[R][3];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < words; ++k) {
    __m512i wk[3];
    panel_row<kInt8>(panel, k, widened, wk);
    const __m512i w0 = wk[0], w1 = wk[1], w2 = wk[2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i xr = _mm512_set1_epi32(static_cast<int>(x[r * words + k]));
      if constexpr (kBf16) {
#if defined(__AVX512BF16__)
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)xr, (__m512bh)w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)xr, (__m512bh)w1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], (__m512bh)xr, (__m512bh)w2);
#endif
      } else {
        const __m512 xf = _mm512_castsi512_ps(xr);
        acc[r][0] = _mm512_fmadd_ps(xf, _mm512_castsi512_ps(w0), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(xf, _mm512_castsi512_ps(w1), acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(xf, _mm512_castsi512_ps(w2), acc[r][2]);
      }
    }
  }
  __m512 b[3] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  if (bias != nullptr) {
    float fb[kPanelCols] = {};
    for (int64_t c = 0; c < cols; ++c) fb[c] = static_cast<float>(bias[c]);
    for (int c = 0; c < 3; ++c) b[c] = _mm512_loadu_ps(fb + 16 * c);
  }
  if (scale != nullptr) {
    float fs[kPanelCols] = {};
    std::memcpy(fs, scale, cols * sizeof(float));
    for (int c = 0; c < 3; ++c) {
      const __m512 sc = _mm512_loadu_ps(fs + 16 * c);
      for (int r = 0; r < R; ++r) acc[r][c] = acc[r][c] * sc;
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) T row[kPanelCols];
    for (int c = 0; c < 3; ++c) {
      if constexpr (kBf16) {
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

template <typename T, bool kInt8 = false>
using TileFn = void (*)(const uint32_t*, int64_t, const void*, uint32_t*, const float*, const T*, T*, int64_t,
                        int64_t);
template <typename T, bool kInt8 = false>
constexpr TileFn<T, kInt8> kTiles[kRowTile + 1] = {
    nullptr, tile<1, T, kInt8>, tile<2, T, kInt8>, tile<3, T, kInt8>, tile<4, T, kInt8>, tile<5, T, kInt8>,
    tile<6, T, kInt8>, tile<7, T, kInt8>, tile<8, T, kInt8>};

// The row chunks of x, each a pass over the weight with the panels split among the threads.
template <typename T>
void run_tiles(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias, at::Tensor& y) {
  const int64_t rows = x.size(0), words = packed.size(1), panels = packed.size(0), out = y.size(1);
  const uint32_t* xs = static_cast<const uint32_t*>(x.data_ptr());
  const uint32_t* w = static_cast<const uint32_t*>(packed.data_ptr());
  const T* bp = bias.defined() ? static_cast<const T*>(bias.data_ptr()) : nullptr;
  T* ys = static_cast<T*>(y.data_ptr());
  for (int64_t m0 = 0; m0 < rows; m0 += kRowChunk) {
    const int64_t m1 = std::min(rows, m0 + kRowChunk);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {    // each thread: a run of whole panels
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t col0 = p * kPanelCols, cols = std::min(kPanelCols, out - col0);
        for (int64_t r = m0; r < m1; r += kRowTile) {
          const int64_t n = std::min(kRowTile, m1 - r);
          kTiles<T>[n](xs + r * words, words, w + p * words * kPanelCols, nullptr, nullptr,
                       bp == nullptr ? nullptr : bp + col0, ys + r * out + col0, out, cols);
        }
      }
    });
  }
}
#endif

// Weight-only int8 (model/quantization.py: w[n][k] = scale[n] q[n][k], q in [-128, 127]), with bf16 x. An int8
// value is exact in bf16, so the first row tile of a panel widens each int8 pair to a bf16 pair in registers
// as it reads it (panel_row), and, when more row tiles follow, keeps the widened panel in a buffer of the
// thread's own (in L2) for them. The per-column scale multiplies the fp32 sums at the end: the products q x are
// exact and only the order of the sums differs from x @ (scale q)^T. Half of bf16's bytes come from memory.
// Measured here (2 cores, Zen 4), the default model's matmuls of 30 layers, cold: 1 row 5.0 ms against bf16's
// 8.2 (and PyTorch's _weight_int8pack_mm's 10.7); 32 rows 21.1 against 23.3 (64.5).
at::Tensor pack_int8_linear(const at::Tensor& qweight) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.size(1) % 2 == 0,
              "pack_int8_linear: an int8 (out, in) weight with an even `in` expected, got ", qweight.sizes(), " ",
              qweight.scalar_type());
  const at::Tensor q = qweight.contiguous();
  const int64_t out = q.size(0), pairs = q.size(1) / 2, panels = (out + kPanelCols - 1) / kPanelCols;
  at::Tensor packed = at::zeros({panels, pairs, kPanelCols}, q.options().dtype(at::kShort));  // int8 pairs
  const uint16_t* src = static_cast<const uint16_t*>(q.data_ptr());                           // (out, pairs)
  uint16_t* dst = static_cast<uint16_t*>(packed.data_ptr());
  for (int64_t n = 0; n < out; ++n)
    for (int64_t k2 = 0; k2 < pairs; ++k2)
      dst[((n / kPanelCols) * pairs + k2) * kPanelCols + n % kPanelCols] = src[n * pairs + k2];
  return packed;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       int64_t out_features, const c10::optional<at::Tensor>& bias) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "int8_linear: x (rows, in) bf16 expected, got ",
              x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kShort && packed.size(2) == kPanelCols &&
              packed.size(1) * 2 == x.size(1) && packed.size(0) * kPanelCols >= out_features &&
              packed.size(0) * kPanelCols < out_features + kPanelCols, "int8_linear: `packed` (", packed.sizes(),
              ") is not pack_int8_linear's layout of a (", out_features, ", ", x.size(1), ") weight");
  TORCH_CHECK(scale.numel() == out_features && scale.scalar_type() == at::kFloat,
              "int8_linear: scale must be fp32 (", out_features, ",)");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == out_features && bias->scalar_type() == at::kBFloat16),
              "int8_linear: bias must be bf16 (", out_features, ",)");
  const at::Tensor xc = x.contiguous(), sc = scale.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t rows = xc.size(0), pairs = packed.size(1), panels = packed.size(0);
  at::Tensor y = at::empty({rows, out_features}, xc.options());
  const uint32_t* xs = static_cast<const uint32_t*>(xc.data_ptr());
  const int8_t* w = static_cast<const int8_t*>(packed.data_ptr());
  const float* sp = sc.data_ptr<float>();
  const at::BFloat16* bp = b.defined() ? b.data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* ys = y.data_ptr<at::BFloat16>();
  for (int64_t m0 = 0; m0 < rows; m0 += kRowChunk) {
    const int64_t m1 = std::min(rows, m0 + kRowChunk);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      std::vector<uint32_t> wide(m1 - m0 > kRowTile ? pairs * kPanelCols : 0);   // the panel widened, if reused
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t col0 = p * kPanelCols, cols = std::min(kPanelCols, out_features - col0);
        for (int64_t r = m0; r < m1; r += kRowTile) {             // the first tile widens the panel as it reads
          const int64_t n = std::min(kRowTile, m1 - r);
          const float* s = sp + col0;
          const at::BFloat16* bc = bp == nullptr ? nullptr : bp + col0;
          at::BFloat16* yc = ys + r * out_features + col0;
          if (r == m0)
            kTiles<at::BFloat16, true>[n](xs + r * pairs, pairs, w + p * pairs * 2 * kPanelCols,
                                          m1 - r > kRowTile ? wide.data() : nullptr, s, bc, yc, out_features, cols);
          else
            kTiles<at::BFloat16>[n](xs + r * pairs, pairs, wide.data(), nullptr, s, bc, yc, out_features, cols);
        }
      }
    });
  }
  return y;
#else
  TORCH_CHECK(false, "int8_linear: this build has no AVX-512 BF16 (bf16_linear_available() is False)");
#endif
}

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

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const c10::optional<at::Tensor>& bias) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16),
              "packed_linear: x (rows, in) fp32 or bf16 expected, got ", x.sizes(), " ", dtype);
  TORCH_CHECK(dtype == at::kBFloat16 ? bf16_linear_available() : fp32_linear_available(),
              "packed_linear: this build has no ", dtype == at::kBFloat16 ? "AVX-512 BF16" : "AVX-512F",
              " for ", dtype, " (see fp32_linear_available() and bf16_linear_available())");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == (dtype == at::kBFloat16 ? at::kInt : at::kFloat) &&
              packed.size(2) == kPanelCols &&
              packed.size(1) * per_word(dtype) == x.size(1) && packed.size(0) * kPanelCols >= out_features &&
              packed.size(0) * kPanelCols < out_features + kPanelCols, "packed_linear: `packed` (",
              packed.sizes(), ") is not pack_linear's layout of a ", dtype, " (", out_features, ", ", x.size(1),
              ") weight");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == out_features && bias->scalar_type() == dtype),
              "packed_linear: bias must be (", out_features, ",) in ", dtype);
  const at::Tensor xc = x.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty({xc.size(0), out_features}, xc.options());
#if defined(__AVX512F__)
  if (dtype == at::kBFloat16)
    run_tiles<at::BFloat16>(xc, packed, b, y);
  else
    run_tiles<float>(xc, packed, b, y);
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("pack_linear(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("pack_int8_linear(Tensor qweight) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, int out_features, Tensor? bias) -> Tensor");
  m.def("fp32_linear_available", &fp32_linear_available);        // no tensor argument: catch-all kernels
  m.def("bf16_linear_available", &bf16_linear_available);
}

TORCH_LIBRARY_IMPL(minivllm_cpu, CPU, m) {
  m.impl("pack_linear", &pack_linear);
  m.impl("packed_linear", &packed_linear);
  m.impl("pack_int8_linear", &pack_int8_linear);
  m.impl("int8_linear", &int8_linear);
}
