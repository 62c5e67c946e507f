// Test callback: writes the training position callbacks see, one line per hook it watches:
//   <hook> <epoch> <global_step> <batch_idx> <current batch size> <sum of the batch's inputs>
// at on_train_batch_end, on_validation_end (not while sanity checking) and on_train_epoch_end;
// with input_width = true, then the width of the batch's input (tensors[0].size(1): a text batch's
// padded tokens); with sample_values = true, then " |" and the first value of each sample's input
// (tensors[0] flattened per sample: the sample ids a test wrote into its data). "{rank}" in the path
// becomes the process's rank. Resume tests compare these lines between an uninterrupted and a
// resumed run.
#include <ember/support/callback_base.h>
#include <ember/plugin.h>
#include <ember/trainer.h>

#include <ATen/ATen.h>

#include <cstdio>
#include <fstream>
#include <string>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::String("path", "\"position.txt\"", "File the lines are appended to."),
    ember::key::Bool("input_width", "false", "Append the width of the batch's input (tensors[0].size(1))."),
    ember::key::Bool("sample_values", "false", "Append the first value of each sample's input."),
};

class PositionProbe final : public ember::ICallback {
 public:
  explicit PositionProbe(const ember::IConfig& cfg)
      : path_(cfg.get_string("path")), input_width_(cfg.get_bool("input_width")), sample_values_(cfg.get_bool("sample_values")) {}

  void on_hook(ember::Hook hook, ember::ITrainer& t) override {
    if (hook != ember::Hook::on_train_batch_end && hook != ember::Hook::on_train_epoch_end &&
        hook != ember::Hook::on_validation_end)
      return;
    if (hook == ember::Hook::on_validation_end && t.sanity_checking()) return;
    if (!out_.is_open()) {
      if (const size_t at = path_.find("{rank}"); at != std::string::npos) path_.replace(at, 6, std::to_string(t.rank()));
      out_.open(path_, std::ios::app);
    }
    const ember::Batch& b = t.current_batch();
    double sum = 0;
    if (!b.tensors.empty() && b.tensors[0].defined()) sum = b.tensors[0].to(at::kDouble).sum().item<double>();
    char line[256];
    std::snprintf(line, sizeof line, "%s %lld %lld %lld %lld %.17g", ember::hook_name(hook),
                  static_cast<long long>(t.current_epoch()), static_cast<long long>(t.global_step()),
                  static_cast<long long>(t.batch_idx()), static_cast<long long>(b.size), sum);
    out_ << line;
    if (input_width_) out_ << ' ' << (b.tensors.empty() || b.tensors[0].dim() < 2 ? 0 : b.tensors[0].size(1));
    if (sample_values_ && !b.tensors.empty() && b.tensors[0].defined()) {
      out_ << " |";
      const at::Tensor first = b.tensors[0].reshape({b.tensors[0].size(0), -1}).select(1, 0).to(at::kCPU, at::kDouble);
      for (int64_t i = 0; i < b.size; ++i) out_ << ' ' << first[i].item<double>();
    }
    out_ << '\n';
    out_.flush();
  }

 private:
  std::string path_;
  std::ofstream out_;
  bool input_width_, sample_values_;
};

ember::ICallback* make(ember::IHost&, const ember::IConfig& cfg) { return new PositionProbe(cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "position_probe", "0.0.1", "Apache-2.0", "Test: records the training position hooks see.",
             EMBER_CONFIG_KEYS(kKeys), make)
