// Device-generic kernel of pyhook::clone_many: per-tensor at::clone.
//
// Registered as CompositeExplicitAutograd so that (a) an empty list, which has
// no tensor for the dispatcher to pick a device from, still works, and (b) any
// backend without a dedicated kernel (MPS, XPU, ...) gets correct results.
// CPU and CUDA have their own kernels in cpu/ and cuda/, which take priority.
#include "pyhook.h"

#include <torch/library.h>

namespace pyhook {

std::vector<at::Tensor> clone_many_generic(at::TensorList tensors) {
  std::vector<at::Tensor> outputs;
  outputs.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    outputs.push_back(t.clone());
  }
  return outputs;
}

TORCH_LIBRARY_IMPL(pyhook, CompositeExplicitAutograd, m) {
  m.impl("clone_many", &clone_many_generic);
}

}  // namespace pyhook
