// Device-generic half of pyhook::Offloader (see offload.h): the host-buffer
// pool, tickets, the bound on bytes in flight, and synchronous copies for
// devices without an asynchronous engine.
#include "offload.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <array>
#include <utility>

#include "pyhook.h"

namespace pyhook {

namespace {

std::array<DeviceCopyEngine*, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>&
engines() {
  static std::array<DeviceCopyEngine*,
                    static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>
      table{};
  return table;
}

// A handful of sizes recur batch after batch, so power-of-two buckets make
// every request after the first few batches a pool hit, at the price of at
// most 2x the bytes. 64 KiB floor: smaller buffers are not worth pooling.
int64_t bucket_size(int64_t nbytes) {
  TORCH_CHECK(nbytes <= (int64_t{1} << 62), "Offloader: a host buffer of ", nbytes,
              " bytes is not possible");
  int64_t size = int64_t{1} << 16;
  while (size < nbytes) {
    size <<= 1;
  }
  return size;
}

// A dense host tensor of `like`'s shape and dtype over the start of `buffer`.
at::Tensor view_as_dense(const at::Tensor& buffer, const at::Tensor& like) {
  return buffer.narrow(0, 0, static_cast<int64_t>(like.nbytes()))
      .view(like.scalar_type())
      .view(like.sizes());
}

// The values of a device tensor as a dense span for a raw byte copy. Lazy
// conjugate/negative bits and zero tensors (no data) are materialised, since a
// byte copy would ignore them; strided tensors are made contiguous. With
// `snapshot`, a tensor that may alias memory the model updates in place later
// is cloned on the current stream first (device bandwidth is far above the
// link's). Each of these runs on the current stream, before the copy.
at::Tensor dense_source(const at::Tensor& t, bool snapshot) {
  if (has_lazy_values(t)) {  // materialised into fresh memory
    return t._is_zerotensor() ? at::zeros(t.sizes(), t.options())
                              : t.resolve_conj().resolve_neg().contiguous();
  }
  if (!t.is_contiguous()) {
    return t.contiguous();
  }
  return snapshot ? t.clone() : t;
}

}  // namespace

void register_copy_engine(c10::DeviceType type, DeviceCopyEngine* engine) {
  engines()[static_cast<size_t>(type)] = engine;
}

DeviceCopyEngine* copy_engine(c10::DeviceType type) {
  return engines()[static_cast<size_t>(type)];
}

std::vector<std::string> offload_async_devices() {
  std::vector<std::string> names;
  for (size_t i = 0; i < engines().size(); ++i) {
    if (engines()[i] != nullptr) {
      names.push_back(c10::DeviceTypeName(static_cast<c10::DeviceType>(i), /*lower_case=*/true));
    }
  }
  return names;
}

// -- HostBufferPool -----------------------------------------------------------

at::Tensor HostBufferPool::get(int64_t nbytes, bool pinned) {
  const int64_t size = bucket_size(nbytes);
  at::Tensor buffer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find({pinned, size});
    if (it != free_.end() && !it->second.empty()) {
      buffer = std::move(it->second.back());
      it->second.pop_back();
      idle_bytes_ -= size;
      ++hits_;
    } else {
      ++misses_;
    }
  }
  if (!buffer.defined()) {
    // Allocated outside the lock: page-locking is slow, and the writer thread
    // gives buffers back concurrently.
    buffer = at::empty({size}, at::TensorOptions().dtype(at::kByte).pinned_memory(pinned));
  }
  std::lock_guard<std::mutex> lock(mu_);
  lent_[buffer.storage().data()] = Lent{buffer, pinned};
  return buffer;
}

void HostBufferPool::put(const at::Tensor& view) {
  if (!view.defined() || !view.has_storage()) {
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = lent_.find(view.storage().data());
  if (it == lent_.end()) {
    return;  // not ours, or already given back
  }
  Lent lent = std::move(it->second);
  lent_.erase(it);
  const int64_t size = lent.buffer.numel();
  if (idle_bytes_ + size <= limit_bytes_) {
    free_[{lent.pinned, size}].push_back(std::move(lent.buffer));
    idle_bytes_ += size;
  }
}

void HostBufferPool::empty() {
  std::lock_guard<std::mutex> lock(mu_);
  free_.clear();
  idle_bytes_ = 0;
}

std::vector<int64_t> HostBufferPool::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return {idle_bytes_, static_cast<int64_t>(lent_.size()), hits_, misses_};
}

// -- Offloader ----------------------------------------------------------------

bool Offloader::Job::query() {
  for (auto& d : done) {
    if (!d->query()) {
      return false;
    }
  }
  return true;
}

void Offloader::Job::wait() {
  for (auto& d : done) {
    d->wait();
  }
}

Offloader::Offloader(int64_t max_inflight_bytes, bool pin, int64_t pool_limit_bytes)
    : pool_(pool_limit_bytes), pin_(pin), max_inflight_bytes_(max_inflight_bytes) {
  TORCH_CHECK(max_inflight_bytes > 0,
              "Offloader: max_inflight_bytes must be positive, got ", max_inflight_bytes);
  TORCH_CHECK(pool_limit_bytes >= 0,
              "Offloader: pool_limit_bytes must be >= 0, got ", pool_limit_bytes);
}

Offloader::~Offloader() {
  // Copies in flight write into host buffers this object keeps alive: they
  // must land before the buffers can be freed.
  try {
    synchronize();
  } catch (...) {
  }
}

void Offloader::drop_locked(std::deque<std::shared_ptr<Job>>::iterator it) {
  inflight_bytes_ -= (*it)->nbytes;
  for (const at::Tensor& buffer : (*it)->to_pool) {
    pool_.put(buffer);  // the pool's lock is a leaf: never held while taking mu_
  }
  (*it)->to_pool.clear();
  jobs_.erase(it);
}

void Offloader::erase_locked(const std::shared_ptr<Job>& job) {
  for (auto it = jobs_.begin(); it != jobs_.end(); ++it) {
    if (*it == job) {
      drop_locked(it);
      return;
    }
  }
}

void Offloader::retire_finished_locked() {
  // Copies on one queue finish in order: stop at the first unfinished job.
  while (!jobs_.empty() && jobs_.front()->query()) {
    drop_locked(jobs_.begin());
  }
}

std::tuple<int64_t, std::vector<at::Tensor>> Offloader::submit(std::vector<at::Tensor> tensors,
                                                               bool copy, bool pooled) {
  const size_t n = tensors.size();
  std::vector<at::Tensor> host(n);
  std::vector<DeviceCopyEngine*> engine_of(n, nullptr);
  int64_t async_bytes = 0;
  int64_t total_bytes = 0;
  for (size_t i = 0; i < n; ++i) {
    at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), "Offloader.submit: tensor ", i, " is undefined");
    TORCH_CHECK(t.layout() == at::kStrided, "Offloader.submit: tensor ", i, " has layout ",
                t.layout(), "; only strided (dense) tensors can be copied to host memory");
    TORCH_CHECK(!t.is_meta(), "Offloader.submit: tensor ", i,
                " is on the meta device and has no values to copy");
    TORCH_CHECK(!t.is_quantized(), "Offloader.submit: tensor ", i,
                " is quantized; dequantize it (or capture its int_repr()) first");
    t = t.detach();
    total_bytes += static_cast<int64_t>(t.nbytes());
    if (!t.is_cpu() && t.numel() > 0) {
      engine_of[i] = copy_engine(t.device().type());
      if (engine_of[i] != nullptr) {
        async_bytes += static_cast<int64_t>(t.nbytes());
      }
    }
  }

  // Back-pressure before anything new is allocated: retire what has finished,
  // then wait for the oldest copies until the new ones fit the budget (a
  // single submission larger than the budget proceeds once nothing else is in
  // flight). The bytes are reserved under the same lock, so that concurrent
  // submitters cannot all pass the check and overshoot the budget together;
  // bytes reserved by a submitter that has not enqueued its job yet count too
  // (there is no job to wait on then: wait until it is enqueued or given back).
  if (async_bytes > 0) {
    std::unique_lock<std::mutex> lock(mu_);
    retire_finished_locked();
    while (inflight_bytes_ > 0 && inflight_bytes_ + async_bytes > max_inflight_bytes_) {
      ++stalls_;
      if (jobs_.empty()) {
        changed_.wait(lock);
        continue;
      }
      std::shared_ptr<Job> oldest = jobs_.front();
      lock.unlock();
      oldest->wait();
      lock.lock();
      erase_locked(oldest);
    }
    inflight_bytes_ += async_bytes;
  }

  // Everything below may throw (out of memory, a device error): `lent` are the
  // pool buffers taken so far, given back if nothing was enqueued.
  std::vector<at::Tensor> lent;
  auto pooled_dst = [&](const at::Tensor& like, bool pinned) {
    lent.push_back(pool_.get(static_cast<int64_t>(like.nbytes()), pinned));
    return view_as_dense(lent.back(), like);
  };
  std::shared_ptr<Job> job;
  try {
    std::vector<size_t> clone_idx;
    std::vector<at::Tensor> clone_src;
    // Asynchronous copies grouped per device: one completion per device.
    std::vector<
        std::pair<c10::Device, std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>>>
        groups;
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& t = tensors[i];
      if (t.is_cpu()) {
        if (!copy) {
          host[i] = t;  // a fresh tensor the model does not own: nothing to copy
        } else if (pooled && t.numel() > 0) {
          at::Tensor dst = pooled_dst(t, false);
          dst.copy_(t);
          host[i] = std::move(dst);
        } else {
          clone_idx.push_back(i);
          clone_src.push_back(t);
        }
        continue;
      }
      if (engine_of[i] == nullptr) {
        host[i] = t.to(at::kCPU);  // no asynchronous engine for this device (or empty)
        continue;
      }
      at::Tensor src = dense_source(t, copy);
      at::Tensor dst =
          pooled ? pooled_dst(t, pin_)
                 : at::empty(t.sizes(),
                             at::TensorOptions().dtype(t.scalar_type()).pinned_memory(pin_));
      auto it = groups.begin();
      while (it != groups.end() && it->first != t.device()) {
        ++it;
      }
      if (it == groups.end()) {
        groups.emplace_back(t.device(),
                            std::make_pair(std::vector<at::Tensor>{}, std::vector<at::Tensor>{}));
        it = std::prev(groups.end());
      }
      it->second.first.push_back(std::move(src));
      it->second.second.push_back(dst);
      host[i] = std::move(dst);
    }
    if (!clone_src.empty()) {
      std::vector<at::Tensor> copies = clone_many_cpu(clone_src);
      for (size_t k = 0; k < clone_idx.size(); ++k) {
        host[clone_idx[k]] = std::move(copies[k]);
      }
    }
    if (!groups.empty()) {
      job = std::make_shared<Job>();
      job->nbytes = async_bytes;
      // Enqueued without the lock: a copy into pageable memory (pin=False)
      // blocks the host, and ready()/wait()/stats() on the writer thread must
      // not wait for it.
      for (auto& [device, sd] : groups) {
        auto& [src, dst] = sd;
        job->done.push_back(copy_engine(device.type())->copy_to_host(device, src, dst));
        // Sources stay alive until the copies have read them (so the caching
        // allocator cannot hand their memory to new tensors), and destinations
        // until written, even if the caller drops its references first.
        for (auto& s : src) {
          job->keep.push_back(std::move(s));
        }
        for (auto& d : dst) {
          job->keep.push_back(std::move(d));
        }
      }
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    if (job && !job->done.empty()) {
      // Copies already enqueued (on other devices) still read and write these
      // tensors: keep the job, with the reserved bytes, until they complete;
      // the caller never sees its pooled buffers, so they return to the pool then.
      job->ticket = next_ticket_++;
      job->to_pool = std::move(lent);
      jobs_.push_back(std::move(job));
    } else {
      // Nothing is in flight (a failing engine call waits for what it queued).
      inflight_bytes_ -= async_bytes;
      for (const at::Tensor& buffer : lent) {
        pool_.put(buffer);
      }
    }
    changed_.notify_all();
    throw;
  }

  std::lock_guard<std::mutex> lock(mu_);
  const int64_t ticket = next_ticket_++;
  bytes_submitted_ += total_bytes;
  if (job) {
    job->ticket = ticket;  // the reserved bytes are now the job's
    jobs_.push_back(std::move(job));
    changed_.notify_all();
  }
  return {ticket, std::move(host)};
}

bool Offloader::ready(int64_t ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& job : jobs_) {
    if (job->ticket == ticket) {
      if (!job->query()) {
        return false;
      }
      std::shared_ptr<Job> keep = job;
      erase_locked(keep);
      return true;
    }
  }
  return true;  // finished and retired, or never asynchronous
}

void Offloader::wait(int64_t ticket) {
  std::shared_ptr<Job> job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& j : jobs_) {
      if (j->ticket == ticket) {
        job = j;
        break;
      }
    }
  }
  if (!job) {
    return;
  }
  job->wait();  // without the lock: other threads keep submitting and waiting
  std::lock_guard<std::mutex> lock(mu_);
  erase_locked(job);
}

void Offloader::synchronize() {
  std::deque<std::shared_ptr<Job>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all = jobs_;
  }
  for (auto& job : all) {
    job->wait();
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& job : all) {
    erase_locked(job);
  }
}

void Offloader::release(std::vector<at::Tensor> tensors) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || !t.has_storage()) {
      continue;
    }
    // A buffer whose copy has not landed yet goes back when its job retires:
    // lent again now, the copy in flight would write into someone else's rows.
    const void* data = t.storage().data();
    Job* owner = nullptr;
    for (auto& job : jobs_) {
      for (const at::Tensor& k : job->keep) {
        if (k.has_storage() && k.storage().data() == data) {
          owner = job.get();
          break;
        }
      }
      if (owner != nullptr) {
        break;
      }
    }
    if (owner != nullptr) {
      owner->to_pool.push_back(t);
    } else {
      pool_.put(t);
    }
  }
}

void Offloader::empty_pool() {
  pool_.empty();
}

std::vector<int64_t> Offloader::stats() {
  std::vector<int64_t> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out = {inflight_bytes_, static_cast<int64_t>(jobs_.size()), bytes_submitted_, stalls_};
  }
  for (int64_t v : pool_.stats()) {
    out.push_back(v);
  }
  return out;
}

}  // namespace pyhook
