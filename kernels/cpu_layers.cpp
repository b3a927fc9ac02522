// The small layers of a decoder, fused, on the CPU: RMSNorm (with the residual add), SiLU-and-mul and rotary
// embedding, each one pass over its rows where PyTorch runs 4-12 separate ops, each reading and writing the
// whole tensor (and allocating its output). vLLM's CPU build has the same three ops in C++ (csrc/cpu).
// Built with cpu_attention.cpp into one library by kernels/cpu_ops.py; layers.py calls them on a CPU.
//
// Each op reproduces the roundings of its PyTorch code in layers.py (which are Hugging Face's): fp32 inside,
// rounded to the model's dtype where the PyTorch code rounds. Only the order of fp32 sums and fused
// multiply-adds differ, so results agree with it to about 1e-6 in fp32 (tests/test_cpu_layers.py).
//
//   rms_norm(x, weight, eps)                   x (rows, size) -> norm(x) * weight
//   fused_add_rms_norm(x, residual, weight, eps) -> (norm(x + residual) * weight, x + residual)
//   silu_and_mul(x)                            x (rows, 2 * n) -> silu(x[:, :n]) * x[:, n:]   (rows, n)
//   rotary_embedding(positions, q, k, cos, sin) -> (q, k) rotated, "rotate half" layout;
//                                              q (tokens, heads, d), k (tokens, kv_heads, d), cos/sin fp32
//                                              (max_position, d / 2)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "cpu_vec.h"
#include "cpu_dtype.h"

namespace {

using minivllm_cpu::from_float;
using minivllm_cpu::round_to;
using minivllm_cpu::to_float;

constexpr int64_t kRowsPerTask = 8;   // rows per at::parallel_for chunk: a decode batch still uses both cores

template <typename T>
void rms_norm_rows(const T* x, const T* residual, const T* weight, T* out, T* residual_out, int64_t rows,
                   int64_t size, int64_t x_stride, float eps) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* o = out + r * size;
      T* s = residual_out ? residual_out + r * size : nullptr;
      float sum_sq = 0.f;
      if (residual) {
        // x + residual in the model's dtype (the PyTorch code adds before upcasting), kept as the new residual.
        const T* res = residual + r * size;
#pragma omp simd reduction(+ : sum_sq)
        for (int64_t i = 0; i < size; ++i) {
          const float v = round_to<T>(to_float(xr[i]) + to_float(res[i]));
          s[i] = from_float<T>(v);                                  // exact: v is already in T
          sum_sq += v * v;
        }
      } else {
#pragma omp simd reduction(+ : sum_sq)
        for (int64_t i = 0; i < size; ++i) sum_sq += to_float(xr[i]) * to_float(xr[i]);
      }
      const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(size) + eps);
      const T* src = residual ? s : xr;
#pragma omp simd
      for (int64_t i = 0; i < size; ++i) {
        o[i] = from_float<T>(round_to<T>(to_float(src[i]) * inv) * to_float(weight[i]));
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be (rows, size) with contiguous rows");
  const bool add = residual.defined() && residual.numel() > 0;
  TORCH_CHECK(!add || (residual.is_contiguous() && residual.sizes() == x.sizes()), "residual must match x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be (size,) in x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor sum = add ? at::empty(x.sizes(), x.options()) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), add ? residual.data_ptr<scalar_t>() : nullptr,
                            weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            add ? sum.data_ptr<scalar_t>() : nullptr, x.size(0), x.size(1), x.stride(0),
                            static_cast<float>(eps));
  });
  return {out, sum};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(fused_add_rms_norm(x, at::Tensor(), weight, eps));
}

template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * n;
      minivllm_cpu::silu_and_mul_row(gate, gate + n, out + r * n, n);
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_and_mul: x must be contiguous (rows, 2 * n)");
  const int64_t n = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), n);
  });
  return out;
}

// One tensor's heads: out[t, h] = rotate(x[t, h]) at position positions[t]; x's rows may be strided (a view of
// the fused qkv output), out is contiguous.
template <typename T>
void rotate(const T* x, T* out, const int64_t* positions, const float* cos, const float* sin, int64_t tokens,
            int64_t heads, int64_t d, int64_t token_stride, int64_t head_stride) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + positions[t] * half;
      const float* s = sin + positions[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xi = x + t * token_stride + h * head_stride;
        T* o = out + (t * heads + h) * d;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_float(xi[i]), x2 = to_float(xi[i + half]);
          o[i] = from_float<T>(x1 * c[i] - x2 * s[i]);
          o[i + half] = from_float<T>(x2 * c[i] + x1 * s[i]);
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& q,
                                                    const at::Tensor& k, const at::Tensor& cos,
                                                    const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.size(2) == k.size(2),
              "rotary_embedding: q and k must be (tokens, heads, head_dim) with contiguous heads");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions must be int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
              cos.size(1) * 2 == q.size(2), "cos/sin must be fp32 (max_position, head_dim / 2)");
  at::Tensor q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_embedding", [&] {
    for (auto [x, out] : {std::make_pair(q, q_out), std::make_pair(k, k_out)}) {
      rotate<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), positions.data_ptr<int64_t>(),
                       cos.data_ptr<float>(), sin.data_ptr<float>(), x.size(0), x.size(1), x.size(2),
                       x.stride(0), x.stride(1));
    }
  });
  return {q_out, k_out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(minivllm_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
}
