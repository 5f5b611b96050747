// CPU kernel of pyhook::clone_many: one pooled buffer, parallel fill.
#include "../pyhook.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

namespace pyhook {
namespace {

// memcpy work is cut into pieces of at most this size so that one large
// tensor is spread over all threads and many small ones are batched.
constexpr int64_t kPieceBytes = int64_t{256} << 10;
// Below this many bytes a single thread is faster than waking the pool.
constexpr int64_t kParallelMinBytes = int64_t{1} << 20;

struct Piece {
  const char* src;
  char* dst;
  int64_t nbytes;
};

// Each output gets its *own* storage whose DataPtr points at its slice of the
// shared block and holds one reference on it. Outputs therefore never share a
// c10::Storage: opcheck's aliasing checks, torch.save and safetensors all see
// independent tensors, while the memory is still one allocation.
at::Tensor make_slice_tensor(PooledBlock* block, const at::Tensor& like, const SlicePlan& s) {
  pooled_block_retain(block);
  c10::DataPtr data(pooled_block_data(block) + s.offset, block, &pooled_block_release,
                    c10::Device(c10::kCPU));
  // Resizable with the default CPU allocator, like a clone's storage: growing
  // an output reallocates it and drops its reference on the block.
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(s.nbytes),
                       std::move(data), c10::GetCPUAllocator(), /*resizable=*/true);
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), like.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), s.strides);
  return out;
}

}  // namespace

std::vector<at::Tensor> clone_many_cpu(at::TensorList tensors) {
  const ClonePlan plan = plan_clone(tensors);
  std::vector<at::Tensor> outputs;
  outputs.reserve(tensors.size());
  if (tensors.empty()) {
    return outputs;
  }

  PooledBlock* block = plan.total_bytes > 0 ? pooled_block_create(plan.total_bytes) : nullptr;
  std::vector<Piece> pieces;
  int64_t raw_bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& in = tensors[i];
    const SlicePlan& s = plan.slices[i];
    if (s.nbytes == 0) {
      outputs.push_back(at::empty_strided(in.sizes(), s.strides, in.options()));
      continue;
    }
    outputs.push_back(make_slice_tensor(block, in, s));
    if (!s.raw_copy) {
      continue;
    }
    // Non-overlapping and dense with non-negative strides: the elements occupy
    // exactly [data_ptr, data_ptr + nbytes), in the order the output expects.
    const char* src = static_cast<const char*>(in.const_data_ptr());
    char* dst = static_cast<char*>(outputs.back().data_ptr());
    for (int64_t done = 0; done < s.nbytes; done += kPieceBytes) {
      pieces.push_back({src + done, dst + done, std::min(kPieceBytes, s.nbytes - done)});
    }
    raw_bytes += s.nbytes;
  }
  if (block != nullptr) {
    pooled_block_release(block);  // drop the creation reference; outputs own it now
  }

  auto copy_pieces = [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      std::memcpy(pieces[p].dst, pieces[p].src, static_cast<size_t>(pieces[p].nbytes));
    }
  };
  const auto n_pieces = static_cast<int64_t>(pieces.size());
  if (raw_bytes < kParallelMinBytes) {
    copy_pieces(0, n_pieces);
  } else {
    at::parallel_for(0, n_pieces, /*grain_size=*/1, copy_pieces);
  }

  // Strided, overlapping, conj/neg views: TensorIterator already parallelises
  // these and resolves conj/neg bits exactly as clone does.
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!plan.slices[i].raw_copy && plan.slices[i].nbytes > 0) {
      outputs[i].copy_(tensors[i]);
    }
  }
  return outputs;
}

TORCH_LIBRARY_IMPL(pyhook, CPU, m) {
  m.impl("clone_many", &clone_many_cpu);
}

}  // namespace pyhook
