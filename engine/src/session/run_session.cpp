#include "session/run_session.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/cuda.h>
#include <torch/utils.h>

#include <cxxabi.h>

#include <ember/deferred_init.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ember/precision.h>

#include <csignal>
#include <cstdlib>
#include <fstream>
#include <map>
#include <typeinfo>

#include "checkpoint/checkpoint_io.h"
#include "common/log.h"
#include "runtime/accelerator.h"
#include "runtime/host_memory.h"
#include "runtime/numerics.h"
#include "checkpoint/sharded_checkpoint.h"
#include "session/elastic_job.h"
#include "session/slurm_requeue.h"
#include "session/stop_signals.h"

namespace fs = std::filesystem;

namespace ember::engine {
namespace {

// A program-made object's name in logs and checkpoints (its state is saved under it): its C++
// type, numbered when several objects share one, so the same program resumes the same states.
template <class T>
std::vector<Named<T>> name_objects(const std::vector<std::shared_ptr<T>>& objects) {
  std::vector<Named<T>> out;
  std::map<std::string, int> seen;
  for (const auto& o : objects) {
    if (!o) throw UsageError("a callback or logger object given to the run is null");
    int status = 0;
    std::unique_ptr<char, void (*)(void*)> demangled(abi::__cxa_demangle(typeid(*o).name(), nullptr, nullptr, &status), std::free);
    std::string name = status == 0 && demangled ? demangled.get() : typeid(*o).name();
    if (const int n = ++seen[name]; n > 1) name += "#" + std::to_string(n);
    out.push_back({name, "", o});
  }
  return out;
}

}  // namespace

RunSession::RunSession(const RunRequest& req) : plan_(make_plan(req)), request_(req) {
  if (!req.consolidate_to.empty()) {  // only the model's and optimizer's state are converted: no callbacks, no loggers
    plan_.callbacks.clear();
    plan_.loggers.clear();
    request_.provided.callbacks.clear();
    request_.provided.loggers.clear();
  }
  if (!req.resume.empty() && req.resume != "last" && req.resume != "best") {
    std::error_code ec;
    if (!fs::is_regular_file(req.resume, ec) && !is_sharded_checkpoint(req.resume))
      throw UsageError("--resume " + req.resume + ": no such checkpoint file (give a .ckpt path, or last / best)");
  }
  const auto& cfg = plan_.config;
  const auto& trainer_cfg = cfg.section("trainer");
  parse_stop_signals(trainer_cfg);  // a bad entry is a config error before anything starts

  RunPlugins plugins;
  auto make = [&](auto& slot, const PluginInfo* info, const IConfig& section) { make_plugin_object(slot, *info, host_, section); };
  Named<IStrategy> strategy;
  make(strategy, plan_.strategy, cfg.section(plan_.strategy->name));
  auto runtime = std::make_unique<Runtime>(std::move(strategy));
  const LaunchRequest launch = Runtime::launch_request(trainer_cfg, cfg.section("parallelism"), req.argv);
  if (!runtime->launch(launch, &launcher_exit_code_, Runtime::pipeline_options(cfg.section("parallelism")))) return;
  const int64_t rank = runtime->rank();

  // Global numerics before any plugin builds tensors.
  const auto seed = static_cast<uint64_t>(trainer_cfg.get_int("seed"));
  for (const auto* accelerator : all_accelerators()) accelerator->manual_seed_all(seed);
  {
    const bool on_cpu = runtime->root_device().is_cpu();
    const int64_t local = runtime->world_size() > 1 ? launch.devices : 1;
    const std::string numerics = apply_numerics(numerics_settings(trainer_cfg, on_cpu, local));
    if (rank == 0) {
      log::info(numerics);
      if (!plan_.auto_precision_note.empty()) log::info(plan_.auto_precision_note);
    }
  }
  if (trainer_cfg.get_bool("deterministic")) at::globalContext().setDeterministicAlgorithms(true, false);

  if (req.provided.data) {
    plugins.data = {"data object", "", req.provided.data};
  } else {
    make(plugins.data, plan_.data, cfg.section("data"));
  }
  DataSetup data_setup;
  data_setup.seed = seed;
  // Tensor-parallel ranks of one data-parallel rank see the same data.
  data_setup.rank = runtime->data_parallel_rank();
  data_setup.world_size = runtime->data_parallel_size();
  plugins.data.object->setup(data_setup);
  Named<IPrecision> precision;
  make(precision, plan_.precision, cfg.section(plan_.precision->name));
  runtime->set_precision(std::move(precision));
  // The model is built from here to the end of the runtime's set-up: its host memory peak is
  // logged, and a strategy that shards may take each piece as it is built (ember/deferred_init.h).
  setup_memory_ = std::make_unique<HostMemoryPeak>();
  if (req.provided.model) {
    plugins.model = {"model object", "", req.provided.model};
  } else {
    const bool deferred = begin_deferred_init(*runtime, trainer_cfg);
    struct Withdraw {
      EngineHost& host;
      ~Withdraw() { host.offer_deferred_init(nullptr); }
    } withdraw{host_};
    if (deferred) host_.offer_deferred_init(runtime->strategy_object().query_interface(kDeferredInitIid));
    auto* plan = deferred ? static_cast<IDeferredInitPlan*>(runtime->strategy_object().query_interface(kDeferredInitPlanIid)) : nullptr;
    if (plan && plan->wants_shapes_pass()) {
      // The strategy decides what this rank keeps from the whole model's shapes (pipeline stages,
      // tensor-parallel slices):
      // a first build gives them, storage-less piece by piece; the second, from the same generator
      // state, keeps the values (ember/deferred_init.h).
      at::Generator generator = at::detail::getDefaultCPUGenerator();
      at::Tensor before;
      {
        std::lock_guard<std::mutex> lock(generator.mutex());
        before = generator.get_state();
      }
      make(plugins.model, plan_.model, cfg.section("model"));
      plan->plan_from_shapes(*plugins.model.object);
      plugins.model = {};
      {
        std::lock_guard<std::mutex> lock(generator.mutex());
        generator.set_state(before);
      }
      if (rank == 0)
        log::info("deferred initialisation: the model was built once for its shapes; built again, each rank keeps only its part (of its "
                  "pipeline stages, its tensor-parallel slices)");
    }
    make(plugins.model, plan_.model, cfg.section("model"));
  }
  for (const auto* c : plan_.callbacks) {
    Named<ICallback> n;
    make(n, c, cfg.section(c->name));
    plugins.callbacks.push_back(std::move(n));
  }
  for (auto& c : name_objects(request_.provided.callbacks)) plugins.callbacks.push_back(std::move(c));
  if (rank == 0) {
    for (const auto* l : plan_.loggers) {
      Named<ILogger> n;
      make(n, l, cfg.section(l->name));
      plugins.loggers.push_back(std::move(n));
    }
    for (auto& l : name_objects(request_.provided.loggers)) plugins.loggers.push_back(std::move(l));
  }

  // Run folder: <root>/<name>/version_<n>; `--resume last|best` continues the newest run that
  // has such a checkpoint, in its own folder.
  const std::string test_ckpt = trainer_cfg.get_string("test_ckpt");
  fast_dev_run_ = trainer_cfg.get_int("fast_dev_run");
  std::string resume = req.resume;
  std::optional<int64_t> version = run_version();
  // A torchrun group re-formed because a node joined or left is the same job, though no restart
  // was counted: it resumes from the job's last checkpoint by itself (session/elastic_job.h).
  const std::string torchrun_job = torchrun_job_id();
  if (resume.empty() && fast_dev_run_ == 0 && has_checkpoint_locator(plugins.callbacks))
    if (const auto v = version_of_torchrun_job(runs_base(), version, torchrun_job);
        v && !find_checkpoint_in_runs(runs_base(), v, "last", plugins.callbacks).empty()) {
      log::info("torchrun re-formed the group of job '" + torchrun_job +
                  "' (a node joined or left, which torchrun does not count as a restart): resuming from the last checkpoint of its run "
                  "folder version_" + std::to_string(*v) + " (--resume last)");
      resume = "last";
      version = v;
    }
  const bool resume_located = resume == "last" || resume == "best";  // choose_run_folder says what is missing
  if (!resume_located && trainer_cfg.get_bool("test_after_fit") && test_ckpt != "current" && !has_checkpoint_locator(plugins.callbacks))
    throw UsageError(trainer_cfg.where("test_ckpt") + ": trainer.test_ckpt = \"" + test_ckpt +
                     "\" needs a checkpoint callback (enable checkpointing, or set test_ckpt = \"current\")");
  if (fast_dev_run_ > 0 && resume_located)
    throw UsageError(trainer_cfg.where("fast_dev_run") + ": trainer.fast_dev_run with --resume " + resume +
                     " would train in that run's folder and overwrite its checkpoints: resume from the checkpoint's path instead");
  if (fast_dev_run_ > 0)
    for (fs::path dir = runs_base(); !dir.empty() && !fs::exists(dir); dir = dir.parent_path()) made_folders_.push_back(dir);
  folder_ = choose_run_folder(runs_base(), version, resume, plugins.callbacks, *runtime);
  if (rank == 0 && fast_dev_run_ == 0) mark_torchrun_job(folder_.dir, torchrun_job);
  if (fast_dev_run_ > 0 && rank == 0)
    log::info("fast_dev_run: " + std::to_string(fast_dev_run_) + " batch(es) of training, validation and test, no sanity check; " +
              folder_.dir.string() + " is removed at the end (kept if the run fails)");
  loop_ = std::make_unique<TrainingLoop>(host_, cfg, std::move(runtime), std::move(plugins), folder_.dir);
  guarded([&] {
    loop_->setup();
    log_setup_memory();
    if (!folder_.checkpoint.empty()) loop_->restore(folder_.checkpoint, /*weights_only=*/req.consolidate_weights_only);
    // A resumed run's own state already holds what it started from; --ckpt brings its own weights.
    else if (!req.weights_from_ckpt) loop_->load_init_checkpoint();
  });
}

// Whether the strategy takes the model piece by piece as it is built: it must offer it, the
// precision handler must say the dtype it will give the parameters, and nothing between the build
// and the strategy's set-up may need their values (channels_last converts them).
bool RunSession::begin_deferred_init(Runtime& runtime, const IConfig& trainer_cfg) {
  auto* deferred = static_cast<IDeferredInit*>(runtime.strategy_object().query_interface(kDeferredInitIid));
  if (deferred == nullptr) return false;
  auto* dtype = static_cast<IParameterDtype*>(runtime.precision_object().query_interface(kParameterDtypeIid));
  std::string why_not;
  if (dtype == nullptr)
    why_not = "precision '" + runtime.precision().name + "' does not say which dtype it gives the parameters (ember::IParameterDtype, SDK 2.10)";
  else if (trainer_cfg.get_bool("channels_last"))
    why_not = "trainer.channels_last converts the whole model before the strategy shards it";
  if (!why_not.empty()) {
    if (runtime.rank() == 0) log::info("deferred initialisation off (the model is built whole on every rank): " + why_not);
    return false;
  }
  return deferred->begin_deferred_init(dtype->parameter_dtype());
}

void RunSession::log_setup_memory() {
  if (!setup_memory_) return;
  const auto growth = setup_memory_->growth();
  setup_memory_.reset();
  if (!growth) return;
  char mb[32];
  std::snprintf(mb, sizeof mb, "%.1f", static_cast<double>(*growth) / (1024.0 * 1024.0));
  // Whether the pieces were taken as they were built, the strategy's own line says.
  log::info(std::string("model set-up: host memory peak +") + mb + " MB");
}

RunSession::~RunSession() {
  if (loop_ && !finished_) {
    try {
      finish("success");
    } catch (const std::exception& e) {
      log::warn(std::string("finishing the run failed: ") + e.what());
    }
  }
}

fs::path RunSession::runs_base() const {
  const auto& t = plan_.config.section("trainer");
  const std::string name = t.has("name") ? t.get_string("name")
                           : request_.config_path.empty() ? "default" : fs::path(request_.config_path).stem().string();
  return fs::path(t.get_string("default_root_dir")) / name;
}

std::optional<int64_t> RunSession::run_version() const {
  const auto& t = plan_.config.section("trainer");
  return t.has("version") ? std::optional<int64_t>(t.get_int("version")) : std::nullopt;
}

template <class F>
auto RunSession::guarded(F&& f) -> decltype(f()) {
  if (finished_) throw RunError("this run has already finished; make a new one to train or evaluate again");
  try {
    return f();
  } catch (...) {
    loop_->notify_exception();
    finished_ = true;
    loop_->finalize("failed");
    // A command that failed before writing anything (engine validate --ckpt best before any
    // training, a model that cannot generate) leaves no empty version_<n> behind to shift the
    // next run's number; fs::remove takes a folder only when it is empty.
    if (loop_->is_global_zero()) {
      std::error_code ec;
      if (fs::is_empty(folder_.dir, ec) && fs::remove(folder_.dir, ec))
        log::info("removed the empty run folder " + folder_.dir.string());
    }
    throw;
  }
}

void RunSession::start_logging() {
  if (loggers_started_) return;
  loggers_started_ = true;
  if (loop_->is_global_zero()) {
    std::ofstream(folder_.dir / "config.toml") << plan_.config.to_toml();
    log::info("run folder " + folder_.dir.string());
  }
  // Loggers of a run resumed in its own folder continue its files; fresh folders (including a
  // resume from an explicit path) start new ones.
  loop_->setup_loggers(folder_.resume_in_place);
}

FitOutcome RunSession::fit() {
  return guarded([&] {
    FitOutcome out;
    // A run resumed in its own folder that already reached max_epochs/max_steps: nothing to
    // train again, and nothing is added to its logs (a requeued job that already ended).
    if (folder_.resume_in_place && loop_->fit_done()) {
      log::info("the run in " + folder_.dir.string() + " already finished (epoch " + std::to_string(loop_->current_epoch()) +
                ", step " + std::to_string(loop_->global_step()) +
                "): nothing to do; raise trainer.max_epochs or trainer.max_steps to train on");
      out.already_finished = true;
      return out;
    }
    start_logging();
    if (request_.stop_signal_handlers) install_stop_signal_handlers(parse_stop_signals(plan_.config.section("trainer")));
    loop_->fit();
    fitted_ = true;
    if ((out.stop_signal = loop_->agreed_stop_signal())) {
      finished_ = true;
      loop_->finalize("interrupted");
      const std::string job = slurm_job_to_requeue();
      if (out.stop_signal == SIGUSR1 && !job.empty() && plan_.config.section("trainer").get_bool("slurm_requeue")) {
        if (loop_->is_global_zero()) requeue_slurm_job(job);
      } else {
        log::warn("interrupted; continue with --resume last");
      }
    }
    return out;
  });
}

void RunSession::restore_weights(const std::string& checkpoint, const char* purpose) {
  if (checkpoint.empty()) return;
  std::string path = checkpoint;
  if (checkpoint == "best" || checkpoint == "last") {
    // This run's own checkpoint first; a run that did not fit takes the newest earlier run's. After
    // fit, only this run's: another run's weights, tested as this one's, would be a wrong result.
    path = loop_->locate_checkpoint(checkpoint);
    if (path.empty() && fitted_)
      throw RunError("this run saved no '" + checkpoint + "' checkpoint in " + folder_.dir.string() + " (it ended at step " +
                     std::to_string(loop_->global_step()) +
                     "; the checkpoint callback saves when its monitor is logged): evaluate the weights as they are "
                     "(trainer.test_ckpt = \"current\") or give a checkpoint file");
    if (path.empty()) path = find_checkpoint_in_runs(runs_base(), run_version(), checkpoint, loop_->callbacks()).string();
    if (path.empty())
      throw RunError("no '" + checkpoint + "' checkpoint in " + folder_.dir.string() + " or an earlier run under " +
                     runs_base().string() + " (train first, or give the checkpoint's path)");
  } else {
    std::error_code ec;
    if (!fs::is_regular_file(path, ec) && !is_sharded_checkpoint(path))
      throw UsageError("--ckpt " + path + ": no such checkpoint file (give a .ckpt path, or best / last)");
  }
  log::info(std::string(purpose) + " " + (path == checkpoint ? "" : checkpoint + " checkpoint ") + path);
  loop_->restore(path, /*weights_only=*/true);
}

MetricValues RunSession::evaluate(Split split, const std::string& checkpoint) {
  return guarded([&] {
    loop_->begin_stage(split == Split::test ? Stage::test : Stage::validate);
    restore_weights(checkpoint, split == Split::test ? "testing" : "validating");
    start_logging();
    auto metrics = split == Split::test ? loop_->test() : loop_->validate();
    loop_->end_stage();
    return metrics;
  });
}

fs::path RunSession::predict(const std::string& checkpoint) {
  return guarded([&] {
    loop_->begin_stage(Stage::predict);
    restore_weights(checkpoint, "predicting with");
    const std::string name = plan_.config.section("data").get_string("predict_split");
    const Split split = name == "train" ? Split::train : name == "val" ? Split::val : Split::test;
    if (loop_->is_global_zero()) {
      std::ofstream(folder_.dir / "config.toml") << plan_.config.to_toml();
      log::info("run folder " + folder_.dir.string());
    }
    const fs::path csv = folder_.dir / "predictions.csv";
    loop_->predict(split, csv);
    loop_->end_stage();
    return csv;
  });
}

std::string RunSession::generate(const std::string& checkpoint, const GenerationOptions& options, std::ostream& out) {
  return guarded([&] {
    loop_->begin_stage(Stage::predict);
    // A model that cannot generate is refused before its checkpoint is read (which can take long).
    loop_->check_can_generate();
    if (checkpoint.empty()) log::warn("no --ckpt: generating with the model as set up (untrained, unless it loaded pretrained weights)");
    restore_weights(checkpoint, "generating with");
    std::string text = loop_->generate(options, out);
    if (loop_->is_global_zero()) {
      std::ofstream(folder_.dir / "config.toml") << plan_.config.to_toml();
      std::ofstream(folder_.dir / "generated.txt", std::ios::binary) << options.prompt << text << "\n";
      log::info("run folder " + folder_.dir.string() + " (generated.txt)");
    }
    loop_->end_stage();
    return text;
  });
}

MetricValues RunSession::validate(const std::string& checkpoint) { return evaluate(Split::val, checkpoint); }
MetricValues RunSession::test(const std::string& checkpoint) { return evaluate(Split::test, checkpoint); }

void RunSession::write_consolidated(const std::string& path) {
  guarded([&] { loop_->write_consolidated(path, folder_.checkpoint, request_.consolidate_weights_only); });
}

void RunSession::finish(const std::string& status) {
  if (finished_) return;
  finished_ = true;
  loop_->finalize(status);
  // fast_dev_run leaves nothing behind (Lightning writes no logs or checkpoints then): the run
  // folder goes, and the folders above it that this run made.
  if (fast_dev_run_ > 0 && status == "success" && loop_->is_global_zero()) {
    remove_tree(folder_.dir);
    std::error_code ec;
    for (const auto& dir : made_folders_) fs::remove(dir, ec);  // innermost first; only when empty
    log::info("fast_dev_run: passed; removed " + folder_.dir.string());
  }
}

}  // namespace ember::engine
