// Declarations shared by the schema file and the per-device kernels.
#pragma once

// Only the Tensor class (with its methods), not <ATen/ATen.h>: that one declares every ATen
// operator and costs each translation unit most of its compile time. Files that call a
// free function (at::empty, ...) include its own <ATen/ops/...> header.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace pyhook {

// Offsets of capture slices inside one buffer are aligned to this many bytes
// (a cache line, and enough for any dtype and for vectorised memcpy).
constexpr int64_t kSliceAlignment = 64;

// Values a raw byte copy of the tensor's memory would get wrong: lazy
// conjugate/negative views, and zero tensors (which have no data). Such a
// tensor must be materialised (copy_, resolve_*) before any memcpy.
inline bool has_lazy_values(const at::Tensor& t) {
  return t.is_conj() || t.is_neg() || t._is_zerotensor();
}

// Checks every index of a batch against `total` rows before anything is written (a bad index
// never leaves a half-written output behind), naming `op`, the index and its position. Returns
// whether idx is one ascending run of rows (a sequential batch); `ascending`, when given, is
// set to whether idx never decreases (its rows are already in file order). Shared by the row
// gathers (cpu/gather.cpp, cpu/dequant.cpp).
inline bool check_row_indices(const int64_t* ix, int64_t n, int64_t total, const char* op,
                              bool* ascending = nullptr) {
  bool sequential = true;
  bool up = true;
  for (int64_t k = 0; k < n; ++k) {
    TORCH_CHECK_INDEX(ix[k] >= 0 && ix[k] < total, op, ": index ", ix[k], " (at position ", k,
                      " of idx) is out of range for ", total, " rows; valid indices are 0..",
                      total - 1);
    sequential = sequential && ix[k] == ix[0] + k;
    up = up && (k == 0 || ix[k] >= ix[k - 1]);
  }
  if (ascending != nullptr) {
    *ascending = up;
  }
  return sequential;
}

// The part holding global row `row`, where `starts` holds each part's first global row, then
// the total (ascending, starts[0] == 0, row in [0, total)): the last part whose first row is
// <= row, so a part without rows (its start equal to the next one's) is never picked. The
// row's index inside that part is row - starts[part]. A binary search: a capture has a few
// parts (one per shard file) per layer. Shared by the row copies of cpu/gather.cpp and
// cpu/dequant.cpp (and gather.cpp's piece -> layer lookup, same layout).
inline size_t part_of_row(const std::vector<int64_t>& starts, int64_t row) {
  return static_cast<size_t>(std::upper_bound(starts.begin() + 1, starts.end(), row) -
                             starts.begin() - 1);
}

// part_of_row without branches on the data (the same answer): a binary search whose steps are
// conditional moves. A shuffled batch's rows fall in random parts, so each branch of
// std::upper_bound is a coin flip the CPU mispredicts half the time; this costs a fixed few
// cycles a step. For the row copies of a gather, which look up every row (twice: the
// prefetch and the copy).
inline size_t part_of_row_branchless(const std::vector<int64_t>& starts, int64_t row) {
  const int64_t* s = starts.data();
  size_t base = 0;
  size_t len = starts.size() - 1;  // parts: the last entry is the total, never <= row
  while (len > 1) {
    const size_t half = len / 2;
    base = s[base + half] <= row ? base + half : base;
    len -= half;
  }
  return base;
}

// Checks the per-layer part counts of a batch op (`counts[l]` consecutive entries of
// `parts` per layer): not empty, each at least 1, adding up to `nparts`; errors name `op`.
inline void check_layer_counts(at::IntArrayRef counts, size_t nparts, const char* op) {
  TORCH_CHECK(!counts.empty(), op, ": `counts` is empty; pass one count per layer");
  int64_t sum = 0;
  for (size_t l = 0; l < counts.size(); ++l) {
    TORCH_CHECK(counts[l] >= 1, op, ": counts[", l, "] is ", counts[l],
                "; every layer needs at least one part");
    sum += counts[l];
  }
  TORCH_CHECK(sum == static_cast<int64_t>(nparts), op, ": `counts` adds up to ", sum,
              " parts, but ", nparts, " were given");
}

// Where one input lands in the shared buffer and with which strides.
struct SlicePlan {
  std::vector<int64_t> strides;  // the strides Tensor::clone() would give
  int64_t offset = 0;            // byte offset in the buffer
  int64_t nbytes = 0;            // numel * itemsize (outputs are always dense)
  bool raw_copy = false;         // source span can be memcpy'd as-is
};

struct ClonePlan {
  std::vector<SlicePlan> slices;
  int64_t total_bytes = 0;
  c10::Device device = c10::Device(c10::kCPU);
};

// Validates the inputs (strided, one device) and lays them out in one buffer.
ClonePlan plan_clone(at::TensorList tensors);

std::vector<at::Tensor> clone_many_cpu(at::TensorList tensors);

// CPU buffer pool (csrc/cpu/pool.cpp).
// Stats order: cached_bytes, cached_buffers, limit_bytes, hits, misses,
// live_bytes, live_buffers.
std::vector<int64_t> pool_stats();
void pool_set_limit(int64_t nbytes);
void pool_empty();

// A pooled buffer shared by several output storages. Each output storage holds
// one reference through its DataPtr context; the buffer goes back to the pool
// when the last reference is dropped.
struct PooledBlock;
PooledBlock* pooled_block_create(size_t nbytes);  // holds one reference
char* pooled_block_data(PooledBlock* block);
void pooled_block_retain(PooledBlock* block);
void pooled_block_release(void* block);  // usable as a c10::DeleterFnPtr
// A fresh contiguous CPU tensor over a pooled buffer (cpu/gather.cpp): memory that is already
// mapped when a buffer of that size was freed before (e.g. the previous batch).
at::Tensor empty_pooled(std::vector<int64_t> size, at::ScalarType dtype);

// Frees a gather plan (cpu/gather.cpp, pyhook::gather_plan): its parts are released.
void gather_plan_release(int64_t plan);

// Tests only (tests/test_gather.py, tests/test_stats_simd.py): torch's team for gathers never
// (0), always (1) or when it spins (-1, the default); helpers or the caller starting late by
// that many microseconds; the one-thread back-off period cleared. And the highest SIMD clone
// the statistics kernel may use (2 AVX-512, 1 AVX2, 0 the baseline; 2 = the CPU's best).
void gather_test_settings(int64_t team, int64_t helper_delay_us, int64_t caller_delay_us);
void stats_test_simd(int64_t cap);

// threads.cpp: the autograd engine's id of the calling thread, and of the thread whose
// forward created the autograd Node being run on this thread (0 outside a backward).
int64_t thread_id();
int64_t autograd_node_thread_id();

}  // namespace pyhook
