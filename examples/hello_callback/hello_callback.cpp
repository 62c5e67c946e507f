// A callback written against the installed Ember SDK: greets at the end of every epoch with the
// step and, when logged, the validation loss.
#include <ember/support/callback_base.h>
#include <ember/plugin.h>

#include <cstdio>
#include <string>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::String("greeting", "\"hello\"", "What to say at the end of each epoch."),
};

class HelloCallback final : public ember::Callback {
 public:
  HelloCallback(ember::IHost& host, const ember::IConfig& cfg) : host_(host), greeting_(cfg.get_string("greeting")) {}

  void on_train_epoch_end(ember::ITrainer& trainer) override {
    std::string line = greeting_ + ": epoch " + std::to_string(trainer.current_epoch()) + " ended at step " +
                       std::to_string(trainer.global_step());
    double val_loss = 0;
    if (trainer.metric("val_loss", &val_loss)) line += ", val_loss " + std::to_string(val_loss);
    host_.log(ember::LogLevel::info, line);
  }

 private:
  ember::IHost& host_;
  std::string greeting_;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new HelloCallback(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "hello_callback", "1.0.0", "MIT", "Example: greets at the end of every epoch.",
             EMBER_CONFIG_KEYS(kKeys), make)
