// One run, from request to finish: the Plan made into plugin objects (or the program's own
// objects), the ranks launched, seeds and numerics applied, the run folder chosen and the training
// loop set up and restored. `engine` (commands.cpp) and the library's ember::Run both drive it:
//   RunSession s(request); if (!s.is_rank()) return s.launcher_exit_code();
//   s.fit(); s.test("best"); s.finish();
// Any call that throws tells the plugins (on_exception) and finishes the run as failed.
#pragma once
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "registry/composition.h"
#include "session/run_folder.h"
#include "config/run_request.h"
#include "loop/training_loop.h"
#include "runtime/host_memory.h"

namespace ember::engine {

using MetricValues = std::vector<std::pair<std::string, double>>;

struct FitOutcome {
  bool already_finished = false;  // resumed in its own folder at max_epochs/max_steps: nothing trained
  int stop_signal = 0;            // the stop signal that ended training early, 0 if none
};

class RunSession {
 public:
  explicit RunSession(const RunRequest& request);
  ~RunSession();  // finishes the run ("success") when finish() was not called
  RunSession(const RunSession&) = delete;
  RunSession& operator=(const RunSession&) = delete;

  // False on a process that only launched the ranks (they ran the run and exited with
  // launcher_exit_code()); nothing else may be called then.
  bool is_rank() const { return loop_ != nullptr; }
  int launcher_exit_code() const { return launcher_exit_code_; }

  FitOutcome fit();
  // Validation or test pass over the weights of `checkpoint`: "" = the weights the run has now,
  // "best"/"last" = located by the checkpoint callback in this run's folder, else a file.
  MetricValues validate(const std::string& checkpoint);
  MetricValues test(const std::string& checkpoint);
  // Predictions for data.predict_split into <run folder>/predictions.csv (one process).
  std::filesystem::path predict(const std::string& checkpoint);
  // `engine generate`: text from the weights of `checkpoint` (as predict), streamed to `out`;
  // the run folder keeps config.toml and generated.txt.
  std::string generate(const std::string& checkpoint, const GenerationOptions& options, std::ostream& out);
  // `engine checkpoint consolidate`: writes the single-file checkpoint of the restored state.
  void write_consolidated(const std::string& path);  // request's consolidate_to, weights only when it says so
  void finish(const std::string& status = "success");

  TrainingLoop& loop() { return *loop_; }
  const ResolvedConfig& config() const { return plan_.config; }
  const std::filesystem::path& run_dir() const { return folder_.dir; }
  const std::filesystem::path& restored_checkpoint() const { return folder_.checkpoint; }
  bool resume_in_place() const { return folder_.resume_in_place; }

 private:
  template <class F>
  auto guarded(F&& f) -> decltype(f());
  MetricValues evaluate(Split split, const std::string& checkpoint);
  void restore_weights(const std::string& checkpoint, const char* purpose);  // "" = keep the current weights
  void start_logging();  // config.toml in the run folder, loggers set up (once)
  std::filesystem::path runs_base() const;  // <default_root_dir>/<name>
  std::optional<int64_t> run_version() const;
  bool begin_deferred_init(Runtime& runtime, const IConfig& trainer_cfg);
  void log_setup_memory();  // "model set-up: host memory peak +X MB", once, after the loop's set-up

  Plan plan_;
  EngineHost host_;
  RunRequest request_;
  RunFolder folder_;
  int64_t fast_dev_run_ = 0;  // trainer.fast_dev_run: the run folder is removed after a successful run
  std::vector<std::filesystem::path> made_folders_;  // the folders above the run's that did not exist before it, innermost first
  std::unique_ptr<TrainingLoop> loop_;
  int launcher_exit_code_ = 0;
  bool loggers_started_ = false, finished_ = false;
  bool fitted_ = false;  // fit() trained: "best"/"last" then mean this run's checkpoints only
  std::unique_ptr<HostMemoryPeak> setup_memory_;  // from just before the model is built to the end of set-up
};

}  // namespace ember::engine
