// 16-lane building blocks shared by the CPU kernels: loads and stores of the model's dtypes as fp32 lanes, exp,
// and the gated MLP's activation on one row.
//
// silu_and_mul_row: out[i] = silu(gate[i]) * up[i], rounded as the PyTorch code in layers.py (Hugging Face's)
// rounds it: silu in fp32, rounded to the model's dtype T, times up, rounded again. cpu_layers.cpp's
// silu_and_mul runs it over a (rows, 2 n) tensor; cpu_gemm.cpp runs silu_and_mul_reg in the gate/up matmul's
// epilogue (`silu_and_mul=True`) on the accumulators rounded to T, so both paths give the same values
// (tests/test_cpu_gemm.py compares them bit for bit). cpu_attention.cpp takes its softmax's exp from exp16.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_dtype.h"

namespace minivllm_cpu {

#if defined(__AVX512F__)
// exp(x) for 16 fp32 lanes, inline (no call: the matmul's epilogue keeps its registers): x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by its Taylor series to r^7 (relative error below 1e-7, under an fp32 ulp), times 2^n.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-103.9f));   // fp32's range
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);                  // ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})   // Horner, r^7 / 7! down to 1
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {       // bf16: the top 16 bits of an fp32
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// 16 fp32 values rounded to T (to nearest even, as from_float) and stored.
template <typename T>
inline void store16(T* p, __m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(p, v);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
}

// 16 fp32 values rounded to T and back (round_to, in registers).
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    T t[16];
    store16(t, v);
    return load16(t);
  }
}

// silu(gate) rounded to T, times up, for 16 lanes of gate and up values (already values of T); the caller rounds
// the result to T as it stores it. The matmul's epilogue (cpu_gemm.cpp) calls this on its accumulators.
template <typename T>
inline __m512 silu_and_mul_reg(__m512 gate, __m512 up) {
  const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(-gate)));
  return _mm512_mul_ps(round16<T>(silu), up);
}

template <typename T>
inline void silu_and_mul16(const T* gate, const T* up, T* out) {
  store16(out, silu_and_mul_reg<T>(load16(gate), load16(up)));
}
#else
template <typename T>
inline void silu_and_mul16(const T* gate, const T* up, T* out) {
#pragma omp simd
  for (int64_t i = 0; i < 16; ++i) {
    const float g = to_float(gate[i]);
    out[i] = from_float<T>(round_to<T>(g / (1.f + std::exp(-g))) * to_float(up[i]));   // silu(g), rounded, * up
  }
}
#endif

// gate, up: n values each, of T; out: n values of T.
template <typename T>
inline void silu_and_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) silu_and_mul16(gate + i, up + i, out + i);
  if (i < n) {                                           // the tail, through zero-padded copies
    T g[16] = {}, u[16] = {};
    T o[16];
    std::memcpy(g, gate + i, (n - i) * sizeof(T));
    std::memcpy(u, up + i, (n - i) * sizeof(T));
    silu_and_mul16(g, u, o);
    std::memcpy(out + i, o, (n - i) * sizeof(T));
  }
}

}  // namespace minivllm_cpu
