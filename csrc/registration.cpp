// Operator schemas of the pyhook namespace, declared once for all devices.
// Kernels live in cpu/*.cpp and cuda/*.cu (TORCH_LIBRARY_IMPL per device);
// fake (meta) and autograd formulas are registered from Python in pyhook/ops.py.

#ifdef PYHOOK_PYTHON_MODULE
// The .so is imported as the Python module pyhook._C only to run the static
// initialisers below; it exposes nothing else, so it can use the stable ABI.
#include <Python.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",     // name
      nullptr,  // doc
      -1,       // per-interpreter state size
      nullptr,  // methods
  };
  return PyModule_Create(&module_def);
}
}
#endif

#include <torch/custom_class.h>
#include <torch/library.h>

#include "offload.h"
#include "pyhook.h"

TORCH_LIBRARY(pyhook, m) {
  // If fake-tensor tracing reaches an op before pyhook.ops was imported,
  // PyTorch imports that module to find the fake implementations.
  m.set_python_module("pyhook.ops");

  // Fresh copies (values, dtype, clone's strides) of every input (on the CPU
  // allocated in one pooled buffer, on CUDA one allocation per output).
  // Outputs alias neither the inputs nor each other's storage.
  m.def("clone_many(Tensor[] tensors) -> Tensor[]");

  // Rows idx (int64, 0 <= idx < total rows) of the concatenation of `parts` along dim 0
  // (the memory-mapped shards of one layer), as one fresh contiguous tensor in a pooled CPU
  // buffer; `_into` writes them into `out` instead (e.g. shared memory in a DataLoader
  // worker). Neither aliases the parts.
  m.def("gather_rows(Tensor[] parts, Tensor idx) -> Tensor");
  m.def("gather_rows_into(Tensor[] parts, Tensor idx, Tensor(a!) out) -> ()");
  // The same for several layers in one call (a dataset batch): layer l's parts are the next
  // counts[l] entries of `parts`; one output per layer, rows idx of each.
  m.def("gather_rows_many(Tensor[] parts, int[] counts, Tensor idx) -> Tensor[]");
  m.def(
      "gather_rows_many_into(Tensor[] parts, int[] counts, Tensor idx, Tensor(a!)[] outs) -> ()");
  // The same with the parts checked and looked up once (a dataset's training loop): gather_plan
  // keeps them and returns the plan's number; gather_plan_rows(plan, idx) is gather_rows_many
  // of the plan's parts; gather_plan_release frees a plan (a number no plan has: nothing).
  m.def("gather_plan(Tensor[] parts, int[] counts) -> int");
  m.def("gather_plan_rows(int plan, Tensor idx) -> Tensor[]");
  m.def("gather_plan_release(int plan) -> ()", &pyhook::gather_plan_release);
  // Tests only (the fixtures of tests/test_gather.py and tests/test_stats_simd.py): thread
  // choices and delays of the gathers, the SIMD level of the statistics (see pyhook.h).
  m.def("_test_gather_settings(int team, int helper_delay_us, int caller_delay_us) -> ()",
        &pyhook::gather_test_settings);
  m.def("_test_stats_simd(int cap) -> ()", &pyhook::stats_test_simd);

  // Rows idx of the quantised parts of a compact store's layer (float8_e4m3fn or int8, one
  // float32 scale per row in `scales`, one tensor per part), dequantised into `dtype`
  // (cpu/dequant.cpp): dtype(float32(row) * scale). Fresh output, or written into `out`.
  m.def("dequant_rows(Tensor[] parts, Tensor[] scales, Tensor idx, ScalarType dtype) -> Tensor");
  m.def("dequant_rows_into(Tensor[] parts, Tensor[] scales, Tensor idx, Tensor(a!) out) -> ()");
  // The same for several layers in one call (a dataset batch): layer l's parts and scales are
  // the next counts[l] entries of `parts` and `scales`; one output per layer, rows idx of each.
  m.def(
      "dequant_rows_many(Tensor[] parts, Tensor[] scales, int[] counts, Tensor idx, "
      "ScalarType dtype) -> Tensor[]");
  m.def(
      "dequant_rows_many_into(Tensor[] parts, Tensor[] scales, int[] counts, Tensor idx, "
      "Tensor(a!)[] outs) -> ()");

  // The CPU buffer pool. These take no tensors, so the dispatcher has no
  // device to pick: they are registered as catch-all kernels right here.
  m.def("pool_stats() -> int[]", &pyhook::pool_stats);
  m.def("pool_set_limit(int nbytes) -> ()", &pyhook::pool_set_limit);
  m.def("pool_empty() -> ()", &pyhook::pool_empty);
  m.def("empty_pooled(int[] size, ScalarType dtype) -> Tensor", &pyhook::empty_pooled);

  // Thread identities as the autograd engine records them (see pyhook/_hooks.py: a
  // thread-guarded hook acts on a checkpoint recomputation only if its owner's forward
  // created the node being run).
  m.def("thread_id() -> int", &pyhook::thread_id);
  m.def("autograd_node_thread_id() -> int", &pyhook::autograd_node_thread_id);

  // Copies to host memory, asynchronous on devices with an engine (CUDA: a
  // side stream into pooled pinned buffers), with a bound on bytes in flight.
  // A class rather than ops: it owns streams, buffers and in-flight copies.
  m.def("offload_async_devices() -> str[]", &pyhook::offload_async_devices);
  m.class_<pyhook::Offloader>("Offloader")
      .def(torch::init<int64_t, bool, int64_t>())
      .def("submit", &pyhook::Offloader::submit)
      .def("ready", &pyhook::Offloader::ready)
      .def("wait", &pyhook::Offloader::wait)
      .def("synchronize", &pyhook::Offloader::synchronize)
      .def("release", &pyhook::Offloader::release)
      .def("empty_pool", &pyhook::Offloader::empty_pool)
      .def("stats", &pyhook::Offloader::stats);
}
