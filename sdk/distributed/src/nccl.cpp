// ProcessGroupNCCL for CUDA ranks. Compiled with USE_C10D_NCCL when this LibTorch has CUDA and
// the nvidia-nccl wheel's header is found (see CMakeLists.txt); otherwise asking for NCCL is a
// clear error at start-up.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "ember/distributed/launch.h"

#include <chrono>
#include <stdexcept>

#ifdef EMBER_DDP_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace ember_dist {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout, c10::Device device) {
#ifdef EMBER_DDP_WITH_NCCL
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  // NCCL's own watchdog aborts a collective that exceeds this (TORCH_NCCL_ASYNC_ERROR_HANDLING).
  opts->timeout = timeout;
  auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
  pg->eagerConnectSingleDevice(device);
  return pg;
#else
  (void)store, (void)rank, (void)size, (void)timeout, (void)device;
  throw std::runtime_error(strategy_name() + ": this build has no NCCL (LibTorch without CUDA, or nccl.h not found at build time); "
                           "use trainer.accelerator = \"cpu\" with backend = \"mpi\"");
#endif
}

}  // namespace ember_dist
