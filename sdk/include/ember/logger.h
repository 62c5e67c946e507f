// ember::ILogger: where metrics go (Lightning's Logger). Implemented by logger plugins. Called on
// global rank 0 only.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "ember/trainer.h"
#include "ember/types.h"

namespace ember {

class EMBER_SDK_API ILogger : public IPluginObject {
 public:
  // Called once before anything is logged, with the run folder ready. `resuming` is true when
  // the run continues an earlier one in the same folder from `resume_step`.
  virtual void setup(ITrainer& trainer, bool resuming, int64_t resume_step) = 0;
  virtual void log_hyperparams(const std::string& resolved_config_toml) = 0;
  // One row of metrics at a step. Names are unique within the call.
  virtual void log_metrics(const std::vector<std::pair<std::string, double>>& metrics, int64_t step) = 0;
  virtual void flush() = 0;
  // "success", "failed" or "interrupted".
  virtual void finalize(const std::string& status) = 0;
};

// SDK 2.7. A logger that also takes images answers query_interface(kLoggerImagesIid): the engine
// hands it the [metrics] table's confusion matrices (docs/metrics.md). `png`: the encoded PNG file.
// Called on global rank 0 only.
inline constexpr const char* kLoggerImagesIid = "ember.ILoggerImages/1";
class EMBER_SDK_API ILoggerImages {
 public:
  virtual ~ILoggerImages() = default;
  virtual void log_image(const std::string& tag, const std::string& png, int64_t width, int64_t height, int64_t step) = 0;
};

// SDK 2.9. A logger that keeps files (an experiment tracker's artifacts) answers
// query_interface(kLoggerArtifactsIid). The engine hands it the run's resolved configuration
// (`kind` "config": <run folder>/config.toml) after log_hyperparams, and, before finalize, the
// checkpoint the checkpoint callback calls best ("best_checkpoint"; not called when there is none).
// Called on global rank 0 only; the logger decides what to upload (the path alone, or the file).
inline constexpr const char* kLoggerArtifactsIid = "ember.ILoggerArtifacts/1";
class EMBER_SDK_API ILoggerArtifacts {
 public:
  virtual ~ILoggerArtifacts() = default;
  virtual void log_artifact(const std::string& path, const std::string& kind) = 0;
};

}  // namespace ember
