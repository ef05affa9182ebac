// Paged attention for short query segments (decode, verify, draft steps) on the CPU: fp32
// queries, scores and outputs over an fp32 or a bf16 KV cache (bf16 keys and values are widened
// exactly on load). Each query row's result is computed the same way whatever the segment's
// length or the batch: a verify row gets the bits a decode row would (bf16 greedy speculation
// equals plain greedy because of it).
//
// Reads each segment's keys and values straight from the paged cache through its block table:
// nothing is gathered or padded. One work unit is one (segment, KV head): its R = q_len * G
// query rows (G query heads share a KV head; row r = i * G + g is token i, head h * G + g)
// score every key, take a causal softmax (token i sees keys 0 .. start + i), and sum the
// values. Units run in parallel on PyTorch's intra-op threads.
//
// Tensors (checked in paged_attention_small):
//   q            [T, H, D]   any row stride, heads contiguous (stride D, 1)
//   k/v_cache    [S, KVH, D] contiguous, float32 or bfloat16 (both alike): this layer's slots,
//                            new tokens already written
//   q_rows       [B] int64   first row of each segment in q and out
//   q_lens       [B] int64   query tokens of each segment
//   starts       [B] int64   position of each segment's first query token
//   block_table  [B, MB] int64 contiguous: the segment's KV blocks in position order
//   out          [T, H, D]   contiguous; rows of these segments are written, others untouched
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using namespace sloserve_vec;

template <class KT>  // the cache's element: float, or uint16_t holding bf16 bits
struct Unit {  // one (segment, KV head)
  const float* q;  // row r = i * G + g at q + i * q_stride + g * D
  int64_t q_stride;
  const KT* k;  // this head's key p of block b at k + (b * block_size + p) * kv_stride
  const KT* v;
  int64_t kv_stride;
  const int64_t* blocks;
  int64_t block_size, q_len, G, D, start, kv_len;
  float* out;  // row r at out + i * out_stride + g * D
  int64_t out_stride;

  const float* q_row(int64_t r) const { return q + (r / G) * q_stride + (r % G) * D; }
  float* out_row(int64_t r) const { return out + (r / G) * out_stride + (r % G) * D; }
};

// Calls f(p, key_or_value_ptr) for positions 0 .. kv_len-1, walking the block table.
template <class KT, class F>
inline void for_each_slot(const Unit<KT>& u, const KT* base, F f) {
  for (int64_t blk = 0, p = 0; p < u.kv_len; ++blk) {
    const KT* b = base + u.blocks[blk] * u.block_size * u.kv_stride;
    const int64_t n = std::min(u.block_size, u.kv_len - p);
    // the next block's rows are fetched while this one is used (blocks need not be adjacent)
    const KT* next = p + n < u.kv_len ? base + u.blocks[blk + 1] * u.block_size * u.kv_stride : b;
    for (int64_t t = 0; t < n; ++t, ++p) {
      for (int64_t d = 0; d < u.D; d += W) __builtin_prefetch(next + t * u.kv_stride + d);
      f(p, b + t * u.kv_stride);
    }
  }
}

// s[r * kv_len + p] = scale * q_r . k_p for rows r0 .. r0+NR-1 and every key (keys past a
// row's causal limit are scored too; the softmax zeroes them).
template <int NR, class KT>
void score_rows(const Unit<KT>& u, int64_t r0, float scale, float* s) {
  const float* qr[NR];
  for (int j = 0; j < NR; ++j) qr[j] = u.q_row(r0 + j);
  for_each_slot(u, u.k, [&](int64_t p, const KT* kp) {
    vf acc[NR];
    vf kc = load(kp);
    for (int j = 0; j < NR; ++j) acc[j] = load(qr[j]) * kc;
    for (int64_t d = W; d < u.D; d += W) {
      kc = load(kp + d);
      for (int j = 0; j < NR; ++j) acc[j] += load(qr[j] + d) * kc;
    }
    for (int j = 0; j < NR; ++j) s[(r0 + j) * u.kv_len + p] = hsum(acc[j]) * scale;
  });
}

// row[0 .. n) becomes its softmax, row[n .. len) zero.
void softmax_row(float* row, int64_t n, int64_t len) {
  float m = row[0];
  for (int64_t p = 1; p < n; ++p) m = std::max(m, row[p]);
  vf vsum{};
  int64_t p = 0;
  for (; p + W <= n; p += W) {
    const vf e = exp_nonpositive(load(row + p) - m);
    store(row + p, e);
    vsum += e;
  }
  float sum = hsum(vsum);
  for (; p < n; ++p) sum += (row[p] = std::exp(row[p] - m));
  const float inv = 1.f / sum;
  for (p = 0; p < n; ++p) row[p] *= inv;
  for (; p < len; ++p) row[p] = 0.f;
}

// out rows r0 .. r0+NR-1, columns d0 .. d0 + NC*W: sum_p s[r, p] * v_p, accumulated in registers.
template <int NR, int NC, class KT>
void value_rows(const Unit<KT>& u, int64_t r0, int64_t d0, const float* s) {
  vf acc[NR][NC];
  for (int j = 0; j < NR; ++j)
    for (int c = 0; c < NC; ++c) acc[j][c] = vf{};
  for_each_slot(u, u.v + d0, [&](int64_t p, const KT* vp) {
    vf vc[NC];
    for (int c = 0; c < NC; ++c) vc[c] = load(vp + c * W);
    for (int j = 0; j < NR; ++j) {
      const float w = s[(r0 + j) * u.kv_len + p];
      for (int c = 0; c < NC; ++c) acc[j][c] += w * vc[c];
    }
  });
  for (int j = 0; j < NR; ++j)
    for (int c = 0; c < NC; ++c) store(u.out_row(r0 + j) + d0 + c * W, acc[j][c]);
}

template <int NC, class KT>
void value_rows_nc(const Unit<KT>& u, int64_t r0, int64_t nr, int64_t d0, const float* s) {
  switch (nr) {
    case 4: return value_rows<4, NC, KT>(u, r0, d0, s);
    case 3: return value_rows<3, NC, KT>(u, r0, d0, s);
    case 2: return value_rows<2, NC, KT>(u, r0, d0, s);
    default: return value_rows<1, NC, KT>(u, r0, d0, s);
  }
}

template <class KT>
void attend(const Unit<KT>& u, float scale, std::vector<float>& s) {
  const int64_t R = u.q_len * u.G;
  s.resize(R * u.kv_len);
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) score_rows<4, KT>(u, r, scale, s.data());
  switch (R - r) {
    case 3: score_rows<3, KT>(u, r, scale, s.data()); break;
    case 2: score_rows<2, KT>(u, r, scale, s.data()); break;
    case 1: score_rows<1, KT>(u, r, scale, s.data()); break;
  }
  for (r = 0; r < R; ++r) softmax_row(s.data() + r * u.kv_len, u.start + r / u.G + 1, u.kv_len);
  for (int64_t d0 = 0; d0 < u.D; d0 += 4 * W) {
    const int64_t nc = std::min<int64_t>(4, (u.D - d0) / W);
    for (r = 0; r < R; r += 4) {
      const int64_t nr = std::min<int64_t>(4, R - r);
      switch (nc) {
        case 4: value_rows_nc<4, KT>(u, r, nr, d0, s.data()); break;
        case 3: value_rows_nc<3, KT>(u, r, nr, d0, s.data()); break;
        case 2: value_rows_nc<2, KT>(u, r, nr, d0, s.data()); break;
        default: value_rows_nc<1, KT>(u, r, nr, d0, s.data()); break;
      }
    }
  }
}

void paged_attention_small(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& q_rows,
                           const at::Tensor& q_lens, const at::Tensor& starts,
                           const at::Tensor& block_table, int64_t block_size, double scale,
                           at::Tensor out) {
  for (const at::Tensor* t : {&q, static_cast<const at::Tensor*>(&out)})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3,
                "paged_attention_small: q and out must be 3-d float32 CPU tensors");
  for (const at::Tensor* t : {&k_cache, &v_cache})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 &&
                    (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16) &&
                    t->scalar_type() == k_cache.scalar_type(),
                "paged_attention_small: the caches must be 3-d float32 or bfloat16 CPU tensors "
                "of one dtype");
  for (const at::Tensor* t : {&q_rows, &q_lens, &starts, &block_table})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous(),
                "paged_attention_small: index tensors must be contiguous int64 CPU tensors");
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(1), B = q_rows.size(0);
  TORCH_CHECK(D % W == 0, "paged_attention_small: head_dim must be a multiple of 16");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "paged_attention_small: heads not a multiple of kv heads");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "paged_attention_small: q heads not contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == D &&
                  out.sizes() == q.sizes(),
              "paged_attention_small: cache or out shape/layout mismatch");
  TORCH_CHECK(q_lens.size(0) == B && starts.size(0) == B && block_table.dim() == 2 &&
                  block_table.size(0) == B,
              "paged_attention_small: per-segment tensors disagree on the segment count");
  const int64_t G = H / KVH, MB = block_table.size(1);
  const int64_t* rows = q_rows.data_ptr<int64_t>();
  const int64_t* qls = q_lens.data_ptr<int64_t>();
  const int64_t* sts = starts.data_ptr<int64_t>();
  const int64_t* bt = block_table.data_ptr<int64_t>();
  TORCH_CHECK(block_size >= 1 && k_cache.size(0) % block_size == 0,
              "paged_attention_small: cache slots not a whole number of blocks");
  const int64_t num_blocks = k_cache.size(0) / block_size;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t used = (sts[b] + qls[b] + block_size - 1) / block_size;
    TORCH_CHECK(qls[b] >= 1 && sts[b] >= 0 && rows[b] >= 0 && rows[b] + qls[b] <= q.size(0) &&
                    used <= MB,
                "paged_attention_small: segment ", b, " out of range");
    for (int64_t j = 0; j < used; ++j)
      TORCH_CHECK(bt[b * MB + j] >= 0 && bt[b * MB + j] < num_blocks,
                  "paged_attention_small: segment ", b, " has a block outside the cache");
  }
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto run = [&](auto* kp, auto* vp) {
    using KT = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t w = begin; w < end; ++w) {
        const int64_t b = w / KVH, h = w % KVH;
        const Unit<KT> u{qp + rows[b] * q.stride(0) + h * G * D, q.stride(0), kp + h * D,
                         vp + h * D, KVH * D, bt + b * MB, block_size, qls[b], G, D, sts[b],
                         sts[b] + qls[b], op + (rows[b] * H + h * G) * D, H * D};
        attend(u, static_cast<float>(scale), scores);
      }
    });
  };
  if (k_cache.scalar_type() == at::kFloat)
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  else  // bf16 as its bit patterns
    run(reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
        reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sloserve_cpu, m) { m.def("paged_attention_small", &paged_attention_small); }
