// Dynamic loss scaling with torch.amp.GradScaler's behaviour, built on the ATen ops Python's
// GradScaler uses (LibTorch has no C++ GradScaler). Header-only, for precision handlers.
//
//   scale(loss)      loss * scale, before backward
//   unscale(opt)     grads *= 1/scale in place; records whether any grad is inf/NaN
//   finite()         reads that flag back to the host (one sync per optimizer step, as Python's)
//   update()         found inf: scale *= backoff_factor, streak reset; else after growth_interval
//                    finite steps in a row: scale *= growth_factor
//
// The scale and the streak ("growth tracker") stay on the device, so the update itself never
// syncs. The CPU and CUDA kernels of both ops ship with LibTorch.
#pragma once
#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/util/StringUtil.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "ember/error.h"

namespace ember {

struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {}) : options_(options) {
    if (options_.init_scale <= 0) throw ConfigError(c10::str("init_scale must be > 0, got ", options_.init_scale));
    if (options_.growth_factor <= 1.0) throw ConfigError(c10::str("growth_factor must be > 1, got ", options_.growth_factor));
    if (options_.backoff_factor <= 0 || options_.backoff_factor >= 1.0)
      throw ConfigError(c10::str("backoff_factor must be in (0, 1), got ", options_.backoff_factor));
    if (options_.growth_interval < 1) throw ConfigError(c10::str("growth_interval must be >= 1, got ", options_.growth_interval));
  }

  // Creates the scale on `device` (once; a restored state is moved there).
  void to(const c10::Device& device) {
    auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
    if (!scale_.defined()) {
      scale_ = at::full({}, options_.init_scale, f32);
      growth_tracker_ = at::zeros({}, at::TensorOptions().dtype(at::kInt).device(device));
    } else {
      scale_ = scale_.to(device);
      growth_tracker_ = growth_tracker_.to(device);
    }
    found_inf_ = at::zeros({}, f32);
  }

  at::Tensor scale(const at::Tensor& loss) const {
    require_ready();
    return loss * scale_.to(loss.device(), /*non_blocking=*/true);
  }

  // Unscales every gradient of `optimizer` in place and records inf/NaN. Gradients are grouped
  // by device and dtype, as the fused op needs (Python's GradScaler does the same).
  void unscale(torch::optim::Optimizer& optimizer) {
    require_ready();
    check_and_multiply(optimizer, scale_.to(at::kDouble).reciprocal().to(at::kFloat));
  }

  // Records inf/NaN in gradients unscale() already divided (multiplies by 1: values unchanged).
  void check_finite(torch::optim::Optimizer& optimizer) {
    require_ready();
    check_and_multiply(optimizer, at::ones({}, at::TensorOptions().dtype(at::kFloat).device(scale_.device())));
  }

  // Whether the last unscale saw only finite gradients (a device-to-host read).
  bool finite() const { return found_inf_.item<float>() == 0.0f; }
  // What unscale/check_finite found on this rank (a device scalar, non-zero for inf/NaN), and the
  // ranks' verdict in its place (IOptimizerStep::found_inf_on_any_rank), before finite()/update().
  const at::Tensor& found_inf() const { return found_inf_; }
  void set_found_inf(const at::Tensor& verdict) { found_inf_.copy_(verdict.reshape({})); }

  void update() {
    require_ready();
    at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, options_.growth_factor, options_.backoff_factor,
                           options_.growth_interval);
  }

  // The current scale as a device tensor (for logging without a sync) and as a number.
  const at::Tensor& scale_tensor() const { return scale_; }
  double current_scale() const { return scale_.defined() ? scale_.item<double>() : options_.init_scale; }
  int64_t growth_tracker() const { return growth_tracker_.defined() ? growth_tracker_.item<int64_t>() : 0; }
  const GradScalerOptions& options() const { return options_; }

  // Python GradScaler.state_dict()'s keys, so a checkpoint reads the same in both worlds.
  c10::impl::GenericDict state_dict() const {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert("scale", current_scale());
    d.insert("growth_factor", options_.growth_factor);
    d.insert("backoff_factor", options_.backoff_factor);
    d.insert("growth_interval", options_.growth_interval);
    d.insert("_growth_tracker", growth_tracker());
    return d;
  }
  void load_state_dict(const c10::impl::GenericDict& d) {
    auto get = [&](const char* key) {
      if (!d.contains(key)) throw RunError(c10::str("loss scaler state lacks '", key, "' (checkpoint from another precision?)"));
      return d.at(key);
    };
    const c10::Device device = scale_.defined() ? scale_.device() : c10::Device(c10::kCPU);
    scale_ = at::full({}, get("scale").toDouble(), at::TensorOptions().dtype(at::kFloat).device(device));
    growth_tracker_ = at::full({}, get("_growth_tracker").toInt(), at::TensorOptions().dtype(at::kInt).device(device));
    options_.growth_factor = get("growth_factor").toDouble();
    options_.backoff_factor = get("backoff_factor").toDouble();
    options_.growth_interval = get("growth_interval").toInt();
    if (!found_inf_.defined()) found_inf_ = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
  }

 private:
  void check_and_multiply(torch::optim::Optimizer& optimizer, const at::Tensor& inv_scale) {
    found_inf_.zero_();
    // Key: (device type, device index, dtype); c10::Device has no ordering of its own.
    std::map<std::tuple<int, int, int>, std::vector<at::Tensor>> groups;
    for (auto& group : optimizer.param_groups())
      for (auto& p : group.params()) {
        const at::Tensor& g = p.grad();
        if (!g.defined()) continue;
        if (g.is_sparse()) throw RunError("loss scaling: sparse gradients are not supported");
        if (g.scalar_type() == at::kHalf)
          throw RunError("loss scaling: gradients are float16; unscaling them in float16 would lose them "
                         "(use mixed precision with float32 parameters, or \"16-true\" without a scaler)");
        groups[{static_cast<int>(g.device().type()), static_cast<int>(g.device().index()), static_cast<int>(g.scalar_type())}]
            .push_back(g);
      }
    for (auto& [key, grads] : groups) {
      const c10::Device device = grads.front().device();
      at::Tensor found = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.to(device, /*non_blocking=*/true));
      found_inf_.add_(found.to(found_inf_.device(), /*non_blocking=*/true));
    }
  }
  void require_ready() const {
    if (!scale_.defined()) throw RunError("loss scaler used before it was placed on a device (call to(device) first)");
  }
  GradScalerOptions options_;
  at::Tensor scale_, growth_tracker_, found_inf_;
};

}  // namespace ember
