// CUDA engine of pyhook::Offloader: device-to-host copies on a side stream.
//
// Host code only (no kernels): a cudaMemcpyAsync into page-locked memory runs
// on the copy engine, overlapping the model's kernels on the compute stream.
// Ordering: the side stream waits on an event recorded on the producer's
// current stream, so the copy reads finished values; the completion is an
// event recorded on the side stream after the copies. Lifetimes are the
// Offloader's job (it holds sources and destinations until the event), so no
// record_stream is needed: a source cannot be freed while its copy is queued.
#include "../offload.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime_api.h>

#include <mutex>
#include <unordered_map>

namespace pyhook {
namespace {

class CudaEvent {
 public:
  explicit CudaEvent(c10::DeviceIndex device) : device_(device) {
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~CudaEvent() {
    if (event_ != nullptr) {
      // An event still pending is released by the driver once it completes.
      const c10::cuda::CUDAGuard guard(device_);
      C10_CUDA_IGNORE_ERROR(cudaEventDestroy(event_));
    }
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
  c10::DeviceIndex device_;
};

class CudaCompletion final : public CopyCompletion {
 public:
  explicit CudaCompletion(c10::DeviceIndex device) : event_(device) {}
  cudaEvent_t event() const { return event_.get(); }

  bool query() override {
    const cudaError_t err = cudaEventQuery(event_.get());
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: clear the sticky status
      return false;
    }
    C10_CUDA_CHECK(err);
    return true;
  }

  void wait() override { C10_CUDA_CHECK(cudaEventSynchronize(event_.get())); }

 private:
  CudaEvent event_;
};

class CudaCopyEngine final : public DeviceCopyEngine {
 public:
  std::unique_ptr<CopyCompletion> copy_to_host(c10::Device device,
                                               const std::vector<at::Tensor>& src,
                                               const std::vector<at::Tensor>& dst) override {
    const c10::DeviceIndex index = device.index();
    const c10::cuda::CUDAGuard guard(device);
    const cudaStream_t producer = c10::cuda::getCurrentCUDAStream(index).stream();
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(producer, &capturing));
    TORCH_CHECK(capturing == cudaStreamCaptureStatusNone,
                "Offloader.submit: the current CUDA stream of ", device,
                " is being captured into a CUDA graph; offload after the graph is captured "
                "(or replayed), not inside it");
    const cudaStream_t side = side_stream(index, producer);

    // Both events exist before anything is enqueued: a failure to create one
    // leaves nothing running.
    auto done = std::make_unique<CudaCompletion>(index);
    CudaEvent produced(index);
    C10_CUDA_CHECK(cudaEventRecord(produced.get(), producer));
    C10_CUDA_CHECK(cudaStreamWaitEvent(side, produced.get(), 0));
    try {
      for (size_t i = 0; i < src.size(); ++i) {
        C10_CUDA_CHECK(cudaMemcpyAsync(dst[i].data_ptr(), src[i].const_data_ptr(),
                                       src[i].nbytes(), cudaMemcpyDeviceToHost, side));
      }
      C10_CUDA_CHECK(cudaEventRecord(done->event(), side));
    } catch (...) {
      // Copies already queued still read src and write dst, and the caller
      // frees both once this throws: let them finish first.
      C10_CUDA_IGNORE_ERROR(cudaStreamSynchronize(side));
      throw;
    }
    return done;
  }

 private:
  // One side stream per device, from PyTorch's pool (created lazily: loading
  // pyhook must not initialise CUDA). The pool hands its streams out round
  // robin, so the model may be running on ours: then take the next one, or the
  // copies would queue behind the model instead of overlapping it.
  cudaStream_t side_stream(c10::DeviceIndex index, cudaStream_t producer) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find(index);
    if (it == streams_.end()) {
      it = streams_.emplace(index, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index))
               .first;
    }
    if (it->second.stream() == producer) {
      it->second = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index);
    }
    return it->second.stream();
  }

  std::mutex mu_;
  std::unordered_map<c10::DeviceIndex, c10::cuda::CUDAStream> streams_;
};

const bool registered = [] {
  // Never destroyed: a daemon writer thread may still call in at exit.
  register_copy_engine(c10::DeviceType::CUDA, new CudaCopyEngine());
  return true;
}();

}  // namespace
}  // namespace pyhook
