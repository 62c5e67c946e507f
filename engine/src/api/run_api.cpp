// The library's ember::Run (engine/include/ember/run.h) over the engine's RunSession, and the
// ModuleModel / TensorData adapters for objects a program makes itself.
#include <ember/run.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <fstream>
#include <string_view>

#include "session/run_session.h"

namespace ember {
namespace {

// The program's own command line, for strategies that start ranks by running it again.
std::vector<std::string> own_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::vector<std::string> out;
  std::string arg;
  while (std::getline(in, arg, '\0')) out.push_back(arg);
  return out;
}

}  // namespace

struct Run::Impl {
  std::unique_ptr<engine::RunSession> session;
  engine::RunSession& rank_session() {
    if (!session->is_rank())
      throw RunError("this process only started the ranks (Run::is_launcher()): exit with launcher_exit_code()");
    return *session;
  }
};

Run::Run(RunOptions options) : impl_(std::make_unique<Impl>()) {
  engine::RunRequest req;
  req.config_path = options.config_file;
  req.config_text = options.config_toml;
  req.plugins = std::move(options.plugins);
  req.sets = std::move(options.overrides);
  req.plugin_paths = std::move(options.plugin_paths);
  req.resume = std::move(options.resume);
  req.argv = options.argv.empty() ? own_command_line() : std::move(options.argv);
  req.provided = {std::move(options.model), std::move(options.data), std::move(options.callbacks), std::move(options.loggers)};
  req.stop_signal_handlers = options.handle_stop_signals;
  impl_->session = std::make_unique<engine::RunSession>(req);
}

Run::~Run() = default;

bool Run::is_launcher() const { return !impl_->session->is_rank(); }
int Run::launcher_exit_code() const { return impl_->session->launcher_exit_code(); }

FitResult Run::fit() {
  auto& s = impl_->rank_session();
  const auto outcome = s.fit();
  FitResult r;
  r.run_dir = s.run_dir().string();
  r.already_finished = outcome.already_finished;
  r.stop_signal = outcome.stop_signal;
  auto& loop = s.loop();
  r.epochs_done = loop.current_epoch();
  r.global_step = loop.global_step();
  for (const auto& [k, v] : loop.metrics().callback_metrics()) r.metrics.emplace_back(k, v);
  r.best_checkpoint = loop.locate_checkpoint("best");
  r.last_checkpoint = loop.locate_checkpoint("last");
  return r;
}

MetricList Run::validate(const std::string& checkpoint) { return impl_->rank_session().validate(checkpoint); }
MetricList Run::test(const std::string& checkpoint) { return impl_->rank_session().test(checkpoint); }
std::string Run::predict(const std::string& checkpoint) { return impl_->rank_session().predict(checkpoint).string(); }
void Run::finish() {
  if (impl_->session->is_rank()) impl_->session->finish("success");
}
std::string Run::run_dir() const { return impl_->session->run_dir().string(); }
int64_t Run::rank() const { return impl_->rank_session().loop().rank(); }
int64_t Run::world_size() const { return impl_->rank_session().loop().world_size(); }
ITrainer& Run::trainer() { return impl_->rank_session().loop(); }

// ---------------------------------------------------------------------------------------------

ModuleModel::ModuleModel(std::shared_ptr<torch::nn::Module> module, LossFn loss, MetricsFn metrics, PredictFn predict,
                         bool predicts_classes)
    : module_(std::move(module)),
      loss_(std::move(loss)),
      metrics_(std::move(metrics)),
      predict_(std::move(predict)),
      predicts_classes_(predicts_classes) {
  if (!module_) throw RunError("ModuleModel: no module given");
  if (!loss_) throw RunError("ModuleModel: no loss function given");
}

void* ModuleModel::query_interface(const char* iid) {
  return predict_ && std::string_view(iid) == kPredictingModelIid ? static_cast<IPredictingModel*>(this) : nullptr;
}

at::Tensor ModuleModel::training_step(const Batch& batch, IStepContext& ctx) {
  at::Tensor loss = loss_(*module_, batch);
  LogOptions o;  // per step and as the epoch mean, on the progress line (train_loss_step/_epoch)
  o.on_step = 1;
  o.on_epoch = 1;
  o.prog_bar = true;
  o.sync_dist = true;
  ctx.log("train_loss", loss.detach(), o);
  return loss;
}

void ModuleModel::evaluate(const Batch& batch, IStepContext& ctx, const char* prefix) {
  LogOptions o;  // epoch means over every rank's samples
  o.on_step = 0;
  o.on_epoch = 1;
  o.prog_bar = true;
  o.sync_dist = true;
  ctx.log(std::string(prefix) + "_loss", loss_(*module_, batch).detach(), o);
  if (metrics_)
    for (auto& [name, value] : metrics_(*module_, batch)) ctx.log(std::string(prefix) + "_" + name, value.detach(), o);
}

void ModuleModel::validation_step(const Batch& batch, IStepContext& ctx) { evaluate(batch, ctx, "val"); }
void ModuleModel::test_step(const Batch& batch, IStepContext& ctx) { evaluate(batch, ctx, "test"); }

// ---------------------------------------------------------------------------------------------

TensorData::TensorData(std::vector<at::Tensor> train, std::vector<at::Tensor> val, std::vector<at::Tensor> test)
    : train_(std::move(train)), val_(std::move(val)), test_(std::move(test)) {
  for (const auto* s : {&train_, &val_, &test_})
    for (const auto& t : *s) {
      if (!t.defined() || t.dim() == 0) throw RunError("TensorData: every tensor needs a first (sample) dimension");
      if (t.size(0) != (*s)[0].size(0))
        throw RunError("TensorData: tensors of a split differ in their number of samples (" + std::to_string((*s)[0].size(0)) +
                       " vs " + std::to_string(t.size(0)) + ")");
    }
}

const std::vector<at::Tensor>& TensorData::split(Split s) const {
  return s == Split::train ? train_ : s == Split::val ? val_ : test_;
}

int64_t TensorData::size(Split s) const {
  const auto& t = split(s);
  return t.empty() ? 0 : t[0].size(0);
}

Batch TensorData::get_batch(Split s, const int64_t* indices, int64_t count) const {
  const auto index = at::from_blob(const_cast<int64_t*>(indices), {count}, at::kLong);
  Batch b;
  b.size = count;
  for (const auto& t : split(s)) b.tensors.push_back(t.index_select(0, index.to(t.device())));
  return b;
}

}  // namespace ember
