// pyhook::Offloader: copies of captured tensors into host memory.
//
// The bookkeeping (host-buffer pool, tickets, bytes in flight, back-pressure)
// is device-generic and lives in offload.cpp. What is asynchronous is a
// device's business: a DeviceCopyEngine enqueues device-to-host copies and
// hands back a CopyCompletion. cuda/offload_cuda.cu registers the CUDA engine
// when the CUDA kernels are built; without an engine a device's tensors are
// copied synchronously.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>  // torch::CustomClassHolder (registration.cpp binds the class)

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace pyhook {

// Completion of copies enqueued on a device queue. Both calls are safe from
// any thread, concurrently.
class CopyCompletion {
 public:
  virtual ~CopyCompletion() = default;
  virtual bool query() = 0;  // never blocks
  virtual void wait() = 0;   // blocks the calling thread until the copies are done
};

// Asynchronous device-to-host copies for one device type.
class DeviceCopyEngine {
 public:
  virtual ~DeviceCopyEngine() = default;
  // Enqueue src[i] -> dst[i] for every i (src dense on `device`, dst dense in
  // host memory, equal byte sizes). The copies read src only after all work
  // queued so far on the device's current stream, i.e. after the producer.
  virtual std::unique_ptr<CopyCompletion> copy_to_host(c10::Device device,
                                                       const std::vector<at::Tensor>& src,
                                                       const std::vector<at::Tensor>& dst) = 0;
};

// Engines are registered by static initialisers and live for the process.
void register_copy_engine(c10::DeviceType type, DeviceCopyEngine* engine);
DeviceCopyEngine* copy_engine(c10::DeviceType type);
// Names of the device types with an asynchronous engine in this build.
std::vector<std::string> offload_async_devices();

// Host buffers in power-of-two buckets (from 64 KiB), reused across batches.
// A buffer is lent as a uint8 tensor; any view of it gives it back.
class HostBufferPool {
 public:
  explicit HostBufferPool(int64_t limit_bytes) : limit_bytes_(limit_bytes) {}
  // `pinned` buffers (page-locked, for asynchronous device copies) and plain
  // ones are kept apart, so a CPU-only capture never touches the CUDA runtime.
  at::Tensor get(int64_t nbytes, bool pinned);
  void put(const at::Tensor& view);
  void empty();
  // idle_bytes, lent_buffers, hits, misses
  std::vector<int64_t> stats();

 private:
  struct Lent {
    at::Tensor buffer;
    bool pinned;
  };
  std::mutex mu_;
  int64_t limit_bytes_;
  int64_t idle_bytes_ = 0;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
  std::map<std::pair<bool, int64_t>, std::vector<at::Tensor>> free_;  // (pinned, size) -> idle
  std::unordered_map<const void*, Lent> lent_;                         // storage pointer -> buffer
};

class Offloader : public torch::CustomClassHolder {
 public:
  Offloader(int64_t max_inflight_bytes, bool pin, int64_t pool_limit_bytes);
  ~Offloader() override;

  // Starts copying `tensors` to host memory and returns (ticket, host
  // tensors). The host tensors may be read only once ready(ticket) is true or
  // wait(ticket) returned. CPU tensors are copied only when `copy` is true
  // (they may alias memory the model overwrites later); device tensors always
  // are, and with `copy` a device-side snapshot is taken first on the current
  // stream so an in-place update queued after this call cannot race the
  // asynchronous read. `pooled` takes host buffers from the pool (give them
  // back with release()).
  std::tuple<int64_t, std::vector<at::Tensor>> submit(std::vector<at::Tensor> tensors, bool copy,
                                                      bool pooled);
  bool ready(int64_t ticket);
  void wait(int64_t ticket);
  void synchronize();
  void release(std::vector<at::Tensor> tensors);
  void empty_pool();
  // inflight_bytes, inflight_jobs, bytes_submitted, stalls, pool idle_bytes,
  // pool lent_buffers, pool hits, pool misses
  std::vector<int64_t> stats();

 private:
  struct Job {
    int64_t ticket = 0;
    int64_t nbytes = 0;
    std::vector<at::Tensor> keep;  // device sources and host destinations
    std::vector<std::unique_ptr<CopyCompletion>> done;
    // Pooled buffers to give back when the job retires: those of a submit that
    // failed after some copies were enqueued, and those release()d early.
    std::vector<at::Tensor> to_pool;
    bool query();
    void wait();
  };
  void retire_finished_locked();
  void erase_locked(const std::shared_ptr<Job>& job);
  void drop_locked(std::deque<std::shared_ptr<Job>>::iterator it);

  std::mutex mu_;
  // Signalled when a reservation becomes a job or is given back: a submitter that finds the
  // budget taken by reservations still being enqueued (no job to wait on yet) waits on it.
  std::condition_variable changed_;
  std::deque<std::shared_ptr<Job>> jobs_;  // in submission order
  HostBufferPool pool_;
  bool pin_;
  int64_t max_inflight_bytes_;
  int64_t inflight_bytes_ = 0;  // bytes of jobs in flight and of reservations being enqueued
  int64_t next_ticket_ = 1;
  int64_t bytes_submitted_ = 0;
  int64_t stalls_ = 0;
};

}  // namespace pyhook
