// CPU kernels of pyhook::gather_rows / pyhook::gather_rows_into: rows picked by a global
// index from a list of row-major parts (the memory-mapped shards of one captured layer).
//
// Why native: numpy's and torch's fancy indexing copy on one core and, for a list of parts,
// need one pass per part. Here every row is one memcpy into one pooled output buffer (no page
// faults on reuse), the copies are spread over the intra-op threads, rows of files that are not
// in the page cache are prefetched together in ascending file order (see prefetch_if_cold), and
// the dispatcher releases the GIL around the call.
#include "../pyhook.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#if defined(__linux__) || defined(__APPLE__)
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#endif
#include <unistd.h>
#if defined(__linux__)
#include <sched.h>
#include <pthread.h>
#include <sys/syscall.h>
#endif
#include <cstdio>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>  // SSE2 (every x86-64 CPU): _mm_stream_si128, _mm_sfence; AVX2 by target
#define PYHOOK_STREAM_STORES 1
#endif

namespace pyhook {
namespace {

// Below this many bytes one thread is faster than waking the others.
constexpr int64_t kParallelMinBytes = int64_t{1} << 20;
// Each thread copies at least this many bytes per task.
constexpr int64_t kGrainBytes = int64_t{64} << 10;
// ... and on torch's spinning team (run_on_team), which starts at once, this many.
constexpr int64_t kTeamMinBytes = int64_t{256} << 10;
// Rows of a batch whose residency is checked before deciding to prefetch.
constexpr int64_t kResidencySamples = 8;
// ... and once kWarmCallsTrusted calls in a row found all theirs resident (a capture that fits
// in the page cache, read again): a mincore call per sample cost 2-4 us with the CPU caches
// cold (after a training step), 16-30 us of a 0.75 ms batch for eight, and 17 us for two
// (timed inside a 1024-row batch of 0.27 ms: the page tables it walks are cold too), so a
// trusted call samples one row. A capture that leaves the page cache is found by the first
// call that samples a cold row, and then sampled fully. (Sampling only one call in 16 was
// tried: the calls in between then fault a cold batch in, a read-around window a row.)
constexpr int64_t kTrustedSamples = 1;
constexpr int kWarmCallsTrusted = 64;
std::atomic<int> warm_calls{0};
constexpr uintptr_t kPage = 4096;  // mincore/madvise granularity (a multiple on every system)

struct Source {
  const char* base;   // row 0 of the part
  int64_t row_step;   // bytes between consecutive rows (any sign, may be 0)
};

struct Prepared {
  std::vector<at::Tensor> keep;  // parts (or dense copies of them) kept alive for the copy
  std::vector<Source> sources;
  std::vector<int64_t> starts;   // global index of each part's first row, then the total
  std::vector<int64_t> row_shape;
  int64_t row_bytes = 0;
  at::ScalarType dtype = at::kFloat;
  // A row's part in one table lookup and one compare (see index_parts): part_at[row >> shift]
  // is the part of the first row of that block of 2^shift rows; empty when not built.
  int shift = 0;
  std::vector<uint32_t> part_at;
};

// Builds the part table of `p` when every part but the last has at least 2^shift rows for a
// shift that keeps the table small: then a block of 2^shift rows holds at most one part's
// first row past its own first row, and a row's part is its block's entry, or the next. The
// rows of a shuffled batch fall in random parts, and a binary search over a dozen shards cost
// four dependent steps a row (13 us of a 4096-row batch, looked up before the copy starts).
void index_parts(Prepared& p) {
  const size_t parts = p.starts.size() - 1;
  const int64_t total = p.starts.back();
  if (parts < 2 || total <= 0) {
    return;  // one part: its index is 0 without a search
  }
  int64_t shortest = total;
  for (size_t i = 0; i + 1 < parts; ++i) {
    shortest = std::min(shortest, p.starts[i + 1] - p.starts[i]);
  }
  if (shortest < 64) {
    return;  // tiny (or empty) parts: the search
  }
  int shift = 0;
  while ((int64_t{2} << shift) <= shortest) {
    ++shift;
  }
  const int64_t blocks = ((total - 1) >> shift) + 1;
  if (blocks > (int64_t{1} << 20) || parts > UINT32_MAX) {
    return;
  }
  p.shift = shift;
  p.part_at.resize(static_cast<size_t>(blocks));
  size_t part = 0;  // one sweep: the part of row b << shift, for b = 0, 1, ...
  for (int64_t b = 0; b < blocks; ++b) {
    while (p.starts[part + 1] <= (b << shift)) {
      ++part;
    }
    p.part_at[static_cast<size_t>(b)] = static_cast<uint32_t>(part);
  }
}

// True when one row of `t` (t[i]) is a dense, row-major block of memory.
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

void check_idx(const at::Tensor& idx) {
  TORCH_CHECK(idx.scalar_type() == at::kLong, "gather_rows: `idx` must be an int64 tensor, got ",
              idx.scalar_type());
  TORCH_CHECK(idx.dim() == 1, "gather_rows: `idx` must be 1-D, got shape ", idx.sizes());
  TORCH_CHECK(idx.device().is_cpu(), "gather_rows: `idx` must be on the CPU, got ", idx.device());
}

void check_parts_given(at::TensorList parts) {
  TORCH_CHECK(!parts.empty(),
              "gather_rows: `parts` is empty; pass at least one part (an empty [0, ...] tensor "
              "gives the row shape and dtype of a layer without rows)");
}

// The parts of one layer, checked, with each part's address and row step and the part table.
Prepared prepare_parts(at::TensorList parts) {
  check_parts_given(parts);
  Prepared p;
  const at::Tensor& first = parts[0];
  TORCH_CHECK(first.dim() >= 1, "gather_rows: part 0 must have a row dimension, got a 0-d tensor");
  p.dtype = first.scalar_type();
  p.row_shape.assign(first.sizes().begin() + 1, first.sizes().end());
  p.row_bytes = static_cast<int64_t>(first.element_size());
  for (int64_t s : p.row_shape) {
    p.row_bytes *= s;
  }
  p.starts.reserve(parts.size() + 1);
  p.starts.push_back(0);
  for (size_t i = 0; i < parts.size(); ++i) {
    at::Tensor t = parts[i];
    TORCH_CHECK(t.device().is_cpu() && t.layout() == at::kStrided, "gather_rows: part ", i,
                " must be a strided CPU tensor, got ", t.device(), " ", t.layout());
    TORCH_CHECK(t.scalar_type() == p.dtype, "gather_rows: part ", i, " has dtype ",
                t.scalar_type(), ", part 0 has ", p.dtype, "; all parts must share one dtype");
    TORCH_CHECK(t.dim() >= 1 && t.sizes().slice(1).equals(p.row_shape), "gather_rows: part ", i,
                " has shape ", t.sizes(), ", part 0 has rows of shape ", first.sizes().slice(1),
                "; all parts must share one row shape");
    if (has_lazy_values(t) || !rows_dense(t)) {
      // Rare (memory maps are dense): materialise the part once, then copy rows by memcpy.
      // copy_ resolves conjugate/negative bits and zero tensors as clone() does.
      at::Tensor dense = at::empty(t.sizes(), t.options());
      dense.copy_(t);
      t = std::move(dense);
    }
    const int64_t rows = t.size(0);
    p.sources.push_back(
        {rows > 0 && p.row_bytes > 0 ? static_cast<const char*>(t.const_data_ptr()) : nullptr,
         t.stride(0) * static_cast<int64_t>(t.element_size())});
    p.starts.push_back(p.starts.back() + rows);
    p.keep.push_back(std::move(t));
  }
  index_parts(p);
  return p;
}

Prepared prepare(at::TensorList parts, const at::Tensor& idx) {
  check_parts_given(parts);  // named before a bad idx, as it always was
  check_idx(idx);
  return prepare_parts(parts);
}

#if defined(__linux__) || defined(__APPLE__)
// Rows of memory-mapped files that are not in the page cache: a page fault on a file mapping
// reads a whole read-around window (read_ahead_kb, often megabytes) synchronously, one fault
// at a time, so a random batch from a cold file reads most of the file. Telling the kernel
// which pages the batch needs (MADV_WILLNEED, in ascending file order) starts all the reads
// at once, for just those pages; the copy then waits on pages already in flight. Measured on
// a 600 MB file of 3 KB rows: 4096 random rows in 85 ms instead of 740 ms. The advice costs a
// system call per row, so it is only given when a sample of the batch's rows is not resident.
bool row_resident(const Prepared& p, int64_t row, std::vector<unsigned char>& vec) {
  const size_t part = part_of_row(p.starts, row);
  const Source& s = p.sources[part];
  const auto addr = reinterpret_cast<uintptr_t>(s.base + (row - p.starts[part]) * s.row_step);
  const uintptr_t first = addr / kPage * kPage;
  const size_t len = addr + static_cast<uintptr_t>(p.row_bytes) - first;
  vec.assign((len + kPage - 1) / kPage, 0);
  if (mincore(reinterpret_cast<void*>(first), len, vec.data()) != 0) {
    return true;  // not a mapping mincore understands: nothing to prefetch
  }
  return std::all_of(vec.begin(), vec.end(), [](unsigned char v) { return (v & 1) != 0; });
}

#if defined(MADV_POPULATE_READ)
// Page faults on a file mapping whose pages are still being read map one page each (the
// kernel maps a whole 64 KiB window around a fault only over pages already read), so a copy
// right behind the disk took a fault per 4 KiB: measured 3x the CPU time of read() for the
// same cold sequential batches. MADV_POPULATE_READ (Linux 5.14) maps the pages of a range in
// one call, waiting for them as the copy would. Left off after the first EINVAL (older kernel).
std::atomic<bool> populate_works{true};

void populate(uintptr_t a, uintptr_t b) {
  if (populate_works.load(std::memory_order_relaxed) &&
      madvise(reinterpret_cast<void*>(a), b - a, MADV_POPULATE_READ) != 0 && errno == EINVAL) {
    populate_works.store(false, std::memory_order_relaxed);
  }
}
#else
void populate(uintptr_t, uintptr_t) {}
#endif

// The page-aligned start of the range the last read_ahead_next advised (0: none).
std::atomic<uintptr_t> read_ahead_start{0};

uintptr_t row_page(const Prepared& p, int64_t row) {
  const size_t part = part_of_row(p.starts, row);
  const Source& s = p.sources[part];
  return reinterpret_cast<uintptr_t>(s.base + (row - p.starts[part]) * s.row_step) / kPage * kPage;
}

// Whether a sampled row of layer `layer` (of `layers`) is not resident. Each layer samples its
// own rows of the batch: the layers' samples interleave (position k * layers + layer of
// samples * layers evenly spaced ones), so that a batch of many layers with one or two samples
// each still checks as many different rows.
bool sampled_cold(const Prepared& p, const int64_t* ix, int64_t n, int64_t max_samples,
                  int64_t layer, int64_t layers) {
  std::vector<unsigned char> vec;
  const int64_t samples = std::min<int64_t>(n, max_samples);
  const int64_t slots = samples * layers;
  for (int64_t k = 0; k < samples; ++k) {
    if (!row_resident(p, ix[(k * layers + layer) * n / slots], vec)) {
      return true;
    }
  }
  return false;
}

// The pages of the rows ix[0..n) of `p`, in ascending order (the disk's elevator), with
// touching rows merged into one range.
std::vector<std::pair<uintptr_t, uintptr_t>> row_pages(const Prepared& p, const int64_t* ix,
                                                       int64_t n) {
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  ranges.reserve(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) {
    const int64_t row = ix[k];
    const size_t part = part_of_row(p.starts, row);
    const Source& s = p.sources[part];
    const auto addr = reinterpret_cast<uintptr_t>(s.base + (row - p.starts[part]) * s.row_step);
    ranges.emplace_back(addr / kPage * kPage, addr + static_cast<uintptr_t>(p.row_bytes));
  }
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<uintptr_t, uintptr_t>> merged;
  uintptr_t lo = ranges[0].first, hi = ranges[0].second;
  for (const auto& r : ranges) {
    if (r.first > hi) {
      merged.emplace_back(lo, hi);
      lo = r.first;
    }
    hi = std::max(hi, r.second);
  }
  merged.emplace_back(lo, hi);
  return merged;
}

// Samples the batch's rows of every layer; if one is not resident, the rows of every layer
// (the layers of a capture live in the same shard files) are announced (MADV_WILLNEED), all
// layers before any waits, then mapped in file order as they arrive. A sequential batch that
// the previous call read ahead (its pages are in the page cache, or on their way, but not
// mapped yet) is mapped too. Returns whether a sampled row was not resident. (Before, each
// layer sampled the same positions of the batch and was announced and waited for on its own:
// a layer whose samples were resident was faulted in, a read-around window a row.)
bool prefetch_if_cold(const std::vector<Prepared>& ps, const int64_t* ix, int64_t n,
                      bool sequential, int64_t max_samples) {
  if (n == 0) {
    return false;
  }
  const auto layers = static_cast<int64_t>(ps.size());
  bool cold = false;
  for (int64_t l = 0; l < layers && !cold; ++l) {
    const Prepared& p = ps[static_cast<size_t>(l)];
    cold = p.row_bytes > 0 && sampled_cold(p, ix, n, max_samples, l, layers);
  }
  if (!cold && !sequential) {
    return false;  // a warm shuffled batch: nothing to announce or map
  }
  std::vector<std::vector<std::pair<uintptr_t, uintptr_t>>> pages(ps.size());
  for (size_t l = 0; l < ps.size(); ++l) {
    const Prepared& p = ps[l];
    const bool ahead = !cold && sequential && n > 1 && p.row_bytes > 0 &&
                       read_ahead_start.load(std::memory_order_relaxed) == row_page(p, ix[0]);
    if (p.row_bytes == 0 || (!cold && !ahead)) {
      continue;
    }
    pages[l] = row_pages(p, ix, n);
    if (cold) {
      for (const auto& r : pages[l]) {
        // Failure only means no read-ahead (e.g. not a file mapping): the copy still works.
        (void)madvise(reinterpret_cast<void*>(r.first), r.second - r.first, MADV_WILLNEED);
      }
    }
  }
  // All reads are in flight: map the pages as they arrive, in file order.
  for (const auto& layer_pages : pages) {
    for (const auto& r : layer_pages) {
      populate(r.first, r.second);
    }
  }
  return cold;
}

// After a sequential batch (rows first .. first + n - 1 in order), the next call of a
// sequential reader asks for the n rows that follow. Reading them from disk while the caller
// uses this batch keeps the disk busy between calls, as the kernel's read-ahead does for
// read(): without it every cold batch started with an idle disk (measured: the first 16 cold
// sequential batches at 0.85x the speed of readinto of the same bytes). Advised only when a
// sample of those rows is not resident, so a warm read costs a few mincore calls.
void read_ahead_next(const Prepared& p, int64_t first, int64_t n) {
  const int64_t total = p.starts.back();
  const int64_t begin = first + n;
  const int64_t end = std::min(total, begin + n);
  if (begin >= end || p.row_bytes == 0) {
    return;
  }
  std::vector<unsigned char> vec;
  const int64_t samples = std::min<int64_t>(end - begin, kResidencySamples);
  bool cold = false;
  for (int64_t k = 0; k < samples && !cold; ++k) {
    cold = !row_resident(p, begin + k * (end - begin) / samples, vec);
  }
  if (!cold) {
    return;
  }
  read_ahead_start.store(row_page(p, begin), std::memory_order_relaxed);
  for (size_t i = 0; i + 1 < p.starts.size(); ++i) {
    const int64_t lo = std::max(begin, p.starts[i]);
    const int64_t hi = std::min(end, p.starts[i + 1]);
    const Source& s = p.sources[i];
    if (lo >= hi || s.row_step != p.row_bytes) {
      continue;  // not in this part, or rows that are not one block of memory
    }
    const auto a = reinterpret_cast<uintptr_t>(s.base + (lo - p.starts[i]) * s.row_step);
    const auto b = reinterpret_cast<uintptr_t>(s.base + (hi - p.starts[i]) * s.row_step);
    (void)madvise(reinterpret_cast<void*>(a / kPage * kPage), b - a / kPage * kPage,
                  MADV_WILLNEED);
  }
}
#else
bool prefetch_if_cold(const std::vector<Prepared>&, const int64_t*, int64_t, bool, int64_t) {
  return false;
}
void read_ahead_next(const Prepared&, int64_t, int64_t) {}
#endif

// Makes this thread's non-temporal stores visible to other threads before what follows (a
// no-op where copy_streaming uses none).
inline void store_fence() {
#if defined(PYHOOK_STREAM_STORES)
  _mm_sfence();
#endif
}

// A page of a part that cannot be read raises SIGBUS in the thread that touches it: a shard
// truncated after it was mapped (another process rewrote or cut the file), or a disk error.
// Uncaught, that ends the process. Readers used to check every shard's size before each batch
// (one fstat a shard: 32 us of a 0.75 ms batch of 11 shards, measured with the CPU caches
// overwritten as a training step does, and O(shards) a batch). Instead the copy is guarded:
// while a thread copies a piece of a gather, a SIGBUS it raises returns from the piece (the
// handler jumps back to the guard), the rest of the call is skipped, and the call raises an
// error that names the address; pyhook's readers then name the shard. Every other SIGBUS goes
// on to the handler that was there before (the default ends the process, as before).
#if defined(__linux__)
struct BusGuard {
  sigjmp_buf env;
  void* volatile addr = nullptr;  // the faulting address, set by the handler
};
// Initial-exec TLS: read by the handler without a call that could allocate.
__attribute__((tls_model("initial-exec"))) thread_local BusGuard* t_bus_guard = nullptr;

struct sigaction bus_previous;     // the handler ours replaced (under bus_mu; read by ours)
std::atomic<int> bus_chaining{0};  // a SIGBUS is being passed to the previous handler
std::mutex bus_mu;

void on_sigbus(int sig, siginfo_t* info, void* ctx) {
  BusGuard* g = t_bus_guard;
  // A memory error the hardware reported (BUS_MCEERR_*) is never ours to recover from.
  const bool hardware = info != nullptr && (info->si_code == BUS_MCEERR_AR ||
                                           info->si_code == BUS_MCEERR_AO);
  if (g != nullptr && !hardware) {
    t_bus_guard = nullptr;
    g->addr = info != nullptr ? info->si_addr : nullptr;
    siglongjmp(g->env, 1);  // SA_NODEFER: SIGBUS is not blocked, no mask to restore
  }
  const struct sigaction prev = bus_previous;
  if (bus_chaining.fetch_add(1) == 0) {
    if ((prev.sa_flags & SA_SIGINFO) != 0 && prev.sa_sigaction != nullptr) {
      prev.sa_sigaction(sig, info, ctx);
      bus_chaining.fetch_sub(1);
      return;
    }
    if ((prev.sa_flags & SA_SIGINFO) == 0 && prev.sa_handler != SIG_DFL &&
        prev.sa_handler != SIG_IGN) {
      prev.sa_handler(sig);
      bus_chaining.fetch_sub(1);
      return;
    }
  }
  // The default action: returning re-runs the faulting access, which now ends the process.
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof(dfl));
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  (void)sigaction(SIGBUS, &dfl, nullptr);
  bus_chaining.fetch_sub(1);
}

// Installs on_sigbus unless it is the handler now (checked every call: a handler installed
// later, such as Python's faulthandler.enable(), replaces ours and is chained to instead).
void ensure_bus_handler() {
  struct sigaction cur;
  // Whether ours is the handler now (or the query failed: nothing to do).
  auto ours = [&cur] {
    return sigaction(SIGBUS, nullptr, &cur) != 0 ||
           ((cur.sa_flags & SA_SIGINFO) != 0 && cur.sa_sigaction == &on_sigbus);
  };
  if (ours()) {
    return;
  }
  std::lock_guard<std::mutex> lock(bus_mu);
  if (ours()) {
    return;
  }
  bus_previous = cur;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = &on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  (void)sigaction(SIGBUS, &sa, nullptr);
}

// fn() with SIGBUS guarded; returns the faulting address, or nullptr when fn() completed.
// noinline: the jump buffer must live in a frame that is active during fn().
__attribute__((noinline)) void* guarded(const std::function<void()>& fn) {
  BusGuard g;
#if defined(__x86_64__)
  const unsigned csr = _mm_getcsr();  // the handler ran with the default SSE control word
#endif
  if (sigsetjmp(g.env, 0) != 0) {
#if defined(__x86_64__)
    _mm_setcsr(csr);
#endif
    void* addr = g.addr;
    return addr != nullptr ? addr : reinterpret_cast<void*>(uintptr_t{1});
  }
  t_bus_guard = &g;
  fn();
  t_bus_guard = nullptr;
  return nullptr;
}
#else
void ensure_bus_handler() {}
void* guarded(const std::function<void()>& fn) {
  fn();
  return nullptr;
}
#endif

[[noreturn]] void raise_bus_error(void* addr) {
  TORCH_CHECK(false, "gather_rows: SIGBUS at address ", addr,
              " while copying rows: a page of a part (or of the output) could not be accessed "
              "(a memory-mapped file became shorter than its mapping, the disk failed, or "
              "shared memory ran out); nothing of this call's output is valid");
}

// Threads that help the calling thread copy, "caller runs" style: the caller publishes a job
// of pieces and claims pieces itself; helpers claim what is left when they get a core. Unlike
// a fork-join region (at::parallel_for), the caller never waits for a helper that has not
// started: on a loaded machine (more runnable threads than cores) an OpenMP region over this
// copy waited a scheduler time slice for its second thread (4096 x 3 KB rows: 8 ms with two
// threads against 2.5 ms with one); here it degrades to the one-thread time. A forked child
// (a DataLoader worker) has no helper threads: its caller simply runs every piece.
struct Job {
  std::function<void(int64_t)> fn;  // called only for claimed pieces, while the caller waits
  int64_t pieces = 0;
  bool fence = false;  // the pieces write with non-temporal stores: store_fence() before done
  std::atomic<int64_t> done{0};
  int64_t helper_delay_us = 0;  // tests only: helpers start this late (g_test_*)

  // The pieces are split into one contiguous range per thread (slot 0: the caller, slot i:
  // helper i), each packed as (front << 32) | back. A thread claims its own range's pieces
  // front to back, then takes what is left of the others' from their backs. Each thread thus
  // copies a run of consecutive pieces, and its prefetch, which runs ahead of the copy into
  // the next piece, asks for rows it will copy itself. With one shared counter the threads'
  // pieces interleaved: every piece started with rows nobody had prefetched and each thread
  // prefetched rows the other copied. Measured (4096 random rows of 3 KB from a warm 1.5 GB
  // mapping, two threads, back-to-back calls, medians of 60, two pairs of alternating
  // processes): 0.58 and 0.58 ms a batch with the shared counter, 0.54 and 0.53 ms this way.
  void split(int slots) {
    // Pieces of 64 KiB: 2^32 of them would be a batch of 256 TiB.
    TORCH_INTERNAL_ASSERT(pieces >= 0 && pieces < (int64_t{1} << 32));
    slots_ = std::max(1, slots);
    ranges_.reset(new Range[static_cast<size_t>(slots_)]);
    for (int s = 0; s < slots_; ++s) {
      const auto lo = static_cast<uint64_t>(pieces * s / slots_);
      const auto hi = static_cast<uint64_t>(pieces * (s + 1) / slots_);
      ranges_[static_cast<size_t>(s)].v.store((lo << 32) | hi, std::memory_order_relaxed);
    }
  }

  // Runs pieces until none is left to claim, then reports them done (one fence per thread,
  // not one per piece: a store fence waits for the write-combining buffers to drain).
  void work(int slot) {
    // Counted in memory: a piece that raises SIGBUS leaves pieces_left through a jump
    // (guarded), and a count kept in a register would be lost.
    volatile int64_t mine = 0;
    slot %= slots_;
    const std::function<void()> pieces_left = [&] {
      int64_t q = 0;
      while (claim(slot, /*front=*/true, q)) {
        run(q);
        mine = mine + 1;
      }
      for (int k = 1; k < slots_; ++k) {
        const int other = (slot + k) % slots_;
        while (claim(other, /*front=*/false, q)) {
          run(q);
          mine = mine + 1;
        }
      }
    };
    // One guard for all of this thread's pieces (not one a piece); after a fault the pieces
    // left are claimed and counted without being run.
    while (void* addr = guarded(pieces_left)) {
      mine = mine + 1;  // the piece that raised it
      uintptr_t none = 0;
      fault.compare_exchange_strong(none, reinterpret_cast<uintptr_t>(addr));
    }
    if (mine > 0) {
      if (fence) {
        store_fence();
      }
      done.fetch_add(mine, std::memory_order_release);
    }
  }

  // The first address a piece could not read (SIGBUS), or 0: the call then raises.
  std::atomic<uintptr_t> fault{0};

 private:
  void run(int64_t q) {
    if (fault.load(std::memory_order_relaxed) == 0) {
      fn(q);
    }
  }

  bool claim(int slot, bool front, int64_t& q) {
    std::atomic<uint64_t>& r = ranges_[static_cast<size_t>(slot)].v;
    uint64_t v = r.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t f = v >> 32, b = v & 0xffffffffu;
      if (f >= b) {
        return false;
      }
      const uint64_t next = front ? (((f + 1) << 32) | b) : ((f << 32) | (b - 1));
      if (r.compare_exchange_weak(v, next, std::memory_order_acq_rel,
                                  std::memory_order_relaxed)) {
        q = static_cast<int64_t>(front ? f : b - 1);
        return true;
      }
    }
  }

  int slots_ = 1;
  // One cache line a range: a thread's claims do not take the line of the other's range away.
  struct alignas(64) Range {
    std::atomic<uint64_t> v{0};
  };
  std::unique_ptr<Range[]> ranges_;
};

// Settings only the tests change (tests/test_gather.py, through the catch-all op
// pyhook::_test_gather_settings): torch's team never (0), always (1) or when it spins (-1,
// the rule every other caller gets), and the helpers or the caller starting this many
// microseconds late, to check that the other thread takes the late one's pieces. Relaxed
// atomics: a test sets them between calls, on the calling thread.
std::atomic<int> g_test_team{-1};
std::atomic<int64_t> g_test_helper_delay_us{0};
std::atomic<int64_t> g_test_caller_delay_us{0};

void sleep_us(int64_t us) {
  if (us > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(us));
  }
}

int64_t steady_us();

// Whether a caller that copied from t0 to t1 and then waited for another thread's pieces until
// t2 waited about as long as it worked: that thread lost its CPU in the middle of a piece (see
// solo_until_us). The same rule for the helpers (Helpers::run) and torch's team (run_on_team).
bool caller_waited(std::chrono::steady_clock::time_point t0,
                   std::chrono::steady_clock::time_point t1,
                   std::chrono::steady_clock::time_point t2) {
  return t2 - t1 > std::chrono::microseconds(100) && (t2 - t1) * 4 > t1 - t0;
}

#if defined(__linux__)
// The calling thread's affinity mask, read again at most once a second: a system call is
// cheap warm (0.2 us) but not right after a training step, when the kernel's code and data
// are out of the CPU caches too (sched_getaffinity took 9 us there, once a call).
bool affinity(cpu_set_t& out) {
  struct Cached {
    cpu_set_t set;
    int64_t at_us = -1;
    bool ok = false;
  };
  thread_local Cached c;
  const int64_t now = steady_us();
  if (c.at_us < 0 || now - c.at_us > 1000000) {
    CPU_ZERO(&c.set);
    c.ok = sched_getaffinity(0, sizeof(c.set), &c.set) == 0;
    c.at_us = now;
  }
  out = c.set;
  return c.ok;
}
#endif

class Helpers {
 public:
  explicit Helpers(int n) {
    for (int i = 0; i < n; ++i) {
      std::thread([this, i] { loop(i + 1); }).detach();
    }
  }

  // Runs the job with the helpers; returns whether the caller, once out of pieces to claim,
  // waited for a helper's piece about as long as it worked itself (a helper lost its core in
  // the middle of a piece).
  bool run(const std::shared_ptr<Job>& job) {
    steer();
    job->helper_delay_us = g_test_helper_delay_us.load(std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    sleep_us(g_test_caller_delay_us.load(std::memory_order_relaxed));
    const auto t0 = std::chrono::steady_clock::now();
    job->work(0);
    const auto t1 = std::chrono::steady_clock::now();
    // Only pieces a helper has claimed remain, and that helper is running them.
    while (job->done.load(std::memory_order_acquire) < job->pieces) {
      std::this_thread::yield();
    }
    const auto t2 = std::chrono::steady_clock::now();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (job_ == job) {
        job_.reset();
      }
    }
    return caller_waited(t0, t1, t2);
  }

  // Wakes the helpers ahead of a job the caller is about to publish (it is still checking the
  // indices and looking up the rows' addresses): a helper that wakes without a job spins for
  // it up to kPrewakeSpinUs, then sleeps again (a call whose index check fails publishes
  // none). A helper woken with the job claimed its first piece 30-60 us after it was published
  // (a virtual CPU that had halted, or one a spinning OpenMP worker held), a tenth of a
  // 4096-row gather, during which the caller copied alone. Measured (4096 random rows of 3 KB,
  // warm, 96 MB of CPU caches overwritten before each call, 60 shuffled rounds, other core
  // idle), seven runs, with the early wake against without: 0.57/0.65, 0.58/0.58, 0.76/0.84,
  // 0.59/0.66, 0.86/0.88, 0.68/0.70, 0.73/0.77 ms.
  void wake() {
    steer();
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++wakes_;
    }
    cv_.notify_all();
  }

 private:
  // Keeps the helpers off the caller's CPU (their affinity: the caller's CPUs but its current
  // one; set again only when the caller runs on another CPU). Woken while the other CPU was
  // held by a thread, most often one of torch's OpenMP workers spinning after the training
  // step, the scheduler put a helper on the caller's own CPU, where it preempted the caller
  // and copied its range while the caller waited: 1.55-1.60 ms a 4096-row batch after an SAE
  // step against 1.35 ms on one thread (the helper's run time equal to the caller's wait,
  // in /proc/self/task/*/schedstat). On another CPU it preempts the spinning worker instead:
  // 0.80-0.83 ms, where torch.index_select (whose own worker is the one spinning) took
  // 0.79-0.86 ms.
  void steer() {
#if defined(__linux__)
    const int cpu = sched_getcpu();
    if (cpu < 0 || cpu == steered_cpu_.load(std::memory_order_relaxed)) {
      return;
    }
    cpu_set_t set;
    if (!affinity(set) || !CPU_ISSET(cpu, &set) || CPU_COUNT(&set) < 2) {
      return;
    }
    CPU_CLR(cpu, &set);
    std::lock_guard<std::mutex> lock(mu_);
    for (pid_t tid : tids_) {
      (void)sched_setaffinity(tid, sizeof(set), &set);  // a failure leaves it where it was
    }
    steered_cpu_.store(cpu, std::memory_order_relaxed);
#endif
  }

  std::atomic<int> steered_cpu_{-1};
  std::vector<pid_t> tids_;  // the helpers' thread ids (under mu_)

  static constexpr int64_t kPrewakeSpinUs = 200;

  void loop(int slot) {
    uint64_t seen = 0;
    uint64_t wakes_seen = 0;
#if defined(__linux__)
    pthread_setname_np(pthread_self(), "pyhook-gather");  // as top, ps and py-spy show it
    {
      std::lock_guard<std::mutex> lock(mu_);
      tids_.push_back(static_cast<pid_t>(syscall(SYS_gettid)));
      steered_cpu_.store(-1, std::memory_order_relaxed);  // steer this one too, next call
    }
#endif
    for (;;) {
      std::shared_ptr<Job> job;
      bool early = false;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_.load() != seen || wakes_ != wakes_seen; });
        wakes_seen = wakes_;
        if (generation_.load() != seen) {
          seen = generation_.load();
          job = job_;
        } else {
          early = true;
        }
      }
      if (early) {
        const auto until =
            std::chrono::steady_clock::now() + std::chrono::microseconds(kPrewakeSpinUs);
        while (generation_.load(std::memory_order_acquire) == seen &&
               std::chrono::steady_clock::now() < until) {
#if defined(__x86_64__) || defined(_M_X64)
          _mm_pause();
#endif
        }
        if (generation_.load(std::memory_order_acquire) == seen) {
          continue;  // no job came: sleep again
        }
        std::lock_guard<std::mutex> lock(mu_);
        seen = generation_.load();
        job = job_;
      }
      if (job) {
        sleep_us(job->helper_delay_us);  // 0 but in tests
        job->work(slot);  // a finished job has no piece left to claim: returns at once
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<Job> job_;
  std::atomic<uint64_t> generation_{0};
  uint64_t wakes_ = 0;
};

// Calls fn(q) for q in [0, pieces) on the calling thread and up to at::get_num_threads() - 1
// helpers (no more threads than CPUs this process may run on). Helpers are created on first
// use in each process (a fork leaves none behind) and, like the buffer pool, deliberately
// leaked: they outlive static destruction at exit.
//
// Helpers are woken whatever else runs on the machine: a helper that finds no core leaves its
// pieces to the caller, which takes them from the back of the helper's range; a helper that
// does find one takes a fair share of the time from whatever ran there. Before, a count of the
// machine's runnable threads (/proc/loadavg) kept the helpers asleep when it saw no spare core;
// it counted torch's own OpenMP workers, which spin for milliseconds after every parallel
// region, and kernel threads runnable for a moment, so a gather that followed any torch
// operation ran on one thread. Measured (4096 random rows of 3 KB from a warm 1.5 GB mapping,
// 96 MB of CPU caches overwritten before each call, pyhook's gather, one-thread gather and
// two-thread torch.index_select in a shuffled order, 40 rounds, medians, 2-core VM), with the
// count against without it: other core idle 0.85-1.12 against 0.65-0.82 ms (index_select
// 0.61-0.85 ms), one process spinning on the other core 1.08-1.24 against 0.76-1.08 ms, two
// and three spinning processes no different (1.00-1.24 ms, both).
//
// A call whose caller then waited for a helper (the helper was preempted in the middle of a
// piece: the other core is busy) makes the calls that follow run on the calling thread alone
// for a while, then the helpers are tried again. Measured in bench_read.py (a) at load 5.5 on
// 2 cores, 4096 x 3 KB rows: 6.25 ms a batch with the helper allowed, 2.81 ms on one thread,
// before this rule; with three processes spinning on 2 cores, one probe run gave 1.2 ms with
// it against 4.4-5.0 ms without, later runs no difference (medians 0.97-1.10 ms). The while
// starts at 50 ms and doubles with every wait in a row, up to 1.6 s; a call in which the
// helpers ran without a wait sets it back to 50 ms. (It was a fixed second:
// one preemption of a helper by a kernel thread or a spinning OpenMP worker on an otherwise
// idle machine sent a second of calls to one thread, half of a bench_read.py case's rounds.)
constexpr int64_t kSoloMinUs = 50000;
constexpr int64_t kSoloMaxUs = 1600000;
std::atomic<int64_t> solo_until_us{0};
std::atomic<int64_t> solo_period_us{kSoloMinUs};

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t steady_us() {
  return steady_ns() / 1000;
}

// The CPUs this process may run on (its affinity mask), 1 if unknown.
int allowed_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (affinity(set)) {
    return std::max(1, CPU_COUNT(&set));
  }
#endif
  return 1;
}

// How many threads a parallel copy uses now: torch's intra-op thread count, no more than the
// CPUs this process may run on, 1 during a one-thread period (see solo_until_us).
int parallel_threads() {
  int threads = std::max(1, at::get_num_threads());
  if (threads > 1) {
    threads = std::min(threads, allowed_cpus());
  }
  if (threads > 1 &&
      steady_us() < solo_until_us.load(std::memory_order_relaxed)) {
    threads = 1;
  }
  return threads;
}

// This process's id without a system call: glibc no longer caches getpid(), and a system call
// right after a training step cost 7-9 us on the 2-core VM (its code has left the CPU caches);
// a batch asked twice. Read on first use, and again in a forked child (pthread_atfork).
std::atomic<pid_t> cached_pid{0};

void refresh_pid() {
  cached_pid.store(getpid(), std::memory_order_relaxed);
}

pid_t current_pid() {
  const pid_t pid = cached_pid.load(std::memory_order_relaxed);
  if (pid != 0) {
    return pid;
  }
  static std::once_flag once;
  std::call_once(once, [] {
#if defined(__linux__) || defined(__APPLE__)
    (void)pthread_atfork(nullptr, nullptr, &refresh_pid);
#endif
    refresh_pid();
  });
  return getpid();
}

// This process's helpers for a copy on `threads` threads (created on first use, and again
// after a fork or a change of the thread count).
Helpers* helpers_for(int threads) {
  static std::mutex mu;
  static Helpers* helpers = nullptr;
  static pid_t owner = 0;
  static int count = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (helpers == nullptr || owner != current_pid() || count != threads - 1) {
    helpers = new Helpers(threads - 1);  // the previous set (or a parent's) is abandoned
    owner = current_pid();
    count = threads - 1;
  }
  return helpers;
}

// After a call on several threads: starts or lengthens the one-thread period if the caller
// waited for a helper, or sets it back to its least if it did not (see solo_until_us).
void update_backoff(bool waited) {
  if (waited) {
    const int64_t period = solo_period_us.load(std::memory_order_relaxed);
    solo_until_us.store(steady_us() + period, std::memory_order_relaxed);
    solo_period_us.store(std::min(kSoloMaxUs, period * 2), std::memory_order_relaxed);
  } else {
    solo_period_us.store(kSoloMinUs, std::memory_order_relaxed);
  }
}

// Right after torch ran a parallel region (a training step, a forward), its OpenMP workers spin
// for a while waiting for the next one: a parallel region started then runs on them at once.
// Waking a sleeping helper instead cost the caller 14 us of a futex wake on this VM (an
// interrupt to the other virtual CPU), and the helper then had to take its CPU from the
// spinning worker. So a call made while every worker of the caller's team is running on a CPU
// copies on that team (run_on_team), with the same pieces claimed the same way; other calls
// use the helpers, which never make the caller wait for a thread that has no core (a parallel
// region waits at its end for every thread of the team, see Job). Measured right after an
// autoencoder step (random rows of 3 KB from a warm file mapping, 2-core VM, 40 paired
// rounds, PYHOOK_GATHER_TEAM=1 against =0): 4096 rows 0.635 against 0.666 ms, 2048 rows 0.366
// against 0.402, 1024 rows 0.248 against 0.278 (torch.index_select 0.579, 0.313, 0.184). In
// bench_read.py (g), four runs each alternating with the previous main: 0.98-1.03x
// index_select (median 1.01x) against 0.92-1.06x (0.95x); with a process spinning on the other
// core as well, 0.96x and 1.57x against 0.93x and 0.54x (a helper without a core: 2.3 ms).
struct Team {
  pid_t pid = 0;
  int threads = 0;
  std::vector<clockid_t> clocks;  // the workers' CPU-time clocks (the caller's own left out)
};
thread_local Team t_team;

// CPU time used so far by the thread of clock c (nanoseconds), -1 if it cannot be read.
int64_t cpu_ns(clockid_t c) {
  timespec ts{};
  if (clock_gettime(c, &ts) != 0) {
    return -1;
  }
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// The workers of the calling thread's team of `threads` threads, found with one parallel
// region (again after a fork or a change of the thread count); none if torch runs its
// parallel regions on the calling thread alone here.
const std::vector<clockid_t>& team_clocks(int threads) {
  Team& t = t_team;
  if (t.pid == current_pid() && t.threads == threads) {
    return t.clocks;
  }
  t.pid = current_pid();
  t.threads = threads;
  t.clocks.clear();
#if defined(__linux__)
  if (!at::in_parallel_region()) {
    std::vector<clockid_t> ids(static_cast<size_t>(threads), clockid_t{0});
    std::vector<char> found(static_cast<size_t>(threads), 0);
    const pthread_t self = pthread_self();
    at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
      clockid_t c{};
      if (pthread_equal(pthread_self(), self) || pthread_getcpuclockid(pthread_self(), &c) != 0) {
        return;
      }
      for (int64_t i = b; i < e; ++i) {
        ids[static_cast<size_t>(i)] = c;
        found[static_cast<size_t>(i)] = 1;
      }
    });
    for (size_t i = 0; i < ids.size(); ++i) {
      if (found[i] && std::find(t.clocks.begin(), t.clocks.end(), ids[i]) == t.clocks.end()) {
        t.clocks.push_back(ids[i]);
      }
    }
  }
#endif
  return t.clocks;
}

// The workers' CPU times at the start of a call (team_running compares them later in the
// call: the call's own first steps are the window, with no wait added unless they took
// under kTeamWindowNs).
struct TeamSample {
  int64_t wall = 0;
  std::vector<int64_t> cpu;  // in the order of t_team.clocks; empty: no sample
};

TeamSample team_sample() {
  TeamSample s;
  if (t_team.pid != current_pid() || t_team.clocks.empty()) {
    return s;
  }
  s.cpu.reserve(t_team.clocks.size());
  for (clockid_t c : t_team.clocks) {
    const int64_t v = cpu_ns(c);
    if (v < 0) {  // that worker ended: find the team again at the next call
      t_team.pid = 0;
      s.cpu.clear();
      return s;
    }
    s.cpu.push_back(v);
  }
  s.wall = steady_ns();
  return s;
}

constexpr int64_t kTeamWindowNs = 1000;

// Whether every worker of the team of `threads` threads ran on a CPU for at least half of the
// time since `s`: spinning after torch's last parallel region (sleeping, or waiting for a CPU
// another thread holds, it gains no CPU time).
bool team_running(const TeamSample& s, int threads) {
  const std::vector<clockid_t>& clocks = team_clocks(threads);
  if (s.cpu.empty() || s.cpu.size() != clocks.size() ||
      clocks.size() + 1 < static_cast<size_t>(threads)) {
    return false;
  }
  int64_t wall = steady_ns();
  while (wall - s.wall < kTeamWindowNs) {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_pause();
#endif
    wall = steady_ns();
  }
  for (size_t i = 0; i < clocks.size(); ++i) {
    const int64_t v = cpu_ns(clocks[i]);
    if (v < 0 || (v - s.cpu[i]) * 2 < wall - s.wall) {
      return false;
    }
  }
  return true;
}

// Runs the job on torch's team: slot k on thread k, each then taking what is left of the
// others' ranges, as with the helpers. Returns whether the caller, out of pieces, waited at
// the region's end about as long as it worked (a worker lost its CPU: see solo_until_us).
bool run_on_team(Job& job, int threads) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  Clock::time_point t1{};
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    const bool caller = at::get_thread_num() == 0;
    for (int64_t i = b; i < e; ++i) {
      job.work(static_cast<int>(i));
    }
    if (caller) {
      t1 = Clock::now();
    }
  });
  const auto t2 = Clock::now();
  return caller_waited(t0, t1 == Clock::time_point{} ? t2 : t1, t2);
}

// Runs the pieces on `threads` threads (from parallel_threads(), taken once a call by the
// caller, which may have woken those helpers already), on torch's team if `team`.
// Raises the error of a piece that hit SIGBUS, once no thread uses the job.
void run_pieces(int threads, bool team, int64_t pieces, const std::function<void(int64_t)>& fn,
                bool fence) {
  auto job = std::make_shared<Job>();
  job->fn = fn;
  job->pieces = pieces;
  job->fence = fence;
  if (threads == 1 || pieces == 1) {
    job->split(1);
    job->work(0);
  } else if (team) {
    job->split(threads);
    update_backoff(run_on_team(*job, threads));
  } else {
    Helpers* h = helpers_for(threads);
    job->split(threads);
    update_backoff(h->run(job));
  }
  // Every piece was done or skipped (h->run waits for them): no helper still uses the job.
  if (const uintptr_t addr = job->fault.load()) {
    raise_bus_error(reinterpret_cast<void*>(addr));
  }
}

// Rows of a shuffled batch are scattered over memory the hardware prefetcher has not seen, and
// over pages the TLB has not seen (4 KiB pages of a file mapping: a 3 KB row touches one or
// two). Asking, about 48 KiB of rows ahead, for the first cache line of each page a row
// touches starts both the page walks and the row's stream early; the hardware prefetcher
// follows the rest of each page. Measured on one thread, 4096 random rows of 3 KB from a
// page-cached file mapping into one buffer (medians of 25, CPU caches flushed): 1.46-1.50 ms
// with the whole first KiB of the row 4 rows ahead (before), 1.26-1.35 ms this way, against
// 1.26-1.31 ms for one memcpy of the same number of consecutive bytes. (With the 2 MiB
// mappings ext4 gives a page-cached file here, the difference was lost in the noise of a
// loaded machine. Before, the prefetch also stopped at the end of each 64 KiB piece of work,
// so most rows of a one-thread gather were never prefetched.)
constexpr int64_t kPrefetchBytesAhead = int64_t{48} << 10;
constexpr int64_t kPrefetchPagesPerRow = 4;

// Where row `row` of the parts starts in memory.
inline const char* row_address(const Prepared& p, int64_t row) {
  size_t part;
  if (!p.part_at.empty()) {
    part = p.part_at[static_cast<size_t>(row >> p.shift)];
    part += static_cast<size_t>(row >= p.starts[part + 1]);
  } else {
    part = part_of_row_branchless(p.starts, row);
  }
  const Source& s = p.sources[part];
  return s.base + (row - p.starts[part]) * s.row_step;
}

// Asks for the first line of each of the row's first pages (at most kPrefetchPagesPerRow).
inline void prefetch_address(const char* a, int64_t row_bytes) {
  __builtin_prefetch(a);
  const auto end = reinterpret_cast<uintptr_t>(a) + static_cast<uintptr_t>(row_bytes);
  uintptr_t page = (reinterpret_cast<uintptr_t>(a) | (kPage - 1)) + 1;
  for (int64_t k = 1; k < kPrefetchPagesPerRow && page < end; ++k, page += kPage) {
    __builtin_prefetch(reinterpret_cast<const char*>(page));
  }
}

inline void prefetch_row(const Prepared& p, int64_t row) {
  prefetch_address(row_address(p, row), p.row_bytes);
}

// A gather of at least this many bytes (all layers of the call) writes its output with
// non-temporal stores (copy_streaming): beyond the L2 cache, the output is not read back
// before the whole batch is written.
constexpr int64_t kStreamMinBytes = int64_t{1} << 20;

// memcpy with non-temporal (streaming) stores for the 32-byte-aligned middle of dst (AVX2;
// plain memcpy without it). A plain store to a line not in the cache first reads the line
// (read for ownership) and then evicts something else: for a batch output of megabytes that
// is a second stream of reads the gather does not need. Streaming stores write whole lines
// straight to memory. Measured, one thread, 4096 random rows of 3 KB from a warm 1.5 GB file
// mapping, CPU caches flushed between rounds, load 5-7 (paired rounds of pyhook.gather_rows,
// PYHOOK_GATHER_STREAM=1 against 0): 32-byte stores 0.87x and 0.90x the CPU time (81 rounds
// each; 0.86x with two threads); 16-byte SSE2 stores 0.91-1.01x, no clear win, not used. In a C
// model of the same loop the output read back afterwards (the consumer's side) still cost
// less in total (0.92x). Every thread that wrote so calls store_fence() before its pieces are
// reported done (Job::work).
#if defined(PYHOOK_STREAM_STORES) && defined(__GNUC__)
#define PYHOOK_STREAM_AVX2 1
// 32-byte streaming stores (one instruction per half line); the caller checks for AVX2.
__attribute__((target("avx2"))) void copy_streaming_avx2(char* dst, const char* src, int64_t n) {
  const auto head = static_cast<int64_t>((32 - reinterpret_cast<uintptr_t>(dst) % 32) % 32);
  std::memcpy(dst, src, static_cast<size_t>(head));
  dst += head;
  src += head;
  n -= head;
  for (; n >= 128; n -= 128, dst += 128, src += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 96), d);
  }
  std::memcpy(dst, src, static_cast<size_t>(n));
}

bool has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2");
  return ok;
}
#endif

// Whether large gathers use non-temporal stores: with AVX2.
bool streaming_wanted() {
#if defined(PYHOOK_STREAM_AVX2)
  return has_avx2();
#else
  return false;
#endif
}

inline void copy_streaming(char* dst, const char* src, int64_t n) {
#if defined(PYHOOK_STREAM_AVX2)
  if (n >= 256) {
    copy_streaming_avx2(dst, src, n);
    return;
  }
#endif
  std::memcpy(dst, src, static_cast<size_t>(n));
}

// The source address of each row ix[0..n) of the parts, one lookup of the row's part each,
// done once per batch before the copy. The copy used to look a row's part up twice, for the
// prefetch ahead of it and for the copy, each a binary search whose branches a shuffled batch
// makes unpredictable. Measured (one thread, 4096 random rows of 3 KB from a warm 1.5 GB
// mapping split in 12 parts, CPU caches evicted, 81 paired rounds, load 3-4): the copy before
// took 1.17x the CPU time of this one (1.05x with only the branchless search).
std::vector<const char*> row_addresses(const Prepared& p, const int64_t* ix, int64_t n) {
  std::vector<const char*> src(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) {
    src[static_cast<size_t>(k)] = row_address(p, ix[k]);
  }
  return src;
}

// Copies the rows at src[begin..end) (from row_addresses) to out + k * row_bytes (k in that
// range); with `stream`, by non-temporal stores (copy_streaming; the caller fences, see
// Job::work). In idx order: the output is written front to back (measured faster than visiting
// the sources in sorted order and scattering the writes, once the rows are in memory). Rows
// whose addresses follow each other (a sequential batch, or a run a shuffled batch holds in
// order) are one copy: each row is one dense block of row_bytes, so the bytes of such a run are
// exactly its rows, even across two parts that lie next to each other in memory.
void copy_range_addresses(const char* const* src, int64_t row_bytes, int64_t n, char* out,
                          int64_t begin, int64_t end, int64_t ahead_bytes, bool stream) {
  const int64_t ahead = std::clamp<int64_t>(ahead_bytes / row_bytes, 1, 256);
  for (int64_t k = begin; k < std::min(end, begin + ahead); ++k) {
    prefetch_address(src[k], row_bytes);
  }
  int64_t pos = begin;
  while (pos < end) {
    const char* a = src[pos];
    int64_t run = 1;
    while (pos + run < end && src[pos + run] == a + run * row_bytes) {
      ++run;
    }
    if (pos + run + ahead < n) {
      prefetch_address(src[pos + run + ahead], row_bytes);
    }
    if (stream) {
      copy_streaming(out + pos * row_bytes, a, run * row_bytes);
    } else {
      std::memcpy(out + pos * row_bytes, a, static_cast<size_t>(run * row_bytes));
    }
    pos += run;
  }
}

// The threads a call copies on, chosen as it starts (wake_for_call): on torch's team, or on the
// caller and its helpers.
struct CallThreads {
  int threads = 1;
  bool team = false;
};

// Copies rows idx[k] of the parts of layer l to outs[l] + k * row_bytes of that layer, for
// every layer and k: one index check, one residency check and one piece of work list for all
// the layers of a batch (a dataset batch of several layers and token ids is one call, so
// the fixed costs of a call, the dispatcher's, the checks' and waking a helper, are paid
// once a batch instead of once a layer).
void gather_layers(const std::vector<Prepared>& ps, const at::Tensor& idx_in,
                   const std::vector<char*>& outs, CallThreads call) {
  int threads = call.threads;
  const at::Tensor idx = idx_in.contiguous();
  const int64_t n = idx.numel();
  if (n == 0) {
    return;
  }
  const int64_t* ix = idx.const_data_ptr<int64_t>();
  ensure_bus_handler();
  int64_t total = ps[0].starts.back();
  int64_t bytes = 0;  // of the whole call, all layers
  for (const Prepared& p : ps) {
    total = std::min(total, p.starts.back());
    bytes += n * p.row_bytes;
  }
  // (wake_for_call chose the team or the helpers; the team starts at once, so fewer bytes
  // are worth splitting)
  const int64_t min_parallel = call.team ? kTeamMinBytes : kParallelMinBytes;
  if (bytes < min_parallel) {
    threads = 1;
  }
  // Every index is checked before anything is written (a bad index never leaves a
  // half-written output behind).
  const bool sequential = check_row_indices(ix, n, total, "gather_rows");
  bool stream = false;  // set below, once the call's bytes are known
  // Each row's source address, looked up once (see row_addresses).
  std::vector<std::vector<const char*>> srcs(ps.size());
  for (size_t l = 0; l < ps.size(); ++l) {
    if (ps[l].row_bytes > 0) {
      srcs[l] = row_addresses(ps[l], ix, n);
    }
  }
  auto copy = [&](const Prepared& p, char* o, int64_t b, int64_t e) {
    const auto l = static_cast<size_t>(&p - ps.data());
    copy_range_addresses(srcs[l].data(), p.row_bytes, n, o, b, e, kPrefetchBytesAhead, stream);
  };
  // A warm batch pays a mincore call per sampled row: the samples are shared by the layers
  // (at least 2 each, each layer its own rows; the layers of a capture live in the same shard
  // files). After kWarmCallsTrusted calls in a row found every sample resident, a call samples
  // 2 rows (1 a layer); one row found cold brings back the full count.
  const auto layers = static_cast<int64_t>(ps.size());
  const bool trusted = warm_calls.load(std::memory_order_relaxed) >= kWarmCallsTrusted;
  const int64_t samples = trusted ? std::max<int64_t>(1, kTrustedSamples / layers)
                                  : std::max<int64_t>(2, kResidencySamples / layers);
  const bool cold = prefetch_if_cold(ps, ix, n, sequential, samples);
  std::vector<int64_t> piece_rows(ps.size()), first_piece(ps.size() + 1, 0);
  for (size_t l = 0; l < ps.size(); ++l) {
    const Prepared& p = ps[l];
    piece_rows[l] = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, p.row_bytes));
    first_piece[l + 1] =
        first_piece[l] + (p.row_bytes > 0 ? (n + piece_rows[l] - 1) / piece_rows[l] : 0);
  }
  if (cold) {
    warm_calls.store(0, std::memory_order_relaxed);
  } else if (!trusted) {
    warm_calls.fetch_add(1, std::memory_order_relaxed);
  }
  stream = bytes >= kStreamMinBytes && streaming_wanted();
  if (bytes < min_parallel) {
    run_pieces(
        1, false, 1,
        [&](int64_t) {
          for (size_t l = 0; l < ps.size(); ++l) {
            if (ps[l].row_bytes > 0) {
              copy(ps[l], outs[l], 0, n);
            }
          }
        },
        stream);
  } else {
    run_pieces(
        threads, call.team, first_piece.back(),
        [&](int64_t q) {
          const auto l = part_of_row(first_piece, q);
          const int64_t b = (q - first_piece[l]) * piece_rows[l];
          copy(ps[l], outs[l], b, std::min(n, b + piece_rows[l]));
        },
        stream);
  }
  if (sequential && n > 1) {
    for (const Prepared& p : ps) {
      read_ahead_next(p, ix[0], n);
    }
  }
}

// The threads a call of `bytes` bytes in all copies on (1 below kParallelMinBytes, or below
// kTeamMinBytes on torch's spinning team) and whether on that team, with the helpers (when
// they are the ones) woken now, before the indices are checked and looked up: a helper takes
// 30-60 us to start (see Helpers::wake).
CallThreads wake_for_bytes(int64_t bytes) {
  // The workers' CPU times first: reading the settings and the thread count is the window
  // team_running looks at (a call of fewer bytes copies on its caller alone: no sample).
  const TeamSample sample = bytes >= kTeamMinBytes ? team_sample() : TeamSample{};
  int threads = bytes >= kTeamMinBytes ? parallel_threads() : 1;
  bool team = false;
  const int test_team = g_test_team.load(std::memory_order_relaxed);
  if (threads > 1 && test_team != 0) {
    // (a first call finds the team, with one parallel region, and uses the helpers)
    team = test_team == 1 || team_running(sample, threads);
  }
  if (!team && bytes < kParallelMinBytes) {
    threads = 1;  // not worth waking a helper for
  }
  if (threads > 1 && !team) {
    helpers_for(threads)->wake();
  }
  return {threads, team};
}

// wake_for_bytes for a call of these parts and indices, before the parts are checked
// (prepare_layers): the bytes come from each layer's first part, unchecked, and a call that
// prepare_layers then refuses publishes no job (the helpers sleep again).
CallThreads wake_for_call(at::TensorList parts, at::IntArrayRef counts, const at::Tensor& idx) {
  int64_t bytes = 0;
  size_t pos = 0;
  for (int64_t c : counts) {
    if (c > 0 && pos < parts.size() && parts[pos].dim() >= 1) {
      const at::Tensor& t = parts[pos];
      int64_t row = static_cast<int64_t>(t.element_size());
      for (int64_t d = 1; d < t.dim(); ++d) {
        row *= t.size(d);
      }
      bytes += idx.numel() * row;
    }
    pos += static_cast<size_t>(std::max<int64_t>(0, c));
  }
  return wake_for_bytes(bytes);
}

// The parts of each layer: `counts[l]` consecutive entries of `parts` per layer.
std::vector<Prepared> prepare_layers(at::TensorList parts, at::IntArrayRef counts,
                                     const at::Tensor& idx) {
  check_layer_counts(counts, parts.size(), "gather_rows_many");
  std::vector<Prepared> ps;
  ps.reserve(counts.size());
  int64_t at = 0;
  for (int64_t c : counts) {
    ps.push_back(prepare(parts.slice(static_cast<size_t>(at), static_cast<size_t>(c)), idx));
    at += c;
  }
  return ps;
}

std::vector<int64_t> out_sizes(const Prepared& p, const at::Tensor& idx) {
  std::vector<int64_t> sizes{idx.numel()};
  sizes.insert(sizes.end(), p.row_shape.begin(), p.row_shape.end());
  return sizes;
}

void check_out(const std::vector<Prepared>& ps, const at::Tensor& idx, const at::Tensor& out,
               size_t l) {
  const Prepared& p = ps[l];
  const std::vector<int64_t> sizes = out_sizes(p, idx);
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == p.dtype && out.sizes().equals(sizes),
              "gather_rows_into: `out` (layer ", l, ") must be a CPU tensor of dtype ", p.dtype,
              " and shape ", c10::IntArrayRef(sizes), ", got ", out.scalar_type(), " ",
              out.sizes(), " on ", out.device());
  TORCH_CHECK(out.is_contiguous(), "gather_rows_into: `out` (layer ", l, ") must be contiguous");
  for (const Prepared& q : ps) {
    for (const at::Tensor& t : q.keep) {
      // Writing into a part would make the result depend on the copy order.
      TORCH_CHECK(out.numel() == 0 || t.numel() == 0 || !t.is_alias_of(out),
                  "gather_rows_into: `out` (layer ", l, ") shares memory with a part");
    }
  }
}

// A fresh contiguous tensor of the given shape whose memory is one pooled buffer; the buffer
// goes back to the pool when the tensor's storage dies.
//
// Buffers of 64 KiB or more start at a page boundary, as the hand-written readers' buffers in
// bench_read.py do. A pooled buffer started 64 bytes past one (the allocator's alignment): a
// row copied from a page-aligned shard to a destination a few bytes ahead of it modulo 4 KiB
// can stall on "4K aliasing" (a load after a store to an address with the same low 12 bits);
// with 3 KB rows that is one row in four. (One paired run at load 8 showed 2.10 ms of CPU into
// a pooled buffer against 1.85 ms into a page-aligned one, 4096 rows of 3 KB on one thread; a
// direct loop of 40 batches then showed no difference, 1.83 against 1.83 ms: not resolved.)
constexpr int64_t kAlignOutputBytes = int64_t{64} << 10;

at::Tensor pooled_empty(std::vector<int64_t> sizes, at::ScalarType dtype, int64_t nbytes) {
  const bool align = nbytes >= kAlignOutputBytes;
  PooledBlock* block =
      pooled_block_create(static_cast<size_t>(nbytes + (align ? int64_t{kPage} : 0)));
  char* base = pooled_block_data(block);
  if (align) {
    base += (kPage - reinterpret_cast<uintptr_t>(base) % kPage) % kPage;
  }
  c10::DataPtr data(base, block, &pooled_block_release, c10::Device(c10::kCPU));
  // Resizable with the default CPU allocator, like any fresh tensor's storage.
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(nbytes),
                       std::move(data), c10::GetCPUAllocator(), /*resizable=*/true);
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
      c10::scalarTypeToTypeMeta(dtype));
  out.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return out;
}

// Rows idx of every layer of `ps` into fresh outputs, one a layer (pooled buffers), on the
// threads `call` chose.
std::vector<at::Tensor> gather_to_new(const std::vector<Prepared>& ps, const at::Tensor& idx,
                                      CallThreads call) {
  std::vector<at::Tensor> result;
  std::vector<char*> outs;
  result.reserve(ps.size());
  outs.reserve(ps.size());
  for (const Prepared& p : ps) {
    const int64_t nbytes = idx.numel() * p.row_bytes;
    if (nbytes == 0) {
      result.push_back(at::empty(out_sizes(p, idx), at::TensorOptions().dtype(p.dtype)));
      outs.push_back(nullptr);
    } else {
      result.push_back(pooled_empty(out_sizes(p, idx), p.dtype, nbytes));
      outs.push_back(static_cast<char*>(result.back().data_ptr()));
    }
  }
  gather_layers(ps, idx, outs, call);  // also reports out-of-range indices (nothing copied)
  return result;
}

}  // namespace

at::Tensor empty_pooled(std::vector<int64_t> size, at::ScalarType type) {
  int64_t nbytes = static_cast<int64_t>(c10::elementSize(type));
  for (int64_t s : size) {
    TORCH_CHECK(s >= 0, "empty_pooled: negative size ", s);
    nbytes *= s;
  }
  if (nbytes == 0) {
    return at::empty(size, at::TensorOptions().dtype(type));
  }
  return pooled_empty(std::move(size), type, nbytes);
}

std::vector<at::Tensor> gather_rows_many_cpu(at::TensorList parts, at::IntArrayRef counts,
                                             const at::Tensor& idx) {
  const CallThreads call = wake_for_call(parts, counts, idx);
  return gather_to_new(prepare_layers(parts, counts, idx), idx, call);
}

void gather_rows_many_into_cpu(at::TensorList parts, at::IntArrayRef counts,
                               const at::Tensor& idx, at::TensorList outs) {
  const CallThreads call = wake_for_call(parts, counts, idx);
  const std::vector<Prepared> ps = prepare_layers(parts, counts, idx);
  TORCH_CHECK(outs.size() == ps.size(), "gather_rows_many_into: ", outs.size(),
              " outputs for ", ps.size(), " layers");
  std::vector<char*> ptrs;
  for (size_t l = 0; l < ps.size(); ++l) {
    check_out(ps, idx, outs[l], l);
    ptrs.push_back(outs[l].numel() ? static_cast<char*>(outs[l].data_ptr()) : nullptr);
  }
  gather_layers(ps, idx, ptrs, call);
}

at::Tensor gather_rows_cpu(at::TensorList parts, const at::Tensor& idx) {
  const int64_t one[] = {static_cast<int64_t>(parts.size())};
  if (parts.empty()) {
    (void)prepare(parts, idx);  // names the empty list
  }
  return gather_rows_many_cpu(parts, one, idx)[0];
}

void gather_rows_into_cpu(at::TensorList parts, const at::Tensor& idx, const at::Tensor& out) {
  if (parts.empty()) {
    (void)prepare(parts, idx);  // names the empty list
  }
  const int64_t one[] = {static_cast<int64_t>(parts.size())};
  gather_rows_many_into_cpu(parts, one, idx, {out});
}

// A dataset's layers, checked and looked up once (prepare_parts: each part's address and row
// step, the part tables), for the batches of its training loop: a batch then passes the plan's
// number and the rows (gather_plan_rows), where gather_rows_many passed every part of every
// layer. Right after a training step (CPU caches cold) the Python binding of an operator that
// takes a list of 11 tensors cost 41 us a call, one that takes a number and a tensor 22 us,
// and checking the parts again another 6 us (probes on the 2-core VM, medians of 300 calls).
// A plan keeps its parts alive until it is released.
namespace {
struct GatherPlan {
  std::vector<Prepared> ps;
  int64_t row_bytes = 0;  // of all layers together
};
std::mutex plans_mu;
std::unordered_map<int64_t, std::shared_ptr<const GatherPlan>> plans;
int64_t plans_made = 0;

std::shared_ptr<const GatherPlan> find_plan(int64_t plan, const char* op) {
  std::lock_guard<std::mutex> lock(plans_mu);
  const auto it = plans.find(plan);
  TORCH_CHECK(it != plans.end(), op, ": no gather plan ", plan,
              " (released already, or never made by gather_plan in this process)");
  return it->second;
}
}  // namespace

int64_t gather_plan_cpu(at::TensorList parts, at::IntArrayRef counts) {
  check_layer_counts(counts, parts.size(), "gather_plan");
  auto plan = std::make_shared<GatherPlan>();
  plan->ps.reserve(counts.size());
  int64_t at = 0;
  for (int64_t c : counts) {
    plan->ps.push_back(
        prepare_parts(parts.slice(static_cast<size_t>(at), static_cast<size_t>(c))));
    plan->row_bytes += plan->ps.back().row_bytes;
    at += c;
  }
  std::lock_guard<std::mutex> lock(plans_mu);
  const int64_t id = ++plans_made;
  plans.emplace(id, std::move(plan));
  return id;
}

void gather_test_settings(int64_t team, int64_t helper_delay_us, int64_t caller_delay_us) {
  g_test_team.store(team < 0 ? -1 : (team == 0 ? 0 : 1), std::memory_order_relaxed);
  g_test_helper_delay_us.store(std::max<int64_t>(0, helper_delay_us), std::memory_order_relaxed);
  g_test_caller_delay_us.store(std::max<int64_t>(0, caller_delay_us), std::memory_order_relaxed);
  solo_until_us.store(0, std::memory_order_relaxed);
  solo_period_us.store(kSoloMinUs, std::memory_order_relaxed);
}

void gather_plan_release(int64_t plan) {
  std::shared_ptr<const GatherPlan> gone;  // its parts are freed outside the lock
  std::lock_guard<std::mutex> lock(plans_mu);
  const auto it = plans.find(plan);
  if (it != plans.end()) {
    gone = std::move(it->second);
    plans.erase(it);
  }
}

std::vector<at::Tensor> gather_plan_rows_cpu(int64_t plan, const at::Tensor& idx) {
  const std::shared_ptr<const GatherPlan> p = find_plan(plan, "gather_plan_rows");
  check_idx(idx);
  const CallThreads call = wake_for_bytes(idx.numel() * p->row_bytes);
  return gather_to_new(p->ps, idx, call);
}

// gather_rows_many is the dataset's batch (pyhook.pipeline.dataset, _backend._gather_many_direct):
// its parts are memory maps of a capture, which never need gradients. Without a kernel for the
// Autograd key, every call went through autograd's boxed fallback, which looks at each part for
// gradients and then dispatches again: 6-8 us a call right after a training step (11 shards,
// 16 rows: 82 against 75-77 us in all). A fallthrough skips the key. (Parts that do require
// gradients now give an output that does not, where the fallback gave one whose backward
// returned no gradient. The public gather_rows and the _into ops keep the fallback.)
TORCH_LIBRARY_IMPL(pyhook, Autograd, m) {
  m.impl("gather_rows_many", torch::CppFunction::makeFallthrough());
  m.impl("gather_plan_rows", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(pyhook, CPU, m) {
  m.impl("gather_rows", &gather_rows_cpu);
  m.impl("gather_rows_into", &gather_rows_into_cpu);
  m.impl("gather_rows_many", &gather_rows_many_cpu);
  m.impl("gather_rows_many_into", &gather_rows_many_into_cpu);
  m.impl("gather_plan", &gather_plan_cpu);
  m.impl("gather_plan_rows", &gather_plan_rows_cpu);
}

}  // namespace pyhook
