// sharded: ZeRO / FSDP data parallel (docs/strategy.md). Multi-process like ddp (same launch,
// rendezvous, timeouts and collectives: plugins/strategies/common), and it owns the model's state
// through strategy contract 2:
//   stage 1  the optimizer state is sharded: each rank steps its 1/N of every parameter; gradients
//            stay whole until the updating micro-batch, then are reduce-scattered;
//   stage 2  + gradients are reduce-scattered on every micro-batch as backward produces them and
//            only this rank's shard is kept;
//   stage 3  + parameters are sharded: a unit's parameters are all-gathered just before its
//            forward (the next unit's prefetched), freed after it, gathered again before its
//            backward and freed once its gradients are reduce-scattered.
// Stages 1 and 2 all-gather the updated shards into the whole parameters after every step.
#include <ember/error.h>
#include <ember/grad_util.h>
#include <ember/model.h>
#include <ember/model_units.h>
#include <ember/plugin.h>
#include <ember/strategy.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <sstream>
#include <unordered_map>

#include "communicator.h"
#include "optimizer_state_tensors.h"
#include "shard_layout.h"

namespace {

using namespace ember_dist;
using namespace ember_sharded;

constexpr EmberConfigKey kKeys[] = {
    EMBER_DIST_CONFIG_KEYS,
    ember::key::Int("stage", "3",
                    "ZeRO stage: 1 shards the optimizer state, 2 also the gradients, 3 also the parameters (FSDP's FULL_SHARD).")
        .at_least(1)
        .at_most(3),
    ember::key::Float("bucket_cap_mb", "25.0",
                      "Parameters that belong to no unit of the model are reduce-scattered (and, under stage 3, gathered) in "
                      "groups of about this many megabytes.")
        .above(0.0),
    ember::key::Bool("prefetch", "true",
                     "Stage 3: start the all-gather of the next unit (in forward) or the previous one (in backward) while the current one runs."),
    ember::key::Int("auto_wrap_min_params", "0",
                    "A unit the model declares with fewer parameters than this is not sharded on its own: it joins the parameters "
                    "gathered for the whole step (FSDP's size-based auto-wrap policy, DeepSpeed's persistence threshold).")
        .at_least(0),
    ember::key::String("state_dict_type", "\"full\"",
                       "Checkpoints as one file gathered on rank 0 (full: what single_device writes and reads) or as a directory "
                       "with one part per rank (sharded: nothing is gathered; resumable on any number of ranks; "
                       "`engine checkpoint consolidate DIR OUT.ckpt` makes the full file).")
        .choices("full|sharded"),
    ember::key::Bool("broadcast_buffers", "true",
                     "Every rank takes rank 0's buffers (batch-norm statistics) before each forward in training mode, and once before "
                     "evaluating after one (PyTorch DDP's broadcast_buffers), so all ranks evaluate with the same statistics."),
};

constexpr size_t kNone = std::numeric_limits<size_t>::max();

class Sharded;

// The engine's optimizer step with the strategy's part added: after the closure's backward, every
// rank agrees whether any gradient is non-finite (a rank sees only its shard, and amp16 must skip
// the step on all ranks or none).
class ShardedStep final : public ember::IOptimizerStep {
 public:
  ShardedStep(ember::IOptimizerStep& inner, Sharded& strategy) : inner_(inner), s_(strategy) {}
  at::Tensor closure() override;
  void before_step() override { inner_.before_step(); }
  void step() override { inner_.step(); }
  torch::optim::Optimizer& optimizer() override { return inner_.optimizer(); }

 private:
  ember::IOptimizerStep& inner_;
  Sharded& s_;
};

class Sharded final : public ember::IStrategy,
                      public ember::IModelStateStrategy,
                      public ember::IShardedCheckpoint,
                      public ember::IUnitHooks {
 public:
  Sharded(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        comm_("sharded", host, cfg),
        stage_(static_cast<int>(cfg.get_int("stage"))),
        bucket_cap_bytes_(std::max<int64_t>(1, static_cast<int64_t>(cfg.get_float("bucket_cap_mb") * 1024.0 * 1024.0))),
        prefetch_(cfg.get_bool("prefetch")),
        min_unit_params_(cfg.get_int("auto_wrap_min_params")),
        buffers_(cfg.get_bool("broadcast_buffers")),
        sharded_checkpoints_(cfg.get_string("state_dict_type") == "sharded") {}

  // The model may be gone by now (plugins are destroyed in reverse order of their kinds): the
  // unit hooks were taken back in teardown().
  ~Sharded() override { teardown(); }

  void* query_interface(const char* iid) override {
    if (std::strcmp(iid, ember::kModelStateStrategyIid) == 0) return static_cast<ember::IModelStateStrategy*>(this);
    if (std::strcmp(iid, ember::kShardedCheckpointIid) == 0) return static_cast<ember::IShardedCheckpoint*>(this);
    return nullptr;
  }

  // ---- IStrategy ----
  bool launch(const ember::LaunchRequest& request, int* exit_code) override { return comm_.launch(request, exit_code); }
  c10::Device root_device() const override { return comm_.device(); }
  int64_t rank() const override { return comm_.rank(); }
  int64_t world_size() const override { return comm_.world(); }
  int64_t local_rank() const override { return comm_.info().local_rank; }

  void setup(torch::nn::Module& /*module*/, std::shared_ptr<torch::optim::Optimizer>& /*optimizer*/) override {
    throw ember::RunError("sharded needs an engine with strategy contract 2 (SDK 1.2 or newer): upgrade the engine");
  }

  ember::Batch batch_to_device(ember::Batch batch) override { return comm_.batch_to_device(std::move(batch)); }

  void backward(const at::Tensor& loss, ember::IPrecision& precision, bool sync_gradients) override {
    // Stage 1 keeps whole gradients until the updating micro-batch; stages 2 and 3 keep only
    // their shard, so every micro-batch reduce-scatters.
    syncing_ = stage_ >= 2 || sync_gradients;
    begin_backward();
    try {
      precision.backward(loss);
    } catch (...) {
      abandon_backward();
      throw;
    }
    end_backward();
  }

  bool optimizer_step(ember::IOptimizerStep& step, ember::IPrecision& precision) override {
    ShardedStep wrapped(step, *this);
    const bool taken = precision.optimizer_step(wrapped);
    // Stages 1 and 2 keep whole parameters for the next forward: gather the updated shards.
    if (stage_ < 3 && taken) gather_all_into_parameters();
    return taken;
  }

  // Clipping by norm needs the norm over all shards: the local sum of squares is all-reduced.
  void clip_gradients(torch::optim::Optimizer& optimizer, double max, ember::ClipAlgorithm algorithm) override {
    auto grads = ember::grads_of(optimizer);
    if (algorithm == ember::ClipAlgorithm::value) {
      for (const auto& g : grads) g.clamp_(-max, max);
      return;
    }
    at::Tensor sumsq = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(comm_.device()));
    for (const auto& g : grads)
      if (g.numel() > 0) sumsq += g.detach().to(at::kDouble).pow(2).sum();
    comm_.label("gradient norm");
    std::vector<at::Tensor> v{sumsq};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    comm_.backend().allreduce(v, opts)->wait();
    auto coef = (max / (sumsq.sqrt() + 1e-6)).clamp_max(1.0);
    for (const auto& g : grads) g.mul_(coef.to(g.scalar_type()));
  }

  at::Tensor reduce(const at::Tensor& value, ember::ReduceOp op) override { return comm_.reduce(value, op); }
  void barrier(const char* name) override { comm_.barrier(name); }
  bool broadcast_flag(bool value) override { return comm_.broadcast_flag(value); }

  void teardown() override {
    if (units_) {
      units_->set_unit_hooks(nullptr);
      units_ = nullptr;
    }
    std::string line;
    if (!params_.empty())
      line = "sharded: stage " + std::to_string(stage_) + ", " + std::to_string(groups_.size()) + " groups, " +
             std::to_string(stats_.gathers) + " all-gathers (" + std::to_string(stats_.prefetched) + " prefetched), " +
             std::to_string(stats_.scatters) + " reduce-scatters (" + std::to_string(stats_.scatters_early) +
             " started while backward was still running)";
    comm_.teardown(line);
  }

  c10::IValue state_dict() const override {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert("world_size", static_cast<int64_t>(comm_.world()));
    d.insert("stage", static_cast<int64_t>(stage_));
    return d;
  }
  void load_state_dict(const c10::IValue& state) override {
    if (!state.isGenericDict()) return;
    auto d = state.toGenericDict();
    if (d.contains("world_size") && d.at("world_size").toInt() != comm_.world())
      host_.log(ember::LogLevel::info, "sharded: the checkpoint was written by " + std::to_string(d.at("world_size").toInt()) +
                                           " ranks and is re-sharded onto " + std::to_string(comm_.world()) +
                                           "; each rank's share of the data differs from here on");
  }

  // ---- strategy contract 2 ----
  void setup_module(ember::IModel& model) override;
  std::shared_ptr<torch::optim::Optimizer> setup_optimizer(ember::IOptimizerFactory& factory) override {
    std::vector<ember::NamedTensor> named;
    for (const auto& p : params_) named.push_back({p.name, p.shard});
    optimizer_ = factory.build(named);
    for (auto& group : optimizer_->param_groups())
      for (auto& t : group.params())
        if (!param_of_shard_.count(t.unsafeGetTensorImpl()))
          throw ember::RunError("sharded: the optimizer holds a tensor that is not one of this strategy's shards (a bug)");
    return optimizer_;
  }

  void forward_begin(bool grad_enabled) override {
    buffers_.before_forward(*module_, comm_);
    forward_grad_ = grad_enabled;
    if (stage_ == 3)
      for (size_t g = 0; g < groups_.size(); ++g)
        if (groups_[g].unit < 0) materialize(g);
  }
  void forward_end() override {
    // Without a backward to come, what no unit holds is freed now; otherwise after backward.
    if (stage_ == 3 && !forward_grad_) release_all();
  }

  void zero_grad() override {
    for (auto& p : params_) {
      if (p.shard.grad().defined()) p.shard.mutable_grad() = at::Tensor();
      if (p.param.grad().defined()) p.param.mutable_grad() = at::Tensor();
    }
  }

  std::vector<ember::NamedTensor> trained_parameters() override {
    std::vector<ember::NamedTensor> out;
    for (const auto& p : params_) out.push_back({p.name, p.shard});
    return out;
  }
  void parameters_changed() override {
    if (stage_ < 3) gather_all_into_parameters();
    else release_all();
  }

  c10::Dict<std::string, at::Tensor> full_model_state(bool rank0_only) override;
  void load_full_model_state(const c10::Dict<std::string, at::Tensor>& state) override;
  std::string full_optimizer_state(bool rank0_only) override;
  void load_full_optimizer_state(const std::string& bytes) override;

  // ---- sharded checkpoints ----
  bool sharded_checkpoints() const override { return sharded_checkpoints_; }
  c10::IValue sharded_state() override;
  void load_sharded_state(int64_t saved_world, const std::function<c10::IValue(int64_t)>& read_part) override;

  // ---- IUnitHooks (stage 3) ----
  void before_unit_forward(int64_t unit) override {
    const size_t g = group_of_unit(unit);
    if (g == kNone) return;
    materialize(g);
    if (prefetch_) prefetch_unit(unit + 1);
  }
  void after_unit_forward(int64_t unit) override {
    const size_t g = group_of_unit(unit);
    if (g != kNone) release(g);
  }
  void before_unit_backward(int64_t unit) override {
    const size_t g = group_of_unit(unit);
    if (g == kNone) return;
    materialize(g);
    if (prefetch_) prefetch_unit(unit - 1);
  }

  // Called by ShardedStep after the closure: every rank learns whether some rank's shard holds a
  // non-finite gradient, and then every rank's gradients say so (the precision handler checks
  // only what it sees).
  void agree_on_finite() {
    if (comm_.world() == 1) return;
    std::vector<at::Tensor> grads;
    for (auto& p : params_)
      if (p.shard.grad().defined() && p.shard.numel() > 0) grads.push_back(p.shard.grad());
    at::Tensor flag = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(comm_.device()));
    if (!grads.empty()) {
      auto norms = at::stack(at::_foreach_norm(grads, 1)).to(at::kFloat);
      flag = at::logical_not(at::isfinite(norms.sum())).to(at::kFloat).reshape({1});
    }
    comm_.label("non-finite gradient vote");
    std::vector<at::Tensor> v{flag};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MAX;
    comm_.backend().allreduce(v, opts)->wait();
    if (flag.item<float>() > 0 && !grads.empty()) grads.front().view(-1)[0].fill_(std::numeric_limits<float>::infinity());
  }

 private:
  friend class ShardedStep;
  struct Stats {
    int64_t gathers = 0, prefetched = 0, scatters = 0, scatters_early = 0;
  };

  size_t group_of_unit(int64_t unit) const {
    if (unit < 0 || unit >= static_cast<int64_t>(unit_group_.size())) return kNone;
    return unit_group_[static_cast<size_t>(unit)];
  }

  void build_groups(ember::IModel& model);
  void hook_gradients();

  // ---- all-gather ----
  void start_gather(size_t g) {
    auto& grp = groups_[g];
    if (grp.gather_work) return;
    at::NoGradGuard no_grad;
    const auto& first = params_[grp.params.front()];
    grp.gather_in = at::zeros({grp.row}, first.shard.options().requires_grad(false));
    for (size_t k : grp.params) {
      const auto& p = params_[k];
      if (p.valid > 0) grp.gather_in.narrow(0, p.offset, p.valid).copy_(p.shard.detach());
    }
    grp.gather_out = at::empty({grp.row * comm_.world()}, grp.gather_in.options());
    comm_.label("all-gather of " + grp.name);
    grp.gather_work = comm_.backend()._allgather_base(grp.gather_out, grp.gather_in);
    ++stats_.gathers;
  }
  // Rank r's chunks of parameter p, joined: the whole tensor (a view into the gather buffer).
  at::Tensor whole_from_gather(const ShardGroup& grp, const ShardedParam& p) const {
    return grp.gather_out.view({comm_.world(), grp.row}).narrow(1, p.offset, p.chunk).reshape({-1}).narrow(0, 0, p.numel).view(p.shape);
  }
  void finish_gather(size_t g) {
    auto& grp = groups_[g];
    grp.gather_work->wait();
    at::NoGradGuard no_grad;
    for (size_t k : grp.params) {
      auto& p = params_[k];
      if (stage_ == 3) allocate_storage(p.param);
      unversioned_view(p.param).copy_(whole_from_gather(grp, p));
    }
    grp.gather_work.reset();
    grp.gather_in = grp.gather_out = at::Tensor();
    grp.materialized = true;
  }
  void materialize(size_t g) {
    if (groups_[g].materialized) return;
    start_gather(g);
    finish_gather(g);
  }
  void prefetch_unit(int64_t unit) {
    const size_t g = group_of_unit(unit);
    if (g == kNone || groups_[g].materialized || groups_[g].gather_work) return;
    start_gather(g);
    ++stats_.prefetched;
  }
  void release(size_t g) {
    auto& grp = groups_[g];
    if (stage_ < 3) return;
    if (grp.gather_work) {  // a prefetch nobody used: it still has to complete
      grp.gather_work->wait();
      grp.gather_work.reset();
      grp.gather_in = grp.gather_out = at::Tensor();
    }
    if (!grp.materialized) return;
    for (size_t k : grp.params) free_storage(params_[k].param);
    grp.materialized = false;
  }
  void release_all() {
    for (size_t g = 0; g < groups_.size(); ++g) release(g);
  }
  void gather_all_into_parameters() {
    for (size_t g = 0; g < groups_.size(); ++g) {
      groups_[g].materialized = false;
      start_gather(g);
    }
    for (size_t g = 0; g < groups_.size(); ++g) finish_gather(g);
  }

  // ---- reduce-scatter ----
  void begin_backward() {
    in_backward_ = true;
    next_ = 0;
    for (auto& grp : groups_) {
      grp.pending = 0;
      for (size_t k : grp.params)
        if (params_[k].trainable) ++grp.pending;
      grp.ready = grp.pending == 0;
      grp.launched = false;
      grp.scatter_work.reset();
    }
    pending_params_ = 0;
    for (const auto& p : params_)
      if (p.trainable) ++pending_params_;
  }
  void on_gradient_ready(size_t k) {
    if (!in_backward_ || !syncing_) return;
    auto& grp = groups_[params_[k].group];
    if (grp.ready) return;
    --pending_params_;
    if (--grp.pending == 0) grp.ready = true;
    // Strictly in the fixed order, the same on every rank.
    while (next_ < order_.size() && groups_[order_[next_]].ready) launch_scatter(order_[next_++]);
  }
  void launch_scatter(size_t g) {
    auto& grp = groups_[g];
    at::NoGradGuard no_grad;
    const int64_t world = comm_.world();
    const auto& first = params_[grp.params.front()];
    grp.scatter_in = at::zeros({world, grp.row}, first.param.options().requires_grad(false));
    for (size_t k : grp.params) {
      auto& p = params_[k];
      if (!p.trainable || !p.param.grad().defined()) continue;
      at::Tensor padded = at::zeros({world * p.chunk}, grp.scatter_in.options());
      padded.narrow(0, 0, p.numel).copy_(p.param.grad().reshape({-1}));
      grp.scatter_in.narrow(1, p.offset, p.chunk).copy_(padded.view({world, p.chunk}));
      // Stage 2 and 3 keep no whole gradient.
      if (stage_ >= 2) p.param.mutable_grad() = at::Tensor();
    }
    grp.scatter_out = at::empty({grp.row}, grp.scatter_in.options());
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::AVG;
    comm_.label("reduce-scatter of " + grp.name);
    at::Tensor flat = grp.scatter_in.view({-1});
    grp.scatter_work = comm_.backend()._reduce_scatter_base(grp.scatter_out, flat, opts);
    grp.launched = true;
    ++stats_.scatters;
    if (pending_params_ > 0) ++stats_.scatters_early;
    // Stage 3: this unit's backward is done, its parameters can go.
    if (stage_ == 3 && grp.unit >= 0) release(g);
  }
  void end_backward() {
    if (!syncing_) {
      in_backward_ = false;
      if (stage_ == 3) release_all();
      return;
    }
    // Groups whose parameters got no gradient (unused in this step) reduce zeros, in order.
    for (; next_ < order_.size(); ++next_) launch_scatter(order_[next_]);
    at::NoGradGuard no_grad;
    for (size_t g : order_) {
      auto& grp = groups_[g];
      grp.scatter_work->wait();
      for (size_t k : grp.params) {
        auto& p = params_[k];
        if (!p.trainable) continue;
        at::Tensor part = grp.scatter_out.narrow(0, p.offset, p.valid);
        if (stage_ == 1 && p.param.grad().defined() && p.param.grad().is_contiguous()) {
          // Stage 1 keeps whole gradients: this rank's reduced part goes into its own slice of
          // the whole gradient, and the shard's gradient is a view of that slice (no extra copy).
          at::Tensor mine = p.param.grad().view({-1}).narrow(0, std::min(comm_.rank() * p.chunk, p.numel), p.valid);
          mine.copy_(part);
          p.shard.mutable_grad() = mine;
        } else if (p.shard.grad().defined()) {
          p.shard.mutable_grad().add_(part);
        } else {
          p.shard.mutable_grad() = part.clone();
        }
      }
      grp.scatter_work.reset();
      grp.scatter_in = grp.scatter_out = at::Tensor();
    }
    in_backward_ = false;
    if (stage_ == 3) release_all();
  }
  void abandon_backward() {
    for (auto& grp : groups_)
      if (grp.scatter_work) grp.scatter_work->wait();
    in_backward_ = false;
    if (stage_ == 3) release_all();
  }

  // Whole value of one shard-shaped tensor (a parameter's shard, or an optimizer state field).
  at::Tensor gather_whole(const ShardedParam& p, const at::Tensor& part) {
    at::NoGradGuard no_grad;
    at::Tensor in = at::zeros({p.chunk}, part.options().requires_grad(false));
    if (p.valid > 0) in.narrow(0, 0, p.valid).copy_(part.detach().reshape({-1}));
    at::Tensor out = at::empty({p.chunk * comm_.world()}, in.options());
    comm_.label("gather of " + p.name);
    comm_.backend()._allgather_base(out, in)->wait();
    return out.narrow(0, 0, p.numel).view(p.shape);
  }
  // This rank's part of a whole tensor shaped like parameter p.
  at::Tensor my_part(const ShardedParam& p, const at::Tensor& whole) const {
    return whole.reshape({-1}).narrow(0, std::min(static_cast<int64_t>(comm_.rank()) * p.chunk, p.numel), p.valid);
  }

  ember::IHost& host_;
  Communicator comm_;
  int stage_;
  int64_t bucket_cap_bytes_;
  bool prefetch_;
  int64_t min_unit_params_;
  BufferBroadcast buffers_;
  bool sharded_checkpoints_;

  torch::nn::Module* module_ = nullptr;
  ember::IUnitModel* units_ = nullptr;
  std::vector<ShardedParam> params_;
  std::vector<ShardGroup> groups_;
  std::vector<size_t> unit_group_;  // unit -> its group (kNone: the unit is gathered with the step)
  std::vector<size_t> order_;       // reduce-scatter order: backward's
  std::unordered_map<const void*, size_t> param_of_shard_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  bool in_backward_ = false, syncing_ = false, forward_grad_ = false;
  size_t next_ = 0, pending_params_ = 0;
  Stats stats_;
};

at::Tensor ShardedStep::closure() {
  at::Tensor loss = inner_.closure();
  s_.agree_on_finite();
  return loss;
}

void Sharded::setup_module(ember::IModel& model) {
  module_ = &model.module();
  module_->to(comm_.device());
  comm_.broadcast_module_from_zero(*module_);  // every rank starts from rank 0's weights and buffers
  build_groups(model);
  const int64_t world = comm_.world(), rank = comm_.rank();
  at::NoGradGuard no_grad;
  for (auto& p : params_) {
    p.chunk = (p.numel + world - 1) / world;
    p.valid = std::clamp<int64_t>(p.numel - rank * p.chunk, 0, p.chunk);
    // Stages 1-2 keep whole parameters, so this rank's part is a view into its parameter (no
    // second copy; the step updates it in place, the all-gather after the step fills the rest).
    // Stage 3 frees the parameter: the part is a tensor of its own.
    at::Tensor part = p.param.detach().view({-1}).narrow(0, std::min(rank * p.chunk, p.numel), p.valid);
    p.shard = stage_ < 3 ? part : part.clone();
    p.shard.set_requires_grad(p.trainable);
    param_of_shard_[p.shard.unsafeGetTensorImpl()] = static_cast<size_t>(&p - params_.data());
  }
  for (auto& grp : groups_) {
    grp.row = 0;
    for (size_t k : grp.params) {
      params_[k].offset = grp.row;
      grp.row += params_[k].chunk;
    }
  }
  hook_gradients();
  if (stage_ == 3) {
    release_all();
    if (units_) units_->set_unit_hooks(this);
  }
  int64_t total = 0, mine = 0;
  for (const auto& p : params_) {
    total += p.numel;
    mine += p.valid;
  }
  host_.log(ember::LogLevel::info, "sharded: stage " + std::to_string(stage_) + ", " + std::to_string(params_.size()) +
                                       " parameters in " + std::to_string(groups_.size()) + " groups (" + std::to_string(unit_group_.size()) +
                                       " units declared by the model); this rank trains " + std::to_string(mine) + " of " +
                                       std::to_string(total) + " elements");
}

// Groups: one per unit the model declares (when it has at least auto_wrap_min_params), and the
// remaining parameters in runs of consecutive ones of about bucket_cap_mb.
void Sharded::build_groups(ember::IModel& model) {
  std::unordered_map<const void*, size_t> index_of;
  for (const auto& item : module_->named_parameters()) {
    ShardedParam p;
    p.name = item.key();
    p.param = item.value();
    p.shape = p.param.sizes().vec();
    p.numel = p.param.numel();
    p.trainable = p.param.requires_grad();
    if (!p.param.is_contiguous())
      throw ember::RunError("sharded: parameter '" + p.name + "' is not contiguous; make it contiguous in the model");
    index_of[p.param.unsafeGetTensorImpl()] = params_.size();
    params_.push_back(std::move(p));
  }
  if (params_.empty()) throw ember::RunError("sharded: the model has no parameters");
  std::vector<bool> placed(params_.size(), false);
  units_ = static_cast<ember::IUnitModel*>(model.query_interface(ember::kUnitModelIid));
  const int64_t n_units = units_ ? units_->num_units() : 0;
  unit_group_.assign(static_cast<size_t>(n_units), kNone);
  for (int64_t u = 0; u < n_units; ++u) {
    std::vector<size_t> members;
    int64_t count = 0;
    for (const auto& t : units_->unit_module(u).parameters()) {
      auto it = index_of.find(t.unsafeGetTensorImpl());
      if (it == index_of.end())
        throw ember::RunError("sharded: unit '" + units_->unit_name(u) + "' has a parameter that is not in the model's module()");
      if (placed[it->second]) continue;  // shared with an earlier unit: it stays there
      members.push_back(it->second);
      count += params_[it->second].numel;
    }
    if (members.empty() || count < min_unit_params_) continue;
    ShardGroup grp;
    grp.name = "unit '" + units_->unit_name(u) + "'";
    grp.unit = u;
    std::sort(members.begin(), members.end());
    for (size_t k : members) placed[k] = true;
    grp.params = std::move(members);
    unit_group_[static_cast<size_t>(u)] = groups_.size();
    groups_.push_back(std::move(grp));
  }
  // The rest: consecutive runs, cut at bucket_cap_mb and at dtype changes.
  ShardGroup current;
  int64_t bytes = 0;
  auto close = [&] {
    if (current.params.empty()) return;
    current.name = "parameters from '" + params_[current.params.front()].name + "'";
    groups_.push_back(std::move(current));
    current = ShardGroup{};
    bytes = 0;
  };
  size_t last = kNone;
  for (size_t k = 0; k < params_.size(); ++k) {
    if (placed[k]) continue;
    const auto& p = params_[k];
    if (!current.params.empty() &&
        (last + 1 != k || params_[current.params.front()].param.scalar_type() != p.param.scalar_type() || bytes >= bucket_cap_bytes_))
      close();
    current.params.push_back(k);
    bytes += p.numel * static_cast<int64_t>(p.param.element_size());
    last = k;
  }
  close();
  for (size_t g = 0; g < groups_.size(); ++g) {
    auto& grp = groups_[g];
    const auto dtype = params_[grp.params.front()].param.scalar_type();
    for (size_t k : grp.params) {
      if (params_[k].param.scalar_type() != dtype)
        throw ember::RunError("sharded: " + grp.name + " mixes parameter dtypes; a unit must hold one dtype");
      params_[k].group = g;
      grp.max_index = std::max(grp.max_index, k);
    }
    order_.push_back(g);
  }
  // Backward produces gradients roughly from the last parameter to the first.
  std::sort(order_.begin(), order_.end(), [&](size_t a, size_t b) { return groups_[a].max_index > groups_[b].max_index; });
}

void Sharded::hook_gradients() {
  for (size_t k = 0; k < params_.size(); ++k) {
    if (!params_[k].trainable) continue;
    auto acc = torch::autograd::impl::grad_accumulator(params_[k].param);
    if (!acc) throw ember::RunError("sharded: parameter '" + params_[k].name + "' is not a leaf tensor that requires grad");
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, k](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list& /*inputs*/) {
          on_gradient_ready(k);
          return outputs;
        }));
    accumulators_.push_back(std::move(acc));
  }
}

c10::Dict<std::string, at::Tensor> Sharded::full_model_state(bool rank0_only) {
  const bool build = !rank0_only || comm_.rank() == 0;
  c10::Dict<std::string, at::Tensor> out;
  for (auto& p : params_) {
    at::Tensor whole = gather_whole(p, p.shard);
    if (build) out.insert(p.name, whole.to(at::kCPU).clone());
  }
  if (build)
    for (const auto& b : module_->named_buffers()) out.insert(b.key(), b.value().detach().to(at::kCPU).clone());
  return out;
}

void Sharded::load_full_model_state(const c10::Dict<std::string, at::Tensor>& state) {
  std::vector<std::string> missing;
  auto check = [&](const std::string& name, at::IntArrayRef sizes) {
    auto it = state.find(name);
    if (it == state.end()) {
      missing.push_back(name);
      return;
    }
    if (it->value().sizes() != sizes)
      throw ember::RunError("'" + name + "' has shape " + c10::str(it->value().sizes()) + " but the model's is " + c10::str(sizes) +
                            " (was it saved from a model with other settings?)");
  };
  for (const auto& p : params_) check(p.name, p.shape);
  for (const auto& b : module_->named_buffers()) check(b.key(), b.value().sizes());
  if (!missing.empty())
    throw ember::RunError("lacks " + std::to_string(missing.size()) + " of the model's tensors, e.g. '" + missing.front() +
                          "' (was it saved from another model?)");
  at::NoGradGuard no_grad;
  for (auto& p : params_) p.shard.detach().copy_(my_part(p, state.at(p.name)));
  for (auto& b : module_->named_buffers()) b.value().detach().copy_(state.at(b.key()));
  parameters_changed();
}

// torch::save of the optimizer with every per-element state tensor whole, exactly what a
// replicating strategy saves, so the file resumes under any strategy and world size.
std::string Sharded::full_optimizer_state(bool rank0_only) {
  const bool build = !rank0_only || comm_.rank() == 0;
  std::vector<std::pair<at::Tensor*, at::Tensor>> saved;
  for (auto& group : optimizer_->param_groups())
    for (auto& t : group.params()) {
      auto it = optimizer_->state().find(t.unsafeGetTensorImpl());
      if (it == optimizer_->state().end()) continue;
      const auto& p = params_[param_of_shard_.at(t.unsafeGetTensorImpl())];
      for_each_state_tensor(*it->second, [&](const char*, at::Tensor& field) {
        at::Tensor whole = gather_whole(p, field);
        saved.emplace_back(&field, field);
        field = whole;
      });
    }
  std::string bytes;
  if (build) {
    std::ostringstream out;
    torch::save(*optimizer_, out);
    bytes = out.str();
  }
  for (auto& [field, shard] : saved) *field = shard;
  return bytes;
}

void Sharded::load_full_optimizer_state(const std::string& bytes) {
  std::istringstream in(bytes);
  optimizer_->state().clear();
  torch::load(*optimizer_, in);
  at::NoGradGuard no_grad;
  for (auto& group : optimizer_->param_groups())
    for (auto& t : group.params()) {
      auto it = optimizer_->state().find(t.unsafeGetTensorImpl());
      if (it == optimizer_->state().end()) continue;
      const auto& p = params_[param_of_shard_.at(t.unsafeGetTensorImpl())];
      for_each_state_tensor(*it->second, [&](const char* name, at::Tensor& field) {
        if (field.numel() != p.numel)
          throw ember::RunError("optimizer state '" + std::string(name) + "' of '" + p.name + "' has " + std::to_string(field.numel()) +
                                " elements, the parameter " + std::to_string(p.numel) + " (saved from another model?)");
        field = my_part(p, field).to(p.shard.device()).clone();
      });
    }
}


// A sharded checkpoint part: this rank's real elements of every parameter and of every per-element
// optimizer state tensor, by parameter name, with the shape and chunk size that place them in the
// whole tensor; the optimizer's own serialization with those fields emptied (groups, options,
// step counts); and, in rank 0's part, the buffers.
c10::IValue Sharded::sharded_state() {
  using Dict = c10::impl::GenericDict;
  Dict part(c10::StringType::get(), c10::AnyType::get());
  part.insert("world_size", static_cast<int64_t>(comm_.world()));
  part.insert("rank", static_cast<int64_t>(comm_.rank()));
  part.insert("stage", static_cast<int64_t>(stage_));
  Dict params(c10::StringType::get(), c10::AnyType::get());
  for (const auto& p : params_) {
    Dict e(c10::StringType::get(), c10::AnyType::get());
    e.insert("shape", c10::List<int64_t>(p.shape));
    e.insert("chunk", p.chunk);
    e.insert("data", p.shard.detach().to(at::kCPU).clone());
    params.insert(p.name, e);
  }
  part.insert("params", params);
  Dict buffers(c10::StringType::get(), c10::AnyType::get());
  if (comm_.rank() == 0)
    for (const auto& b : module_->named_buffers()) buffers.insert(b.key(), b.value().detach().to(at::kCPU).clone());
  part.insert("buffers", buffers);
  Dict fields(c10::StringType::get(), c10::AnyType::get());
  std::vector<std::pair<at::Tensor*, at::Tensor>> saved;
  for (auto& group : optimizer_->param_groups())
    for (auto& t : group.params()) {
      auto it = optimizer_->state().find(t.unsafeGetTensorImpl());
      if (it == optimizer_->state().end()) continue;
      const auto& p = params_[param_of_shard_.at(t.unsafeGetTensorImpl())];
      Dict mine(c10::StringType::get(), c10::AnyType::get());
      for_each_state_tensor(*it->second, [&](const char* name, at::Tensor& field) {
        mine.insert(name, field.detach().to(at::kCPU).clone());
        saved.emplace_back(&field, field);
        field = at::empty({0}, field.options());
      });
      fields.insert(p.name, mine);
    }
  std::ostringstream out;
  torch::save(*optimizer_, out);
  for (auto& [field, value] : saved) *field = value;
  const std::string bytes = out.str();
  at::Tensor blob = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(blob.data_ptr(), bytes.data(), bytes.size());
  part.insert("optimizer", blob);
  part.insert("optimizer_fields", fields);
  return part;
}

// Re-sharding: each saved rank k held elements [k * c', k * c' + valid'_k) of a parameter (c' its
// saved chunk); this rank needs [r * c, r * c + valid). The overlap of the two is copied, part by
// part, so any saved world size loads onto any other.
void Sharded::load_sharded_state(int64_t saved_world, const std::function<c10::IValue(int64_t)>& read_part) {
  if (saved_world < 1) throw ember::RunError("the sharded checkpoint says it was written by " + std::to_string(saved_world) + " ranks");
  auto first = read_part(0).toGenericDict();
  auto saved_params = first.at("params").toGenericDict();
  for (const auto& p : params_) {
    if (!saved_params.contains(p.name))
      throw ember::RunError("lacks parameter '" + p.name + "' (was it saved from another model?)");
    auto shape = saved_params.at(p.name).toGenericDict().at("shape").toIntVector();
    if (shape != p.shape)
      throw ember::RunError("'" + p.name + "' has shape " + c10::str(c10::IntArrayRef(shape)) + " but the model's is " +
                            c10::str(c10::IntArrayRef(p.shape)) + " (was it saved from a model with other settings?)");
  }
  // Groups, options and step counts from rank 0's serialization; per-element fields refilled below.
  {
    at::Tensor blob = first.at("optimizer").toTensor().contiguous();
    std::istringstream in(std::string(static_cast<const char*>(blob.data_ptr()), static_cast<size_t>(blob.numel())));
    optimizer_->state().clear();
    torch::load(*optimizer_, in);
  }
  // The fields to fill, per parameter index.
  std::vector<std::vector<std::pair<std::string, at::Tensor*>>> targets(params_.size());
  for (auto& group : optimizer_->param_groups())
    for (auto& t : group.params()) {
      auto it = optimizer_->state().find(t.unsafeGetTensorImpl());
      if (it == optimizer_->state().end()) continue;
      const size_t k = param_of_shard_.at(t.unsafeGetTensorImpl());
      for_each_state_tensor(*it->second, [&](const char* name, at::Tensor& field) {
        field = at::zeros({params_[k].valid}, field.options().device(params_[k].shard.device()));
        targets[k].emplace_back(name, &field);
      });
    }
  at::NoGradGuard no_grad;
  const int64_t rank = comm_.rank();
  for (int64_t k = 0; k < saved_world; ++k) {
    auto part = k == 0 ? first : read_part(k).toGenericDict();
    auto sp = part.at("params").toGenericDict();
    auto sf = part.at("optimizer_fields").toGenericDict();
    for (size_t i = 0; i < params_.size(); ++i) {
      auto& p = params_[i];
      auto entry = sp.at(p.name).toGenericDict();
      const int64_t chunk = entry.at("chunk").toInt();
      const int64_t begin = k * chunk, end = std::min(p.numel, begin + chunk);
      const int64_t lo = std::max(begin, rank * p.chunk), hi = std::min(end, rank * p.chunk + p.valid);
      if (lo >= hi) continue;
      auto copy = [&](at::Tensor& dst, const at::Tensor& src, const std::string& what) {
        if (src.numel() != std::max<int64_t>(0, end - begin))
          throw ember::RunError("part " + std::to_string(k) + " holds " + std::to_string(src.numel()) + " elements of " + what +
                                ", expected " + std::to_string(std::max<int64_t>(0, end - begin)) + " (a damaged checkpoint?)");
        dst.narrow(0, lo - rank * p.chunk, hi - lo).copy_(src.narrow(0, lo - begin, hi - lo));
      };
      copy(p.shard, entry.at("data").toTensor(), "'" + p.name + "'");
      if (!targets[i].empty()) {
        if (!sf.contains(p.name)) throw ember::RunError("part " + std::to_string(k) + " has no optimizer state for '" + p.name + "'");
        auto fields = sf.at(p.name).toGenericDict();
        for (auto& [name, field] : targets[i]) {
          if (!fields.contains(name))
            throw ember::RunError("part " + std::to_string(k) + " has no optimizer state '" + name + "' for '" + p.name + "'");
          copy(*field, fields.at(name).toTensor(), "the optimizer's '" + name + "' of '" + p.name + "'");
        }
      }
    }
  }
  auto buffers = first.at("buffers").toGenericDict();
  for (auto& b : module_->named_buffers()) {
    if (!buffers.contains(b.key())) throw ember::RunError("lacks buffer '" + b.key() + "' (was it saved from another model?)");
    b.value().detach().copy_(buffers.at(b.key()).toTensor());
  }
  parameters_changed();
}

ember::IStrategy* make(ember::IHost& host, const ember::IConfig& cfg) { return new Sharded(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IStrategy, "sharded", "0.1.0", "Apache-2.0",
             "ZeRO / FSDP data parallel: optimizer state (stage 1), gradients (2) and parameters (3) sharded over the ranks, "
             "gathered per unit of the model (" EMBER_DIST_BACKENDS ").",
             EMBER_CONFIG_KEYS(kKeys), make)
