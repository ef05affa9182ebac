// Fused elementwise steps of a decoder layer on the CPU, fp32: each replaces a chain of small
// PyTorch ops (one allocation and one pass over memory per op) by one pass.
//
//   rms_norm(x [T, N], w [N], eps) -> y            y = x / sqrt(mean(x^2) + eps) * w
//   add_rms_norm(h [T, N], a [T, N], w, eps) -> y  h += a (in place), then y = rms_norm(h)
//   silu_mul(gu [T, 2I]) -> y [T, I]               y = silu(gu[:, :I]) * gu[:, I:]
//   rope_store(qkv [T, (H + 2 KVH) D], cos, sin [T, D/2], slots [T], k_cache, v_cache
//              [S, KVH, D], H, KVH) -> ()
//       rotates the q and k heads of qkv in place (rotate-half convention: the first half of
//       a head pairs with the second) and writes each token's k and v heads to its cache slot.
//
// Every op matches its PyTorch chain up to float rounding (sums run in a different order).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec.h"

namespace {

using namespace sloserve_vec;

constexpr int64_t kRowGrain = 16;  // rows per thread chunk: decode-size batches stay on one thread

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 &&
                  t.stride(1) == 1,
              name, ": expected a 2-d float32 CPU tensor with contiguous rows");
}

void norm_row(const float* x, const float* w, float eps, int64_t n, float* y) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < n; ++j) ss += x[j] * x[j];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] = x[j] * r * w[j];
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1) && w.scalar_type() == at::kFloat,
              "rms_norm: weight must be float32 [N]");
  const int64_t T = x.size(0), N = x.size(1);
  at::Tensor y = at::empty({T, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, T, kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) norm_row(xp + t * xs, wp, static_cast<float>(eps), N, yp + t * N);
  });
  return y;
}

at::Tensor add_rms_norm(at::Tensor h, const at::Tensor& a, const at::Tensor& w, double eps) {
  check_rows(h, "add_rms_norm");
  check_rows(a, "add_rms_norm");
  TORCH_CHECK(h.sizes() == a.sizes() && w.is_contiguous() && w.numel() == h.size(1) &&
                  w.scalar_type() == at::kFloat,
              "add_rms_norm: shapes of h, a and weight disagree");
  const int64_t T = h.size(0), N = h.size(1);
  at::Tensor y = at::empty({T, N}, h.options());
  float* hp = h.data_ptr<float>();
  const float *ap = a.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t hs = h.stride(0), as = a.stride(0);
  at::parallel_for(0, T, kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* hr = hp + t * hs;
      const float* ar = ap + t * as;
#pragma omp simd
      for (int64_t j = 0; j < N; ++j) hr[j] += ar[j];
      norm_row(hr, wp, static_cast<float>(eps), N, yp + t * N);
    }
  });
  return y;
}

at::Tensor silu_mul(const at::Tensor& gu) {
  check_rows(gu, "silu_mul");
  TORCH_CHECK(gu.size(1) % 2 == 0, "silu_mul: last dim must be even");
  const int64_t T = gu.size(0), I = gu.size(1) / 2, gs = gu.stride(0);
  at::Tensor y = at::empty({T, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float *g = gp + t * gs, *u = g + I;
      float* o = yp + t * I;
      int64_t j = 0;
      for (; j + W <= I; j += W) {  // silu(x) = x * sigmoid(x), sigmoid from e^-|x| <= 1
        const vf x = load(g + j);
        const vf e = exp_nonpositive(x < 0.f ? x : -x);
        const vf sig = x < 0.f ? e / (1.f + e) : 1.f / (1.f + e);
        store(o + j, x * sig * load(u + j));
      }
      for (; j < I; ++j) o[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
    }
  });
  return y;
}

void rope_store(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                const at::Tensor& slots, at::Tensor k_cache, at::Tensor v_cache, int64_t heads,
                int64_t kv_heads) {
  check_rows(qkv, "rope_store");
  check_rows(cos, "rope_store");
  check_rows(sin, "rope_store");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat && k_cache.size(1) == kv_heads,
              "rope_store: caches must be contiguous float32 [S, kv_heads, D]");
  const int64_t T = qkv.size(0), D = k_cache.size(2), half = D / 2, S = k_cache.size(0);
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) == (heads + 2 * kv_heads) * D && cos.size(0) == T &&
                  sin.size(0) == T && cos.size(1) == half && sin.size(1) == half,
              "rope_store: qkv, cos/sin or cache shapes disagree");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T,
              "rope_store: slots must be contiguous int64 [T]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "rope_store: slot ", sp[t], " outside the cache");
  float* xp = qkv.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const int64_t xs = qkv.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, T, kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* row = xp + t * xs;
      const float *c = cp + t * cs, *s = snp + t * ss;
      for (int64_t hd = 0; hd < heads + kv_heads; ++hd) {
        float* x = row + hd * D;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = x[j], x2 = x[j + half];
          x[j] = x1 * c[j] - x2 * s[j];
          x[j + half] = x2 * c[j] + x1 * s[j];
        }
      }
      const int64_t n = kv_heads * D;
      std::copy_n(row + heads * D, n, kc + sp[t] * n);
      std::copy_n(row + (heads + kv_heads) * D, n, vc + sp[t] * n);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sloserve_cpu, m) {
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("rope_store", &rope_store);
}
