// drafttrain's fp32 decode attention for x86-64 CPUs with AVX2 + FMA: a few queries per sequence (a decoding
// step: 1; a draft tree's verification: its nodes) against that sequence's cached keys/values, grouped-query
// heads (GQA) served from ONE read of their shared key/value head.
//
// Why (docs/benchmarks/decode_attention.md): with few queries per sequence the attention is a
// stream over the KV cache (B x h_kv x T x hd floats, twice), and torch's sdpa spends 2-3x that stream on
// it on the 2-core CPU: transformers hands it GQA as [B, h_kv, group, hd] queries (its pack_gqa) or with
// enable_gqa, and the fused CPU kernel's blocking wastes the tiny query block. At the self-distillation
// generator's batch of 64 rows x ~300 cached tokens that was ~3.5 ms a layer, about what the layer's
// linears take. Here each (sequence, key/value head) task streams its keys from memory once, scoring the
// group's G x Q query rows against them (the rows after the first re-read them from L1/L2), then its
// values once the same way.
//
// decode_attention(q [B, H, Q, D], k [B, H_kv, T, D], v [B, H_kv, T, D], mask [B or 1, 1, Q or 1, T] or None,
// scale) -> [B, H, Q, D], float32. H a multiple of H_kv; D in {16, 32, 64, 128}; the last dimension of q,
// k, v, mask contiguous (k / v may be views into a larger cache: any other strides). Scores
// s = (q . k) * scale + mask, p = softmax(s) (at::_softmax, torch's own, per query row), out = sum_t p_t v_t.
//
// Numerics: fp32 throughout; each dot product and each weighted sum is one in-order FMA chain per
// 8-lane group, so it differs from sdpa by float reassociation only (~1e-7 relative), and a query row's
// output depends neither on the batch nor on the other queries of its call (a tree node gets the same
// arithmetic as the same token decoded alone, up to the softmax's sum over a different key count).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace {

struct Dims {
  int64_t B, H, HKV, Q, T;
  int64_t qs_b, qs_h, qs_q, ks_b, ks_h, ks_t, vs_b, vs_h, vs_t, ms_b, ms_q;
};

// 4 dot products q . k_{t..t+3} (each k_j: HV * 8 contiguous floats at kt + j * ks_t), reduced together:
// lanes of each product summed by one fixed tree of horizontal adds, the same for every key
template <int HV>
inline __m128 dot4(const __m256* qr, const float* kt, int64_t ks_t) {
  __m256 a0 = _mm256_mul_ps(qr[0], _mm256_loadu_ps(kt));
  __m256 a1 = _mm256_mul_ps(qr[0], _mm256_loadu_ps(kt + ks_t));
  __m256 a2 = _mm256_mul_ps(qr[0], _mm256_loadu_ps(kt + 2 * ks_t));
  __m256 a3 = _mm256_mul_ps(qr[0], _mm256_loadu_ps(kt + 3 * ks_t));
#pragma GCC unroll 32
  for (int u = 1; u < HV; ++u) {
    a0 = _mm256_fmadd_ps(qr[u], _mm256_loadu_ps(kt + 8 * u), a0);
    a1 = _mm256_fmadd_ps(qr[u], _mm256_loadu_ps(kt + ks_t + 8 * u), a1);
    a2 = _mm256_fmadd_ps(qr[u], _mm256_loadu_ps(kt + 2 * ks_t + 8 * u), a2);
    a3 = _mm256_fmadd_ps(qr[u], _mm256_loadu_ps(kt + 3 * ks_t + 8 * u), a3);
  }
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));  // [q.k_t, q.k_t+1, q.k_t+2, q.k_t+3]
}

// scores[b, h, i, t] = (q[b, h, i] . k[b, h / G, t]) * scale + mask[b, i, t]; one task per (b, kv head): its
// keys come from memory once (the group's first query row) and from L1/L2 for the other G * Q - 1 rows, each
// row's query held in registers over 4 keys at a time; a last partial block of keys is copied into a
// zero-padded one, so every key gets the same arithmetic wherever it falls
template <int HV>
void scores_kernel(const Dims& d, const float* q, const float* k, const float* mask, float scale, float* out) {
  const int64_t G = d.H / d.HKV;
  constexpr int D = HV * 8;
  const int64_t T4 = d.T / 4 * 4;
  at::parallel_for(0, d.B * d.HKV, 1, [&](int64_t a, int64_t e) {
    alignas(32) float pad[4 * D];
    const __m128 vscale = _mm_set1_ps(scale);
    for (int64_t bg = a; bg < e; ++bg) {
      const int64_t b = bg / d.HKV, g = bg % d.HKV;
      const float* kb = k + b * d.ks_b + g * d.ks_h;
      if (T4 < d.T) {  // the tail keys, zero-padded to a block of 4
        std::fill(pad, pad + 4 * D, 0.f);
        for (int64_t j = 0; j < d.T - T4; ++j) std::copy(kb + (T4 + j) * d.ks_t, kb + (T4 + j) * d.ks_t + D, pad + j * D);
      }
      for (int64_t j = 0; j < G; ++j) {
        const int64_t h = g * G + j;
        for (int64_t i = 0; i < d.Q; ++i) {
          const float* qh = q + b * d.qs_b + h * d.qs_h + i * d.qs_q;
          const float* mb = mask ? mask + b * d.ms_b + i * d.ms_q : nullptr;
          __m256 qr[HV];
#pragma GCC unroll 32
          for (int u = 0; u < HV; ++u) qr[u] = _mm256_loadu_ps(qh + 8 * u);
          float* o = out + ((b * d.H + h) * d.Q + i) * d.T;
          for (int64_t t = 0; t < T4; t += 4) {
            __m128 sc = _mm_mul_ps(dot4<HV>(qr, kb + t * d.ks_t, d.ks_t), vscale);
            if (mb) sc = _mm_add_ps(sc, _mm_loadu_ps(mb + t));
            _mm_storeu_ps(o + t, sc);
          }
          if (T4 < d.T) {
            alignas(16) float r[4];
            _mm_store_ps(r, _mm_mul_ps(dot4<HV>(qr, pad, D), vscale));
            for (int64_t t = T4; t < d.T; ++t) o[t] = mb ? r[t - T4] + mb[t] : r[t - T4];
          }
        }
      }
    }
  });
}

// out[b, h, i] = sum_t p[b, h, i, t] v[b, h / G, t]
template <int HV>
void weighted_kernel(const Dims& d, const float* p, const float* v, float* out) {
  const int64_t G = d.H / d.HKV;
  at::parallel_for(0, d.B * d.HKV, 1, [&](int64_t a, int64_t e) {
    for (int64_t bg = a; bg < e; ++bg) {
      const int64_t b = bg / d.HKV, g = bg % d.HKV;
      const float* vb = v + b * d.vs_b + g * d.vs_h;
      for (int64_t r = 0; r < G * d.Q; ++r) {  // the group's query rows: (head g * G + r / Q, query r % Q)
        const int64_t row = (b * d.H + g * G) * d.Q + r;
        const float* ph = p + row * d.T;
        __m256 acc[HV];
#pragma GCC unroll 32
        for (int u = 0; u < HV; ++u) acc[u] = _mm256_setzero_ps();
        for (int64_t t = 0; t < d.T; ++t) {
          const __m256 w = _mm256_broadcast_ss(ph + t);
          const float* vt = vb + t * d.vs_t;
#pragma GCC unroll 32
          for (int u = 0; u < HV; ++u) acc[u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8 * u), acc[u]);
        }
        float* o = out + row * HV * 8;
#pragma GCC unroll 32
        for (int u = 0; u < HV; ++u) _mm256_storeu_ps(o + 8 * u, acc[u]);
      }
    }
  });
}

template <int HV>
torch::Tensor run(const Dims& d, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                  const float* mask, float scale) {
  auto scores = torch::empty({d.B, d.H, d.Q, d.T}, q.options());
  scores_kernel<HV>(d, q.data_ptr<float>(), k.data_ptr<float>(), mask, scale, scores.data_ptr<float>());
  auto p = at::_softmax(scores, -1, false);  // torch's own softmax over the keys
  auto out = torch::empty({d.B, d.H, d.Q, HV * 8}, q.options());
  weighted_kernel<HV>(d, p.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

}  // namespace

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                               double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat,
              "decode_attention: float32 only");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "decode_attention: CPU tensors only");
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), D = q.size(3), HKV = k.size(1), T = k.size(2);
  TORCH_CHECK(Q >= 1, "decode_attention: no queries");
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == HKV && v.size(2) == T && k.size(3) == D &&
                  v.size(3) == D, "decode_attention: q, k, v shapes disagree");
  TORCH_CHECK(HKV > 0 && H % HKV == 0, "decode_attention: query heads must be a multiple of key/value heads");
  TORCH_CHECK(T > 0, "decode_attention: no keys");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: head dim must be contiguous");
  const float* mp = nullptr;
  int64_t ms_b = 0, ms_q = 0;
  torch::Tensor m;
  if (mask.has_value() && mask->defined()) {
    m = *mask;
    TORCH_CHECK(m.scalar_type() == torch::kFloat && m.dim() == 4 && m.size(1) == 1 && (m.size(2) == Q || m.size(2) == 1) &&
                    m.size(3) == T && (m.size(0) == B || m.size(0) == 1) && m.stride(3) == 1,
                "decode_attention: mask must be float32 [B or 1, 1, Q or 1, T] with a contiguous last dim");
    mp = m.data_ptr<float>();
    ms_b = m.size(0) == 1 ? 0 : m.stride(0);
    ms_q = m.size(2) == 1 ? 0 : m.stride(2);
  }
  Dims d{B, H, HKV, Q, T, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
         v.stride(0), v.stride(1), v.stride(2), ms_b, ms_q};
  const float s = static_cast<float>(scale);
  switch (D) {
    case 16: return run<2>(d, q, k, v, mp, s);
    case 32: return run<4>(d, q, k, v, mp, s);
    case 64: return run<8>(d, q, k, v, mp, s);
    case 128: return run<16>(d, q, k, v, mp, s);
    default: TORCH_CHECK(false, "decode_attention: head dim ", D, " not built (16, 32, 64, 128)");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "few-query GQA attention over a KV cache (float32)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("mask"), pybind11::arg("scale"));
}
