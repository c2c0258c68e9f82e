// drafttrain's fp32 linear layer for x86-64 CPUs with AVX2 + FMA: y = x W^T + b. Built twice where the
// CPU has AVX-512 (drafttrain/fastlinear.py picks the build): the same 8-wide ymm code, but compiled with
// -mavx512vl the compiler may use 32 ymm registers instead of 16, so a tile holds up to 24-27 accumulators
// (6 rows x 32 columns, 9 x 24) instead of 12: fewer weight loads per FMA, fewer passes over a weight tile.
//
// Why (docs/benchmarks/forward_cost.md): on the CPU wheel of torch, F.linear (MKL sgemm) and
// oneDNN's prepacked inner product both spend 2-4x the memory roofline on the few-row products a
// decoding or verification step makes (1-17 rows against 538 MB of weights), and MKL's AVX2 path on
// AMD cores is slow at every size. This is the textbook register-blocked GEMM micro-kernel (the
// BLIS / Goto design: a tile of MT rows x NV*8 columns held in MT*NV ymm accumulators, the weight
// streamed once per tile as NV contiguous 8-float vectors per k, each input scalar broadcast) with
// the tile shape chosen per row count so that 8-12 independent FMA chains hide the FMA latency.
//
// Layout: pack(W [N, K]) -> Wp [NB8, K, 8] (column block j holds W[8j:8j+8, k] contiguously for every
// k; N padded with zero rows to a multiple of 96, a whole number of tiles of every width). linear(x [..., K], Wp, N, bias [N] or None) ->
// y [..., N], float32, contiguous.
//
// Numerics: every output is one FMA chain over k = 0..K-1 in order, then + bias, whatever the tile
// shape, the row count or the row's position: a row's output is bitwise the same computed alone or
// in any batch (batch invariance). It differs from F.linear by float reassociation only.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kMChunk = 192;  // rows per pass over the weights: x chunk stays in L2 while W streams
#ifdef __AVX512VL__
constexpr int kMaxAcc = 27;  // accumulators per tile: 32 ymm registers (AVX-512VL) = acc + NV weights + 1 broadcast
#else
constexpr int kMaxAcc = 12;  // 16 ymm registers (AVX2)
#endif

template <int MT, int NV>
inline void tile(const float* __restrict x, int64_t K, const float* __restrict wp, float* __restrict y,
                 int64_t N, int64_t n0, const float* __restrict bias) {
  __m256 acc[MT][NV];
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 w[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) w[v] = _mm256_loadu_ps(wp + (v * K + k) * 8);
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      const __m256 b = _mm256_broadcast_ss(x + m * K + k);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_fmadd_ps(b, w[v], acc[m][v]);
    }
  }
  // fully unrolled so that the accumulators never live in memory (a rolled loop here makes GCC spill
  // all of them to the stack on every k, which halves the kernel's speed)
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const int64_t c = n0 + v * 8;
      if (c + 8 <= N) {
        __m256 r = acc[m][v];
        if (bias) r = _mm256_add_ps(r, _mm256_loadu_ps(bias + c));
        _mm256_storeu_ps(y + m * N + c, r);
      } else if (c < N) {
        alignas(32) float buf[8];
        _mm256_store_ps(buf, acc[m][v]);
        for (int64_t j = 0; c + j < N; ++j) y[m * N + c + j] = buf[j] + (bias ? bias[c + j] : 0.f);
      }
    }
  }
}

// rows [0, M) of x against every column tile of NV vectors; tiles of at most mt_max rows, balanced
// (9 rows with mt_max 3 -> 3+3+3; 17 with 6 -> 6+6+5)
template <int NV>
void run(const float* xp, int64_t M, int64_t K, const float* w, float* yp, int64_t N, const float* bp,
         int64_t mt_max) {
  const int64_t n_tiles = (N + 8 * NV - 1) / (8 * NV);
  for (int64_t c0 = 0; c0 < M; c0 += kMChunk) {
    const int64_t c1 = std::min(M, c0 + kMChunk);
    at::parallel_for(0, n_tiles, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* wt = w + t * NV * K * 8;
        const int64_t n0 = t * NV * 8;
        int64_t m = c0;
        while (m < c1) {
          const int64_t left = c1 - m, tiles = (left + mt_max - 1) / mt_max, mt = (left + tiles - 1) / tiles;
          const float* xm = xp + m * K;
          float* ym = yp + m * N;
          switch (mt) {  // only shapes with MT * NV <= kMaxAcc are compiled; the dispatch below never asks for others
            case 1: tile<1, NV>(xm, K, wt, ym, N, n0, bp); break;
            case 2: tile<2, NV>(xm, K, wt, ym, N, n0, bp); break;
            case 3: tile<3, NV>(xm, K, wt, ym, N, n0, bp); break;
            case 4: if constexpr (4 * NV <= kMaxAcc) { tile<4, NV>(xm, K, wt, ym, N, n0, bp); } break;
            case 5: if constexpr (5 * NV <= kMaxAcc) { tile<5, NV>(xm, K, wt, ym, N, n0, bp); } break;
            case 6: if constexpr (6 * NV <= kMaxAcc) { tile<6, NV>(xm, K, wt, ym, N, n0, bp); } break;
            case 7: if constexpr (7 * NV <= kMaxAcc) { tile<7, NV>(xm, K, wt, ym, N, n0, bp); } break;
            case 8: if constexpr (8 * NV <= kMaxAcc) { tile<8, NV>(xm, K, wt, ym, N, n0, bp); } break;
            default: if constexpr (9 * NV <= kMaxAcc) { tile<9, NV>(xm, K, wt, ym, N, n0, bp); } break;
          }
          m += mt;
        }
      }
    });
  }
}

}  // namespace

torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.device().is_cpu(),
              "pack: expected a 2-D float32 CPU weight [N, K], got ", w.sizes(), " ", w.scalar_type());
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t NB = (N + 95) / 96 * 12;  // a whole number of 16-, 24- and 32-column tiles
  auto wp = torch::zeros({NB, K, 8}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = wp.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k = 0; k < K; ++k) dst[((n / 8) * K + k) * 8 + (n % 8)] = src[n * K + k];
  });
  return wp;
}

torch::Tensor linear(torch::Tensor x, torch::Tensor wp, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "linear: expected a float32 CPU input, got ", x.scalar_type());
  const int64_t K = x.size(-1);
  TORCH_CHECK(wp.dim() == 3 && wp.size(1) == K && wp.size(2) == 8 && wp.size(0) * 8 >= N && N > 0,
              "linear: packed weight ", wp.sizes(), " does not match in_features ", K, " / out_features ", N);
  x = x.contiguous();
  const int64_t M = K ? x.numel() / K : 0;
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  if (M == 0) return y;
  if (K == 0) return y.zero_();
  torch::Tensor bc;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == torch::kFloat32, "linear: bias must be float32 [N]");
    bc = bias->contiguous();
    bp = bc.data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* w = wp.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#ifdef __AVX512VL__
  // 32 registers: tiles of up to 6 x 32 (24 accumulators), balanced (12 rows -> 6 + 6, 17 -> 6 + 6 + 5);
  // 7-9 rows -> one tile of up to 9 x 24 (27). Measured against the AVX2 build on an AVX-512 AMD EPYC
  // (Zen 4) VM, the 211 linears of SmolLM2-135M: the same at 1-4 rows, 10-20% less at 5-17, ~8% at 64
  // (docs/benchmarks/forward_cost.md: the whole forward, kernel vs kernel_avx2).
  if (M >= 7 && M <= 9) run<3>(xp, M, K, w, yp, N, bp, 9);
  else run<4>(xp, M, K, w, yp, N, bp, 6);
#else
  // tile shapes (rows x columns) that keep 8-12 accumulators: 1-3 or 9 rows -> 3 x 32; 4, 7, 8 -> 4 x 24;
  // otherwise 6 x 16 (measured on the 2-core AMD EPYC VM; docs/benchmarks/forward_cost.md)
  if (M <= 3 || M == 9) run<4>(xp, M, K, w, yp, N, bp, 3);
  else if (M == 4 || M == 7 || M == 8) run<3>(xp, M, K, w, yp, N, bp, 4);
  else run<2>(xp, M, K, w, yp, N, bp, 6);
#endif
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#ifdef __AVX512VL__
  m.attr("isa") = "avx512";
#else
  m.attr("isa") = "avx2";
#endif
  m.def("pack", &pack, "W [N, K] float32 -> packed [NB8, K, 8]");
  m.def("linear", &linear, "x [..., K] @ W^T + b on the packed weight -> [..., N]");
}
