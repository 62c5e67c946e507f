// ember::Run: the engine as a library, Lightning's `Trainer` called from your own program.
//
//   ember::RunOptions options;
//   options.config_toml = "[trainer]\nmax_epochs = 3\n[optimizer]\nname = \"adam\"\n";
//   options.plugins = {"early_stopping"};            // plugins by name, as `engine --plugins`
//   options.model = std::make_shared<ember::ModuleModel>(net, loss_fn);   // your module
//   options.data = std::make_shared<ember::TensorData>(train, val, test);  // your tensors
//   ember::Run run(options);
//   auto fit = run.fit();                 // returns; never exits the process
//   auto test = run.test("best");         // metrics of the best checkpoint's weights
//
// A run is configured exactly as a run.toml (same sections, keys, validation and one-line errors
// with positions), except that objects the program made replace the [model]/[data] plugins and
// add callbacks and loggers. Plugins are found next to libember.so, in EMBER_PLUGIN_PATH and in
// `plugin_paths`. Nothing process-wide is changed behind your back: stop-signal handlers only
// when asked (`handle_stop_signals`), no default-dtype switching. What is process-wide by nature
// stays so: LibTorch's global RNG (seeded from trainer.seed when a run starts), intra-op threads
// and denormal flushing (trainer.num_threads / flush_denormal), the engine's log.
// Several runs may live in one process one after the other; they never share state.
#pragma once
#include <ember/callback.h>
#include <ember/data.h>
#include <ember/library.h>
#include <ember/logger.h>
#include <ember/model.h>
#include <ember/predict.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace ember {

using MetricList = std::vector<std::pair<std::string, double>>;

struct RunOptions {
  std::string config_toml;                 // the run's configuration, as a run.toml's text
  std::string config_file;                 // or a run.toml file (with config_toml: only its name in messages)
  std::vector<std::string> plugins;        // plugin names, as `engine --plugins`
  std::vector<std::string> overrides;      // "section.key=value", as `engine --set`
  std::vector<std::string> plugin_paths;   // extra folders to search for plugins
  std::string resume;                      // "last", "best" or a checkpoint file, as `engine --resume`
  std::shared_ptr<IModel> model;           // instead of [model] name
  std::shared_ptr<IDataModule> data;       // instead of [data] name
  std::vector<std::shared_ptr<ICallback>> callbacks;  // in addition to callback plugins
  std::vector<std::shared_ptr<ILogger>> loggers;      // in addition to (or, when given, instead of the default csv) loggers
  bool handle_stop_signals = false;        // install trainer.stop_signals' handlers (the engine does)
  // The program's command line, for strategies that start ranks by running the program again
  // (ddp, sharded with trainer.devices > 1). Empty: /proc/self/cmdline.
  std::vector<std::string> argv;
};

struct FitResult {
  std::string run_dir;
  int64_t epochs_done = 0;        // epochs completed (Lightning's current_epoch after fit)
  int64_t global_step = 0;
  bool already_finished = false;  // resumed a run that had reached max_epochs/max_steps
  int stop_signal = 0;            // a stop signal ended training early (0: none)
  MetricList metrics;             // the last value of every published metric (callback_metrics)
  std::string best_checkpoint, last_checkpoint;  // "" when none was saved
};

class EMBER_API Run {
 public:
  // Validates the configuration, loads the plugins, starts the ranks (multi-process strategies),
  // seeds, builds every object, chooses the run folder and restores `resume`. Throws
  // std::runtime_error subclasses with one-line messages for bad input.
  explicit Run(RunOptions options);
  ~Run();  // finishes the run (loggers flushed, strategy torn down) if finish() was not called
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

  // True on a process that only started the ranks: they ran the whole run in child processes,
  // and this process should exit with launcher_exit_code(). Nothing else may be called then.
  bool is_launcher() const;
  int launcher_exit_code() const;

  FitResult fit();
  // One validation / test pass. `checkpoint`: "" = the weights the run has now, "best"/"last" =
  // the checkpoint callback's (after fit(), this run's only: an error when it saved none; without
  // fit(), the newest earlier run's), or a file.
  MetricList validate(const std::string& checkpoint = "");
  MetricList test(const std::string& checkpoint = "");
  // Lightning's trainer.predict: writes <run_dir>/predictions.csv for data.predict_split (one row
  // per sample: id, predicted class, class probabilities; see `engine predict`) and returns its
  // path. The model must implement ember::IPredictingModel (ModuleModel: give `predict`).
  std::string predict(const std::string& checkpoint = "");
  void finish();

  std::string run_dir() const;
  int64_t rank() const;
  int64_t world_size() const;
  // The trainer as plugins see it: metrics, module, optimizer, position.
  ITrainer& trainer();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Any torch::nn::Module as a model: `loss(module, batch)` computes the loss of a batch, in
// training (returned to the engine) and in validation/test (logged as val_loss/test_loss). With
// `metrics`, evaluation also logs what it returns, prefixed with val_/test_ (e.g. {"acc", ...}).
// With `predict` (one row per sample: class probabilities when `predicts_classes`), the model can
// predict (Run::predict, `engine predict`).
class EMBER_API ModuleModel final : public IModel, public IPredictingModel {
 public:
  using LossFn = std::function<at::Tensor(torch::nn::Module& module, const Batch& batch)>;
  using MetricsFn = std::function<std::vector<std::pair<std::string, at::Tensor>>(torch::nn::Module& module, const Batch& batch)>;
  using PredictFn = std::function<at::Tensor(torch::nn::Module& module, const Batch& batch)>;
  ModuleModel(std::shared_ptr<torch::nn::Module> module, LossFn loss, MetricsFn metrics = nullptr, PredictFn predict = nullptr,
              bool predicts_classes = true);
  void* query_interface(const char* iid) override;
  at::Tensor predict_step(const Batch& batch) override { return predict_(*module_, batch); }
  bool predicts_classes() const override { return predicts_classes_; }
  torch::nn::Module& module() override { return *module_; }
  at::Tensor training_step(const Batch& batch, IStepContext& ctx) override;
  void validation_step(const Batch& batch, IStepContext& ctx) override;
  void test_step(const Batch& batch, IStepContext& ctx) override;

 private:
  void evaluate(const Batch& batch, IStepContext& ctx, const char* prefix);
  std::shared_ptr<torch::nn::Module> module_;
  LossFn loss_;
  MetricsFn metrics_;
  PredictFn predict_;
  bool predicts_classes_;
};

// In-memory tensors as a data module: each split is a list of tensors with the same first
// dimension (e.g. {inputs, targets}); an empty list means the split has no data.
class EMBER_API TensorData final : public IDataModule {
 public:
  TensorData(std::vector<at::Tensor> train, std::vector<at::Tensor> val = {}, std::vector<at::Tensor> test = {});
  void setup(const DataSetup&) override {}
  int64_t size(Split split) const override;
  Batch get_batch(Split split, const int64_t* indices, int64_t count) const override;

 private:
  const std::vector<at::Tensor>& split(Split s) const;
  std::vector<at::Tensor> train_, val_, test_;
};

}  // namespace ember
