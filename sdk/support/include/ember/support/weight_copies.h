// Module tensors that weight averaging tracks, copies between them, and the batch-norm statistics
// pass of torch.optim.swa_utils.update_bn. Header-only; shared by swa and ema.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ember/trainer.h>

namespace ember::support {

// The tensors the strategy trains (parameters, or this rank's shards of them under a sharding
// strategy: averaging is element-wise, so each rank averages what it holds), then (with_buffers)
// the floating-point buffers (batch-norm running statistics; integer counters are never
// averaged; buffers are never sharded). After writing into them, call ITrainerWeights::parameters_changed().
inline std::vector<at::Tensor> tracked_tensors(ember::ITrainer& t, bool with_buffers) {
  std::vector<at::Tensor> out;
  for (auto& p : ember::trainer_service<ember::ITrainerWeights>(t, "weight averaging").trained_parameters()) out.push_back(p.tensor);
  if (with_buffers)
    for (auto& b : t.module().named_buffers())
      if (b.value().is_floating_point()) out.push_back(b.value());
  return out;
}

inline std::vector<at::Tensor> all_buffers(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (auto& b : m.named_buffers()) out.push_back(b.value());
  return out;
}

inline std::vector<at::Tensor> clones(const std::vector<at::Tensor>& v) {
  std::vector<at::Tensor> out;
  for (const auto& t : v) out.push_back(t.detach().clone());
  return out;
}

inline std::vector<at::Tensor> cpu_clones(const std::vector<at::Tensor>& v) {
  std::vector<at::Tensor> out;
  for (const auto& t : v) out.push_back(t.detach().to(at::kCPU).clone());
  return out;
}

// dst[i] <- src[i] in place (device and dtype follow dst). Sizes must match.
inline void copy_into(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < dst.size(); ++i) dst[i].detach().copy_(src[i]);
}

// torch.optim.swa_utils.update_bn: reset every batch-norm layer's running statistics, set its
// momentum to None (a cumulative average over the pass), run the training split forward in
// training mode without gradients, then restore the momenta. Returns the number of layers (0:
// no pass was made).
inline int64_t update_batch_norm(ember::ITrainer& t) {
  struct Saved {
    torch::nn::BatchNormOptions* options;
    std::optional<double> momentum;
  };
  std::vector<Saved> saved;
  auto visit = [&](auto* bn) {
    if (!bn || !bn->options.track_running_stats()) return;
    bn->reset_running_stats();
    saved.push_back({&bn->options, bn->options.momentum()});
    bn->options.momentum(std::nullopt);
  };
  for (const auto& m : t.module().modules(/*include_self=*/true)) {
    visit(dynamic_cast<torch::nn::BatchNorm1dImpl*>(m.get()));
    visit(dynamic_cast<torch::nn::BatchNorm2dImpl*>(m.get()));
    visit(dynamic_cast<torch::nn::BatchNorm3dImpl*>(m.get()));
  }
  if (saved.empty()) return 0;
  // The pass must not move the random streams (dropout draws from them in training mode): a run
  // that finished and is then resumed for more epochs has to go on exactly like one that never
  // stopped.
  std::vector<std::pair<at::Generator, at::Tensor>> rng;
  {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    rng.emplace_back(cpu, cpu.get_state());
    if (const c10::Device device = t.root_device(); !device.is_cpu()) {
      at::Generator g = at::globalContext().defaultGenerator(device);
      rng.emplace_back(g, g.get_state());
    }
  }
  const bool was_training = t.module().is_training();
  t.module().train();
  auto& passes = ember::trainer_service<ember::ITrainerPasses>(t, "weight averaging");
  passes.for_each_batch(ember::Split::train, -1, [&](const ember::Batch& b) {
    passes.run_forward(b);
    return true;
  });
  t.module().train(was_training);
  for (auto& s : saved) s.options->momentum(s.momentum);
  for (auto& [gen, state] : rng) gen.set_state(state);
  return static_cast<int64_t>(saved.size());
}

}  // namespace ember::support
