// Row routines shared by cpu_glue.cpp (single ops) and cpu_step.cpp (the fused decode
// stack), so both compute norms and rotary element for element alike.
#pragma once

#include <cmath>
#include <cstdint>

namespace pdserve_rows {

constexpr int64_t kLanes = 16;

inline float sum_squares(const float* x, int64_t n) {
  float part[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) part[j] += x[i + j] * x[i + j];
  }
  for (; i < n; ++i) part[i % kLanes] += x[i] * x[i];
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

}  // namespace pdserve_rows
