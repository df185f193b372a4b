// A whole decode step's decoder stack as one CPU op (pdserve issue 16), fp32, built with
// engine/attention/cpu_kernels.cpp by engine/attention/cpu_build.py, and the batch-
// invariant GEMM every decode row is projected with.
//
// At batch 1 a step is a walk over every weight once; what it costs beyond that walk is
// per-op overhead (dozens of torch ops and Python per layer) and a GEMV slower than the
// memory. Here each projection weight is kept once more in a layout read as one
// sequential stream (`pack_rows`: blocks of 64 outputs, k-major, [ceil(N/64), K, 64]),
// and the layers run back to back in C++: norm, QKV GEMV, rotary, KV write, paged
// attention (the pdserve_cpu ops, through the dispatcher), o GEMV, residual + norm,
// gate/up GEMV, silu * up, down GEMV.
//   pack_rows(w [N, K]) -> [ceil(N/64), K, 64]
//   gemv(x [M, K], packed, bias?, n) -> [M, n]            x @ w.T + bias
//   decode_layers(x, cos, sin, norms, weights, biases, k_caches, v_caches, slot_mapping,
//                 block_tables, seq_lens, dims [H, KVH, D, I, qk_norm], eps, scale)
//     -> the residual stream after the last layer (before the final norm)
// Batch invariance: every output of `gemv` is one fused multiply-add chain over k in
// order, whatever the number of rows, the register tile or the thread that computes it,
// so a sequence's numbers do not depend on what it is batched with (oneDNN's GEMMs give
// a row other bits at 1 row than at 2+ for some shapes).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_rows.h"

namespace {

constexpr int64_t kVec = 16;  // outputs per vector (a zmm of floats)
constexpr int64_t kTileRows = 6;  // input rows per register tile
constexpr int64_t kTileBlocks = 4;  // vectors per register tile
constexpr int64_t kBlock = kVec * kTileBlocks;  // outputs per block of the packed layout

// y[r][c*16 + j] for r < R, c < C, j < valid(c) of one register tile: every output is
// one fused multiply-add chain over k = 0, 1, ..., K-1 from zero (then + bias), whatever
// R and C the tile has, so a row's bits do not depend on its batch. `w` is the tile's
// first vector in a packed block [K, 64]: its next vectors follow it.
template <int R, int C>
inline void tile(const float* w, const float* x, int64_t ldx, int64_t K, float* y,
                 int64_t ldy, int64_t last_valid, const float* bias) {
  auto valid = [&](int c) { return c + 1 == C ? last_valid : kVec; };
#if defined(__AVX512F__)
  auto mask = [&](int c) {
    const int64_t v = valid(c);
    return v >= kVec ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << v) - 1);
  };
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_ps(w + k * kBlock + c * kVec);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(wv[c], xb, acc[r][c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask(c), bias + c * kVec) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 v = bias ? _mm512_add_ps(acc[r][c], b) : acc[r][c];
      _mm512_mask_storeu_ps(y + r * ldy + c * kVec, mask(c), v);
    }
  }
#else
  float acc[R][C][kVec] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int64_t j = 0; j < kVec; ++j)
          acc[r][c][j] = std::fma(w[k * kBlock + c * kVec + j], x[r * ldx + k], acc[r][c][j]);
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < valid(c); ++j)
        y[r * ldy + c * kVec + j] = bias ? acc[r][c][j] + bias[c * kVec + j] : acc[r][c][j];
#endif
}

template <int C>
inline void tile_rows(int64_t R, const float* w, const float* x, int64_t ldx, int64_t K,
                      float* y, int64_t ldy, int64_t last_valid, const float* bias) {
  switch (R) {
    case 1: tile<1, C>(w, x, ldx, K, y, ldy, last_valid, bias); break;
    case 2: tile<2, C>(w, x, ldx, K, y, ldy, last_valid, bias); break;
    case 3: tile<3, C>(w, x, ldx, K, y, ldy, last_valid, bias); break;
    case 4: tile<4, C>(w, x, ldx, K, y, ldy, last_valid, bias); break;
    case 5: tile<5, C>(w, x, ldx, K, y, ldy, last_valid, bias); break;
    default: tile<6, C>(w, x, ldx, K, y, ldy, last_valid, bias); break;
  }
}

// y [M, n] (row stride ldy) = x [M, K] (row stride ldx) @ W.T (+ bias), W packed. The
// threads split the output vectors evenly; each walks its vectors up to four at a time
// (within a packed block) and, for each group, every input row six at a time (the
// group's weights stay in L2; cutting K into L1-sized pieces measured 10-20% slower).
void gemv_into(const float* x, int64_t ldx, int64_t M, const at::Tensor& packed,
               const at::Tensor* bias, int64_t n, float* y, int64_t ldy) {
  const int64_t K = packed.size(1), vecs = (n + kVec - 1) / kVec;
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  // at least ~64K multiply-adds a task, so a tiny projection stays on one thread
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, M * K * kVec));
  at::parallel_for(0, vecs, grain, [&](int64_t v0, int64_t v1) {
    for (int64_t v = v0; v < v1;) {
      const int64_t c0 = v % kTileBlocks, nv = std::min(kTileBlocks - c0, v1 - v);
      const int64_t col = v * kVec, last_valid = std::min(kVec, n - (v + nv - 1) * kVec);
      const float* w = wp + (v / kTileBlocks) * K * kBlock + c0 * kVec;
      const float* bb = bp ? bp + col : nullptr;
      for (int64_t m = 0; m < M; m += kTileRows) {
        const int64_t R = std::min(kTileRows, M - m);
        const float* xm = x + m * ldx;
        float* ym = y + m * ldy + col;
        switch (nv) {
          case 1: tile_rows<1>(R, w, xm, ldx, K, ym, ldy, last_valid, bb); break;
          case 2: tile_rows<2>(R, w, xm, ldx, K, ym, ldy, last_valid, bb); break;
          case 3: tile_rows<3>(R, w, xm, ldx, K, ym, ldy, last_valid, bb); break;
          default: tile_rows<4>(R, w, xm, ldx, K, ym, ldy, last_valid, bb); break;
        }
      }
      v += nv;
    }
  });
}

void check_packed(const at::Tensor& p, int64_t K, int64_t n, const char* what) {
  TORCH_CHECK(p.scalar_type() == at::kFloat && p.dim() == 3 && p.size(2) == kBlock &&
                  p.is_contiguous() && p.size(1) == K && p.size(0) * kBlock >= n,
              what, ": a pack_rows weight [ceil(", n, "/64), ", K, ", 64] was expected, got ",
              p.sizes());
}

at::Tensor pack_rows(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack_rows: fp32 [N, K]");
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + kBlock - 1) / kBlock;
  at::Tensor padded = at::zeros({blocks * kBlock, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({blocks, kBlock, K}).transpose(1, 2).contiguous();
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "gemv: x fp32 [M, K] with unit inner stride");
  check_packed(packed, x.size(1), n, "gemv");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  const at::Tensor* b = bias.has_value() && bias->defined() ? &*bias : nullptr;
  TORCH_CHECK(!b || (b->is_contiguous() && b->numel() == n && b->scalar_type() == at::kFloat),
              "gemv: bias [n] fp32");
  gemv_into(x.data_ptr<float>(), x.stride(0), x.size(0), packed, b, n, y.data_ptr<float>(), n);
  return y;
}

at::Tensor decode_layers(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList norms, at::TensorList weights,
                         c10::List<c10::optional<at::Tensor>> biases, at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, at::IntArrayRef dims, double eps_d,
                         double scale) {
  using pdserve_rows::norm_row;
  TORCH_CHECK(dims.size() == 5, "decode_layers: dims [H, KVH, D, I, qk_norm]");
  const int64_t H = dims[0], KVH = dims[1], D = dims[2], I = dims[3];
  const bool qk_norm = dims[4] != 0;
  const int64_t L = static_cast<int64_t>(k_caches.size()), per_norm = qk_norm ? 4 : 2;
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "decode_layers: x fp32 [T, hidden]");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == per_norm * L &&
                  static_cast<int64_t>(weights.size()) == 4 * L &&
                  static_cast<int64_t>(biases.size()) == 4 * L &&
                  static_cast<int64_t>(v_caches.size()) == L,
              "decode_layers: per layer 4 weights, 4 biases, ", per_norm, " norms, 2 caches");
  const int64_t T = x_in.size(0), hid = x_in.size(1), QKV = (H + 2 * KVH) * D;
  const float eps = static_cast<float>(eps_d);
  const at::Tensor c = cos.reshape({T, D}).contiguous(), s = sin.reshape({T, D}).contiguous();
  TORCH_CHECK(c.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat, "rotary fp32");
  for (int64_t i = 0; i < L; ++i) {
    check_packed(weights[4 * i], hid, QKV, "qkv");
    check_packed(weights[4 * i + 1], H * D, hid, "o_proj");
    check_packed(weights[4 * i + 2], hid, 2 * I, "gate_up");
    check_packed(weights[4 * i + 3], I, hid, "down_proj");
  }
  static auto attend = c10::Dispatcher::singleton()
      .findSchemaOrThrow("pdserve_cpu::paged_decode", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, double)>();
  static auto write = c10::Dispatcher::singleton()
      .findSchemaOrThrow("pdserve_cpu::write_kv", "")
      .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                  const at::Tensor&)>();
  const auto opts = x_in.options();
  at::Tensor x = x_in.contiguous().clone();  // the residual stream, updated in place
  at::Tensor h = at::empty({T, hid}, opts), qkv = at::empty({T, QKV}, opts);
  at::Tensor q = at::empty({T, H, D}, opts), k = at::empty({T, KVH, D}, opts);
  at::Tensor gu = at::empty({T, 2 * I}, opts), act = at::empty({T, I}, opts);
  at::Tensor delta = at::empty({T, hid}, opts), tmp = at::empty({D}, opts);
  float *xp = x.data_ptr<float>(), *hp = h.data_ptr<float>(), *qkvp = qkv.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *gp = gu.data_ptr<float>();
  float *dp = delta.data_ptr<float>(), *tp = tmp.data_ptr<float>();
  const float *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
  std::vector<c10::optional<at::Tensor>> held(4 * L);  // keeps bias() pointers alive
  for (int64_t j = 0; j < 4 * L; ++j) held[j] = biases.get(j);
  auto b_at = [&](int64_t j) -> const at::Tensor* {
    return held[j].has_value() && held[j]->defined() ? &*held[j] : nullptr;
  };
  auto project = [&](const at::Tensor& in, int64_t j, int64_t n, float* y) {  // y = in @ W_j.T + b_j
    gemv_into(in.data_ptr<float>(), in.size(1), T, weights[j], b_at(j), n, y, n);
  };
  auto add_norm = [&](const at::Tensor& w) {  // x += delta; h = norm(x)
    const float* wp = w.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      float* xr = xp + t * hid;
      const float* dr = dp + t * hid;
#pragma omp simd
      for (int64_t i = 0; i < hid; ++i) xr[i] += dr[i];
      norm_row(xr, wp, eps, hid, hp + t * hid);
    }
  };
  for (int64_t t = 0; t < T; ++t)
    norm_row(xp + t * hid, norms[0].data_ptr<float>(), eps, hid, hp + t * hid);
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor* nw = &norms[per_norm * i];
    project(h, 4 * i, QKV, qkvp);
    for (int64_t t = 0; t < T; ++t) {
      const float* ct = cp + t * D;
      const float* st = sp + t * D;
      for (int64_t j = 0; j < H + KVH; ++j) {
        const float* src = qkvp + t * QKV + j * D;
        if (qk_norm) {
          norm_row(src, nw[j < H ? 2 : 3].data_ptr<float>(), eps, D, tp);
          src = tp;
        }
        float* dst = j < H ? qp + (t * H + j) * D : kp + (t * KVH + j - H) * D;
        pdserve_rows::rope_row(src, ct, st, D, dst);
      }
    }
    const at::Tensor v = qkv.narrow(1, (H + KVH) * D, KVH * D).view({T, KVH, D});
    at::Tensor kc = k_caches[i], vc = v_caches[i];
    write.call(k, v, kc, vc, slot_mapping);
    const at::Tensor o = attend.call(q, kc, vc, block_tables, seq_lens, scale);
    project(o.view({T, H * D}), 4 * i + 1, hid, dp);
    add_norm(nw[1]);
    project(h, 4 * i + 2, 2 * I, gp);
    // torch's own silu and mul on the same views as the layer loop: bit for bit its
    // activations, so a decode row's tokens do not depend on the path its batch took
    at::mul_out(act, at::silu(gu.narrow(1, 0, I)), gu.narrow(1, I, I));
    project(act, 4 * i + 3, hid, dp);
    if (i + 1 < L) {
      add_norm(norms[per_norm * (i + 1)]);
    } else {
      for (int64_t j = 0; j < T * hid; ++j) xp[j] += dp[j];
    }
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("pack_rows(Tensor w) -> Tensor");
  m.def("gemv(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] weights, "
        "Tensor?[] biases, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int[] dims, float eps, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("pack_rows", &pack_rows);
  m.impl("gemv", &gemv);
  m.impl("decode_layers", &decode_layers);
}
