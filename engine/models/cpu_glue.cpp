// The Llama layer's elementwise glue as single CPU ops (pdserve issue 16), fp32, built
// with engine/attention/cpu_kernels.cpp by engine/attention/cpu_build.py.
//
// A decode step of a thin model runs ~40 small torch ops per layer; each of these ops
// replaces several of them (and their temporaries) with one pass over the rows. (silu *
// up stays torch's: its vectorised exp beat a fused loop here, 229 us against 2.4 ms
// for 512 rows.)
//   rms_norm(x, w, eps)               transformers' RMSNorm: w * (x * rsqrt(mean(x^2) + eps))
//   add_rms_norm(x, delta, w, eps)    (x + delta, rms_norm(x + delta)): the residual add fused
//   rope(x [T, N, D], cos, sin)       x * cos + roll(x, D/2) * sin (sin's first half negated),
//                                     element for element as torch computes it (no FMA)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

#include "cpu_rows.h"

namespace {

using pdserve_rows::norm_row;
using pdserve_rows::rope_row;

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "pdserve_cpu glue ops are fp32");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.is_contiguous() && w.numel() == x.size(1),
              "rms_norm: x [T, hidden] with unit inner stride, weight [hidden]");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w);
  const int64_t T = x.size(0), n = x.size(1), ld = x.stride(0);
  at::Tensor out = at::empty({T, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) norm_row(xp + t * ld, wp, eps, n, op + t * n);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& w, double eps) {
  check_rows(x, w);
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.stride(1) == 1 &&
              delta.scalar_type() == at::kFloat, "add_rms_norm: delta must match x");
  const int64_t T = x.size(0), n = x.size(1);
  at::Tensor sum = at::empty({T, n}, x.options());
  at::Tensor out = at::empty({T, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t lx = x.stride(0), ldd = delta.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      float* s = sp + t * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) s[i] = xp[t * lx + i] + dp[t * ldd + i];
      norm_row(s, wp, eps, n, op + t * n);
    }
  });
  return {sum, out};
}

void rope_rows(const float* x, int64_t lt, int64_t ln, const float* c, const float* s,
               int64_t lc, int64_t T, int64_t N, int64_t D, float* out) {
  at::parallel_for(0, T, 8, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      for (int64_t h = 0; h < N; ++h) {
        rope_row(x + t * lt + h * ln, c + t * lc, s + t * lc, D, out + (t * N + h) * D);
      }
    }
  });
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat, "rope: fp32");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rope: x [T, heads, D] with unit inner stride, D even");
  const int64_t T = x.size(0), N = x.size(1), D = x.size(2);
  const at::Tensor c = cos.reshape({T, D}).contiguous(), s = sin.reshape({T, D}).contiguous();
  at::Tensor out = at::empty({T, N, D}, x.options());
  rope_rows(x.data_ptr<float>(), x.stride(0), x.stride(1), c.data_ptr<float>(),
            s.data_ptr<float>(), D, T, N, D, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
}
