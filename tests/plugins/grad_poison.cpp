// Test callback: plants an inf in the gradients of chosen training batches (in on_after_backward,
// i.e. inside the step, before the precision handler unscales) and writes one line per training
// batch: "batch global_step stepped skipped max_abs_weight_change", the change measured from the
// end of the previous batch. With it a test checks the loss scaler's skip/backoff/growth sequence
// and that a skipped step leaves the weights untouched.
#include <ember/support/callback_base.h>
#include <ember/config.h>
#include <ember/plugin.h>

#include <torch/nn/module.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <vector>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::String("path", "\"poison.txt\"", "File the per-batch lines are appended to."),
    ember::key::IntList("batches", "[]", "Training batches (counted across epochs from 0) whose gradients get an inf."),
    ember::key::Bool("nan", "false", "Plant NaN instead of inf."),
};

class GradPoison final : public ember::Callback {
 public:
  explicit GradPoison(const ember::IConfig& cfg)
      : out_(cfg.get_string("path"), std::ios::app), batches_(cfg.get_int_list("batches")), nan_(cfg.get_bool("nan")) {}

  void on_train_start(ember::ITrainer& t) override { snapshot(t); }
  void on_after_backward(ember::ITrainer& t) override {
    if (std::find(batches_.begin(), batches_.end(), count_) == batches_.end()) return;
    for (auto& p : t.module().parameters())
      if (p.grad().defined()) {
        p.grad().view(-1)[0].fill_(nan_ ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity());
        break;
      }
  }
  void on_train_batch_end(ember::ITrainer& t) override {
    double change = 0;
    auto params = t.module().parameters();
    for (size_t i = 0; i < params.size() && i < before_.size(); ++i)
      change = std::max(change, (params[i].detach().to(at::kDouble) - before_[i]).abs().max().item<double>());
    out_ << count_ << " " << t.global_step() << " " << t.optimizer_stepped() << " " << t.optimizer_step_skipped() << " "
         << change << "\n" << std::flush;
    ++count_;
    snapshot(t);
  }
  c10::IValue state_dict() const override { return count_; }
  void load_state_dict(const c10::IValue& s) override { count_ = s.toInt(); }

 private:
  void snapshot(ember::ITrainer& t) {
    before_.clear();
    for (const auto& p : t.module().parameters()) before_.push_back(p.detach().to(at::kDouble).clone());
  }
  std::ofstream out_;
  std::vector<int64_t> batches_;
  bool nan_;
  int64_t count_ = 0;  // training batches seen, across epochs
  std::vector<at::Tensor> before_;
};

ember::ICallback* make(ember::IHost&, const ember::IConfig& cfg) { return new GradPoison(cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "grad_poison", "0.0.1", "Apache-2.0", "Test: plants inf/NaN gradients, traces steps.",
             EMBER_CONFIG_KEYS(kKeys), make)
