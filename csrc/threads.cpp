// Which thread's forward recorded the autograd node being run: lets a thread-guarded hook tell
// a recomputation of its owner's forward (activation checkpointing, run during a backward on
// any thread) from a recomputation of another thread's forward.

#include <ATen/record_function.h>
#include <torch/csrc/autograd/function.h>

#include "pyhook.h"

namespace pyhook {

int64_t thread_id() {
  // The id every autograd Node records for the thread that created it (never 0).
  return static_cast<int64_t>(at::RecordFunction::currentThreadId());
}

int64_t autograd_node_thread_id() {
  // The Node the engine is running on this thread (set only during a backward), or 0.
  auto node = torch::autograd::get_current_node();
  return node ? static_cast<int64_t>(node->thread_id()) : 0;
}

}  // namespace pyhook
