// Bounded pool of CPU capture buffers.
//
// Why: a fresh multi-megabyte allocation comes straight from mmap, so every
// capture of a forward pass pays one page fault per 4 KiB page before the copy
// even starts. Handing the previous forward's buffers back makes the copy run
// at memory bandwidth. The pool only ever holds buffers nobody references:
// a buffer is returned when the last output storage viewing it dies.
#include "../pyhook.h"

#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace pyhook {
namespace {

constexpr int64_t kDefaultLimit = int64_t{1} << 30;  // 1 GiB

// Sizes are rounded so that captures of nearly the same size share buffers.
size_t round_size(size_t n) {
  const size_t q = n < (size_t{64} << 10) ? 64 : 4096;
  return (n + q - 1) / q * q;
}

// Buffers from 1 MiB up are mapped straight from the kernel, not taken from
// malloc's heap. Taken from the heap, a capture buffer takes the chunk the
// forward just freed, so the forward's next temporaries fault in fresh pages
// (and a later malloc_trim gives back the forward's pages with the pool's);
// mapped, the pool never moves the forward's heap. Mapped buffers are 2 MiB
// aligned and advised MADV_HUGEPAGE (a 2 MiB page faults once, not 512
// times; the kernel ignores it where transparent huge pages are off), and prefaulted in one
// call (MADV_POPULATE_WRITE) instead of one trap per page during the copy.
constexpr size_t kMapMin = size_t{1} << 20;
constexpr size_t kHuge = size_t{2} << 20;

void* map_buffer(size_t capacity) {
  if (capacity < kMapMin) {
    return c10::alloc_cpu(capacity);
  }
  constexpr bool huge = true;
  const size_t span = capacity + (huge ? kHuge : 0);
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(raw != MAP_FAILED, "pyhook: could not map a capture buffer of ", capacity,
              " bytes (out of memory?)");
  char* start = static_cast<char*>(raw);
  if (huge) {
    const auto addr = reinterpret_cast<uintptr_t>(raw);
    char* aligned = start + ((kHuge - addr % kHuge) % kHuge);
    const size_t head = static_cast<size_t>(aligned - start);
    const size_t tail = span - head - capacity;
    if (head > 0) {
      munmap(start, head);
    }
    if (tail > 0) {
      munmap(aligned + capacity, tail);
    }
    start = aligned;
#ifdef MADV_HUGEPAGE
    madvise(start, capacity, MADV_HUGEPAGE);  // advice only: ignored where THP is off
#endif
  }
#ifdef MADV_POPULATE_WRITE
  madvise(start, capacity, MADV_POPULATE_WRITE);  // best effort (Linux >= 5.14)
#endif
  return start;
}

void unmap_buffer(void* p, size_t capacity) {
  if (capacity < kMapMin) {
    c10::free_cpu(p);
  } else {
    munmap(p, capacity);
  }
}

int64_t limit_from_env() {
  const char* env = std::getenv("PYHOOK_POOL_LIMIT");
  if (env == nullptr || *env == '\0') {
    return kDefaultLimit;
  }
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  if (end == env || *end != '\0' || v < 0) {
    TORCH_WARN("PYHOOK_POOL_LIMIT=", env, " is not a non-negative byte count; using ",
               kDefaultLimit);
    return kDefaultLimit;
  }
  return static_cast<int64_t>(v);
}

class Pool {
 public:
  // On a hit, `capacity` is updated to the size of the reused buffer.
  void* acquire(size_t& capacity) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Best fit, but never hand out a buffer much larger than asked: that
      // would pin memory a later, larger capture could have used.
      auto it = free_.lower_bound(capacity);
      if (it != free_.end() && it->first <= capacity + capacity / 8) {
        void* p = it->second;
        capacity = it->first;
        cached_bytes_ -= static_cast<int64_t>(it->first);
        free_.erase(it);
        ++hits_;
        live_bytes_ += static_cast<int64_t>(capacity);
        ++live_buffers_;
        return p;
      }
      ++misses_;
      live_bytes_ += static_cast<int64_t>(capacity);
      ++live_buffers_;
    }
    return map_buffer(capacity);
  }

  void release(void* p, size_t capacity) {
    std::vector<std::pair<size_t, void*>> evicted;
    bool cached = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      live_bytes_ -= static_cast<int64_t>(capacity);
      --live_buffers_;
      const auto cap = static_cast<int64_t>(capacity);
      if (cap <= limit_) {
        // Make room by dropping the largest cached buffers: the buffer being
        // released belongs to the capture pattern that is running now.
        while (cached_bytes_ + cap > limit_ && !free_.empty()) {
          auto it = std::prev(free_.end());
          cached_bytes_ -= static_cast<int64_t>(it->first);
          evicted.emplace_back(it->first, it->second);
          free_.erase(it);
        }
        free_.emplace(capacity, p);
        cached_bytes_ += cap;
        cached = true;
      }
    }
    // Free outside the lock: munmap of a large buffer is not cheap.
    for (auto& e : evicted) {
      unmap_buffer(e.second, e.first);
    }
    if (!cached) {
      unmap_buffer(p, capacity);
    }
  }

  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {cached_bytes_, static_cast<int64_t>(free_.size()), limit_, hits_, misses_,
            live_bytes_, live_buffers_};
  }

  void set_limit(int64_t nbytes) {
    TORCH_CHECK(nbytes >= 0, "pool limit must be >= 0 bytes, got ", nbytes);
    std::multimap<size_t, void*> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      limit_ = nbytes;
      // Evict largest first until the cache fits the new limit.
      while (cached_bytes_ > limit_ && !free_.empty()) {
        auto it = std::prev(free_.end());
        cached_bytes_ -= static_cast<int64_t>(it->first);
        evicted.insert(*it);
        free_.erase(it);
      }
    }
    for (auto& kv : evicted) {
      unmap_buffer(kv.second, kv.first);
    }
  }

  void empty() {
    std::multimap<size_t, void*> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      evicted.swap(free_);
      cached_bytes_ = 0;
    }
    for (auto& kv : evicted) {
      unmap_buffer(kv.second, kv.first);
    }
  }

 private:
  std::mutex mu_;
  std::multimap<size_t, void*> free_;
  int64_t cached_bytes_ = 0;
  int64_t limit_ = limit_from_env();
  int64_t hits_ = 0;
  int64_t misses_ = 0;
  int64_t live_bytes_ = 0;
  int64_t live_buffers_ = 0;
};

// Deliberately leaked: output tensors may be freed during interpreter
// shutdown, after this library's static destructors would have run. A leaked
// singleton keeps the mutex and free list valid for the life of the process.
Pool& pool() {
  static Pool* instance = new Pool();
  return *instance;
}

}  // namespace

struct PooledBlock {
  char* data;
  size_t capacity;
  std::atomic<int64_t> refs;
};

PooledBlock* pooled_block_create(size_t nbytes) {
  size_t capacity = round_size(nbytes == 0 ? 1 : nbytes);
  void* data = pool().acquire(capacity);
  return new PooledBlock{static_cast<char*>(data), capacity, {1}};
}

char* pooled_block_data(PooledBlock* block) {
  return block->data;
}

void pooled_block_retain(PooledBlock* block) {
  block->refs.fetch_add(1, std::memory_order_relaxed);
}

void pooled_block_release(void* ctx) {
  auto* block = static_cast<PooledBlock*>(ctx);
  if (block->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    pool().release(block->data, block->capacity);
    delete block;
  }
}

std::vector<int64_t> pool_stats() {
  return pool().stats();
}

void pool_set_limit(int64_t nbytes) {
  pool().set_limit(nbytes);
}

void pool_empty() {
  pool().empty();
}

}  // namespace pyhook
