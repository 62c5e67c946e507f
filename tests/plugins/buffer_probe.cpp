// Test plugin: after the first batch of every validation pass logs, per rank, the sum of the
// model's floating-point buffers (batch-norm statistics) that batch was evaluated with, so tests
// can check that every rank evaluates with the same ones:
//   buffer_probe: rank R epoch E buffers S
#include <ember/support/callback_base.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/trainer.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdio>

namespace {

class BufferProbe final : public ember::Callback {
 public:
  explicit BufferProbe(ember::IHost& host) : host_(host) {}
  void on_validation_batch_end(ember::ITrainer& t) override {
    if (t.batch_idx() != 0) return;
    double sum = 0;
    for (const auto& b : t.module().buffers())
      if (b.is_floating_point()) sum += b.detach().to(at::kDouble).sum().item<double>();
    char line[160];
    std::snprintf(line, sizeof line, "buffer_probe: rank %lld epoch %lld buffers %.17g", static_cast<long long>(t.rank()),
                  static_cast<long long>(t.current_epoch()), sum);
    host_.log(ember::LogLevel::info, line);
  }

 private:
  ember::IHost& host_;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig&) { return new BufferProbe(host); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "buffer_probe", "0.0.1", "Apache-2.0", "Test: logs each rank's buffer sum during validation.",
             EMBER_NO_CONFIG_KEYS, make)
