// Row routines shared by cpu_glue.cpp (single ops), cpu_step.cpp (the fused decode
// stack) and engine/attention/cpu_kernels.cpp (the vectorised exp), so they compute
// norms and rotary element for element alike.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pdserve_rows {

constexpr int64_t kLanes = 16;

// Explicit FMAs and no contraction: the same bits in every translation unit that inlines
// it (the compiler may otherwise fuse `+= x * x` in one loop and not in another).
__attribute__((optimize("fp-contract=off")))
inline float sum_squares(const float* x, int64_t n) {
  float part[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) part[j] = std::fma(x[i + j], x[i + j], part[j]);
  }
  for (; i < n; ++i) part[i % kLanes] = std::fma(x[i], x[i], part[i % kLanes]);
  for (int64_t w = kLanes / 2; w > 0; w /= 2) {
    for (int64_t j = 0; j < w; ++j) part[j] += part[j + w];
  }
  return part[0];
}

// transformers' RMSNorm of one row: w * (x * rsqrt(mean(x^2) + eps)); out may alias x
inline void norm_row(const float* x, const float* w, float eps, int64_t n, float* out) {
  const float r = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

// One head's rotary: x * cos + roll(x, D/2) * sin (sin's first half negated), with the
// separate roundings of torch's three elementwise ops (no FMA); out must not alias x.
__attribute__((optimize("fp-contract=off")))
inline void rope_row(const float* x, const float* c, const float* s, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float a1 = x[d] * c[d];
    const float a2 = x[d < half ? d + half : d - half] * s[d];
    out[d] = a1 + a2;
  }
}

// x[i] = exp(x[i]) for x[i] <= 0 (scores minus their max), vectorised: Cephes' expf
// (range reduction by ln 2 in two parts, degree-6 polynomial, 2^k from the exponent
// bits), within 2 ulp of std::exp; below -87 the result is the smallest normal float's
// order (an exp(-87) weight next to a max of 1 is rounded away anyway).
inline void exp_nonpositive(float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::max(x[i], -87.0f);
    const float k = std::floor(v * 1.44269504088896341f + 0.5f);
    const float r = (v - k * 0.693359375f) + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;  // 2^k, k in [-126, 0]
    float two_k;
    std::memcpy(&two_k, &bits, sizeof(two_k));
    x[i] = p * two_k;
  }
}

}  // namespace pdserve_rows
