// Portable 16-float vectors for the CPU kernels, and e^x on them.
#pragma once

#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace sloserve_vec {

// 16 floats; GCC/Clang lower it to AVX-512, pairs of AVX2 registers or scalar code.
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
constexpr int64_t W = 16;

inline vf load(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
// 16 bfloat16 values (their bit patterns) widened to floats: exact (bf16 is float's top half).
inline vf load(const uint16_t* p) {
  typedef uint16_t vh __attribute__((vector_size(32)));
  vh h;
  __builtin_memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vi) << 16);
}
inline float hsum(vf v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps((__m512)v);
#else
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
#endif
}

// e^x for x <= 0 (softmax inputs after subtracting the row max), within ~1e-7 relative:
// x = n ln2 + r with |r| <= ln2 / 2, e^r by the Cephes expf polynomial, 2^n into the exponent.
inline vf exp_nonpositive(vf x) {
  x = x < -87.0f ? vf{} - 87.0f : x;
  const vf t = x * 1.44269504088896341f + 12582912.0f;  // + 1.5 * 2^23 rounds n to nearest
  const vf n = t - 12582912.0f;
  const vf r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 split in two for precision
  vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi e = (((vi)t - 0x4B400000) + 127) << 23;  // t's low mantissa bits hold n
  return p * (vf)e;
}

}  // namespace sloserve_vec
