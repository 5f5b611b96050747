// CPU kernel of pyhook::row_stats: one batch's statistics row of a capture
// (see pyhook/pipeline/_record.py, batch_stats), computed where the rows are:
// on the forward's thread, right after a layer's rows were copied, while they
// are still in cache.
//
// Output (float64 [1, 2 + 2*D]): count, sum of row L2 norms, column means,
// column M2 (sum of squared deviations from the mean). Exact to float64
// rounding like a two-pass reduction: the rows are read in blocks that fit in
// cache; each block's column sums give its mean, a second pass over the same
// (cached) block its squared deviations from that mean, both accumulated in
// float64; blocks merge with Chan's parallel formula. Columns are split into
// one range per thread (at::parallel_for), so no float64 copy of the batch and
// no temporary larger than a block is made.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace pyhook {
namespace {

// Elements per block and column range: 64 Ki values (256 KiB of float32) stay
// in a core's L2 between the two passes.
constexpr int64_t kBlockElems = int64_t{1} << 16;
// Below this many values one thread is faster than waking the pool.
constexpr int64_t kParallelMinElems = int64_t{1} << 16;

// The kernel's body, compiled three times: for the baseline (SSE2), AVX2 (twice the float64
// lanes) and AVX-512 (four times), picked at run time. The loops vectorise across columns only,
// in the same order of operations (no reassociation, no contraction into fused multiply-adds):
// all give the same bits. tests/test_stats_simd.py compares them, capping the level with the
// catch-all op pyhook::_test_stats_simd (stats_test_simd below).
template <typename T>
__attribute__((always_inline)) inline void columns_stats_body(const T* x, int64_t n, int64_t d,
                                                              int64_t c0, int64_t c1,
                                                              double* mean, double* m2,
                                                              double* sq) {
#ifdef __clang__
#pragma clang fp contract(off)  // clang ignores GCC's optimize attribute on the AVX-512 clone
#endif
  const int64_t w = c1 - c0;
  std::vector<double> bsum(static_cast<size_t>(w));
  std::vector<double> bm2(static_cast<size_t>(w));
  const int64_t step = std::max<int64_t>(1, kBlockElems / std::max<int64_t>(w, 1));
  int64_t done = 0;
  for (int64_t r0 = 0; r0 < n; r0 += step) {
    const int64_t k = std::min(step, n - r0);
    std::fill(bsum.begin(), bsum.end(), 0.0);
    std::fill(bm2.begin(), bm2.end(), 0.0);
    double* bs = bsum.data();
    double* bq = bm2.data();
    for (int64_t r = r0; r < r0 + k; ++r) {
      const T* row = x + r * d + c0;
      // The row's squared norm in 8 independent lanes (vectorised without reassociating).
      double acc[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
      int64_t j = 0;
      for (; j + 8 <= w; j += 8) {
        for (int l = 0; l < 8; ++l) {
          const double v = static_cast<double>(row[j + l]);
          bs[j + l] += v;
          acc[l] += v * v;
        }
      }
      for (; j < w; ++j) {
        const double v = static_cast<double>(row[j]);
        bs[j] += v;
        acc[0] += v * v;
      }
      sq[r] += ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
    const double inv = 1.0 / static_cast<double>(k);
    for (int64_t j = 0; j < w; ++j) {
      bs[j] *= inv;  // the block's mean
    }
    for (int64_t r = r0; r < r0 + k; ++r) {
      const T* row = x + r * d + c0;
      for (int64_t j = 0; j < w; ++j) {
        const double dv = static_cast<double>(row[j]) - bs[j];
        bq[j] += dv * dv;
      }
    }
    double* mu = mean + c0;
    double* q = m2 + c0;
    if (done == 0) {
      std::copy(bs, bs + w, mu);
      std::copy(bq, bq + w, q);
    } else {
      const double total = static_cast<double>(done + k);
      const double cross = static_cast<double>(done) * static_cast<double>(k) / total;
      const double share = static_cast<double>(k) / total;
      for (int64_t j = 0; j < w; ++j) {
        const double delta = bs[j] - mu[j];  // the block's mean minus the running mean
        q[j] += bq[j] + delta * delta * cross;
        // An infinite mean stays infinite (inf - inf would make it NaN): where the two means
        // differ by no finite delta (either is inf or NaN), their sum has the mean's value.
        const double merged = mu[j] + delta * share;
        const double summed = mu[j] + bs[j];
        mu[j] = delta - delta == 0.0 ? merged : summed;  // (delta finite: a blend, no branch)
      }
    }
    done += k;
  }
}

template <typename T>
void columns_stats_base(const T* x, int64_t n, int64_t d, int64_t c0, int64_t c1, double* mean,
                        double* m2, double* sq) {
  columns_stats_body<T>(x, n, d, c0, c1, mean, m2, sq);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define PYHOOK_STATS_AVX2 1
template <typename T>
__attribute__((target("avx2"))) void columns_stats_avx2(const T* x, int64_t n, int64_t d,
                                                        int64_t c0, int64_t c1, double* mean,
                                                        double* m2, double* sq) {
  columns_stats_body<T>(x, n, d, c0, c1, mean, m2, sq);
}
// AVX-512: eight float64 lanes. "avx512f" implies FMA, so contraction is turned off for this
// clone (GCC: fp-contract=off; clang: the pragma in the body): the same operations in the same
// order as the other two.
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"), optimize("fp-contract=off"))) void
columns_stats_avx512(const T* x, int64_t n, int64_t d, int64_t c0, int64_t c1, double* mean,
                     double* m2, double* sq) {
  columns_stats_body<T>(x, n, d, c0, c1, mean, m2, sq);
}
#endif

// The highest clone the tests allow (2: no cap; see stats_test_simd).
std::atomic<int> g_test_simd_cap{2};

// Which clone runs: 2 AVX-512, 1 AVX2, 0 the baseline; the CPU's features, capped by the tests.
int simd_level() {
#ifdef PYHOOK_STATS_AVX2
  static const int cpu = !__builtin_cpu_supports("avx2") ? 0
                         : (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
                             ? 2
                             : 1;
  return std::min(cpu, g_test_simd_cap.load(std::memory_order_relaxed));
#else
  return 0;
#endif
}

template <typename T>
void columns_stats(int simd, const T* x, int64_t n, int64_t d, int64_t c0, int64_t c1,
                   double* mean, double* m2, double* sq) {
#ifdef PYHOOK_STATS_AVX2
  if (simd == 2) {
    columns_stats_avx512<T>(x, n, d, c0, c1, mean, m2, sq);
    return;
  }
  if (simd == 1) {
    columns_stats_avx2<T>(x, n, d, c0, c1, mean, m2, sq);
    return;
  }
#endif
  (void)simd;
  columns_stats_base<T>(x, n, d, c0, c1, mean, m2, sq);
}

at::Tensor row_stats_cpu(const at::Tensor& rows) {
  TORCH_CHECK(rows.dim() == 2, "row_stats: rows must be [rows, values], got ", rows.dim(),
              " dimensions");
  TORCH_CHECK(!rows.is_complex(), "row_stats: complex rows have no statistics");
  const at::Tensor x = rows.contiguous();
  const int64_t n = x.size(0);
  const int64_t d = x.size(1);
  at::Tensor out = at::zeros({1, 2 + 2 * d}, x.options().dtype(at::kDouble));
  if (n == 0) {
    return out;
  }
  double* o = out.data_ptr<double>();
  // One column range per thread (at most), each at least 64 columns wide.
  int64_t chunks = 1;
  if (n * d >= kParallelMinElems && !at::in_parallel_region()) {
    chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), d / 64));
  }
  std::vector<double> sq(static_cast<size_t>(chunks * n), 0.0);  // partial squared norms
  const int simd = simd_level();
  AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, x.scalar_type(), "row_stats",
                             [&] {
                               const scalar_t* src = x.const_data_ptr<scalar_t>();
                               auto run = [&](int64_t c) {
                                 const int64_t c0 = d * c / chunks;
                                 const int64_t c1 = d * (c + 1) / chunks;
                                 columns_stats<scalar_t>(simd, src, n, d, c0, c1, o + 2,
                                                         o + 2 + d, sq.data() + c * n);
                               };
                               if (chunks == 1) {
                                 run(0);
                               } else {
                                 at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
                                   for (int64_t c = b; c < e; ++c) {
                                     run(c);
                                   }
                                 });
                               }
                             });
  double norms = 0.0;
  for (int64_t r = 0; r < n; ++r) {
    double s = 0.0;
    for (int64_t c = 0; c < chunks; ++c) {
      s += sq[static_cast<size_t>(c * n + r)];
    }
    norms += std::sqrt(s);
  }
  o[0] = static_cast<double>(n);
  o[1] = norms;
  return out;
}

}  // namespace

void stats_test_simd(int64_t cap) {
  g_test_simd_cap.store(static_cast<int>(std::clamp<int64_t>(cap, 0, 2)),
                        std::memory_order_relaxed);
}
}  // namespace pyhook

// Declared here (a fragment of the pyhook namespace), so that this op needs no
// line in registration.cpp.
TORCH_LIBRARY_FRAGMENT(pyhook, m) {
  // Statistics row [1, 2 + 2*D] (float64) of rows [n, D]: count, sum of row L2
  // norms, column means, column M2. CPU only; other devices use torch ops.
  m.def("row_stats(Tensor rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(pyhook, CPU, m) {
  m.impl("row_stats", &pyhook::row_stats_cpu);
}
