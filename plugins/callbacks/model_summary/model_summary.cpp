// Plugin "model_summary": Lightning's ModelSummary. At fit start (rank 0) logs a table of the
// model's layers down to `max_depth` (name, type, parameters, train/eval mode) and the totals:
// trainable, non-trainable, all parameters and their size in MB.
#include <ember/support/callback_base.h>
#include <ember/support/sync_batch_norm.h>
#include <ember/config.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/trainer.h>

#include <torch/nn/module.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "table.h"

namespace {

namespace ms = ember_model_summary;

constexpr EmberConfigKey kKeys[] = {
    ember::key::Int("max_depth", "1",
                    "Depth of nested layers listed: 1 = the model's direct children, -1 = all, 0 = no summary.")
        .at_least(-1),
};

class ModelSummary final : public ember::Callback {
 public:
  ModelSummary(ember::IHost& host, const ember::IConfig& cfg) : host_(host), max_depth_(cfg.get_int("max_depth")) {}

  void on_fit_start(ember::ITrainer& t) override {
    if (max_depth_ == 0 || !t.is_global_zero()) return;
    for (const auto& line : summarize(t.module(), max_depth_)) host_.log(ember::LogLevel::info, line);
  }

  static std::vector<std::string> summarize(torch::nn::Module& root, int64_t max_depth) {
    std::vector<ms::Row> rows;
    ms::Totals totals;
    for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
      const std::string& name = item.key();
      const int64_t depth = 1 + static_cast<int64_t>(std::count(name.begin(), name.end(), '.'));
      const auto& m = item.value();
      (m->is_training() ? totals.modules_train : totals.modules_eval) += 1;
      if (max_depth >= 0 && depth > max_depth) continue;
      ms::Row r;
      r.name = name;
      r.type = ms::short_type(m->name());
      // A SyncBatchNorm*d that does not normalise over ranks (one process, or sync_batchnorm
      // false) is a plain batch norm: Lightning would show BatchNorm2d there too.
      if (const auto* norm = dynamic_cast<const ember::SyncedNormStatus*>(m.get());
          norm != nullptr && !norm->normalises_over_ranks() && r.type.starts_with("Sync"))
        r.type.erase(0, 4);
      r.training = m->is_training();
      for (const auto& p : m->parameters(/*recurse=*/true)) r.params += p.numel();
      rows.push_back(std::move(r));
    }
    (root.is_training() ? totals.modules_train : totals.modules_eval) += 1;
    // A parameter shared by two layers counts once.
    std::set<const void*> seen;
    double bytes = 0;
    for (const auto& p : root.parameters(/*recurse=*/true)) {
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      (p.requires_grad() ? totals.trainable : totals.non_trainable) += p.numel();
      bytes += static_cast<double>(p.numel()) * static_cast<double>(p.element_size());
    }
    totals.size_mb = bytes / 1e6;
    return ms::format_table(rows, totals);
  }

 private:
  ember::IHost& host_;
  int64_t max_depth_;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new ModelSummary(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "model_summary", "0.1.0", "Apache-2.0",
             "Logs the model's layers with parameter counts at fit start (Lightning's ModelSummary).",
             EMBER_CONFIG_KEYS(kKeys), make)
