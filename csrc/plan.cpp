// ExpandUtils.h includes all of <ATen/Functions.h> unless ATen's per-operator headers are
// announced; it only needs view/view_copy, and this file calls neither.
#ifndef AT_PER_OPERATOR_HEADERS
#define AT_PER_OPERATOR_HEADERS
#endif
#include "pyhook.h"

#include <ATen/ExpandUtils.h>

namespace pyhook {

ClonePlan plan_clone(at::TensorList tensors) {
  ClonePlan plan;
  plan.slices.resize(tensors.size());
  if (tensors.empty()) {
    return plan;
  }
  plan.device = tensors[0].device();
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), "pyhook::clone_many: tensor ", i, " is undefined");
    TORCH_CHECK(t.layout() == at::kStrided,
                "pyhook::clone_many: tensor ", i, " has layout ", t.layout(),
                "; only strided tensors are supported");
    TORCH_CHECK(t.device() == plan.device,
                "pyhook::clone_many: all tensors must be on one device, but tensor ", i,
                " is on ", t.device(), " and tensor 0 is on ", plan.device);
    SlicePlan& s = plan.slices[i];
    // Same rule as at::clone(preserve_format): keep the strides of a
    // non-overlapping dense tensor, otherwise infer dense strides that keep
    // the input's dimension order (what at::empty_like does).
    const bool dense = t.is_non_overlapping_and_dense();
    s.strides = dense ? t.strides().vec() : at::infer_dense_strides(t.sizes(), t.strides());
    s.nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    // A conj/neg view must be materialised by copy_, exactly as clone does.
    s.raw_copy = dense && !has_lazy_values(t);
    s.offset = offset;
    offset += (s.nbytes + kSliceAlignment - 1) / kSliceAlignment * kSliceAlignment;
  }
  plan.total_bytes = offset;
  return plan;
}

}  // namespace pyhook
