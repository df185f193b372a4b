// CPU paged attention ops (pdserve issue 16), built once by engine/attention/cpu_build.py.
//
// Caches are [num_blocks, block_size, KVH, D], contiguous; block tables [S, W] int32;
// seq_lens [S] int32. Sequence s's token i lives at slot
//   block_tables[s, i / block_size] * block_size + i % block_size
// and its K row for head h starts at (slot * KVH + h) * D.
//
// pdserve_cpu::paged_decode reads K/V straight from the cache by block table (no padded
// gather): one work item per (sequence, KV head) computes the G = H / KVH query heads
// sharing that head, with an online softmax updated once per block (scores of a block,
// its max, one rescale of the accumulators, then P @ V of the block).
// pdserve_cpu::write_kv scatters a step's K/V rows into their slots (slot -1: skipped).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "../models/cpu_rows.h"

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

constexpr int64_t kLanes = 16;  // partial sums per dot product: one AVX-512 vector

// sum_d a[d] * b[d], in kLanes independent partial sums (vectorised, no dependency chain
// through one accumulator).
template <typename T>
inline float dot(const float* a, const T* b, int64_t D) {
  float part[kLanes] = {0.f};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) part[j] += a[d + j] * to_f(b[d + j]);
  }
  for (; d < D; ++d) part[d % kLanes] += a[d] * to_f(b[d]);
  // a tree over the lanes (vector adds), not 16 dependent scalar adds
  for (int64_t w = kLanes / 2; w > 0; w /= 2) {
    for (int64_t j = 0; j < w; ++j) part[j] += part[j + w];
  }
  return part[0];
}

#if defined(__AVX512F__)
// fp32 rows whose length is a multiple of 16: one accumulator register, one reduction.
inline float dot(const float* a, const float* b, int64_t D) {
  if (D % 16 != 0) return dot<float>(a, b, D);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  }
  return _mm512_reduce_add_ps(acc);
}
#endif

using pdserve_rows::exp_nonpositive;

// Ask for n rows of D elements, `stride` apart, to be brought into cache (cold KV is
// read from DRAM: without it each block's first touch stalls the walk).
template <typename T>
inline void prefetch_rows(const T* p, int64_t stride, int64_t n, int64_t D) {
  const int64_t bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t t = 0; t < n; ++t) {
    const char* row = reinterpret_cast<const char*>(p + t * stride);
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(row + o);
  }
}

// One sequence's KV heads [h0, h1): out rows [R, D] (fp32) of the R = (h1 - h0) * G query
// heads reading them. A block is walked token by token over all these heads at once, so
// the cache is read in order (a token's heads are adjacent): cold KV streams from DRAM.
template <typename T>
void attend_heads(const float* q, const T* k_cache, const T* v_cache, const int32_t* table,
                  int64_t n, int64_t block_size, int64_t kvh, int64_t h0, int64_t h1,
                  int64_t G, int64_t D, float scale, float* out, float* scratch) {
  const int64_t tok = kvh * D;  // elements between consecutive tokens of one head
  const int64_t R = (h1 - h0) * G;
  float* s = scratch;                       // [R, block_size] scores, then probabilities
  float* m = s + R * block_size;            // [R] running max
  float* l = m + R;                         // [R] running sum
  std::fill(out, out + R * D, 0.f);
  std::fill(m, m + R, -std::numeric_limits<float>::infinity());
  std::fill(l, l + R, 0.f);
  const int64_t blocks = (n + block_size - 1) / block_size;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t nb = std::min(block_size, n - b * block_size);
    const int64_t base = (static_cast<int64_t>(table[b]) * block_size * kvh + h0) * D;
    if (b + 1 < blocks) {  // the next block's rows, while this one computes
      const int64_t next = (static_cast<int64_t>(table[b + 1]) * block_size * kvh + h0) * D;
      prefetch_rows(k_cache + next, tok, block_size, (h1 - h0) * D);
      prefetch_rows(v_cache + next, tok, block_size, (h1 - h0) * D);
    }
    const T* k = k_cache + base;
    for (int64_t t = 0; t < nb; ++t) {
      for (int64_t r = 0; r < R; ++r) {
        s[r * block_size + t] = dot(q + r * D, k + t * tok + (r / G) * D, D) * scale;
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      float* sr = s + r * block_size;
      float bm = m[r];
      for (int64_t t = 0; t < nb; ++t) bm = std::max(bm, sr[t]);
      const float corr = std::exp(m[r] - bm);  // exp(-inf) = 0 on the first block
#pragma omp simd
      for (int64_t t = 0; t < nb; ++t) sr[t] -= bm;
      exp_nonpositive(sr, nb);
      float sum = 0.f;
      for (int64_t t = 0; t < nb; ++t) sum += sr[t];
      l[r] = l[r] * corr + sum;
      m[r] = bm;
      if (corr != 1.f) {
        float* o = out + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] *= corr;
      }
    }
    const T* v = v_cache + base;
    for (int64_t t = 0; t < nb; ++t) {
      for (int64_t r = 0; r < R; ++r) {
        const T* vr = v + t * tok + (r / G) * D;
        const float p = s[r * block_size + t];
        float* o = out + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += p * to_f(vr[d]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.f / l[r];
    float* o = out + r * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

template <typename T>
void decode_impl(const at::Tensor& qf, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& tables, const at::Tensor& lens, float scale, at::Tensor& out) {
  const int64_t S = qf.size(0), H = qf.size(1), D = qf.size(2);
  const int64_t block_size = k_cache.size(1), kvh = k_cache.size(2);
  const int64_t G = H / kvh, W = tables.size(1);
  // work items: (sequence, a range of KV heads); a sequence's heads are split only where
  // there are too few sequences to keep every thread busy
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::min<int64_t>(kvh, std::max<int64_t>(1, (2 * threads + S - 1) / S));
  const int64_t per = (kvh + splits - 1) / splits;
  const float* q = qf.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const int32_t* tab = tables.data_ptr<int32_t>();
  const int32_t* len = lens.data_ptr<int32_t>();
  at::parallel_for(0, S * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(per * G * (block_size + 2));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / splits, h0 = (i % splits) * per, h1 = std::min(kvh, h0 + per);
      if (h0 >= h1) continue;
      const int64_t off = (s * H + h0 * G) * D;  // query heads h0*G .. h1*G-1 of row s
      attend_heads<T>(q + off, kc, vc, tab + s * W, len[s], block_size, kvh, h0, h1, G, D,
                      scale, o + off, scratch.data());
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "paged_decode: q [S, H, D], cache 4-d");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "head_dim of q and cache differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  const int64_t S = q.size(0);
  TORCH_CHECK(block_tables.size(0) >= S && seq_lens.size(0) >= S, "metadata rows < queries");
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  at::Tensor out = at::empty(qf.sizes(), qf.options());
  if (S == 0) return out.to(q.scalar_type());
  const int32_t* len = lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(len[s] >= 1 && (len[s] + k_cache.size(1) - 1) / k_cache.size(1) <=
                block_tables.size(1), "seq_len ", len[s], " out of its block table");
  }
  const float sc = static_cast<float>(scale);
  switch (k_cache.scalar_type()) {
    case at::kFloat: decode_impl<float>(qf, k_cache, v_cache, tables, lens, sc, out); break;
    case at::kBFloat16:
      decode_impl<c10::BFloat16>(qf, k_cache, v_cache, tables, lens, sc, out); break;
    case at::kHalf: decode_impl<c10::Half>(qf, k_cache, v_cache, tables, lens, sc, out); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported cache dtype ", k_cache.scalar_type());
  }
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

template <typename I>
void write_rows(const at::Tensor& x, const at::Tensor& cache, const I* slots, int64_t n) {
  const at::Tensor src = (x.scalar_type() == cache.scalar_type() ? x : x.to(cache.scalar_type()));
  const at::Tensor rows = (src.stride(2) == 1 && src.stride(1) == src.size(2)) ? src
                                                                               : src.contiguous();
  const int64_t row = cache.size(2) * cache.size(3), es = cache.element_size();
  const char* base = static_cast<const char*>(rows.data_ptr());
  char* dst = static_cast<char*>(cache.data_ptr());
  const int64_t stride = rows.stride(0) * es;
  for (int64_t t = 0; t < n; ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(dst + slots[t] * row * es, base + t * stride, row * es);
  }
}

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k.dim() == 3 && k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3),
              "write_kv: k must be [T, KVH, D] of the cache's heads");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t n = std::min<int64_t>(slots.numel(), k.size(0));
  const int64_t total = k_cache.size(0) * k_cache.size(1);
  auto run = [&](auto* sp) {
    for (int64_t t = 0; t < n; ++t) TORCH_CHECK(sp[t] < total, "slot ", sp[t], " out of cache");
    write_rows(k, k_cache, sp, n);
    write_rows(v, v_cache, sp, n);
  };
  if (slots.scalar_type() == at::kInt) {
    run(slots.data_ptr<int32_t>());
  } else {
    TORCH_CHECK(slots.scalar_type() == at::kLong, "slot_mapping must be int32 or int64");
    run(slots.data_ptr<int64_t>());
  }
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> Tensor");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("write_kv", &write_kv);
}
