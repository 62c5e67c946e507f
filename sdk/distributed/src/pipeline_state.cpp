#include "ember/distributed/pipeline_state.h"

#include <ember/error.h>
#include <ember/model_units.h>
#include <ember/support/optimizer_state_tensors.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>

namespace ember_dist {

namespace {

std::string pickled(const c10::IValue& value) {
  const std::vector<char> bytes = torch::pickle_save(value);
  return std::string(bytes.begin(), bytes.end());
}
c10::IValue unpickled(const std::string& bytes) { return torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end())); }

// While it lives the optimizer's groups are widened to the whole model's (widen_groups); then its
// own groups come back and the stand-ins' state goes.
struct WidenedGroups {
  torch::optim::Optimizer& optimizer;
  std::vector<std::vector<at::Tensor>> own;
  std::vector<at::Tensor> stand_ins;
  explicit WidenedGroups(torch::optim::Optimizer& o) : optimizer(o) {}
  WidenedGroups(const WidenedGroups&) = delete;
  WidenedGroups& operator=(const WidenedGroups&) = delete;
  ~WidenedGroups() {
    for (const auto& s : stand_ins) optimizer.state().erase(s.unsafeGetTensorImpl());
    for (size_t g = 0; g < own.size(); ++g) optimizer.param_groups()[g].params() = own[g];
  }
};

}  // namespace

PipelineState::PipelineState(ember_dist::DeviceMesh& mesh, const ember::PipelineOptions& options) : mesh_(mesh), options_(options) {
  const int64_t p = mesh_.pipeline_size();
  if (!ember_dist::parse_schedule(options_.schedule, &kind_))
    throw ember::ConfigError(options_.where_schedule + ": parallelism.schedule = \"" + options_.schedule +
                             "\" is not a pipeline schedule: use \"gpipe\", \"1f1b\" or \"interleaved_1f1b\"");
  virtual_stages_ = options_.virtual_stages;
  if (kind_ == ember_dist::PipelineScheduleKind::interleaved_1f1b && virtual_stages_ < 2)
    throw ember::ConfigError(options_.where_virtual_stages + ": parallelism.virtual_stages = " + std::to_string(virtual_stages_) +
                             " with schedule = \"interleaved_1f1b\": the interleaved schedule needs 2 or more stages per rank");
  if (kind_ != ember_dist::PipelineScheduleKind::interleaved_1f1b && virtual_stages_ != 1)
    throw ember::ConfigError(options_.where_virtual_stages + ": parallelism.virtual_stages = " + std::to_string(virtual_stages_) +
                             " needs schedule = \"interleaved_1f1b\" (" + options_.schedule + " runs one stage per rank)");
  microbatches_ = options_.microbatches > 0 ? options_.microbatches : p;
  if (kind_ == ember_dist::PipelineScheduleKind::interleaved_1f1b && microbatches_ % p != 0)
    throw ember::ConfigError(options_.where_microbatches + ": parallelism.microbatches = " + std::to_string(microbatches_) +
                             " with schedule = \"interleaved_1f1b\" must be a multiple of pipeline_parallel = " + std::to_string(p));
}

std::vector<ember::UnitRange> PipelineState::plan(ember::IModel& model) {
  const int64_t p = mesh_.pipeline_size(), stages = p * virtual_stages_;
  const std::string who = "the model";
  const std::string degrees = "parallelism.pipeline_parallel = " + std::to_string(p) +
                              (virtual_stages_ > 1 ? " x virtual_stages = " + std::to_string(virtual_stages_) : std::string());
  model_ = static_cast<ember::IPipelineModel*>(model.query_interface(ember::kPipelineModelIid));
  auto* units = static_cast<ember::IUnitModel*>(model.query_interface(ember::kUnitModelIid));
  if (!model_ || !units)
    throw ember::ConfigError(options_.where_pipeline_parallel + ": " + degrees + ": " + who +
                             " cannot be cut into pipeline stages (it does not implement ember::IPipelineModel); set pipeline_parallel "
                             "= 1, or use a model that can (transformer, gpt; docs/parallelism.md)");
  const int64_t n = units->num_units();
  if (stages > n)
    throw ember::ConfigError(options_.where_pipeline_parallel + ": " + degrees + " = " + std::to_string(stages) + " stages, but " +
                             who + " has " + std::to_string(n) + " unit" + (n == 1 ? "" : "s") +
                             " and a stage holds at least one: use at most " + std::to_string(n) + " stages");
  std::vector<int64_t> sizes = options_.stage_units;
  if (!sizes.empty()) {
    const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
    const bool positive = std::all_of(sizes.begin(), sizes.end(), [](int64_t s) { return s >= 1; });
    if (static_cast<int64_t>(sizes.size()) != stages || total != n || !positive)
      throw ember::ConfigError(options_.where_stage_units + ": parallelism.stage_units lists " + std::to_string(sizes.size()) +
                               " stages of " + std::to_string(total) + " units; the run has " + std::to_string(stages) +
                               " stages and " + who + " " + std::to_string(n) +
                               " units: give one count (>= 1) per stage, summing to the units");
  } else {
    std::vector<int64_t> weights;
    for (int64_t u = 0; u < n; ++u) {
      int64_t w = 0;
      for (const auto& t : units->unit_module(u).parameters()) w += t.numel();
      weights.push_back(std::max<int64_t>(w, 1));
    }
    sizes = ember_dist::balance_stages(weights, stages);
  }
  std::vector<ember::UnitRange> ranges;
  for (int64_t s = 0, begin = 0; s < stages; begin += sizes[static_cast<size_t>(s)], ++s)
    ranges.push_back({begin, begin + sizes[static_cast<size_t>(s)]});
  return ranges;
}

std::vector<ember::UnitRange> PipelineState::stages_of_this_rank(ember::IModel& model) {
  const auto ranges = plan(model);
  const int64_t p = mesh_.pipeline_size();
  std::vector<ember::UnitRange> mine;
  for (int64_t c = 0; c < virtual_stages_; ++c) mine.push_back(ranges[static_cast<size_t>(c * p + mesh_.pipeline_rank())]);
  return mine;
}

void PipelineState::cut_shapes(ember::IModel& model) {
  const auto mine = stages_of_this_rank(model);
  model_->keep_pipeline_stages(mine);
  model_ = nullptr;  // that model is destroyed next; cut() finds the real one
}

void PipelineState::cut(ember::IModel& model, const std::string& strategy, ember::IHost& host) {
  const auto ranges = plan(model);
  auto* units = static_cast<ember::IUnitModel*>(model.query_interface(ember::kUnitModelIid));
  auto& module = model.module();
  int64_t k = 0;
  for (const auto& t : module.named_parameters()) order_.emplace(t.key(), k++);
  for (const auto& t : module.named_buffers()) order_.emplace(t.key(), k++);
  for (auto& name : model_->pipeline_shared_parameters()) shared_.push_back({std::move(name), {}, at::kFloat});
  runner_ = std::make_unique<ember_dist::PipelineRunner>(mesh_.pipeline(), kind_, microbatches_, ranges);
  model_->keep_pipeline_stages(runner_->my_stages());
  module_ = &module;
  host.log(ember::LogLevel::info, strategy + ": " + runner_->describe([&](int64_t u) { return units->unit_name(u); }) + "; this rank holds " +
                                      std::to_string(ember_dist::parameter_elements(module)) + " parameter elements");
}

void PipelineState::set_optimizer(torch::optim::Optimizer& optimizer, const std::vector<ember::NamedTensor>& trained) {
  trained_.clear();
  for (const auto& t : trained) {
    trained_.emplace(t.tensor.unsafeGetTensorImpl(), t.name);
    if (!device_) device_ = t.tensor.device();
  }
  const auto& names = trained_;
  c10::impl::GenericList mine(c10::ListType::create(c10::StringType::get()));
  for (auto& group : optimizer.param_groups()) {
    c10::List<std::string> g;
    for (const auto& t : group.params()) g.push_back(names.at(t.unsafeGetTensorImpl()));
    mine.push_back(g);
  }
  const auto all = mesh_.pipeline().all_gather_bytes(pickled(mine));
  groups_.assign(optimizer.param_groups().size(), {});
  for (size_t r = 0; r < all.size(); ++r) {
    const auto list = unpickled(all[r]).toList();
    if (list.size() != groups_.size())
      throw ember::RunError("pipeline: the optimizer has " + std::to_string(groups_.size()) + " parameter groups on pipeline stage " +
                            std::to_string(mesh_.pipeline_rank()) + " and " + std::to_string(list.size()) + " on stage " +
                            std::to_string(r) + ": under pipeline parallelism every stage's configure_optimizers must build the same groups");
    for (size_t g = 0; g < list.size(); ++g)
      for (const c10::IValue name : list.get(g).toList()) groups_[g].push_back(name.toStringRef());
  }
  for (auto& g : groups_) {
    std::sort(g.begin(), g.end(), [&](const std::string& a, const std::string& b) { return order_.at(a) < order_.at(b); });
    g.erase(std::unique(g.begin(), g.end()), g.end());  // a shared parameter once
  }
  // Every rank learns each shared parameter's shape (after any tensor-parallel split) from a stage
  // that holds it.
  if (shared_.empty()) return;
  auto params = module_->named_parameters();
  c10::impl::GenericDict held(c10::StringType::get(), c10::AnyType::get());
  for (const auto& s : shared_)
    if (const at::Tensor* p = params.find(s.name)) held.insert(s.name, at::empty(p->sizes(), p->options().device(at::kCPU)));
  for (const auto& bytes : mesh_.pipeline().all_gather_bytes(pickled(held))) {
    const auto d = unpickled(bytes).toGenericDict();
    for (auto& s : shared_)
      if (s.shape.empty() && d.contains(s.name)) {
        const at::Tensor t = d.at(s.name).toTensor();
        s.shape = t.sizes().vec();
        s.dtype = t.scalar_type();
      }
  }
  for (const auto& s : shared_)
    if (s.shape.empty())
      throw ember::RunError("pipeline: the model names '" + s.name + "' as shared by pipeline stages, but no stage holds it (a model bug)");
  // Counted in the norm by the first stage only.
  if (mesh_.pipeline_rank() != 0)
    for (const auto& [impl, name] : trained_)
      for (const auto& s : shared_)
        if (s.name == name) not_in_norm_.insert(impl);
}

void PipelineState::sum_shared_gradients() {
  at::NoGradGuard no_grad;
  auto params = module_->named_parameters();
  for (const auto& s : shared_) {
    at::Tensor* p = params.find(s.name);
    at::Tensor g = p && p->grad().defined() ? p->grad().contiguous() : at::zeros(s.shape, at::TensorOptions().dtype(s.dtype));
    mesh_.pipeline().all_reduce(g, ember::ReduceOp::sum, "shared gradient " + s.name);
    if (p) p->mutable_grad() = g;
  }
}

bool PipelineState::counted_in_norm(const at::Tensor& trained) const { return not_in_norm_.count(trained.unsafeGetTensorImpl()) == 0; }

double PipelineState::theoretical_bubble() const {
  return ember_dist::theoretical_bubble(kind_, mesh_.pipeline_size(), microbatches_, virtual_stages_);
}

std::string PipelineState::describe_stats() const {
  if (!runner_ || runner_->stats().batches == 0) return "";
  const auto& p = runner_->stats();
  char line[256];
  std::snprintf(line, sizeof(line), "; pipeline: %lld training batches, %.1f%% of their time waiting for other stages (the schedule's bubble in theory: %.1f%%)",
                static_cast<long long>(p.batches), 100.0 * p.waiting / std::max(p.seconds, 1e-12), 100.0 * theoretical_bubble());
  return line;
}

at::Tensor PipelineState::sum_over_stages(const at::Tensor& squared) {
  at::Tensor t = squared.to(at::kFloat).reshape({1}).contiguous();
  mesh_.pipeline().all_reduce(t, ember::ReduceOp::sum, "gradient norm");
  return t.reshape({});
}

c10::Dict<std::string, at::Tensor> PipelineState::merge_model_state(const c10::Dict<std::string, at::Tensor>& part, bool build, bool all) {
  c10::Dict<std::string, at::Tensor> out;
  if (!all && !in_rank0_group()) return out;
  const auto parts = mesh_.pipeline().all_gather_bytes(pickled(part));
  if (!build) return out;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& bytes : parts)
    for (const auto& e : unpickled(bytes).toGenericDict()) tensors.emplace_back(e.key().toStringRef(), e.value().toTensor());
  std::stable_sort(tensors.begin(), tensors.end(), [&](const auto& a, const auto& b) { return order_.at(a.first) < order_.at(b.first); });
  for (auto& [name, t] : tensors)
    if (!out.contains(name)) out.insert(name, t);  // a shared parameter: the first stage's copy
  return out;
}

std::vector<std::vector<at::Tensor>> PipelineState::widen_groups(torch::optim::Optimizer& optimizer, std::vector<at::Tensor>* stand_ins) {
  std::map<std::string, at::Tensor> own;
  for (auto& group : optimizer.param_groups())
    for (const auto& t : group.params()) own.emplace(trained_.at(t.unsafeGetTensorImpl()), t);
  std::vector<std::vector<at::Tensor>> saved;
  for (size_t g = 0; g < groups_.size(); ++g) {
    auto& params = optimizer.param_groups()[g].params();
    saved.push_back(params);
    std::vector<at::Tensor> wide;
    for (const auto& name : groups_[g]) {
      auto it = own.find(name);
      if (it != own.end()) wide.push_back(it->second);
      else {
        wide.push_back(at::empty({0}));
        stand_ins->push_back(wide.back());
      }
    }
    params = wide;
  }
  return saved;
}

std::string PipelineState::full_optimizer_state(torch::optim::Optimizer& optimizer, bool build, bool all,
                                                const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& whole_field) {
  // This stage's state, whole (every rank: the gathers are collective), by name.
  const auto& names = trained_;
  c10::impl::GenericDict mine(c10::StringType::get(), c10::AnyType::get());
  std::map<const void*, std::map<std::string, at::Tensor>> whole;
  torch::optim::OptimizerParamState* model_state = nullptr;
  for (auto& group : optimizer.param_groups())
    for (auto& t : group.params()) {
      auto it = optimizer.state().find(t.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;
      if (!model_state) model_state = it->second.get();
      c10::Dict<std::string, at::Tensor> fields;
      ember::for_each_state_tensor(*it->second, [&](const char* field, at::Tensor& value) {
        at::Tensor w = whole_field(t, value);
        whole[t.unsafeGetTensorImpl()][field] = w;
        fields.insert(field, w.detach().to(at::kCPU));
      });
      mine.insert(names.at(t.unsafeGetTensorImpl()), fields);
    }
  if (!all && !in_rank0_group()) return "";
  const auto parts = mesh_.pipeline().all_gather_bytes(pickled(mine));
  if (!build) return "";
  std::map<std::string, c10::Dict<c10::IValue, c10::IValue>> remote;
  for (size_t r = 0; r < parts.size(); ++r) {
    if (static_cast<int64_t>(r) == mesh_.pipeline_rank()) continue;
    for (const auto& e : unpickled(parts[r]).toGenericDict()) remote.emplace(e.key().toStringRef(), e.value().toGenericDict());
  }
  if (!remote.empty() && !model_state)
    throw ember::RunError("pipeline: stage " + std::to_string(mesh_.pipeline_rank()) +
                          " holds no optimizer state while other stages do: cannot write the whole optimizer state");
  // Own parameters with their whole fields; a stand-in for each other stage's parameter gets a copy
  // of this stage's state object (same optimizer, same step count) holding that parameter's fields.
  std::vector<std::pair<at::Tensor*, at::Tensor>> swapped;
  for (auto& [impl, fields] : whole) {
    auto& state = *optimizer.state().at(const_cast<void*>(impl));
    ember::for_each_state_tensor(state, [&](const char* field, at::Tensor& value) {
      swapped.emplace_back(&value, value);
      value = fields.at(field);
    });
  }
  std::string bytes;
  try {
    bytes = save_over_whole_model(optimizer, [&](const std::string& name) -> std::unique_ptr<torch::optim::OptimizerParamState> {
      auto it = remote.find(name);
      if (it == remote.end()) return nullptr;
      auto state = model_state->clone();
      ember::for_each_state_tensor(*state, [&](const char* field, at::Tensor& value) {
        if (!it->second.contains(field))
          throw ember::RunError("pipeline: the stages disagree on the optimizer's state fields ('" + std::string(field) + "' of '" + name + "')");
        value = it->second.at(field).toTensor();
      });
      return state;
    });
  } catch (...) {
    for (auto& [field, value] : swapped) *field = value;
    throw;
  }
  for (auto& [field, value] : swapped) *field = value;
  return bytes;
}

std::string PipelineState::save_over_whole_model(
    torch::optim::Optimizer& optimizer,
    const std::function<std::unique_ptr<torch::optim::OptimizerParamState>(const std::string& name)>& stand_in_state) {
  WidenedGroups widened(optimizer);
  widened.own = widen_groups(optimizer, &widened.stand_ins);
  std::set<std::string> own;
  for (const auto& [impl, name] : trained_) own.insert(name);
  size_t k = 0;
  for (const auto& g : groups_)
    for (const auto& name : g) {
      if (own.count(name)) continue;
      const at::Tensor& stand_in = widened.stand_ins[k++];
      if (auto state = stand_in_state(name)) optimizer.state()[stand_in.unsafeGetTensorImpl()] = std::move(state);
    }
  std::ostringstream out;
  torch::save(optimizer, out);
  return out.str();
}

std::string PipelineState::optimizer_over_whole_model(torch::optim::Optimizer& optimizer) {
  // Which parameters hold state on some stage (a frozen one never does).
  c10::impl::GenericList mine(c10::StringType::get());
  torch::optim::OptimizerParamState* model_state = nullptr;
  for (auto& group : optimizer.param_groups())
    for (auto& t : group.params()) {
      auto it = optimizer.state().find(t.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;
      if (!model_state) model_state = it->second.get();
      mine.push_back(trained_.at(t.unsafeGetTensorImpl()));
    }
  std::set<std::string> with_state;
  for (const auto& bytes : mesh_.pipeline().all_gather_bytes(pickled(mine)))
    for (const c10::IValue name : unpickled(bytes).toList()) with_state.insert(name.toStringRef());
  return save_over_whole_model(optimizer, [&](const std::string& name) -> std::unique_ptr<torch::optim::OptimizerParamState> {
    if (!with_state.count(name)) return nullptr;
    if (!model_state)
      throw ember::RunError("pipeline: stage " + std::to_string(mesh_.pipeline_rank()) +
                            " holds no optimizer state while other stages do: cannot write the optimizer's layout");
    return model_state->clone();
  });
}

void PipelineState::load_full_optimizer_state(torch::optim::Optimizer& optimizer, const std::string& bytes,
                                              const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& to_part) {
  {
    WidenedGroups widened(optimizer);
    widened.own = widen_groups(optimizer, &widened.stand_ins);
    std::istringstream in(bytes);
    optimizer.state().clear();
    torch::load(optimizer, in, device_);
  }
  at::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups())
    for (auto& t : group.params()) {
      auto it = optimizer.state().find(t.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;
      ember::for_each_state_tensor(*it->second, [&](const char*, at::Tensor& field) { field = to_part(t, field); });
    }
}

}  // namespace ember_dist
