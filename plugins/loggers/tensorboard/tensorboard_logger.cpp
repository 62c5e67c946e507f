// Plugin "tensorboard": Lightning's TensorBoardLogger. Writes TensorBoard event files into the run
// folder: every logged metric as a scalar (tag = metric name, step, wall time), the resolved
// config as text ("config") and as hyperparameters (the HParams tab, one hparam per
// "section.key"), and optionally histograms of the weights and gradients every N steps.
//
// Each session writes its own file (events.out.tfevents.<time>.<host>.<pid>.<n>). A run resumed
// in its folder starts its file with a SessionLog START at resume_step, so TensorBoard drops the
// steps after the checkpoint that the older file holds and the resumed run logs again.
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/logger.h>
#include <ember/plugin.h>
#include <ember/trainer.h>
#include <torch/torch.h>

#include <toml++/toml.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "event_writer.h"

namespace {

namespace fs = std::filesystem;

// clang-format off
// Lightning's save_dir, name and version: one run folder for every logger, set in [trainer].
constexpr const char* kRunFolderAdvice =
    "every logger writes into the run folder <trainer.default_root_dir>/<trainer.name>/version_<trainer.version>: set "
    "those [trainer] keys";
constexpr EmberConfigKey kKeys[] = {
    ember::key::Int("histogram_every_n_steps", "0",
        "Write histograms of every parameter and its gradient each N optimizer steps (0 = never).").at_least(0),
    ember::key::Int("max_queue", "10",
        "Log calls buffered before the file is flushed (TensorFlow's SummaryWriter max_queue); also flushed at every epoch end.").at_least(1),
    ember::key::Int("histogram_bins", "30", "Buckets of each histogram.").at_least(1).at_most(1000),
    ember::key::Bool("log_config_text", "true", "Write the resolved config as a text summary (\"config\")."),
    ember::key::Bool("log_hparams", "true", "Write the resolved config's scalar keys to the HParams tab."),
    ember::key::Elsewhere("save_dir", kRunFolderAdvice),
    ember::key::Elsewhere("name", kRunFolderAdvice),
    ember::key::Elsewhere("version", kRunFolderAdvice),
};
// clang-format on

double now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// "section.key" -> value for every leaf of the config; arrays become their TOML text.
void flatten(const toml::table& t, const std::string& prefix, std::vector<std::pair<std::string, ember_tb::HParam>>& out) {
  for (const auto& [k, node] : t) {
    const std::string name = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const auto* sub = node.as_table()) {
      flatten(*sub, name, out);
    } else if (const auto* i = node.as_integer()) {
      out.emplace_back(name, static_cast<double>(i->get()));
    } else if (const auto* f = node.as_floating_point()) {
      out.emplace_back(name, f->get());
    } else if (const auto* b = node.as_boolean()) {
      out.emplace_back(name, b->get());
    } else if (const auto* s = node.as_string()) {
      out.emplace_back(name, s->get());
    } else if (const auto* arr = node.as_array()) {
      std::ostringstream text;
      text << *arr;
      out.emplace_back(name, text.str());
    }
  }
}

ember_tb::Histogram histogram_of(const at::Tensor& t, int64_t bins) {
  ember_tb::Histogram h;
  auto v = t.detach().to(torch::kCPU, torch::kDouble).flatten();
  v = v.masked_select(torch::isfinite(v));
  h.num = static_cast<double>(v.numel());
  if (v.numel() == 0) return h;
  h.min = v.min().item<double>();
  h.max = v.max().item<double>();
  h.sum = v.sum().item<double>();
  h.sum_squares = (v * v).sum().item<double>();
  if (h.min == h.max) {
    h.bucket_limit = {h.max};
    h.bucket = {h.num};
    return h;
  }
  auto counts = torch::histc(v, bins, h.min, h.max).contiguous();
  const double width = (h.max - h.min) / static_cast<double>(bins);
  for (int64_t i = 0; i < bins; ++i) {
    h.bucket_limit.push_back(i + 1 == bins ? h.max : h.min + width * static_cast<double>(i + 1));
    h.bucket.push_back(counts[i].item<double>());
  }
  return h;
}

class TensorBoardLogger final : public ember::ILogger, public ember::ILoggerImages {
 public:
  TensorBoardLogger(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        hist_every_(cfg.get_int("histogram_every_n_steps")),
        bins_(cfg.get_int("histogram_bins")),
        max_queue_(cfg.get_int("max_queue")),
        log_text_(cfg.get_bool("log_config_text")),
        log_hparams_(cfg.get_bool("log_hparams")) {}

  ~TensorBoardLogger() override {
    try {
      if (writer_) writer_->flush();
    } catch (...) {
    }
  }

  void setup(ember::ITrainer& trainer, bool resuming, int64_t resume_step) override {
    trainer_ = &trainer;
    const fs::path dir = trainer.run_dir();
    guarded("set up", [&] {
      fs::create_directories(dir);
      // TensorBoard reads a folder's event files in name order, so a resumed session's file must
      // sort after the older ones for its SessionLog START to drop their later steps: its name's
      // time is past the newest one's even within the same second (where the pid would decide,
      // and "10000" sorts before "9999").
      double name_time = 0;
      for (const auto& entry : fs::directory_iterator(dir)) {
        const std::string name = entry.path().filename().string();
        const std::string prefix = "events.out.tfevents.";
        if (name.rfind(prefix, 0) != 0) continue;
        if (!resuming) {
          // A fresh run in a folder that has event files: they belong to another run (as csv does).
          host_.log(ember::LogLevel::warn, "tensorboard: removing " + entry.path().string() + " (this run does not resume)");
          fs::remove(entry.path());
          continue;
        }
        try {
          name_time = std::max(name_time, std::stod(name.substr(prefix.size(), name.find('.', prefix.size()) - prefix.size())) + 1);
        } catch (const std::exception&) {  // a name without a time: it orders after nothing
        }
      }
      const double t = now();
      writer_ = std::make_unique<ember_tb::EventWriter>((dir / ember_tb::event_file_name(std::max(t, name_time))).string(), t);
      // The first step after the checkpoint is logged at index resume_step (rows are logged at
      // global_step - 1): TensorBoard drops what older files hold from there on.
      if (resuming) writer_->session_start(resume_step, t);
    });
  }

  void log_hyperparams(const std::string& resolved_config_toml) override {
    require_setup("log_hyperparams");
    guarded("write hyperparameters", [&] {
      const double t = now();
      if (log_text_) writer_->text("config", "```toml\n" + resolved_config_toml + "```\n", 0, t);
      if (log_hparams_) {
        std::vector<std::pair<std::string, ember_tb::HParam>> hp;
        flatten(toml::parse(resolved_config_toml), "", hp);
        writer_->hparams_start(hp, t);
      }
      writer_->flush();
    });
  }

  void log_metrics(const std::vector<std::pair<std::string, double>>& metrics, int64_t step) override {
    require_setup("log_metrics");
    guarded("write", [&] {
      const double t = now();
      writer_->scalars(metrics, step, t);
      if (hist_every_ > 0 && trainer_->stage() == ember::Stage::fit) {
        const int64_t gs = trainer_->global_step();
        if (gs > 0 && gs % hist_every_ == 0 && gs != last_hist_step_) {
          last_hist_step_ = gs;
          for (const auto& item : trainer_->module().named_parameters()) {
            writer_->histogram("weights/" + item.key(), histogram_of(item.value(), bins_), step, t);
            if (item.value().grad().defined())
              writer_->histogram("grads/" + item.key(), histogram_of(item.value().grad(), bins_), step, t);
          }
        }
      }
      if (++queued_ >= max_queue_) {
        writer_->flush();
        queued_ = 0;
      }
    });
  }

  // The [metrics] table's confusion matrices (the "images" tab).
  void log_image(const std::string& tag, const std::string& png, int64_t width, int64_t height, int64_t step) override {
    require_setup("log_image");
    guarded("write", [&] { writer_->image(tag, png, static_cast<int>(width), static_cast<int>(height), step, now()); });
  }
  void* query_interface(const char* iid) override {
    if (std::string_view(iid) == ember::kLoggerImagesIid) return static_cast<ember::ILoggerImages*>(this);
    return nullptr;
  }

  void flush() override {
    if (writer_) guarded("flush", [&] { writer_->flush(); });
  }

  void finalize(const std::string& status) override {
    if (!writer_) return;
    guarded("finish", [&] {
      if (log_hparams_) writer_->hparams_end(status == "success" ? 1 : status == "failed" ? 2 : 0, now());
      writer_->flush();
    });
  }

 private:
  void require_setup(const char* call) const {
    if (!writer_) throw ember::RunError(std::string("tensorboard: ") + call + " was called before setup");
  }

  template <class Fn>
  void guarded(const char* what, Fn&& fn) {
    try {
      fn();
    } catch (const ember::RunError&) {
      throw;
    } catch (const std::exception& e) {
      throw ember::RunError(std::string("tensorboard: cannot ") + what + " (" +
                            (writer_ ? writer_->path() : std::string("run folder")) + "): " + e.what());
    }
  }

  ember::IHost& host_;
  const int64_t hist_every_, bins_, max_queue_;
  int64_t queued_ = 0;
  const bool log_text_, log_hparams_;
  ember::ITrainer* trainer_ = nullptr;
  std::unique_ptr<ember_tb::EventWriter> writer_;
  int64_t last_hist_step_ = -1;
};

ember::ILogger* make(ember::IHost& host, const ember::IConfig& cfg) { return new TensorBoardLogger(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ILogger, "tensorboard", "0.1.0", "Apache-2.0",
             "Writes TensorBoard event files: scalars, the config as text and hparams, confusion matrices as images, optional weight/gradient histograms.",
             EMBER_CONFIG_KEYS(kKeys), make)
