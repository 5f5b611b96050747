// CPU kernels of pyhook::dequant_rows / pyhook::dequant_rows_into: rows picked by a global
// index from the quantised parts of one layer of a compact store (float8_e4m3fn or int8, one
// float32 scale per row), dequantised into a floating dtype:
//
//     out[k] = dtype(float32(part[idx[k]]) * scale[idx[k]])
//
// computed in float32 and rounded once to the output dtype (pyhook/_reference.py's
// dequant_rows is the specification; tests/test_compact.py holds the two equal).
//
// Why native: a Python pass would gather the 1-byte rows, widen them to float32, multiply and
// cast, each a full pass over the batch with a temporary. Here every output element is one
// few vectorised integer and float operations and one store, read straight from the
// memory-mapped shards, with the GIL released by the dispatcher. The gather of plain rows
// (csrc/cpu/gather.cpp) is not touched: this is a separate op.
#include "../pyhook.h"

#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace pyhook {
namespace {

// Values converted through a float32 buffer at a time (outputs other than float32).
constexpr int64_t kBlock = 1024;

struct Part {
  const uint8_t* base;  // row 0 of the part (1-byte elements)
  int64_t row_step;     // bytes between consecutive rows
  const float* scale;   // one per row
};

struct Plan {
  std::vector<at::Tensor> keep;  // parts and scales (or dense copies) kept alive
  std::vector<Part> parts;
  std::vector<int64_t> starts;  // global index of each part's first row, then the total
  std::vector<int64_t> row_shape;
  int64_t row_elems = 1;
  bool fp8 = true;
  bool f16c = false;  // the CPU converts float16 vectors (fp8_row_f16c)
};

bool has_f16c();

bool rows_dense(const at::Tensor& t) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) {
      return false;
    }
    expected *= t.size(d);
  }
  return true;
}

Plan prepare(at::TensorList parts, at::TensorList scales, const at::Tensor& idx) {
  TORCH_CHECK(!parts.empty(), "dequant_rows: `parts` is empty; pass at least one part");
  TORCH_CHECK(parts.size() == scales.size(), "dequant_rows: ", parts.size(), " parts but ",
              scales.size(), " scale tensors; pass one scale tensor per part");
  TORCH_CHECK(idx.scalar_type() == at::kLong, "dequant_rows: `idx` must be an int64 tensor, got ",
              idx.scalar_type());
  TORCH_CHECK(idx.dim() == 1, "dequant_rows: `idx` must be 1-D, got shape ", idx.sizes());
  TORCH_CHECK(idx.device().is_cpu(), "dequant_rows: `idx` must be on the CPU, got ", idx.device());
  Plan p;
  const at::Tensor& first = parts[0];
  TORCH_CHECK(first.dim() >= 1, "dequant_rows: part 0 must have a row dimension");
  const auto dtype = first.scalar_type();
  TORCH_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kChar,
              "dequant_rows: parts must be float8_e4m3fn or int8, got ", dtype);
  p.fp8 = dtype == at::kFloat8_e4m3fn;
  p.f16c = has_f16c();
  p.row_shape.assign(first.sizes().begin() + 1, first.sizes().end());
  for (int64_t s : p.row_shape) {
    p.row_elems *= s;
  }
  p.starts.push_back(0);
  for (size_t i = 0; i < parts.size(); ++i) {
    at::Tensor t = parts[i];
    at::Tensor s = scales[i];
    TORCH_CHECK(t.device().is_cpu() && t.layout() == at::kStrided, "dequant_rows: part ", i,
                " must be a strided CPU tensor");
    TORCH_CHECK(t.scalar_type() == dtype, "dequant_rows: part ", i, " has dtype ",
                t.scalar_type(), ", part 0 has ", dtype);
    TORCH_CHECK(t.dim() >= 1 && t.sizes().slice(1).equals(p.row_shape), "dequant_rows: part ", i,
                " has shape ", t.sizes(), ", part 0 has rows of shape ", first.sizes().slice(1));
    TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == at::kFloat && s.dim() == 1 &&
                    s.size(0) == t.size(0),
                "dequant_rows: scales ", i, " must be a float32 CPU tensor [", t.size(0),
                "] (one per row of part ", i, "), got ", s.scalar_type(), " ", s.sizes());
    if (!rows_dense(t)) {
      t = t.contiguous();
    }
    if (!s.is_contiguous()) {
      s = s.contiguous();
    }
    const int64_t rows = t.size(0);
    p.parts.push_back(
        {rows > 0 && p.row_elems > 0 ? static_cast<const uint8_t*>(t.const_data_ptr()) : nullptr,
         t.stride(0), rows > 0 ? s.const_data_ptr<float>() : nullptr});
    p.starts.push_back(p.starts.back() + rows);
    p.keep.push_back(std::move(t));
    p.keep.push_back(std::move(s));
  }
  return p;
}

// Built for AVX2 as well as the baseline where the compiler can (the wheel's flags target the
// baseline x86-64, SSE2): the loops below are vectorised either way, and the AVX2 clone is
// picked at load time on CPUs that have it (measured alone: 2048 rows of 384 in 0.41 ms of CPU
// against 1.1 ms for the SSE2 build). On x86 with F16C, fp8_row_f16c below is faster still.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define PYHOOK_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define PYHOOK_CLONES
#endif

// One row of float8_e4m3fn values times `scale`, as float32: the product float32(q) * scale,
// rounded once, as the reference computes it. Integer and float operations without branches,
// so that the loop vectorises (a 256-entry table lookup does not): the 7 exponent-and-mantissa
// bits go under a float exponent of 127, giving (1 + m/8) * 2^e; a subnormal or zero (e = 0) is
// (that - 1) * 2 = m/4; both are 2^7 times the fp8 magnitude and never a float subnormal (which
// a flush-to-zero mode would zero); the sign is copied last (so -0 stays -0), NaN (S.1111.111)
// is made by its bits. The 2^-7 is folded into the scale when that is exact (the product is the
// same real number, rounded once).
PYHOOK_CLONES void fp8_row(const uint8_t* src, float scale, float* dst, int64_t d) {
  const float a = std::fabs(scale);
  const bool fold = !(a > 0.0f && a < 0x1p-100f);
  const float f = fold ? scale * 0x1p-7f : scale;
  const float pre = fold ? 1.0f : 0x1p-7f;
  for (int64_t j = 0; j < d; ++j) {
    const uint32_t b = src[j];
    const uint32_t m = b & 0x7Fu;
    const uint32_t nan_mask = 0u - static_cast<uint32_t>(m == 0x7Fu);
    const uint32_t bits = ((m << 20) + (127u << 23)) | (nan_mask & 0x7FC00000u);
    const uint32_t sign_bits = ((b & 0x80u) << 24) | 0x3F800000u;  // +-1.0
    float v;
    float sign;
    std::memcpy(&v, &bits, sizeof v);
    std::memcpy(&sign, &sign_bits, sizeof sign);
    const float sub = static_cast<float>(static_cast<int32_t>((b & 0x78u) == 0));
    v = std::copysign((v - sub) * (1.0f + sub), sign);
    dst[j] = (v * pre) * f;
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define PYHOOK_F16C 1
// The same values 8 at a time with F16C: an fp8 e4m3 value's bits, moved into a float16's
// (sign to bit 15, exponent and mantissa under it), are the value times 2^-8 as a float16,
// subnormals included (float16 has the range); VCVTPH2PS widens them exactly (MXCSR's
// denormals-are-zero does not apply to it), and 2^8 is folded into the scale when exact. NaN
// (S.1111.111) is set as a float16 NaN. Measured, 2048 random rows of 384 into float32, one
// thread: 0.34 ms of CPU, against 0.75 ms for the portable loop and 0.21 ms for a memcpy gather
// of the same rows in bf16 (0.26 ms in float32).
__attribute__((target("avx2,f16c"))) void fp8_row_f16c(const uint8_t* src, float scale,
                                                      float* dst, int64_t d) {
  const bool fold = std::fabs(scale) < 0x1p119f || std::isnan(scale);
  const __m256 f = _mm256_set1_ps(fold ? scale * 0x1p8f : scale);
  const __m256 pre = _mm256_set1_ps(fold ? 1.0f : 0x1p8f);
  const __m128i low7 = _mm_set1_epi16(0x7F);
  const __m128i sign = _mm_set1_epi16(0x80);
  const __m128i nan16 = _mm_set1_epi16(0x7E00);
  int64_t j = 0;
  for (; j + 8 <= d; j += 8) {
    __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j)));
    const __m128i m = _mm_and_si128(b, low7);
    __m128i h = _mm_or_si128(_mm_slli_epi16(m, 7), _mm_slli_epi16(_mm_and_si128(b, sign), 8));
    h = _mm_blendv_epi8(h, nan16, _mm_cmpeq_epi16(m, low7));
    const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(h), pre);
    _mm256_storeu_ps(dst + j, _mm256_mul_ps(v, f));
  }
  if (j < d) {
    fp8_row(src + j, scale, dst + j, d - j);
  }
}
#endif

bool has_f16c() {
#if defined(PYHOOK_F16C)
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

PYHOOK_CLONES void int8_row(const int8_t* src, float scale, float* dst, int64_t d) {
  for (int64_t j = 0; j < d; ++j) {
    dst[j] = static_cast<float>(src[j]) * scale;
  }
}

inline void float_row(const Plan& p, const uint8_t* src, float scale, float* dst, int64_t d) {
  if (p.fp8) {
#if defined(PYHOOK_F16C)
    if (p.f16c) {
      fp8_row_f16c(src, scale, dst, d);
      return;
    }
#endif
    fp8_row(src, scale, dst, d);
  } else {
    int8_row(reinterpret_cast<const int8_t*>(src), scale, dst, d);
  }
}

// One thread on purpose: an OpenMP region over a batch waited for its second thread on a loaded
// machine (measured 2048 rows of 384: 20 ms with at::parallel_for under load 5, 1.9 ms on the
// calling thread; csrc/cpu/gather.cpp says the same of its copies).
template <typename T>
void dequant_into(const Plan& p, const at::Tensor& idx_in, T* out) {
  const at::Tensor idx = idx_in.contiguous();
  const int64_t n = idx.numel();
  if (n == 0) {
    return;
  }
  const int64_t* ix = idx.const_data_ptr<int64_t>();
  const int64_t total = p.starts.back();
  (void)check_row_indices(ix, n, total, "dequant_rows");
  const int64_t d = p.row_elems;
  if (d == 0) {
    return;
  }
  std::vector<float> buffer;
  if (!std::is_same<T, float>::value) {
    buffer.resize(static_cast<size_t>(std::min<int64_t>(d, kBlock)));
  }
  for (int64_t k = 0; k < n; ++k) {
    const int64_t row = ix[k];
    const auto part = part_of_row(p.starts, row);
    const Part& s = p.parts[part];
    const int64_t local = row - p.starts[part];
    const uint8_t* src = s.base + local * s.row_step;
    const float scale = s.scale[local];
    T* dst = out + k * d;
    if constexpr (std::is_same<T, float>::value) {
      float_row(p, src, scale, dst, d);
    } else {
      for (int64_t a = 0; a < d; a += kBlock) {
        const int64_t m = std::min(kBlock, d - a);
        float_row(p, src + a, scale, buffer.data(), m);
        for (int64_t j = 0; j < m; ++j) {
          dst[a + j] = static_cast<T>(buffer[j]);
        }
      }
    }
  }
}

void dispatch(const Plan& p, const at::Tensor& idx, const at::Tensor& out) {
  void* data = out.numel() ? out.data_ptr() : nullptr;
  switch (out.scalar_type()) {
    case at::kFloat:
      dequant_into(p, idx, static_cast<float*>(data));
      break;
    case at::kDouble:
      dequant_into(p, idx, static_cast<double*>(data));
      break;
    case at::kBFloat16:
      dequant_into(p, idx, static_cast<c10::BFloat16*>(data));
      break;
    case at::kHalf:
      dequant_into(p, idx, static_cast<c10::Half*>(data));
      break;
    default:
      TORCH_CHECK(false, "dequant_rows: the output dtype must be float32, float64, bfloat16 or "
                         "float16, got ", out.scalar_type());
  }
}

// -- the fused batch: every quantised layer of a dataset batch in one call -------------------
//
// dequant_rows_many[_into]: layer l's parts and scales are the next counts[l] entries of
// `parts` / `scales`; one index check for the batch, then per layer each row is read straight
// from its part, widened, scaled and rounded into the output in registers (no float32 buffer,
// no temporaries), the rows a few ahead prefetched (a shuffled batch's rows are scattered over
// memory the hardware prefetcher has not seen). One thread, like dequant_rows: measured on this
// 2-core VM with the other core busy, waking a second thread cost more than the decode.

#if defined(PYHOOK_F16C)
// Output element types the vector loop below stores: float, bfloat16 (round to nearest even,
// as c10::BFloat16 and torch's casts round), float16 (VCVTPS2PH, nearest even), double.
enum class Out { kF32, kBF16, kF16, kF64 };

// Eight float32 values to `dst` as float32, float64 or float16.
template <Out O>
__attribute__((target("avx2,f16c"), always_inline)) inline void store8(void* dst, int64_t j,
                                                                       __m256 v) {
  if constexpr (O == Out::kF32) {
    _mm256_storeu_ps(static_cast<float*>(dst) + j, v);
  } else if constexpr (O == Out::kF64) {
    double* d = static_cast<double*>(dst) + j;
    _mm256_storeu_pd(d, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    _mm256_storeu_pd(d + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
  } else {
    static_assert(O == Out::kF16, "bfloat16 is stored sixteen at a time (store16)");
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<c10::Half*>(dst) + j),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// Sixteen float32 values (v0: the first eight) to `dst` as T. bfloat16: the two halves rounded,
// packed into one register and stored at once (two shuffles for sixteen values, not four).
template <Out O>
__attribute__((target("avx2,f16c"), always_inline)) inline void store16(void* dst, int64_t j,
                                                                        __m256 v0, __m256 v1) {
  if constexpr (O == Out::kBF16) {
    // bits + 0x7FFF + lsb, the top half: round to nearest even. A NaN here is a quiet NaN with
    // an empty low payload (from an fp8 NaN or an infinite scale times 0; rows with a NaN
    // scale take the scalar path), which this keeps a NaN.
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i bias = _mm256_set1_epi32(0x7FFF);
    const __m256i b0 = _mm256_castps_si256(v0);
    const __m256i b1 = _mm256_castps_si256(v1);
    const __m256i r0 = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(b0, bias),
                         _mm256_and_si256(_mm256_srli_epi32(b0, 16), one)),
        16);
    const __m256i r1 = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(b1, bias),
                         _mm256_and_si256(_mm256_srli_epi32(b1, 16), one)),
        16);
    // packus interleaves the 128-bit lanes: [r0 0-3, r1 0-3 | r0 4-7, r1 4-7]
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<c10::BFloat16*>(dst) + j), packed);
  } else {
    store8<O>(dst, j, v0);
    store8<O>(dst, j + 8, v1);
  }
}

// Sixteen fp8 e4m3 values at src as float32 (times 2^-8, exact: fp8_row_f16c explains why):
// their bits moved into float16 bits, widened by VCVTPH2PS.
__attribute__((target("avx2,f16c"), always_inline)) inline void fp8x16(const uint8_t* src,
                                                                       __m256& lo, __m256& hi) {
  const __m256i low7 = _mm256_set1_epi16(0x7F);
  const __m256i b =
      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  // (b + (b & 0x80)) << 7: exponent and mantissa to bits 7..13, the sign to bit 15
  __m256i h =
      _mm256_slli_epi16(_mm256_add_epi16(b, _mm256_and_si256(b, _mm256_set1_epi16(0x80))), 7);
  const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(b, low7), low7);
  h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7E00)));  // a float16 NaN
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

__attribute__((target("avx2,f16c"), always_inline)) inline void int8x16(const uint8_t* src,
                                                                        __m256& lo, __m256& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}

// One quantised row (fp8 e4m3 or int8) times `scale` into `dst` as T, 32 values a step (two
// independent groups of 16, for the out-of-order core to overlap), then 16: widened, times the
// scale (2^8 folded in for fp8), rounded once. The caller sends rows whose scale is NaN or too
// large to fold to the scalar path; the last d % 16 values also go there (returns where).
template <bool kFp8, Out O>
__attribute__((target("avx2,f16c"))) int64_t qrow_avx2(const uint8_t* src, float scale, void* dst,
                                                       int64_t d) {
  const __m256 f = _mm256_set1_ps(kFp8 ? scale * 0x1p8f : scale);
  __m256 a0, a1, b0, b1;
  int64_t j = 0;
  for (; j + 32 <= d; j += 32) {
    if constexpr (kFp8) {
      fp8x16(src + j, a0, a1);
      fp8x16(src + j + 16, b0, b1);
    } else {
      int8x16(src + j, a0, a1);
      int8x16(src + j + 16, b0, b1);
    }
    store16<O>(dst, j, _mm256_mul_ps(a0, f), _mm256_mul_ps(a1, f));
    store16<O>(dst, j + 16, _mm256_mul_ps(b0, f), _mm256_mul_ps(b1, f));
  }
  for (; j + 16 <= d; j += 16) {
    if constexpr (kFp8) {
      fp8x16(src + j, a0, a1);
    } else {
      int8x16(src + j, a0, a1);
    }
    store16<O>(dst, j, _mm256_mul_ps(a0, f), _mm256_mul_ps(a1, f));
  }
  return j;
}

using RowFn = int64_t (*)(const uint8_t*, float, void*, int64_t);

template <bool kFp8>
RowFn pick_row(at::ScalarType out) {
  switch (out) {
    case at::kFloat:
      return &qrow_avx2<kFp8, Out::kF32>;
    case at::kBFloat16:
      return &qrow_avx2<kFp8, Out::kBF16>;
    case at::kHalf:
      return &qrow_avx2<kFp8, Out::kF16>;
    default:
      return &qrow_avx2<kFp8, Out::kF64>;
  }
}
#endif

// Values j.. of one row in the scalar loops (the exact reference computation), as T.
template <typename T>
void scalar_rest(const Plan& p, const uint8_t* src, float scale, T* dst, int64_t j, int64_t d) {
  float buffer[kBlock];
  for (int64_t a = j; a < d; a += kBlock) {
    const int64_t m = std::min(kBlock, d - a);
    float_row(p, src + a, scale, buffer, m);
    for (int64_t i = 0; i < m; ++i) {
      dst[a + i] = static_cast<T>(buffer[i]);
    }
  }
}

void scalar_rest_any(const Plan& p, const uint8_t* src, float scale, void* dst,
                     at::ScalarType out, int64_t j, int64_t d) {
  switch (out) {
    case at::kFloat:
      scalar_rest(p, src, scale, static_cast<float*>(dst), j, d);
      break;
    case at::kBFloat16:
      scalar_rest(p, src, scale, static_cast<c10::BFloat16*>(dst), j, d);
      break;
    case at::kHalf:
      scalar_rest(p, src, scale, static_cast<c10::Half*>(dst), j, d);
      break;
    default:
      scalar_rest(p, src, scale, static_cast<double*>(dst), j, d);
  }
}

inline void prefetch_qrow(const Plan& p, int64_t row, int64_t row_bytes) {
  const auto part = part_of_row(p.starts, row);
  const Part& s = p.parts[part];
  const int64_t local = row - p.starts[part];
  const char* a = reinterpret_cast<const char*>(s.base + local * s.row_step);
  const int64_t lines = std::min<int64_t>(row_bytes, 2048);
  for (int64_t o = 0; o < lines; o += 64) {
    __builtin_prefetch(a + o);
  }
  __builtin_prefetch(s.scale + local);
}

// Rows ix[0..n) of layer p into `out` (n rows of p.row_elems values of type `type`).
void dequant_layer(const Plan& p, const int64_t* ix, int64_t n, void* out, at::ScalarType type) {
  const int64_t d = p.row_elems;
  if (d == 0 || n == 0) {
    return;
  }
  const int64_t item = static_cast<int64_t>(c10::elementSize(type));
  const int64_t ahead = std::clamp<int64_t>(4096 / d, 2, 16);
  for (int64_t k = 0; k < std::min(n, ahead); ++k) {
    prefetch_qrow(p, ix[k], d);
  }
#if defined(PYHOOK_F16C)
  RowFn fn = nullptr;
  if (p.f16c) {
    fn = p.fp8 ? pick_row<true>(type) : pick_row<false>(type);
  }
#endif
  for (int64_t k = 0; k < n; ++k) {
    if (k + ahead < n) {
      prefetch_qrow(p, ix[k + ahead], d);
    }
    const int64_t row = ix[k];
    const auto part = part_of_row(p.starts, row);
    const Part& s = p.parts[part];
    const int64_t local = row - p.starts[part];
    const uint8_t* src = s.base + local * s.row_step;
    const float scale = s.scale[local];
    char* dst = static_cast<char*>(out) + k * d * item;
    int64_t j = 0;
#if defined(PYHOOK_F16C)
    // fp8: 2^8 folds into the scale exactly below 2^119 (fp8_row_f16c); a NaN scale may carry
    // any payload, which the bfloat16 rounding above must not see.
    if (fn != nullptr && !std::isnan(scale) && (!p.fp8 || std::fabs(scale) < 0x1p119f)) {
      j = fn(src, scale, dst, d);
    }
#endif
    if (j < d) {
      scalar_rest_any(p, src, scale, dst, type, j, d);
    }
  }
}

std::vector<Plan> prepare_many(at::TensorList parts, at::TensorList scales,
                               at::IntArrayRef counts, const at::Tensor& idx) {
  TORCH_CHECK(parts.size() == scales.size(), "dequant_rows_many: ", parts.size(),
              " parts but ", scales.size(), " scale tensors; pass one scale tensor per part");
  check_layer_counts(counts, parts.size(), "dequant_rows_many");
  std::vector<Plan> ps;
  ps.reserve(counts.size());
  int64_t at = 0;
  for (int64_t c : counts) {
    const auto a = static_cast<size_t>(at), m = static_cast<size_t>(c);
    ps.push_back(prepare(parts.slice(a, m), scales.slice(a, m), idx));
    at += c;
  }
  return ps;
}

void dequant_many(const std::vector<Plan>& ps, const at::Tensor& idx_in,
                  const std::vector<at::Tensor>& outs) {
  const at::Tensor idx = idx_in.contiguous();
  const int64_t n = idx.numel();
  if (n == 0) {
    return;
  }
  const int64_t* ix = idx.const_data_ptr<int64_t>();
  int64_t total = ps[0].starts.back();
  for (const Plan& p : ps) {
    total = std::min(total, p.starts.back());
  }
  (void)check_row_indices(ix, n, total, "dequant_rows_many");
  for (size_t l = 0; l < ps.size(); ++l) {
    if (outs[l].numel()) {
      dequant_layer(ps[l], ix, n, outs[l].data_ptr(), outs[l].scalar_type());
    }
  }
}

bool dequant_dtype_ok(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

std::vector<int64_t> out_sizes(const Plan& p, const at::Tensor& idx) {
  std::vector<int64_t> sizes{idx.numel()};
  sizes.insert(sizes.end(), p.row_shape.begin(), p.row_shape.end());
  return sizes;
}

}  // namespace

at::Tensor dequant_rows_cpu(at::TensorList parts, at::TensorList scales, const at::Tensor& idx,
                            at::ScalarType dtype) {
  const Plan p = prepare(parts, scales, idx);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 ||
                  dtype == at::kHalf,
              "dequant_rows: the output dtype must be float32, float64, bfloat16 or float16, got ",
              dtype);
  at::Tensor out = at::empty(out_sizes(p, idx), at::TensorOptions().dtype(dtype));
  dispatch(p, idx, out);
  return out;
}

void dequant_rows_into_cpu(at::TensorList parts, at::TensorList scales, const at::Tensor& idx,
                           const at::Tensor& out) {
  const Plan p = prepare(parts, scales, idx);
  const auto sizes = out_sizes(p, idx);
  TORCH_CHECK(out.device().is_cpu() && out.sizes().equals(sizes) && out.is_contiguous(),
              "dequant_rows_into: `out` must be a contiguous CPU tensor of shape ",
              c10::IntArrayRef(sizes), ", got ", out.sizes(), " on ", out.device());
  dispatch(p, idx, out);
}

std::vector<at::Tensor> dequant_rows_many_cpu(at::TensorList parts, at::TensorList scales,
                                              at::IntArrayRef counts, const at::Tensor& idx,
                                              at::ScalarType dtype) {
  TORCH_CHECK(dequant_dtype_ok(dtype), "dequant_rows_many: the output dtype must be float32, "
              "float64, bfloat16 or float16, got ", dtype);
  const std::vector<Plan> ps = prepare_many(parts, scales, counts, idx);
  std::vector<at::Tensor> outs;
  outs.reserve(ps.size());
  for (const Plan& p : ps) {
    outs.push_back(empty_pooled(out_sizes(p, idx), dtype));  // no page faults on reuse
  }
  dequant_many(ps, idx, outs);
  return outs;
}

void dequant_rows_many_into_cpu(at::TensorList parts, at::TensorList scales,
                                at::IntArrayRef counts, const at::Tensor& idx,
                                at::TensorList outs) {
  const std::vector<Plan> ps = prepare_many(parts, scales, counts, idx);
  TORCH_CHECK(outs.size() == ps.size(), "dequant_rows_many_into: ", outs.size(),
              " outputs for ", ps.size(), " layers");
  std::vector<at::Tensor> os;
  for (size_t l = 0; l < ps.size(); ++l) {
    const auto sizes = out_sizes(ps[l], idx);
    const at::Tensor& o = outs[l];
    TORCH_CHECK(o.device().is_cpu() && o.sizes().equals(sizes) && o.is_contiguous() &&
                    dequant_dtype_ok(o.scalar_type()),
                "dequant_rows_many_into: `out` (layer ", l, ") must be a contiguous CPU float32, "
                "float64, bfloat16 or float16 tensor of shape ", c10::IntArrayRef(sizes),
                ", got ", o.scalar_type(), " ", o.sizes(), " on ", o.device());
    os.push_back(o);
  }
  dequant_many(ps, idx, os);
}

TORCH_LIBRARY_IMPL(pyhook, CPU, m) {
  m.impl("dequant_rows", &dequant_rows_cpu);
  m.impl("dequant_rows_into", &dequant_rows_into_cpu);
  m.impl("dequant_rows_many", &dequant_rows_many_cpu);
  m.impl("dequant_rows_many_into", &dequant_rows_many_into_cpu);
}

}  // namespace pyhook
