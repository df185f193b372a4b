// A whole decode step's decoder stack as one CPU op (pdserve issue 16), fp32, built with
// engine/attention/cpu_kernels.cpp by engine/attention/cpu_build.py.
//
// At batch 1 a step is a walk over every weight once; what it costs beyond that walk is
// per-op overhead (dozens of torch ops and Python per layer) and a GEMV slower than the
// memory. Here each projection weight is kept once more in a layout read as one
// sequential stream (`pack_rows`: blocks of 16 output rows, k-major, [ceil(N/16), K, 16]),
// and the layers run back to back in C++: norm, QKV GEMV, rotary, KV write, paged
// attention (the pdserve_cpu ops, through the dispatcher), o GEMV, residual + norm,
// gate/up GEMV, silu * up, down GEMV.
//   pack_rows(w [N, K]) -> [ceil(N/16), K, 16]
//   gemv(x [M, K], packed, bias?, n) -> [M, n]            x @ w.T + bias
//   decode_layers(x, cos, sin, norms, weights, biases, k_caches, v_caches, slot_mapping,
//                 block_tables, seq_lens, dims [H, KVH, D, I, qk_norm], eps, scale)
//     -> the residual stream after the last layer (before the final norm)
// Every output row's dot products run in the same order whatever the batch (rows are
// taken four at a time, each with its own accumulators): a sequence's numbers do not
// depend on what it is batched with.

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

constexpr int64_t kBlock = 16;  // output rows per block of the packed layout
constexpr int64_t kUnroll = 4;  // independent partial sums over k per output row

// Rows [0, M) (M <= 4) of y[:, b*16 .. b*16+16) for one packed block `w` [K, 16].
template <int M>
inline void block_rows(const float* w, const float* x, int64_t ldx, int64_t K, float* y,
                       int64_t ldy, int64_t valid) {
#if defined(__AVX512F__)
  __m512 acc[M][kUnroll];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < kUnroll; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kUnroll <= K; k += kUnroll) {
    for (int u = 0; u < kUnroll; ++u) {
      const __m512 wv = _mm512_load_ps(w + (k + u) * kBlock);
      for (int m = 0; m < M; ++m)
        acc[m][u] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[m * ldx + k + u]), acc[m][u]);
    }
  }
  for (; k < K; ++k) {
    const __m512 wv = _mm512_load_ps(w + k * kBlock);
    for (int m = 0; m < M; ++m)
      acc[m][0] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[m * ldx + k]), acc[m][0]);
  }
  const __mmask16 mask = valid >= kBlock ? 0xffff : static_cast<__mmask16>((1u << valid) - 1);
  for (int m = 0; m < M; ++m) {
    const __m512 s = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]),
                                   _mm512_add_ps(acc[m][2], acc[m][3]));
    _mm512_mask_storeu_ps(y + m * ldy, mask, s);
  }
#else
  float acc[M][kUnroll][kBlock] = {};
  int64_t k = 0;
  for (; k + kUnroll <= K; k += kUnroll)
    for (int u = 0; u < kUnroll; ++u)
      for (int m = 0; m < M; ++m)
        for (int64_t j = 0; j < kBlock; ++j)
          acc[m][u][j] += w[(k + u) * kBlock + j] * x[m * ldx + k + u];
  for (; k < K; ++k)
    for (int m = 0; m < M; ++m)
      for (int64_t j = 0; j < kBlock; ++j) acc[m][0][j] += w[k * kBlock + j] * x[m * ldx + k];
  for (int m = 0; m < M; ++m)
    for (int64_t j = 0; j < valid && j < kBlock; ++j)
      y[m * ldy + j] = (acc[m][0][j] + acc[m][1][j]) + (acc[m][2][j] + acc[m][3][j]);
#endif
}

// y [M, n] (row stride ldy) = x [M, K] (row stride ldx) @ W.T (+ bias), W packed.
void gemv_into(const float* x, int64_t ldx, int64_t M, const at::Tensor& packed,
               const at::Tensor* bias, int64_t n, float* y, int64_t ldy) {
  const int64_t blocks = packed.size(0), K = packed.size(1);
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* w = wp + b * K * kBlock;
      const int64_t col = b * kBlock, valid = std::min(kBlock, n - col);
      for (int64_t m = 0; m < M; m += 4) {
        const float* xm = x + m * ldx;
        float* ym = y + m * ldy + col;
        switch (std::min<int64_t>(4, M - m)) {
          case 1: block_rows<1>(w, xm, ldx, K, ym, ldy, valid); break;
          case 2: block_rows<2>(w, xm, ldx, K, ym, ldy, valid); break;
          case 3: block_rows<3>(w, xm, ldx, K, ym, ldy, valid); break;
          default: block_rows<4>(w, xm, ldx, K, ym, ldy, valid); break;
        }
        if (bp)
          for (int64_t r = m; r < std::min(M, m + 4); ++r)
            for (int64_t j = 0; j < valid; ++j) y[r * ldy + col + j] += bp[col + j];
      }
    }
  });
}

void check_packed(const at::Tensor& p, int64_t K, int64_t n, const char* what) {
  TORCH_CHECK(p.scalar_type() == at::kFloat && p.dim() == 3 && p.size(2) == kBlock &&
                  p.is_contiguous() && p.size(1) == K && p.size(0) * kBlock >= n,
              what, ": a pack_rows weight [ceil(", n, "/16), ", K, ", 16] was expected, got ",
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
                         c10::List<c10::optional<at::Tensor>> biases, at::TensorList onednn,
                         at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, at::IntArrayRef dims, double eps_d,
                         double scale, int64_t gemv_rows) {
  using pdserve_rows::norm_row;
  TORCH_CHECK(dims.size() == 5, "decode_layers: dims [H, KVH, D, I, qk_norm]");
  const int64_t H = dims[0], KVH = dims[1], D = dims[2], I = dims[3];
  const bool qk_norm = dims[4] != 0;
  const int64_t L = static_cast<int64_t>(k_caches.size()), per_norm = qk_norm ? 4 : 2;
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "decode_layers: x fp32 [T, hidden]");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == per_norm * L &&
                  (weights.empty() || static_cast<int64_t>(weights.size()) == 4 * L) &&
                  static_cast<int64_t>(biases.size()) == 4 * L &&
                  static_cast<int64_t>(v_caches.size()) == L,
              "decode_layers: per layer 4 weights, 4 biases, ", per_norm, " norms, 2 caches");
  const int64_t T = x_in.size(0), hid = x_in.size(1), QKV = (H + 2 * KVH) * D;
  const float eps = static_cast<float>(eps_d);
  const at::Tensor c = cos.reshape({T, D}).contiguous(), s = sin.reshape({T, D}).contiguous();
  TORCH_CHECK(c.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat, "rotary fp32");
  TORCH_CHECK(onednn.empty() || static_cast<int64_t>(onednn.size()) == 4 * L,
              "decode_layers: 4 oneDNN weights per layer, or none");
  // rows past gemv_rows multiply oneDNN's packed weights (a GEMM beats the GEMV there)
  const bool gemm = !onednn.empty() && T > gemv_rows;
  TORCH_CHECK(gemm || !weights.empty(), "decode_layers: no row-block weights for ", T, " rows");
  for (int64_t i = 0; i < L && !gemm; ++i) {
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
  static auto linear = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                        c10::string_view, c10::List<std::optional<at::Scalar>>,
                        std::optional<c10::string_view>)>();
  // y [T, n] = x [T, K] @ W_j.T + b_j, on whichever packed copy serves T rows
  auto project = [&](const at::Tensor& in, int64_t j, int64_t n, float* y) {
    if (!gemm) {
      gemv_into(in.data_ptr<float>(), in.size(1), T, weights[j], b_at(j), n, y, n);
      return;
    }
    const at::Tensor r = linear.call(in, onednn[j], held[j], "none",
                                     c10::List<std::optional<at::Scalar>>(), "");
    std::copy(r.data_ptr<float>(), r.data_ptr<float>() + T * n, y);
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
        "Tensor?[] biases, Tensor[] onednn, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int[] dims, float eps, "
        "float scale, int gemv_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("pack_rows", &pack_rows);
  m.impl("gemv", &gemv);
  m.impl("decode_layers", &decode_layers);
}

// oneDNN's packed weights are MkldnnCPU tensors: a step that takes them dispatches there
TORCH_LIBRARY_IMPL(pdserve_cpu, MkldnnCPU, m) {
  m.impl("decode_layers", &decode_layers);
}
