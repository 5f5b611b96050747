// CUDA kernel of pyhook::clone_many.
//
// On CUDA the caching allocator already is a pool (no page faults, no driver
// calls on reuse), so each output gets its own allocation from it instead of a
// slice of one buffer: a slice with a foreign deleter would make
// Tensor.record_stream() a silent no-op (the caching allocator only tracks
// DataPtrs it created), which is a correctness hazard for multi-stream users.
// All copies are enqueued on the current stream, like clone's, so ordering
// with the producer kernels and later consumers needs no extra sync.
#include "../pyhook.h"

#include <ATen/ops/empty_strided.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cuda_runtime.h>

namespace pyhook {

std::vector<at::Tensor> clone_many_cuda(at::TensorList tensors) {
  const ClonePlan plan = plan_clone(tensors);
  std::vector<at::Tensor> outputs;
  outputs.reserve(tensors.size());
  if (tensors.empty()) {
    return outputs;
  }
  const c10::cuda::CUDAGuard guard(plan.device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(plan.device.index()).stream();

  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& in = tensors[i];
    const SlicePlan& s = plan.slices[i];
    at::Tensor out = at::empty_strided(in.sizes(), s.strides, in.options());
    if (s.nbytes > 0) {
      if (s.raw_copy) {
        // Dense source span, same strides: one device-to-device copy.
        C10_CUDA_CHECK(cudaMemcpyAsync(out.data_ptr(), in.const_data_ptr(),
                                       static_cast<size_t>(s.nbytes), cudaMemcpyDeviceToDevice,
                                       stream));
      } else {
        out.copy_(in);
      }
    }
    outputs.push_back(std::move(out));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return outputs;
}

TORCH_LIBRARY_IMPL(pyhook, CUDA, m) {
  m.impl("clone_many", &clone_many_cuda);
}

}  // namespace pyhook
