// Attention on the CPU, in C++, built on first use by kernels/cpu_ops.py:
//   paged_decode_attention  the CPU counterpart of triton_ops.paged_decode_attention (same arguments, same
//                           layouts; kernels/__init__.py lists them)
//   prefill_attention       fresh prompts (no cached context) attending causally to this step's own K and V
//                           (below paged_decode_attention)
//   store_kv_cache          this step's K and V into their cache slots (the reference's store, in one pass)
//
// Why a kernel: reference.paged_decode_attention gathers every sequence's blocks into a contiguous buffer
// (index_select) and then calls PyTorch's attention, so each step reads the whole KV context twice and
// writes it once, per layer. This reads each sequence's K and V once, straight out of the block table,
// which is what vLLM's own CPU attention (csrc/cpu) does too. A decode step's attention is bound by those
// bytes: the arithmetic is two multiply-adds per cached element.
//
//   query        (num_seqs, num_heads, head_dim)                   the model's dtype, contiguous
//   key_cache    (num_blocks, block_size, num_kv_heads, head_dim)  the model's dtype, or fp8 e4m3
//   value_cache  same
//   block_tables (num_seqs, max_blocks_per_seq) int32
//   seq_lens     (num_seqs,) int32: tokens of KV per sequence, the new one included
//   returns      (num_seqs, num_heads, head_dim), the query's dtype
//
// A work item is one sequence (or, with few sequences, one sequence's KV head): it reads each KV head once
// for all `group` query heads that share it (GQA). Items are spread over torch's own thread pool
// (at::parallel_for).
// Each pass walks the block table block by block and slot by slot (no division per token), in 8-lane fp32
// registers (vec8), and asks for the next block while it reads the current one (prefetch): the blocks are
// scattered over the pool, where the hardware prefetcher loses the stream. Measured on the default model's
// shapes (32 sequences of 160 tokens, 30 layers' caches, 2-core AVX2): 15-20% less time than reading token by
// token with a division per token (README, "Decode attention").
// Softmax is the exact two-pass form (max first), in fp32, like the reference; only the order of the fp32
// sums differs from it, so results agree to about 1e-6 (tests/test_cpu_attention.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstring>
#include <numeric>
#include <type_traits>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <limits>
#include <vector>

#include "cpu_dtype.h"
#include "cpu_vec.h"

namespace {

using minivllm_cpu::from_float;
using minivllm_cpu::to_float;

// Eight fp32 lanes: one AVX2 register (two on NEON). GCC's and Clang's vector extension, so the same source
// compiles to whatever -march=native offers; `a += b * c` becomes one fused multiply-add per register.
typedef float vec8 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename C>
inline vec8 load8(const C* p) {           // bf16 / fp16 / fp8: widened lane by lane
  vec8 v;
  for (int64_t l = 0; l < kLanes; ++l) v[l] = to_float(p[l]);
  return v;
}
inline float hsum(vec8 v) {
  float s = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// q . k over head_dim, q in fp32: whole registers (two accumulators, so the multiply-adds of one dot do not
// all wait on each other), then the lanes left when head_dim is not a multiple of 8.
template <typename C>
inline float dot(const float* q, const C* k, int64_t head_dim) {
  vec8 a0 = {}, a1 = {};
  int64_t d = 0;
  for (; d + 2 * kLanes <= head_dim; d += 2 * kLanes) {
    a0 += load8(q + d) * load8(k + d);
    a1 += load8(q + d + kLanes) * load8(k + d + kLanes);
  }
  for (; d + kLanes <= head_dim; d += kLanes) a0 += load8(q + d) * load8(k + d);
  float s = hsum(a0 + a1);
  for (; d < head_dim; ++d) s += q[d] * to_float(k[d]);
  return s;
}

// acc += p * v over head_dim.
template <typename C>
inline void axpy(float p, const C* v, float* acc, int64_t head_dim) {
  int64_t d = 0;
  for (; d + kLanes <= head_dim; d += kLanes) {
    vec8 a = load8(acc + d);
    a += p * load8(v + d);
    std::memcpy(acc + d, &a, sizeof a);
  }
  for (; d < head_dim; ++d) acc[d] += p * to_float(v[d]);
}

// Asks for `bytes` from p into the cache ahead of use. The blocks of a sequence are scattered over the pool, so
// the hardware prefetcher, which follows one address stream, stalls at every block boundary; each pass asks
// for the next block's token while it reads the current block's.
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(static_cast<const char*>(p) + off);
}

// s[0 ... n-1] = exp(s - max s), the softmax's numerators (exact two-pass form, fp32); returns their sum.
inline float exp_and_sum(float* s, int64_t n) {
#if defined(__AVX512F__)
  // 16 lanes at a time, the last ones masked: a row of any length runs no scalar exp (a short prompt's rows
  // are a few registers long, and a scalar tail cost about as much as the rest).
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = static_cast<__mmask16>(n - i >= 16 ? 0xffff : (1u << (n - i)) - 1);
    top = _mm512_mask_max_ps(top, lanes, top, _mm512_maskz_loadu_ps(lanes, s + i));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = static_cast<__mmask16>(n - i >= 16 ? 0xffff : (1u << (n - i)) - 1);
    const __m512 e = minivllm_cpu::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, s + i), m));
    _mm512_mask_storeu_ps(s + i, lanes, e);
    sum = _mm512_mask_add_ps(sum, lanes, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
#else
  const float m = *std::max_element(s, s + n);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return sum;
#endif
}

#if defined(__AVX512F__)
// ---- the AVX-512 decode path: a (sequence, KV head) per work item, its rows' vectors in registers ----
//
// For fp32 and bf16 caches with head_dim 32, 64 or 128 and the GQA groups listed in try_decode_tiled (the
// default model: 3 x 64). A work item is one sequence's one KV head, so it reads only that head's slice of
// each block (two cache lines a token at head_dim 64 in bf16). Pass 1 converts each key row to fp32 once, into NC registers of 16 lanes, and
// multiplies it by all G query rows (held in registers); pass 2 converts each value row once and adds it into
// G x NC accumulator registers, which stay in registers for the whole sequence. The other decode path
// (below) converts each row once per query head and keeps its accumulators in memory. Measured on 30 layers'
// bf16 caches at batch 32 (contexts 64-512, 211 MB of K and V, 2 cores, AMD EPYC Zen 4): 25.5-28.6 ms with
// that path, 18.1-19.8 ms with this one (7.4-8.3 against 10.6-11.6 GB/s). Its remaining cost is waiting for
// rows from memory, so the slices are asked for kAheadBlocks blocks ahead, and the first value blocks during
// the last key blocks. Items are handed out longest first from a shared counter.
typedef float v16 __attribute__((vector_size(64)));
constexpr int64_t kAheadBlocks = 2;            // a block's slice is asked for this many blocks ahead

template <typename C>
inline v16 load16(const C* p) {
  if constexpr (std::is_same_v<C, float>) {
    v16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
  } else {                                     // bf16: the top half of an fp32
    typedef uint16_t u16x16 __attribute__((vector_size(32)));
    typedef uint32_t u32x16 __attribute__((vector_size(64)));
    u16x16 h;
    std::memcpy(&h, p, sizeof h);
    const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    v16 v;
    std::memcpy(&v, &w, sizeof v);
    return v;
  }
}

inline float sum16(v16 v) { return _mm512_reduce_add_ps(v); }

template <typename Q, typename C, int G, int NC>
void decode_tiled(const Q* query, const C* key_cache, const C* value_cache, const int32_t* block_tables,
                  const int32_t* seq_lens, Q* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                  int64_t block_size, int64_t max_blocks, float scale, float v_scale) {
  constexpr int64_t head_dim = 16 * NC;
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  std::vector<int64_t> order(num_seqs * num_kv_heads);          // items (seq, kv head), longest first
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return seq_lens[a / num_kv_heads] > seq_lens[b / num_kv_heads];
  });
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores;
    for (int64_t index; (index = next_item.fetch_add(1)) < static_cast<int64_t>(order.size());) {
      const int64_t seq = order[index] / num_kv_heads, h = order[index] % num_kv_heads;
      const int64_t len = seq_lens[seq], num_blocks = (len + block_size - 1) / block_size;
      const int32_t* table = block_tables + seq * max_blocks;
      v16 q[G][NC];                                              // the G query rows, times the scale
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < NC; ++c) {
          const Q* row = query + (seq * num_heads + h * G + g) * head_dim + 16 * c;
          float lanes[16];
          for (int l = 0; l < 16; ++l) lanes[l] = to_float(row[l]) * scale;
          std::memcpy(&q[g][c], lanes, sizeof lanes);
        }
      scores.resize(G * len);                                    // scores[g * len + t]
      // Pass 1: scores, block by block; a key row is converted once for all G rows.
      for (int64_t b = 0; b < num_blocks; ++b) {
        const C* block = key_cache + table[b] * block_stride + h * head_dim;
        // asks for the block kAheadBlocks on (past the last key block: the first value blocks)
        const int64_t ahead = b + kAheadBlocks;
        const C* next = ahead < num_blocks ? key_cache + table[ahead] * block_stride + h * head_dim
                                           : value_cache + table[std::min(ahead - num_blocks, num_blocks - 1)] *
                                                 block_stride + h * head_dim;
        const int64_t t0 = b * block_size, n = std::min(block_size, len - t0);
        for (int64_t i = 0; i < n; ++i) {
          prefetch(next + i * token_stride, head_dim * sizeof(C));
          v16 k[NC];
          for (int c = 0; c < NC; ++c) k[c] = load16(block + i * token_stride + 16 * c);
          for (int g = 0; g < G; ++g) {
            v16 a = q[g][0] * k[0];
            for (int c = 1; c < NC; ++c) a += q[g][c] * k[c];
            scores[g * len + t0 + i] = sum16(a);
          }
        }
      }
      float total[G];                                            // softmax: p = exp(s - max), and its sum
      for (int g = 0; g < G; ++g) total[g] = exp_and_sum(scores.data() + g * len, len);
      // Pass 2: acc[g] = sum_t p[g][t] * v_t; a value row is converted once for all G rows.
      v16 acc[G][NC] = {};
      for (int64_t b = 0; b < num_blocks; ++b) {
        const C* block = value_cache + table[b] * block_stride + h * head_dim;
        const C* next = b + kAheadBlocks < num_blocks
                            ? value_cache + table[b + kAheadBlocks] * block_stride + h * head_dim : nullptr;
        const int64_t t0 = b * block_size, n = std::min(block_size, len - t0);
        for (int64_t i = 0; i < n; ++i) {
          if (next != nullptr) prefetch(next + i * token_stride, head_dim * sizeof(C));
          v16 v[NC];
          for (int c = 0; c < NC; ++c) v[c] = load16(block + i * token_stride + 16 * c);
          for (int g = 0; g < G; ++g) {
            const float p = scores[g * len + t0 + i];
            for (int c = 0; c < NC; ++c) acc[g][c] += p * v[c];
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        Q* o = out + (seq * num_heads + h * G + g) * head_dim;
        const float norm = v_scale / total[g];
        for (int c = 0; c < NC; ++c) {
          float lanes[16];
          std::memcpy(lanes, &acc[g][c], sizeof lanes);
          for (int l = 0; l < 16; ++l) o[16 * c + l] = from_float<Q>(lanes[l] * norm);
        }
      }
    }
  });
}

// Runs decode_tiled when it covers this shape (and returns true), else returns false.
template <typename Q, typename C>
bool try_decode_tiled(const Q* query, const C* key_cache, const C* value_cache, const int32_t* block_tables,
                      const int32_t* seq_lens, Q* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, float v_scale) {
  if constexpr (!std::is_same_v<Q, C> || !(std::is_same_v<C, float> || std::is_same_v<C, c10::BFloat16>)) {
    return false;
  } else {
    const int64_t group = num_heads / num_kv_heads;
#define MINIVLLM_TILED(G_, NC_)                                                                              \
  if (group == G_ && head_dim == 16 * NC_) {                                                                 \
    decode_tiled<Q, C, G_, NC_>(query, key_cache, value_cache, block_tables, seq_lens, out, num_seqs,       \
                                num_heads, num_kv_heads, block_size, max_blocks, scale, v_scale);           \
    return true;                                                                                             \
  }
    MINIVLLM_TILED(1, 4) MINIVLLM_TILED(2, 4) MINIVLLM_TILED(3, 4) MINIVLLM_TILED(4, 4) MINIVLLM_TILED(6, 4)
    MINIVLLM_TILED(1, 8) MINIVLLM_TILED(2, 8) MINIVLLM_TILED(3, 8)
    MINIVLLM_TILED(1, 2) MINIVLLM_TILED(2, 2) MINIVLLM_TILED(4, 2) MINIVLLM_TILED(8, 2)
#undef MINIVLLM_TILED
    return false;
  }
}
#endif

template <typename Q, typename C>
void decode(const Q* query, const C* key_cache, const C* value_cache, const int32_t* block_tables,
            const int32_t* seq_lens, Q* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, float v_scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;       // elements from one cached token to the next
  const int64_t block_stride = block_size * token_stride;
  // A work item is one sequence and `span` of its KV heads. All of them when there are enough sequences to
  // keep every thread busy: then an item reads each of its blocks front to back (one token's heads are
  // adjacent), which streams from memory; one head per item otherwise (batch 1 still uses every thread).
  const int64_t span = num_seqs >= 4 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / span;
  const int64_t rows = span * group;                           // query heads of one item
  at::parallel_for(0, num_seqs * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(rows * head_dim), acc(rows * head_dim), total(rows), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / items_per_seq, kv_head0 = (item % items_per_seq) * span;
      const int64_t len = seq_lens[seq];
      const int32_t* table = block_tables + seq * max_blocks;
      const int64_t num_blocks = (len + block_size - 1) / block_size;
      // The item's query rows, in fp32, pre-multiplied by the softmax scale. Query head kv_head * group + g
      // reads KV head kv_head, so the rows of heads kv_head0 ... kv_head0 + span - 1 are adjacent: row
      // r = h * group + g, for the item's h-th KV head.
      const Q* q_in = query + (seq * num_heads + kv_head0 * group) * head_dim;
      for (int64_t i = 0; i < rows * head_dim; ++i) q[i] = to_float(q_in[i]) * scale;
      scores.resize(rows * len);                                 // scores[r * len + t]

      // Pass 1: scores = q . k for every cached token t = b * block_size + i (block table[b], slot i). Blocks
      // then slots, so no division per token; each token's `span` heads are adjacent in memory.
      for (int64_t b = 0; b < num_blocks; ++b) {
        const C* block = key_cache + table[b] * block_stride + kv_head0 * head_dim;
        const C* next = b + 1 < num_blocks ? key_cache + table[b + 1] * block_stride + kv_head0 * head_dim
                                           : value_cache + table[0] * block_stride + kv_head0 * head_dim;
        const int64_t t0 = b * block_size, n = std::min(block_size, len - t0);
        for (int64_t i = 0; i < n; ++i) {
          prefetch(next + i * token_stride, span * head_dim * sizeof(C));
          for (int64_t h = 0; h < span; ++h) {
            const C* k = block + i * token_stride + h * head_dim;
            for (int64_t g = 0; g < group; ++g) {
              const int64_t r = h * group + g;
              scores[r * len + t0 + i] = dot(q.data() + r * head_dim, k, head_dim);
            }
          }
        }
      }
      // Softmax over t, per query row: p = exp(s - max), normalised at the end.
      for (int64_t r = 0; r < rows; ++r) total[r] = exp_and_sum(scores.data() + r * len, len);
      // Pass 2: acc = sum_t p_t * v_t, in the same order as pass 1.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < num_blocks; ++b) {
        const C* block = value_cache + table[b] * block_stride + kv_head0 * head_dim;
        const C* next = b + 1 < num_blocks ? value_cache + table[b + 1] * block_stride + kv_head0 * head_dim
                                           : nullptr;
        const int64_t t0 = b * block_size, n = std::min(block_size, len - t0);
        for (int64_t i = 0; i < n; ++i) {
          if (next != nullptr) prefetch(next + i * token_stride, span * head_dim * sizeof(C));
          for (int64_t h = 0; h < span; ++h) {
            const C* v = block + i * token_stride + h * head_dim;
            for (int64_t g = 0; g < group; ++g) {
              const int64_t r = h * group + g;
              axpy(scores[r * len + t0 + i], v, acc.data() + r * head_dim, head_dim);
            }
          }
        }
      }
      Q* o = out + (seq * num_heads + kv_head0 * group) * head_dim;
      for (int64_t r = 0; r < rows; ++r) {
        const float norm = v_scale / total[r];                  // an fp8 cache holds V / v_scale
        for (int64_t d = 0; d < head_dim; ++d) o[r * head_dim + d] = from_float<Q>(acc[r * head_dim + d] * norm);
      }
    }
  });
}

template <typename Q, typename C>
void run(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
         const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out, double scale,
         double v_scale) {
#if defined(__AVX512F__)
  if (try_decode_tiled<Q, C>(query.data_ptr<Q>(), key_cache.data_ptr<C>(), value_cache.data_ptr<C>(),
                             block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), out.data_ptr<Q>(),
                             query.size(0), query.size(1), key_cache.size(2), query.size(2), key_cache.size(1),
                             block_tables.size(1), static_cast<float>(scale), static_cast<float>(v_scale)))
    return;
#endif
  decode<Q, C>(query.data_ptr<Q>(), key_cache.data_ptr<C>(), value_cache.data_ptr<C>(),
               block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), out.data_ptr<Q>(),
               query.size(0), query.size(1), key_cache.size(2), query.size(2), key_cache.size(1),
               block_tables.size(1), static_cast<float>(scale), static_cast<float>(v_scale));
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, double k_scale, double v_scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query (num_seqs, num_heads, head_dim) and a cache "
              "(num_blocks, block_size, num_kv_heads, head_dim) expected");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
              block_tables.is_contiguous() && seq_lens.is_contiguous(), "contiguous tensors expected");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "query and cache head_dim differ");
  at::Tensor out = at::empty_like(query);
  const double qk_scale = scale * k_scale;                      // an fp8 cache holds K / k_scale
  const auto qt = query.scalar_type(), ct = key_cache.scalar_type();
  const bool fp8 = ct == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 || ct == qt, "the cache's dtype must be the query's, or fp8 e4m3");
  if (qt == at::kFloat) {
    fp8 ? run<float, c10::Float8_e4m3fn>(query, key_cache, value_cache, block_tables, seq_lens, out, qk_scale, v_scale)
        : run<float, float>(query, key_cache, value_cache, block_tables, seq_lens, out, qk_scale, v_scale);
  } else if (qt == at::kBFloat16) {
    fp8 ? run<c10::BFloat16, c10::Float8_e4m3fn>(query, key_cache, value_cache, block_tables, seq_lens, out, qk_scale, v_scale)
        : run<c10::BFloat16, c10::BFloat16>(query, key_cache, value_cache, block_tables, seq_lens, out, qk_scale, v_scale);
  } else if (qt == at::kHalf) {
    fp8 ? run<c10::Half, c10::Float8_e4m3fn>(query, key_cache, value_cache, block_tables, seq_lens, out, qk_scale, v_scale)
        : run<c10::Half, c10::Half>(query, key_cache, value_cache, block_tables, seq_lens, out, qk_scale, v_scale);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: query dtype ", qt, " is not float32, bfloat16 or float16");
  }
  return out;
}

// ---- store_kv_cache: this step's new K and V into their cache slots ----
//
//   key, value    (num_tokens, num_kv_heads, head_dim)   the cache's dtype; heads contiguous, rows may be
//                                                         strided (views of the qkv projection)
//   key_cache     (num_blocks, block_size, num_kv_heads, head_dim), value_cache the same
//   slot_mapping  (num_tokens,) int64: token t goes to slot s = block * block_size + offset; -1 is padding
//
// The reference (kernels/reference.py) does this with index_copy_, after asking whether any slot is -1 (a sync
// with the host and three more ops, per layer). Here it is one pass that skips -1 slots, as vLLM's
// reshape_and_cache does on its CPU backend.
void store_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key_cache.dim() == 4 &&
              value_cache.sizes() == key_cache.sizes(), "store_kv_cache: key, value (num_tokens, num_kv_heads, "
              "head_dim) and caches (num_blocks, block_size, num_kv_heads, head_dim) expected");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
              value.stride(1) == value.size(2), "store_kv_cache: each row's heads must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "store_kv_cache: contiguous caches expected");
  TORCH_CHECK(key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3),
              "store_kv_cache: key rows do not match the cache's (num_kv_heads, head_dim)");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type() &&
              value_cache.scalar_type() == key_cache.scalar_type(), "store_kv_cache: key, value and caches must "
              "share one dtype (an fp8 cache goes through the reference, which quantizes)");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == key.size(0), "store_kv_cache: slot_mapping must be int64 (num_tokens,)");
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t)
    TORCH_CHECK(slots[t] < num_slots, "store_kv_cache: slot ", slots[t], " of token ", t, " is past the cache's ",
                num_slots, " slots");
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size(), v_stride = value.stride(0) * value.element_size();
  at::parallel_for(0, key.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;                                // padding
      std::memcpy(kc + slots[t] * row_bytes, k + t * k_stride, row_bytes);
      std::memcpy(vc + slots[t] * row_bytes, v + t * v_stride, row_bytes);
    }
  });
}

// ---- prefill_attention: fresh prompts, attending causally to this step's own K and V ----
//
//   query        (num_tokens, num_heads, head_dim)      this step's rows, the model's dtype; heads contiguous,
//   key, value   (num_tokens, num_kv_heads, head_dim)   rows may be strided (views of the qkv projection)
//   starts, lens (num_seqs,) int64: sequence s is rows starts[s] ... starts[s] + lens[s] - 1, a whole prompt
//                (positions 0 ... lens[s] - 1): query row i attends to key rows 0 ... i of its sequence
//   returns      (num_tokens, num_heads, head_dim): the sequences' rows; any other row is left unwritten
//
// A prefill's attention is two small matrix products per (sequence, head): scores = Q K^T, out = P V. Done one
// query row at a time (a dot product per key, a horizontal sum per score) it ran at about 40 GFLOP/s here, as
// did PyTorch's CPU flash attention called per prompt (the default model's prompts are 64-256 tokens: nine heads
// of one short prompt are too little work for one call). This kernel computes both products as register tiles,
// the way a matrix-multiply kernel does, with kTileLanes fp32 lanes per register (16 with AVX-512, 8 with AVX2):
//
//   scores  kTileRows query rows by kTileLanes keys: one accumulator register per query row; for each d, one load
//           of K^T[d][keys] and kTileRows multiply-adds by a broadcast q[row][d]. K^T is written once per item.
//   softmax per query row over its keys 0 ... its position (the causal mask), exact: max, exp, sum, in fp32.
//   values  kValueRows query rows by kDimRegs registers of output dims: for each key j, kDimRegs loads of
//           V[j][dims] and kValueRows * kDimRegs multiply-adds by a broadcast p[row][j].
//
// Every multiply-add is a whole register of useful work (no horizontal sum per score), and each loaded register
// is used several times. Everything is fp32 inside, as in the reference; only the order of the sums differs.
// The query rows of a tile are (row, head) pairs of one KV head's `group` query heads, row by row, so the heads
// that share K and V share each loaded register of it. A work item is (sequence, KV head, block of kBlockRows
// rows): its K^T and V (keys 0 ... the block's last row), written once in the layouts above, at most a few
// hundred KB, stay in L2. Its cost grows with its last row, so items are handed out costliest first from a
// shared counter. bf16 on a CPU with AVX-512 BF16 takes its scores from the bf16 values (score_tile_bf16).
#if defined(__AVX512F__)
constexpr int64_t kTileLanes = 16;
#else
constexpr int64_t kTileLanes = 8;
#endif
typedef float vreg __attribute__((vector_size(kTileLanes * sizeof(float))));
constexpr int64_t kTileRows = 12;             // query rows of a score tile (accumulators)
constexpr int64_t kDimRegs = kTileLanes == 16 ? 4 : 2;   // output registers per query row in a value tile
constexpr int64_t kValueRows = 6;             // query rows of a value tile: 6 x kDimRegs accumulators
constexpr int64_t kBlockRows = 64;            // prompt rows per work item
constexpr int64_t kPrefetchRows = 8;          // K and V rows are asked for this many rows ahead of their copy

inline vreg load_reg(const float* p) {
  vreg v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store_reg(float* p, vreg v) { std::memcpy(p, &v, sizeof v); }

// s[t][j0 ... j0 + kTileLanes - 1] = q[t] . k[j] for the tile's kTileRows query rows q (fp32, row-major,
// head_dim apart) and K^T kt[d][key] (key_pitch apart).
inline void score_tile(const float* q, const float* kt, int64_t key_pitch, int64_t j0, int64_t head_dim,
                       float* s, int64_t s_pitch) {
  vreg acc[kTileRows] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    const vreg k = load_reg(kt + d * key_pitch + j0);
#pragma GCC unroll 16
    for (int64_t t = 0; t < kTileRows; ++t) acc[t] += q[t * head_dim + d] * k;
  }
#pragma GCC unroll 16
  for (int64_t t = 0; t < kTileRows; ++t) store_reg(s + t * s_pitch + j0, acc[t]);
}

// o[t][d0 ... d0 + kDimRegs * kTileLanes - 1] = sum over keys j < n of p[t][j] * v[j][d] for kValueRows rows of p
// (s_pitch apart) and v (fp32, row-major, v_pitch apart).
inline void value_tile(const float* p, int64_t s_pitch, const float* v, int64_t v_pitch, int64_t n, int64_t d0,
                       float* o, int64_t o_pitch) {
  vreg acc[kValueRows][kDimRegs] = {};
  for (int64_t j = 0; j < n; ++j) {
    vreg vj[kDimRegs];
#pragma GCC unroll 8
    for (int64_t c = 0; c < kDimRegs; ++c) vj[c] = load_reg(v + j * v_pitch + d0 + c * kTileLanes);
#pragma GCC unroll 8
    for (int64_t t = 0; t < kValueRows; ++t) {
      const float pj = p[t * s_pitch + j];
#pragma GCC unroll 8
      for (int64_t c = 0; c < kDimRegs; ++c) acc[t][c] += pj * vj[c];
    }
  }
#pragma GCC unroll 8
  for (int64_t t = 0; t < kValueRows; ++t)
#pragma GCC unroll 8
    for (int64_t c = 0; c < kDimRegs; ++c) store_reg(o + t * o_pitch + d0 + c * kTileLanes, acc[t][c]);
}

#if defined(__AVX512BF16__)
// bf16 models on a CPU with AVX-512 BF16: the scores straight from the bf16 values, with vdpbf16ps (16 lanes,
// each adds the products of two bf16 pairs to an fp32 sum). A product of two bf16 values is exact in fp32, so
// this is the fp32 score tile's arithmetic, summed in pairs, at twice its rate, and no conversion of K or Q.
// q: the tile's query rows as bf16 pairs (a 32-bit word each), half_dim words apart; kt: K^T by pairs,
// kt[p][key] = key's dims 2p and 2p + 1 (key_pitch words apart). The scale is applied to the fp32 sums.
inline void score_tile_bf16(const uint32_t* q, const uint32_t* kt, int64_t key_pitch, int64_t j0, int64_t half_dim,
                            float scale, float* s, int64_t s_pitch) {
  __m512 acc[kTileRows];
#pragma GCC unroll 16
  for (int64_t t = 0; t < kTileRows; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < half_dim; ++p) {
    const __m512bh k = (__m512bh)_mm512_loadu_si512(kt + p * key_pitch + j0);
#pragma GCC unroll 16
    for (int64_t t = 0; t < kTileRows; ++t)
      acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[t * half_dim + p])), k);
  }
#pragma GCC unroll 16
  for (int64_t t = 0; t < kTileRows; ++t) _mm512_storeu_ps(s + t * s_pitch + j0, acc[t] * scale);
}
constexpr bool kBf16Scores = true;
#else
constexpr bool kBf16Scores = false;
#endif

template <typename T, bool kTryPairs = true>
void prefill(const T* query, const T* key, const T* value, const int64_t* starts, const int64_t* lens, T* out,
             int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t q_stride,
             int64_t k_stride, int64_t v_stride, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  constexpr int64_t kValueDims = kDimRegs * kTileLanes;
  const int64_t v_pitch = (head_dim + kValueDims - 1) / kValueDims * kValueDims;   // whole value tiles
  struct Item { int64_t seq, kv_head, row0, row1; };               // prompt rows row0 ... row1 - 1
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t r0 = 0; r0 < lens[s]; r0 += kBlockRows)
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({s, h, r0, std::min(lens[s], r0 + kBlockRows)});
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.row1 > b.row1; });
  // bf16 with AVX-512 BF16 and an even head_dim: scores from bf16 pairs.
  constexpr bool kPairs = kTryPairs && kBf16Scores && std::is_same_v<T, c10::BFloat16>;
  const int64_t half_dim = head_dim / 2;
  if constexpr (kPairs)
    if (head_dim % 2 != 0)
      return prefill<T, false>(query, key, value, starts, lens, out, num_seqs, num_heads, num_kv_heads,
                               head_dim, q_stride, k_stride, v_stride, scale);
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> q32, kt, v32, s, o;
    std::vector<uint32_t> q_pairs, kt_pairs;
    for (int64_t index; (index = next_item.fetch_add(1)) < static_cast<int64_t>(items.size());) {
      const Item& item = items[index];
      const int64_t start = starts[item.seq], num_keys = item.row1;   // its rows see keys < row1 at most
      const int64_t key_pitch = (num_keys + kTileLanes - 1) / kTileLanes * kTileLanes;
      // The item's query rows as (row, head) pairs, row by row: q32[(i - row0) * group + g] is row i of query
      // head kv_head * group + g (those heads are adjacent in a query row), times the scale; padded with zero
      // rows to whole score tiles.
      const int64_t num_rows = (item.row1 - item.row0) * group;
      const int64_t padded_rows = (num_rows + kTileRows - 1) / kTileRows * kTileRows;
      if constexpr (kPairs) {
        // bf16 pairs: q_pairs[r][p] = dims 2p, 2p + 1 of (row, head) pair r; K^T by pairs, kt_pairs[p][key].
        q_pairs.assign(padded_rows * half_dim, 0u);
        for (int64_t i = item.row0; i < item.row1; ++i)              // the group's heads are adjacent
          std::memcpy(q_pairs.data() + (i - item.row0) * group * half_dim,
                      query + (start + i) * q_stride + item.kv_head * group * head_dim, group * head_dim * sizeof(T));
        kt_pairs.assign(half_dim * key_pitch, 0u);
        for (int64_t j = 0; j < num_keys; ++j) {
          const T* k = key + (start + j) * k_stride + item.kv_head * head_dim;
          if (j + kPrefetchRows < num_keys) prefetch(k + kPrefetchRows * k_stride, head_dim * sizeof(T));
          for (int64_t p = 0; p < half_dim; ++p) std::memcpy(&kt_pairs[p * key_pitch + j], k + 2 * p, 4);
        }
      } else {
        q32.assign(padded_rows * head_dim, 0.f);
        for (int64_t i = item.row0; i < item.row1; ++i) {
          const T* q = query + (start + i) * q_stride + item.kv_head * group * head_dim;
          float* dst = q32.data() + (i - item.row0) * group * head_dim;
          for (int64_t e = 0; e < group * head_dim; ++e) dst[e] = to_float(q[e]) * scale;
        }
        // K^T (head_dim, key_pitch) of this KV head in fp32; zero in the padding.
        kt.assign(head_dim * key_pitch, 0.f);
        for (int64_t j = 0; j < num_keys; ++j) {
          const T* k = key + (start + j) * k_stride + item.kv_head * head_dim;
          if (j + kPrefetchRows < num_keys) prefetch(k + kPrefetchRows * k_stride, head_dim * sizeof(T));
          for (int64_t d = 0; d < head_dim; ++d) kt[d * key_pitch + j] = to_float(k[d]);
        }
      }
      // V (num_keys, v_pitch) of this KV head in fp32; zero in the padding.
      v32.assign(num_keys * v_pitch, 0.f);
      for (int64_t j = 0; j < num_keys; ++j) {
        const T* v = value + (start + j) * v_stride + item.kv_head * head_dim;
        if (j + kPrefetchRows < num_keys) prefetch(v + kPrefetchRows * v_stride, head_dim * sizeof(T));
        float* v_row = v32.data() + j * v_pitch;
        for (int64_t d = 0; d < head_dim; ++d) v_row[d] = to_float(v[d]);
      }
      s.resize(kTileRows * key_pitch);
      o.resize(kTileRows * v_pitch);
      for (int64_t r0 = 0; r0 < num_rows; r0 += kTileRows) {
        // Tile rows r0 ... r0 + kTileRows - 1; (row, head) pair r is prompt row row0 + r / group, which sees
        // keys 0 ... that row. The tile's last real pair sees the most keys: n.
        const int64_t last = std::min(r0 + kTileRows, num_rows) - 1;
        const int64_t n = item.row0 + last / group + 1;
        for (int64_t j0 = 0; j0 < n; j0 += kTileLanes) {
#if defined(__AVX512BF16__)
          if constexpr (kPairs) {
            score_tile_bf16(q_pairs.data() + r0 * half_dim, kt_pairs.data(), key_pitch, j0, half_dim, scale,
                            s.data(), key_pitch);
            continue;
          }
#endif
          score_tile(q32.data() + r0 * head_dim, kt.data(), key_pitch, j0, head_dim, s.data(), key_pitch);
        }
        float total[kTileRows];
        for (int64_t t = 0; t < kTileRows; ++t) {
          float* st = s.data() + t * key_pitch;
          const int64_t keys = r0 + t < num_rows ? item.row0 + (r0 + t) / group + 1 : n;   // this row's
          total[t] = exp_and_sum(st, keys);
          for (int64_t j = keys; j < n; ++j) st[j] = 0.f;          // masked: later keys weigh nothing
        }
        for (int64_t t0 = 0; t0 < kTileRows; t0 += kValueRows)
          for (int64_t d0 = 0; d0 < v_pitch; d0 += kValueDims)
            value_tile(s.data() + t0 * key_pitch, key_pitch, v32.data(), v_pitch, n, d0,
                       o.data() + t0 * v_pitch, v_pitch);
        for (int64_t t = 0; t < kTileRows && r0 + t < num_rows; ++t) {
          const int64_t i = item.row0 + (r0 + t) / group, head = item.kv_head * group + (r0 + t) % group;
          T* dst = out + ((start + i) * num_heads + head) * head_dim;
          const float* src = o.data() + t * v_pitch;
          const float inv = 1.f / total[t];
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = from_float<T>(src[d] * inv);
        }
      }
    }
  });
}

at::Tensor prefill_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const at::Tensor& starts, const at::Tensor& lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3, "prefill_attention: query "
              "(num_tokens, num_heads, head_dim) and key, value (num_tokens, num_kv_heads, head_dim) expected");
  for (const at::Tensor* t : {&query, &key, &value})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "prefill_attention: each row's heads must be "
                "contiguous (rows may be strided)");
  TORCH_CHECK(key.sizes() == value.sizes(), "prefill_attention: key and value must have one shape");
  TORCH_CHECK(key.size(0) == query.size(0) && key.size(2) == query.size(2) && query.size(1) % key.size(1) == 0,
              "prefill_attention: key rows and head_dim must match the query's, and num_heads be a multiple of "
              "num_kv_heads");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(),
              "prefill_attention: query, key and value must have one dtype");
  TORCH_CHECK(starts.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && starts.is_contiguous() &&
              lens.is_contiguous() && starts.numel() == lens.numel(), "starts and lens must be int64 (num_seqs,)");
  const int64_t* s = starts.data_ptr<int64_t>();
  const int64_t* l = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < starts.numel(); ++i)
    TORCH_CHECK(s[i] >= 0 && l[i] >= 1 && s[i] + l[i] <= query.size(0), "prefill_attention: sequence ", i,
                " (rows ", s[i], " ... ", s[i] + l[i] - 1, ") is outside the ", query.size(0), " rows");
  at::Tensor out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "prefill_attention", [&] {
    prefill<scalar_t>(query.data_ptr<scalar_t>(), key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(), s, l,
                      out.data_ptr<scalar_t>(), starts.numel(), query.size(1), key.size(1), query.size(2),
                      query.stride(0), key.stride(0), value.stride(0), static_cast<float>(scale));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, float k_scale, float v_scale) -> Tensor");
  m.def("prefill_attention(Tensor query, Tensor key, Tensor value, Tensor starts, Tensor lens, float scale) "
        "-> Tensor");
  m.def("store_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(minivllm_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("store_kv_cache", &store_kv_cache);
}
