// Shared by the bundled models: the forward of IDataParallelModel (the dp strategy), i.e. LibTorch's
// torch::nn::parallel::data_parallel (scatter the batch along dim 0, replicate the module onto each
// device, run the replicas in parallel, gather the outputs on devices[0]) with one difference:
// LibTorch's parallel_apply runs the replicas on at::parallel_for (OpenMP) threads without the
// caller's thread-local state, so a replica on another thread would run outside the precision
// handler's autocast region and with gradients enabled under the evaluation loop's no_grad. Here
// every replica runs under the caller's at::ThreadLocalState and on its device's current stream
// (what PyTorch's Python parallel_apply does). Scatter and gather are differentiable copies
// (chunk + to, to + cat), so the same code runs on CPU "devices" too, which is how it is tested.
// Header-only: each plugin .so compiles its own copy.
#pragma once
#include <exception>
#include <memory>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/Device.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/nn/parallel/data_parallel.h>

namespace ember_models {

// Net: a torch::nn::Cloneable<Net> with at::Tensor forward(at::Tensor). Fewer than two devices
// (or a batch too small to split) run the plain forward. Replicas are rebuilt on every call, as
// torch::nn::parallel::data_parallel does: replicate() clones the module (each clone's reset()
// builds fresh layers whose values are then overwritten by copies of the current parameters) and
// links every replica parameter's gradient back to the original one, so backward accumulates the
// summed gradient into the module's own parameters on devices[0].
template <typename Net>
at::Tensor data_parallel_forward(const std::shared_ptr<Net>& net, const at::Tensor& input,
                                 const std::vector<c10::Device>& devices) {
  if (devices.size() < 2 || input.dim() == 0) return net->forward(input);
  std::vector<at::Tensor> chunks = input.chunk(static_cast<int64_t>(devices.size()), 0);
  const size_t n = chunks.size();  // fewer than the devices when the batch is smaller
  if (n < 2) return net->forward(input);
  const std::vector<c10::Device> used(devices.begin(), devices.begin() + static_cast<std::ptrdiff_t>(n));
  for (size_t i = 0; i < n; ++i) chunks[i] = chunks[i].to(used[i], /*non_blocking=*/true);

  const std::vector<std::shared_ptr<Net>> replicas = torch::nn::parallel::replicate(net, used);

  const at::ThreadLocalState caller_state;  // grad mode, autocast, dispatch keys of this thread
  std::vector<c10::Stream> streams;
  streams.reserve(n);
  for (const auto& d : used) streams.push_back(c10::impl::VirtualGuardImpl(d.type()).getStream(d));

  std::vector<at::Tensor> outputs(n);
  std::vector<std::exception_ptr> errors(n);
  auto run = [&](size_t i) {
    try {
      at::ThreadLocalStateGuard state_guard(caller_state);
      c10::StreamGuard stream_guard(streams[i]);  // device i current, on its current stream
      outputs[i] = replicas[i]->forward(chunks[i]);
    } catch (...) {
      errors[i] = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(n - 1);
  try {
    for (size_t i = 1; i < n; ++i) threads.emplace_back(run, i);
  } catch (...) {  // no thread to be had: join the ones started before giving up
    for (auto& t : threads) t.join();
    throw;
  }
  run(0);  // the first replica on this thread
  for (auto& t : threads) t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);

  for (size_t i = 1; i < n; ++i) outputs[i] = outputs[i].to(used[0], /*non_blocking=*/true);
  return at::cat(outputs, 0);
}

}  // namespace ember_models
