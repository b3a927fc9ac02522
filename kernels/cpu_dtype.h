// The model's dtypes to and from fp32, for the CPU kernels (cpu_attention.cpp, cpu_layers.cpp): every kernel
// loads its inputs into fp32, computes there, and rounds its outputs back to the model's dtype.
//
// Why not c10's own conversions: c10::BFloat16's float -> bf16 tests for NaN with a branch, and GCC leaves a
// loop containing it scalar; measured here (AVX-512, 32 x 3,072 bf16 values), SiLU-and-mul ran 9x slower in
// bf16 than in fp32 (159 against 18 us). The bit arithmetic below is the same rounding (round to nearest,
// ties to even; NaN to the canonical quiet NaN), written as integer operations and a select, which vectorise:
// bf16 is the top 16 bits of an fp32.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace minivllm_cpu {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e4m3fn x) { return static_cast<float>(x); }

// x rounded to T (round to nearest even, as c10 and PyTorch's .to(dtype) do).
template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  // Integer compare: unlike std::isnan it survives -ffast-math (which assumes no NaN).
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7fc0u : rounded), c10::BFloat16::from_bits());
}

// Rounds through the model's dtype, as the PyTorch code's `.to(dtype)` does (a no-op for fp32).
template <typename T>
inline float round_to(float x) { return to_float(from_float<T>(x)); }

}  // namespace minivllm_cpu
