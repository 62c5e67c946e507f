// Test plugin: records every hook it sees (and, with `record_model`, marks where the model's hooks
// fall) to a file, and can log a scripted metric per epoch for checkpoint/top-k tests.
#include <ember/support/callback_base.h>
#include <ember/plugin.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#ifdef TEST_PLUGIN_CLASH
// What Debian's libsentencepiece does (an absl-style flag object exported as FLAGS_minloglevel, a
// name libc10 exports too): loaded after libc10, the constructor writes over c10's flag and its
// neighbours. The engine must refuse the plugin rather than run with LibTorch's memory changed.
struct ClashingFlag {
  ClashingFlag() { std::memset(static_cast<void*>(bytes), 0xff, sizeof bytes); }
  unsigned char bytes[32];
};
__attribute__((visibility("default"))) ClashingFlag FLAGS_minloglevel;
#endif

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::String("path", "\"hooks.txt\"", "File the hook names are appended to."),
    ember::key::FloatList("scripted_values", "[]", "Value of the metric 'score' logged at each epoch's end (index = epoch)."),
    ember::key::Bool("monitoring", "false", "Whether to declare itself a monitoring callback."),
    ember::key::Int("stop_at_epoch", "-1", "Request a stop at the end of this epoch (-1 = never)."),
#if TEST_PLUGIN_BAD_ELSEWHERE == 1  // a name flagged "elsewhere" without advice: the engine refuses it
    ember::key::Elsewhere("period", ""),
#elif TEST_PLUGIN_BAD_ELSEWHERE == 2  // a name both a key and flagged "elsewhere": refused too
    ember::key::Elsewhere("path", "write it elsewhere"),
#endif
};

class HookRecorder final : public ember::ICallback {
 public:
  explicit HookRecorder(const ember::IConfig& cfg)
      : out_(cfg.get_string("path"), std::ios::app),
        values_(cfg.get_float_list("scripted_values")),
        monitoring_(cfg.get_bool("monitoring")),
        stop_at_(cfg.get_int("stop_at_epoch")) {}

  void on_hook(ember::Hook hook, ember::ITrainer& t) override {
    out_ << ember::hook_name(hook) << "\n";
    out_.flush();
    if (hook == ember::Hook::on_train_epoch_end) {
      auto e = static_cast<size_t>(t.current_epoch());
      if (e < values_.size()) t.log_metric("score", values_[e]);
      if (stop_at_ >= 0 && t.current_epoch() == stop_at_) t.request_stop("hook_recorder: scripted stop");
    }
  }
  bool monitors_metrics() const override { return monitoring_; }

 private:
  std::ofstream out_;
  std::vector<double> values_;
  bool monitoring_;
  int64_t stop_at_;
};

ember::ICallback* make(ember::IHost&, const ember::IConfig& cfg) { return new HookRecorder(cfg); }

}  // namespace

#ifndef TEST_PLUGIN_NAME
#define TEST_PLUGIN_NAME "hook_recorder"
#endif
EMBER_PLUGIN(ember::ICallback, TEST_PLUGIN_NAME, "0.0.1", "Apache-2.0", "Test: records hooks to a file.",
             EMBER_CONFIG_KEYS(kKeys), make)
