// amp16 ("16-mixed"): float32 parameters, forward and loss under autocast to float16, and
// dynamic loss scaling with torch.amp.GradScaler's behaviour (ember/grad_scaler.h): backward of
// loss * scale, unscale before on_before_optimizer_step and clipping, skip the optimizer step on
// inf/NaN gradients (the engine tells schedulers through ITrainer::optimizer_step_skipped), back
// off or grow the scale. Gradient accumulation needs nothing extra: every micro-batch is scaled
// by the same scale, which only changes after the step. Logs amp_scale and amp_skipped_steps.
#include <ember/support/grad_scaler.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/precision.h>
#include <ember/support/precision_util.h>
#include <ember/trainer.h>

#include <torch/nn/module.h>

#include <cstring>
#include <optional>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::Float("init_scale", "65536.0", "Loss scale at the start of training (torch.amp.GradScaler's init_scale).").above(0.0),
    ember::key::Float("growth_factor", "2.0", "The scale is multiplied by this after growth_interval steps in a row with finite gradients.").above(1.0),
    ember::key::Float("backoff_factor", "0.5", "The scale is multiplied by this when a step finds inf/NaN gradients (and the step is skipped).").above(0.0).below(1.0),
    ember::key::Int("growth_interval", "2000", "Finite steps in a row before the scale grows.").at_least(1),
    ember::key::Bool("log_scale", "true", "Log amp_scale (the scale after this step's update) and amp_skipped_steps with the step metrics."),
};

class Amp16 final : public ember::IPrecision, public ember::ITrainerAware, public ember::IGradientUnscaler, public ember::IParameterDtype {
 public:
  Amp16(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        scaler_(ember::GradScalerOptions{cfg.get_float("init_scale"), cfg.get_float("growth_factor"),
                                         cfg.get_float("backoff_factor"), cfg.get_int("growth_interval")}),
        log_scale_(cfg.get_bool("log_scale")) {}

  void setup(torch::nn::Module& module, const c10::Device& device) override {
    module.to(at::kFloat);
    device_ = device;
    ember::check_precision_supported("amp16 (16-mixed)", device, at::kHalf, /*autocast=*/true,
                                     "use bf16 (\"bf16-mixed\") or fp32 instead");
    if (device.is_cpu())
      host_.log(ember::LogLevel::warn,
                "amp16 on cpu: float16 autocast works, but most CPU float16 kernels are slower than float32; "
                "bf16 (\"bf16-mixed\") is usually the faster mixed precision on a CPU, and trainer.precision = "
                "\"auto\" picks the fastest precision this device runs well");
    scaler_.to(device);
  }
  ember::Batch convert_input(ember::Batch batch) override { return ember::cast_floating(std::move(batch), at::kFloat); }
  void forward_begin() override { region_.emplace(device_.type(), at::kHalf); }
  void forward_end() override { region_.reset(); }
  void backward(const at::Tensor& loss) override { scaler_.scale(loss).backward(); }

  bool optimizer_step(ember::IOptimizerStep& step) override {
    step.closure();
    // Hooks and clipping see true gradient values (Lightning's order: unscale, then
    // on_before_optimizer_step and clipping, then the step if the gradients are finite).
    // A program that unscaled already (Fabric's clip_gradients) gets only the inf/NaN check.
    if (unscaled_) scaler_.check_finite(step.optimizer());
    else scaler_.unscale(step.optimizer());
    unscaled_ = false;
    // Every rank skips the same steps: under a sharding strategy a rank sees only its shard.
    scaler_.set_found_inf(step.found_inf_on_any_rank(scaler_.found_inf()));
    step.before_step();
    const bool finite = scaler_.finite();
    if (finite) step.step();
    else ++skipped_;
    scaler_.update();
    if (log_scale_ && trainer_) {
      ember::LogOptions o;
      o.on_step = 1;
      o.on_epoch = 0;
      trainer_->log_tensor("amp_scale", scaler_.scale_tensor().clone(), o);
      trainer_->log_tensor("amp_skipped_steps", at::scalar_tensor(static_cast<double>(skipped_), at::kDouble), o);
    }
    return finite;
  }

  c10::IValue state_dict() const override {
    auto d = scaler_.state_dict();
    d.insert("skipped_steps", skipped_);
    return d;
  }
  void load_state_dict(const c10::IValue& state) override {
    if (!state.isGenericDict()) throw ember::RunError("amp16: checkpoint holds no loss-scaler state");
    auto d = state.toGenericDict();
    scaler_.load_state_dict(d);
    if (d.contains("skipped_steps")) skipped_ = d.at("skipped_steps").toInt();
  }
  void* query_interface(const char* iid) override {
    if (std::strcmp(iid, ember::kTrainerAwareIid) == 0) return static_cast<ember::ITrainerAware*>(this);
    if (std::strcmp(iid, ember::kGradientUnscalerIid) == 0) return static_cast<ember::IGradientUnscaler*>(this);
    if (std::strcmp(iid, ember::kParameterDtypeIid) == 0) return static_cast<ember::IParameterDtype*>(this);
    return nullptr;
  }
  c10::ScalarType parameter_dtype() const override { return at::kFloat; }
  void unscale_gradients(torch::optim::Optimizer& optimizer) override {
    if (unscaled_) return;
    scaler_.unscale(optimizer);
    unscaled_ = true;
  }
  void attach_trainer(ember::ITrainer* trainer) override { trainer_ = trainer; }

 private:
  ember::IHost& host_;
  ember::GradScaler scaler_;
  bool log_scale_;
  c10::Device device_{c10::kCPU};
  std::optional<ember::AutocastRegion> region_;
  int64_t skipped_ = 0;
  bool unscaled_ = false;  // by unscale_gradients, since the last step
  ember::ITrainer* trainer_ = nullptr;
};

ember::IPrecision* make(ember::IHost& host, const ember::IConfig& cfg) { return new Amp16(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IPrecision, "amp16", "0.1.0", "Apache-2.0",
             "Mixed precision: float16 autocast with dynamic loss scaling (Lightning's \"16-mixed\").",
             EMBER_CONFIG_KEYS(kKeys), make)
