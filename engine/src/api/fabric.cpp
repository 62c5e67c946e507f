// ember::Fabric (engine/include/ember/fabric.h): the program's own loop over Ember's strategy and
// precision plugins. The plugins are chosen and validated by the composition root (make_plan), as
// for a run of the engine; the step goes through the same strategy/precision contract as the
// engine's training loop (docs/step.md), with the program in the loop's place.
#include <ember/support/metrics.h>

#include "api/fabric_impl.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/utils.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "common/log.h"
#include "runtime/accelerator.h"
#include "session/run_folder.h"
#include "config/run_request.h"

namespace fs = std::filesystem;

namespace ember {

namespace {

// make_plan names an override "--set trainer.precision=..." and the key "trainer.precision";
// Fabric's values come from its options, so its messages name those.
std::string fabric_where(std::string message) {
  auto replace_all = [&](const std::string& from, const std::string& to) {
    for (size_t at = message.find(from); at != std::string::npos; at = message.find(from, at + to.size()))
      message.replace(at, from.size(), to);
  };
  replace_all("--set trainer.", "FabricOptions.");
  for (const char* key : {"strategy", "precision", "accelerator", "devices", "num_nodes"})
    replace_all(std::string("trainer.") + key, std::string("FabricOptions.") + key);
  return message;
}

std::string toml_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::vector<std::string> own_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> argv;
  size_t start = 0;
  while (start < all.size()) {
    size_t end = all.find('\0', start);
    if (end == std::string::npos) end = all.size();
    argv.push_back(all.substr(start, end - start));
    start = end + 1;
  }
  return argv;
}

engine::Plan plan_for(const FabricOptions& o) {
  engine::RunRequest req;
  req.program_loop = true;
  req.plugin_paths = o.plugin_paths;
  req.plugins = o.loggers;
  if (!o.plugin_config.empty()) {
    req.config_path = "FabricOptions.plugin_config";
    req.config_text = o.plugin_config;
    // The loop's own settings are the program's; only plugin sections belong here.
    auto raw = engine::RawConfig::parse(o.plugin_config, req.config_path);
    for (const char* section : {"trainer", "model", "data", "optimizer"})
      if (auto* node = raw.file.get(section)) {
        const auto& b = node->source().begin;
        throw ConfigError(req.config_path + ":" + std::to_string(b.line) + ":" + std::to_string(b.column) + ": [" + section +
                          "] is an engine section; under Fabric the program decides what it holds (FabricOptions has "
                          "accelerator, strategy, precision, devices and num_nodes): keep only plugin sections here");
      }
  }
  if (o.devices < 1 || o.num_nodes < 1)
    throw ConfigError("FabricOptions.devices = " + std::to_string(o.devices) + ", num_nodes = " + std::to_string(o.num_nodes) +
                      ": both must be at least 1");
  if (o.tensor_parallel < 1)
    throw ConfigError("FabricOptions.tensor_parallel = " + std::to_string(o.tensor_parallel) + ": it must be at least 1");
  if (o.tensor_parallel > 1 && !o.parallelize)
    throw ConfigError("FabricOptions.tensor_parallel = " + std::to_string(o.tensor_parallel) +
                      " needs FabricOptions.parallelize, the program's plan that splits the module (docs/parallelism.md)");
  // "auto" is resolved by make_plan, as for the engine's runs.
  req.sets = {"trainer.accelerator=" + toml_string(o.accelerator),
              "trainer.strategy=" + toml_string(o.strategy),
              "trainer.precision=" + toml_string(o.precision),
              "trainer.devices=" + std::to_string(o.devices),
              "trainer.num_nodes=" + std::to_string(o.num_nodes),
              "parallelism.tensor_parallel=" + std::to_string(o.tensor_parallel),
              std::string("parallelism.sequence_parallel=") + (o.sequence_parallel ? "true" : "false"),
              // No implicit csv logger, checkpoint or model summary: the program names its loggers.
              "trainer.logger=false",
              "trainer.enable_checkpointing=false",
              "trainer.enable_model_summary=false"};
  engine::Plan plan = engine::make_plan(req);
  if (!plan.callbacks.empty())
    throw ConfigError("FabricOptions.plugin_config: '" + plan.callbacks.front()->name +
                      "' is a callback plugin; Fabric runs no callbacks (the program's loop calls what it needs)");
  return plan;
}

}  // namespace

Fabric::Impl::Impl(FabricOptions o) : options(std::move(o)) {
  try {
    plan = plan_for(options);
    engine::Named<IStrategy> strategy;
    engine::make_plugin_object(strategy, *plan.strategy, host, plan.config.section(plan.strategy->name));
    runtime = std::make_unique<engine::Runtime>(std::move(strategy));
  } catch (const engine::UsageError& e) {
    throw ConfigError(fabric_where(e.what()));
  } catch (const engine::PluginError& e) {
    throw ConfigError(e.what());
  }
  if (options.argv.empty()) options.argv = own_command_line();
}

bool Fabric::Impl::launch_ranks(int* exit_code) {
  if (launched) return true;
  const LaunchRequest request = engine::Runtime::launch_request(plan.config.section("trainer"), plan.config.section("parallelism"), options.argv);
  // The program's own loop calls the model's forward; it cannot hand batches to pipeline stages.
  if (request.pipeline_parallel > 1)
    throw ConfigError(plan.config.section("parallelism").where("pipeline_parallel") + ": parallelism.pipeline_parallel = " +
                      std::to_string(request.pipeline_parallel) +
                      ": ember::Fabric runs the program's own forward, which pipeline stages cannot split; train it with `engine fit` "
                      "(whose loop hands whole batches to the stages) or set pipeline_parallel = 1");
  if (!runtime->launch(request, exit_code)) return false;
  launched = true;
  try {
    engine::Named<IPrecision> precision;
    engine::make_plugin_object(precision, *plan.precision, host, plan.config.section(plan.precision->name));
    runtime->set_precision(std::move(precision));
  } catch (const engine::PluginError& e) {
    throw ConfigError(e.what());
  }
  return true;
}

void Fabric::Impl::ensure_launched() {
  if (launched) return;
  if (options.devices * options.num_nodes > 1)
    throw RunError("ember::Fabric: devices x num_nodes = " + std::to_string(options.devices * options.num_nodes) +
                   " ranks; start them with fabric.launch(fn) and call this from fn");
  int code = 0;
  if (!launch_ranks(&code)) throw RunError("ember::Fabric: the strategy started other processes; use fabric.launch(fn)");
}

void Fabric::Impl::require_setup(const char* call) const {
  if (!runtime->is_setup()) throw RunError(std::string("ember::Fabric::") + call + ": call setup(module, optimizer factory) first");
}

void Fabric::Impl::finish(const std::string& status) {
  if (finished) return;
  finished = true;
  for (auto& l : loggers) {
    try {
      l.object->flush();
      l.object->finalize(status);
    } catch (const std::exception& e) {
      log::warn("logger '" + l.name + "': " + e.what());
    }
  }
  runtime->teardown();  // only a launched runtime has anything to end
}

// ---------------------------------------------------------------------------------------------

Fabric::Fabric(FabricOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}

Fabric::~Fabric() {
  try {
    impl_->finish(impl_->failed ? "failed" : "success");
  } catch (const std::exception& e) {
    log::warn(std::string("ember::Fabric: finishing failed: ") + e.what());
  }
}

int Fabric::launch(const std::function<void(Fabric&)>& fn) {
  auto fail = [&](const std::string& line, int code) {
    log::error(line);
    impl_->failed = true;
    try {
      impl_->finish("failed");
    } catch (const std::exception&) {
    }
    return code;
  };
  try {
    int code = 0;
    if (!impl_->launch_ranks(&code)) return code;
    fn(*this);
    finish_saves();  // a background save still pending is committed (or its failure reported) here
    return 0;
  } catch (const ConfigError& e) {
    return fail(e.what(), 2);
  } catch (const engine::UsageError& e) {
    return fail(e.what(), 2);
  } catch (const c10::Error& e) {
    return fail(std::string("run failed: ") + e.what_without_backtrace(), 1);
  } catch (const std::exception& e) {
    return fail(std::string("run failed: ") + e.what(), 1);
  }
}

std::shared_ptr<torch::optim::Optimizer> Fabric::setup(std::shared_ptr<torch::nn::Module> module, const OptimizerFactory& make_optimizer) {
  auto& d = *impl_;
  d.ensure_launched();
  if (!module) throw RunError("ember::Fabric::setup: the module is null");
  if (!make_optimizer) throw RunError("ember::Fabric::setup: the optimizer factory is empty");
  if (d.model) throw RunError("ember::Fabric::setup: called twice; one Fabric trains one model (make another Fabric for another)");
  d.model = std::make_shared<engine::ProgramModule>(std::move(module), d.options.parallelize);
  struct ProgramOptimizer final : IOptimizerFactory {
    const OptimizerFactory& make;
    explicit ProgramOptimizer(const OptimizerFactory& m) : make(m) {}
    std::shared_ptr<torch::optim::Optimizer> build(const std::vector<NamedTensor>& params) override {
      std::vector<at::Tensor> tensors;
      tensors.reserve(params.size());
      for (const auto& p : params) tensors.push_back(p.tensor);
      auto optimizer = make(std::move(tensors));
      if (!optimizer) throw RunError("ember::Fabric::setup: the optimizer factory returned no optimizer");
      return optimizer;
    }
  } factory(make_optimizer);
  // The engine's order (docs/strategy.md), through the same runtime the engine's loop uses.
  return d.runtime->setup(*d.model, factory);
}

DistributedSampler Fabric::distributed_sampler(int64_t size, bool shuffle, uint64_t seed, bool drop_last) {
  impl_->ensure_launched();
  // Tensor-parallel ranks of one data-parallel rank draw the same samples.
  const auto& rt = *impl_->runtime;
  return DistributedSampler(size, rt.data_parallel_size(), rt.data_parallel_rank(), shuffle, seed, drop_last);
}

Batch Fabric::to_device(Batch batch) {
  impl_->ensure_launched();
  return impl_->runtime->to_device(std::move(batch));
}

at::Tensor Fabric::to_device(const at::Tensor& tensor) {
  auto& d = *impl_;
  d.ensure_launched();
  // One tensor through the batch calls, in a Batch whose storage is kept between calls (no
  // allocation per call).
  Batch b = std::move(d.single_tensor_batch);
  b.tensors.clear();
  b.tensors.push_back(tensor);
  b.size = tensor.dim() > 0 ? tensor.size(0) : 1;
  b = d.runtime->to_device(std::move(b));
  if (b.tensors.size() != 1) throw RunError("ember::Fabric::to_device: a plugin changed the number of tensors in a batch (a plugin bug)");
  at::Tensor out = std::move(b.tensors.front());
  d.single_tensor_batch = std::move(b);
  return out;
}

Fabric::ForwardRegion Fabric::autocast(bool grad_enabled) {
  auto& d = *impl_;
  d.require_setup("autocast");
  d.forward_regions.push_back(d.runtime->forward(grad_enabled));
  return ForwardRegion(this);
}

Fabric::ForwardRegion::~ForwardRegion() {
  if (!fabric_) return;
  // Regions close in the reverse order of their opening (each is a scope in the program).
  auto& regions = fabric_->impl_->forward_regions;
  if (!regions.empty()) regions.pop_back();
}

void Fabric::backward(const at::Tensor& loss) {
  auto& d = *impl_;
  d.require_setup("backward");
  if (!loss.defined() || loss.numel() != 1)
    throw RunError("ember::Fabric::backward: the loss must be a scalar tensor");
  if (!loss.requires_grad())
    throw RunError("ember::Fabric::backward: the loss does not require grad (computed under no_grad, or detached?)");
  d.runtime->backward(loss, d.sync_gradients);
  // Kept as is until the step's closure returns it (a detach() would be a dispatcher round trip
  // per step; backward already freed the graph) and released right after the step.
  d.last_loss = loss;
  d.backward_pending = true;
}

Fabric::NoBackwardSync Fabric::no_backward_sync() {
  impl_->sync_gradients = false;
  return NoBackwardSync(this);
}

Fabric::NoBackwardSync::~NoBackwardSync() {
  if (fabric_) fabric_->impl_->sync_gradients = true;
}

at::Tensor Fabric::clip_gradients(double max, ClipAlgorithm algorithm) {
  auto& d = *impl_;
  if (!(max > 0))
    throw ConfigError("ember::Fabric::clip_gradients: max = " + std::to_string(max) + " must be > 0");
  d.require_setup("clip_gradients");
  if (!d.backward_pending) throw RunError("ember::Fabric::clip_gradients: call backward(loss) first (there are no gradients to clip)");
  return d.runtime->unscale_and_clip_gradients(max, algorithm);
}

bool Fabric::optimizer_step() {
  auto& d = *impl_;
  d.require_setup("optimizer_step");
  if (!d.backward_pending) throw RunError("ember::Fabric::optimizer_step: call backward(loss) first");
  // The closure returns the loss the program already backpropagated (Lightning Fabric's way):
  // the precision handler unscales, the step clips and updates unless the gradients are inf/NaN.
  struct Step final : IOptimizerStep {
    Fabric::Impl& d;
    explicit Step(Fabric::Impl& impl) : d(impl) {}
    at::Tensor closure() override { return d.last_loss; }
    void before_step() override {}
    void step() override { d.runtime->optimizer().step(); }
    torch::optim::Optimizer& optimizer() override { return d.runtime->optimizer(); }
    at::Tensor found_inf_on_any_rank(const at::Tensor& found_inf) override { return found_inf; }
  } step(d);
  const bool took = d.runtime->optimizer_step(step);
  d.backward_pending = false;
  d.last_loss.reset();
  return took;
}

void Fabric::zero_grad() {
  impl_->require_setup("zero_grad");
  impl_->runtime->zero_grad();
}

at::Tensor Fabric::all_reduce(const at::Tensor& value, ReduceOp op) {
  impl_->ensure_launched();
  return impl_->runtime->reduce(value, op);
}

void Fabric::barrier(const std::string& name) {
  impl_->ensure_launched();
  impl_->runtime->barrier(name.c_str());
}

namespace {
// Sums over the data-parallel ranks (Runtime::reduce); on a device mesh whose tensor-parallel peers
// hold copies, rank 0's totals then go to every rank, as the engine's [metrics] table does.
void sync_over_ranks(engine::Runtime& rt, const std::vector<metrics::Metric*>& all) {
  metrics::sync_metrics(all, {[&](const at::Tensor& t, ReduceOp op) { return rt.reduce(t, op); }, rt.data_parallel_rank(), rt.data_parallel_size()});
  if (rt.data_parallel_size() != rt.world_size())
    metrics::broadcast_metrics(all, [&](const at::Tensor& t) { return rt.broadcast(t, 0); });
}
}  // namespace

void Fabric::sync(metrics::MetricCollection& collection) {
  impl_->ensure_launched();
  // One state per compute group; compute() hands it to the group's other metrics.
  sync_over_ranks(*impl_->runtime, collection.distinct());
}

void Fabric::sync(metrics::Metric& metric) {
  impl_->ensure_launched();
  sync_over_ranks(*impl_->runtime, {&metric});
}

at::Tensor Fabric::broadcast(const at::Tensor& value, int64_t src) {
  impl_->ensure_launched();
  if (src < 0 || src >= world_size())
    throw RunError("ember::Fabric::broadcast: src = " + std::to_string(src) + " is not a rank of 0.." + std::to_string(world_size() - 1));
  try {
    return impl_->runtime->broadcast(value, src);
  } catch (const RunError& e) {
    throw RunError(std::string("ember::Fabric::broadcast: ") + e.what());
  }
}

bool Fabric::broadcast(bool flag) {
  impl_->ensure_launched();
  return impl_->runtime->broadcast_flag(flag);
}

int64_t Fabric::rank() const {
  impl_->ensure_launched();
  return impl_->runtime->rank();
}
int64_t Fabric::local_rank() const {
  impl_->ensure_launched();
  return impl_->runtime->local_rank();
}
int64_t Fabric::world_size() const {
  impl_->ensure_launched();
  return impl_->runtime->world_size();
}
c10::Device Fabric::device() const {
  impl_->ensure_launched();
  return impl_->runtime->root_device();
}
std::string Fabric::strategy_name() const { return impl_->runtime->strategy().name; }
std::string Fabric::precision_name() const { return impl_->plan.precision->name; }

void Fabric::seed_everything(uint64_t seed) {
  for (const auto* accelerator : engine::all_accelerators()) accelerator->manual_seed_all(seed);
}

// ---------------------------------------------------------------------------------------------
// Logging: rank 0's loggers, started by the first value.

void Fabric::log(const std::string& name, double value, int64_t step) { log_dict({{name, value}}, step); }

void Fabric::log_dict(const std::vector<std::pair<std::string, double>>& values, int64_t step) {
  auto& d = *impl_;
  d.ensure_launched();
  if (d.runtime->rank() != 0 || d.plan.loggers.empty() || values.empty()) return;
  if (!d.loggers_started) {
    d.loggers_started = true;
    const fs::path dir = engine::next_version_dir(fs::path(d.options.root_dir) / d.options.name, std::nullopt);
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw RunError("ember::Fabric: cannot create the log folder " + dir.string() + ": " + ec.message());
    d.log_dir = dir.string();
    const std::string config = d.plan.config.to_toml();
    d.logger_view = engine::make_logger_view(d.log_dir, config, 0, d.runtime->world_size(), d.runtime->root_device(),
                                             &d.last_logged_step);
    for (const auto* info : d.plan.loggers) {
      engine::Named<ILogger> n;
      try {
        engine::make_plugin_object(n, *info, d.host, d.plan.config.section(info->name));
      } catch (const engine::PluginError& e) {
        throw ConfigError(e.what());
      }
      n.object->setup(*d.logger_view, /*resuming=*/false, 0);
      n.object->log_hyperparams(config);
      d.loggers.push_back(std::move(n));
    }
  }
  d.last_logged_step = step;
  for (auto& l : d.loggers) l.object->log_metrics(values, step);
}

std::string Fabric::log_dir() const { return impl_->log_dir; }

}  // namespace ember
