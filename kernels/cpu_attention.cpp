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
// scattered over the pool, where the hardware prefetcher loses the stream; it also saves a division per token.
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
#include <utility>
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

// The same into L2 only (prefetcht1), for the AVX-512 decode path, which asks for whole blocks ahead from memory:
// a request into L1 holds one of its few miss buffers per line until the line arrives, which stalls the stream.
inline void prefetch_l2(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(static_cast<const char*>(p) + off, 0, 2);
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
// ---- the AVX-512 decode path: a sequence (or one of its KV heads) per work item, block by block ----
//
// For fp32 and bf16 caches, and fp8 e4m3 caches under an fp32 or bf16 model (widened block by block:
// widen_e4m3), with head_dim 32, 64 or 128 and the GQA groups listed in try_decode_tiled (the default model:
// 3 x 64). A work item is one sequence with all its KV heads when there are enough sequences (at least 4 a thread), else one sequence's one KV head (batch 1 still uses every thread). Both passes walk
// the item's blocks in order and, within a block, its heads in order, so each block's rows (contiguous in the
// cache) are read front to back once, the way the hardware streams memory best.
//   Pass 1 (scores): for each run of up to 16 tokens and each of the G query rows that share the KV head, 16
//     registers of partial products (dot_lanes: vdpbf16ps straight from the bf16 values where the CPU has it,
//     else fp32 multiply-adds), then one transpose-and-add (transpose_sum16) turns them into one register of 16
//     scores. A horizontal sum per score costs 8 dependent instructions; this costs about 3.
//   Pass 2 (P V): each value row is loaded once and added into G x NC accumulator registers, held in registers
//     for a block and kept in a small buffer between blocks. A bf16 row is split into its even and odd elements
//     (a shift and a mask: no conversion instructions), so the accumulators hold the dims in that order until
//     the output is written.
// Memory: a pass asks for the block kAheadBlocks on while it reads the current one (into L2: prefetcht1; asking for
// L1 fills its few miss buffers and stalls), the first value blocks during the
// last key blocks, and the next item's first key blocks during the last value blocks (a thread claims its next
// item when it starts one). Items are handed out longest first from a shared counter.
// Its time per layer against the PyTorch reference is in docs/benchmarks.md.
constexpr int64_t kAheadBlocks = 2;            // a block's slices are asked for this many blocks ahead
typedef float v16 __attribute__((vector_size(64)));   // 16 fp32 lanes (the same type as __m512)

// A register whose lane i is the sum of p[i]'s 16 lanes: 16 scores' horizontal sums in 45 shuffles and adds
// (one _mm512_reduce_add_ps per score is 8, in a chain). Each step adds pairs of registers after interleaving
// them, halving the count: 32-bit lanes, then 64-bit, then 128-bit quarters twice.
inline __m512 transpose_sum16(const __m512 (&p)[16]) {
  __m512 a[8], b[4], c[2];
  for (int j = 0; j < 8; ++j)       // per quarter: [p0+p2, q0+q2, p1+p3, q1+q3] of rows 2j (p) and 2j+1 (q)
    a[j] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * j], p[2 * j + 1]), _mm512_unpackhi_ps(p[2 * j], p[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {     // per quarter: rows 4j ... 4j+3, each summed over that quarter's 4 lanes
    const __m512d x = _mm512_castps_pd(a[2 * j]), y = _mm512_castps_pd(a[2 * j + 1]);
    b[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int j = 0; j < 2; ++j)       // quarters 0+1 and 2+3 of b[2j], then of b[2j+1]
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // quarter k of the result: rows 4k ... 4k+3
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// 16 lanes whose sum is q . k over head_dim = 16 NC (q and k in the cache's dtype): vdpbf16ps on bf16 pairs
// where the CPU has it (products exact in fp32, sums in fp32), else fp32 multiply-adds.
template <typename C, int NC>
inline __m512 dot_lanes(const C* q, const C* k) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<C, c10::BFloat16>) {
    __m512 a = _mm512_setzero_ps();
    for (int c = 0; c < NC / 2; ++c)
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q + 32 * c), (__m512bh)_mm512_loadu_si512(k + 32 * c));
    return a;
  }
#endif
  __m512 a = _mm512_mul_ps(minivllm_cpu::load16(q), minivllm_cpu::load16(k));
  for (int c = 1; c < NC; ++c)
    a = _mm512_fmadd_ps(minivllm_cpu::load16(q + 16 * c), minivllm_cpu::load16(k + 16 * c), a);
  return a;
}

// An fp8 e4m3 cache in this path: each block's slice of K or V is widened first, once for all G query heads, into a
// small buffer of Row values (bf16 for a bf16 model, fp32 for fp32), and the passes read that. Every e4m3 value
// is exactly a bf16 value (4 exponent bits and 3 mantissa bits fit in bf16's 8 and 7), so this loses nothing.
// Row<Q, C>: what the passes read: the cache's own dtype, or for fp8 the query's.
template <typename Q, typename C>
using Row = std::conditional_t<std::is_same_v<C, c10::Float8_e4m3fn>, Q, C>;

// The bf16 bits of the e4m3 magnitudes 0 ... 127 (sign bit clear), as four registers of 32: a table lookup is
// exact for subnormals and NaN alike, where bit arithmetic needs a case for each.
struct E4m3Table {
  alignas(64) uint16_t bits[128];
  E4m3Table() {
    for (int m = 0; m < 128; ++m) {
      const c10::Float8_e4m3fn e(static_cast<uint8_t>(m), c10::Float8_e4m3fn::from_bits());
      bits[m] = c10::BFloat16(static_cast<float>(e)).x;
    }
  }
};
inline const E4m3Table& e4m3_table() {
  static const E4m3Table table;
  return table;
}

// 32 e4m3 values -> 32 bf16 (exact): the magnitude's 7 bits index the 128-entry table (two 64-entry lookups,
// vpermt2w, chosen by bit 6), then the sign bit moves from bit 7 to bit 15.
inline __m512i e4m3x32_to_bf16(const void* p, const __m512i (&table)[4]) {
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  const __m512i lo = _mm512_permutex2var_epi16(table[0], b, table[1]);     // indexes use bits 0-5 only
  const __m512i hi = _mm512_permutex2var_epi16(table[2], b, table[3]);
  const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(b, _mm512_set1_epi16(0x40)), lo, hi);
  const __m512i sign = _mm512_and_si512(_mm512_slli_epi16(b, 8), _mm512_set1_epi16(static_cast<short>(0x8000)));
  return _mm512_or_si512(mag, sign);
}

// dst[i * head_dim + d] = row i's value d widened to R (bf16 or fp32), for the n rows of a block slice of an fp8
// cache (rows `token_stride` apart); head_dim is a multiple of 32.
template <typename R>
void widen_e4m3(const c10::Float8_e4m3fn* src, int64_t n, int64_t token_stride, int64_t head_dim, R* dst) {
  const uint16_t* bits = e4m3_table().bits;
  const __m512i table[4] = {_mm512_load_si512(bits), _mm512_load_si512(bits + 32), _mm512_load_si512(bits + 64),
                            _mm512_load_si512(bits + 96)};
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < head_dim; d += 32) {
      const __m512i v = e4m3x32_to_bf16(src + i * token_stride + d, table);
      if constexpr (std::is_same_v<R, c10::BFloat16>) {
        _mm512_storeu_si512(dst + i * head_dim + d, v);
      } else {                                                   // fp32: a bf16's bits are an fp32's top half
        _mm512_storeu_si512(dst + i * head_dim + d,
                            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
        _mm512_storeu_si512(dst + i * head_dim + d + 16,
                            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
      }
    }
}

// A block slice as the passes read it: token i's values at rows + i * stride. The cache's own rows, or for fp8
// the slice widened into `wide` (rows head_dim apart).
template <typename R, typename C>
inline std::pair<const R*, int64_t> slice_rows(const C* slice, int64_t n, int64_t token_stride, int64_t head_dim,
                                               R* wide) {
  if constexpr (std::is_same_v<R, C>) {
    return {slice, token_stride};
  } else {
    widen_e4m3(slice, n, token_stride, head_dim, wide);
    return {wide, head_dim};
  }
}

template <typename Q, typename C, int G, int NC>
void decode_tiled(const Q* query, const C* key_cache, const C* value_cache, const int32_t* block_tables,
                  const int32_t* seq_lens, Q* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                  int64_t block_size, int64_t max_blocks, float scale, float v_scale) {
  constexpr int64_t head_dim = 16 * NC;
  using R = Row<Q, C>;                                           // what the passes read (see widen_e4m3)
  constexpr bool kFp8 = !std::is_same_v<R, C>;
  static_assert((!std::is_same_v<R, c10::BFloat16> && !kFp8) || NC % 2 == 0,
                "bf16 and fp8 rows are read 32 values a register (dot_lanes, the even/odd split of V, widen_e4m3)");
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  const int64_t span = num_seqs >= 4 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / span;
  std::vector<int64_t> order(num_seqs * items_per_seq);          // items, longest first
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return seq_lens[a / items_per_seq] > seq_lens[b / items_per_seq];
  });
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores;
    std::vector<v16> accs(span * G * NC);                        // accumulators between blocks: row r, part c
    std::vector<float> total(span * G);                          // the softmax's denominators
    std::vector<R> wide(kFp8 ? block_size * head_dim : 0);        // fp8: a block slice widened, rows head_dim apart
    const int64_t num_items = static_cast<int64_t>(order.size());
    // the item after this one is claimed when this one starts, so that this one's last value blocks can ask for
    // its first key blocks
    for (int64_t index = next_item.fetch_add(1), upcoming; index < num_items; index = upcoming) {
      upcoming = next_item.fetch_add(1);
      const int64_t seq = order[index] / items_per_seq, h0 = (order[index] % items_per_seq) * span;
      const int64_t len = seq_lens[seq], num_blocks = (len + block_size - 1) / block_size;
      const int32_t* table = block_tables + seq * max_blocks;
      const C* upcoming_keys = nullptr;                          // the upcoming item's key slices, block 0 ...
      const int32_t* upcoming_table = nullptr;
      int64_t upcoming_blocks = 0;
      if (upcoming < num_items) {
        const int64_t s2 = order[upcoming] / items_per_seq;
        upcoming_keys = key_cache + (order[upcoming] % items_per_seq) * span * head_dim;
        upcoming_table = block_tables + s2 * max_blocks;
        upcoming_blocks = (seq_lens[s2] + block_size - 1) / block_size;
      }
      scores.resize(span * G * len);                             // scores[r * len + t]
      for (int64_t b = 0; b < num_blocks; ++b) {
        const C* block = key_cache + table[b] * block_stride + h0 * head_dim;
        const int64_t ahead = b + kAheadBlocks;
        const C* next = ahead < num_blocks ? key_cache + table[ahead] * block_stride + h0 * head_dim
                                           : value_cache + table[std::min(ahead - num_blocks, num_blocks - 1)] *
                                                 block_stride + h0 * head_dim;
        const int64_t t0 = b * block_size, n = std::min(block_size, len - t0);
        for (int64_t hh = 0; hh < span; ++hh) {
          const auto [rows, stride] = slice_rows<R>(block + hh * head_dim, n, token_stride, head_dim, wide.data());
          const R* q_rows = query + (seq * num_heads + (h0 + hh) * G) * head_dim;
          float* srow = scores.data() + hh * G * len + t0;
          for (int64_t i0 = 0; i0 < n; i0 += 16) {
            const int64_t m = std::min<int64_t>(16, n - i0);
            for (int64_t i = 0; i < m; ++i)
              prefetch_l2(next + (i0 + i) * token_stride + hh * head_dim, head_dim * sizeof(C));
            for (int g = 0; g < G; ++g) {
              __m512 part[16];
#pragma GCC unroll 16
              for (int i = 0; i < 16; ++i)
                part[i] = i < m ? dot_lanes<R, NC>(q_rows + g * head_dim, rows + (i0 + i) * stride)
                                : _mm512_setzero_ps();
              const __mmask16 lanes = static_cast<__mmask16>(m == 16 ? 0xffff : (1u << m) - 1);
              _mm512_mask_storeu_ps(srow + g * len + i0, lanes,
                                    _mm512_mul_ps(transpose_sum16(part), _mm512_set1_ps(scale)));
            }
          }
        }
      }
      for (int64_t r = 0; r < span * G; ++r) total[r] = exp_and_sum(scores.data() + r * len, len);
      std::fill(accs.begin(), accs.end(), v16{});
      for (int64_t b = 0; b < num_blocks; ++b) {
        const C* block = value_cache + table[b] * block_stride + h0 * head_dim;
        const int64_t ahead = b + kAheadBlocks;
        const C* next = ahead < num_blocks ? value_cache + table[ahead] * block_stride + h0 * head_dim
                        : ahead - num_blocks < upcoming_blocks
                            ? upcoming_keys + upcoming_table[ahead - num_blocks] * block_stride : nullptr;
        const int64_t t0 = b * block_size, n = std::min(block_size, len - t0);
        for (int64_t hh = 0; hh < span; ++hh) {
          v16 acc[G][NC];
          for (int g = 0; g < G; ++g)
            for (int c = 0; c < NC; ++c) acc[g][c] = accs[(hh * G + g) * NC + c];
          const float* prow = scores.data() + hh * G * len + t0;
          const auto [rows, stride] = slice_rows<R>(block + hh * head_dim, n, token_stride, head_dim, wide.data());
          for (int64_t i = 0; i < n; ++i) {
            if (next != nullptr) prefetch_l2(next + i * token_stride + hh * head_dim, head_dim * sizeof(C));
            v16 v[NC];
            if constexpr (std::is_same_v<R, c10::BFloat16>) {
              // a register of 32 bf16 values gives two of fp32: the even elements and the odd ones, so
              // acc[g][2 c2] holds dims 32 c2 + 0, 2, 4 ... and acc[g][2 c2 + 1] dims 32 c2 + 1, 3, 5 ...
              for (int c2 = 0; c2 < NC / 2; ++c2) {
                const __m512i w = _mm512_loadu_si512(rows + i * stride + 32 * c2);
                v[2 * c2] = (v16)_mm512_slli_epi32(w, 16);
                v[2 * c2 + 1] = (v16)_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
              }
            } else {
              for (int c = 0; c < NC; ++c)
                v[c] = minivllm_cpu::load16(rows + i * stride + 16 * c);
            }
            for (int g = 0; g < G; ++g) {
              const float p = prow[g * len + i];
              for (int c = 0; c < NC; ++c) acc[g][c] += p * v[c];
            }
          }
          for (int g = 0; g < G; ++g)
            for (int c = 0; c < NC; ++c) accs[(hh * G + g) * NC + c] = acc[g][c];
        }
      }
      for (int64_t r = 0; r < span * G; ++r) {
        Q* o = out + (seq * num_heads + h0 * G + r) * head_dim;
        const float norm = v_scale / total[r];
        for (int c = 0; c < NC; ++c) {
          float lanes[16];
          std::memcpy(lanes, &accs[r * NC + c], sizeof lanes);
          for (int l = 0; l < 16; ++l) {
            const int64_t d = std::is_same_v<R, c10::BFloat16> ? 32 * (c / 2) + 2 * l + c % 2 : 16 * c + l;
            o[d] = from_float<Q>(lanes[l] * norm);
          }
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
  using R = Row<Q, C>;
  if constexpr (!std::is_same_v<Q, R> || !(std::is_same_v<R, float> || std::is_same_v<R, c10::BFloat16>)) {
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
              "share one dtype (for an fp8 cache, quantize K and V first: reference.quantize_fp8)");
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
