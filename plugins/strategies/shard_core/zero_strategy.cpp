// ZeRO data parallel, shared by the `sharded` and `offload` plugins (docs/strategy.md). Multi-process
// like ddp (same launch, rendezvous, timeouts and collectives: sdk/distributed, Ember::distributed), and it
// owns the model's state through strategy contract 2:
//   stage 1  the optimizer state is sharded: each rank steps its 1/N of every parameter; gradients
//            stay whole until the updating micro-batch, then are reduce-scattered;
//   stage 2  + gradients are reduce-scattered on every micro-batch as backward produces them and
//            only this rank's shard is kept;
//   stage 3  + parameters are sharded: a unit's parameters are all-gathered just before its
//            forward (the next unit's prefetched), freed after it, gathered again before its
//            backward and freed once its gradients are reduce-scattered.
// Stages 1 and 2 all-gather the updated shards into the whole parameters after every step.
// Offload (ZeRO-Offload / ZeRO-Infinity's parameter offload): the shards are fp32 masters in host
// memory, each group's reduced gradient is copied to the host as soon as it is ready (a side
// stream on GPUs) and accumulated there in fp32, the optimizer steps on the host (ATen's fused CPU
// kernels), and the device only ever holds compute-dtype weights: all of them (stage 2) or the
// unit that runs (stage 3, offload_params). One rank is world size 1: no collective runs then.
#include "zero_strategy.h"

#include <ember/error.h>
#include <ember/grad_util.h>
#include <ember/model.h>
#include <ember/model_units.h>

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

#include "host_offload.h"
#include "optimizer_state_tensors.h"
#include "shard_layout.h"

namespace ember_shard {
namespace {

using namespace ember_dist;

constexpr size_t kNone = std::numeric_limits<size_t>::max();

class ZeroStrategy;

// The engine's optimizer step with the strategy's part added: after the closure's backward, every
// rank agrees whether any gradient is non-finite (a rank sees only its shard, and amp16 must skip
// the step on all ranks or none).
class ZeroStep final : public ember::IOptimizerStep {
 public:
  ZeroStep(ember::IOptimizerStep& inner, ZeroStrategy& strategy) : inner_(inner), s_(strategy) {}
  at::Tensor closure() override;
  void before_step() override { inner_.before_step(); }
  void step() override { inner_.step(); }
  torch::optim::Optimizer& optimizer() override { return inner_.optimizer(); }

 private:
  ember::IOptimizerStep& inner_;
  ZeroStrategy& s_;
};

class ZeroStrategy final : public ember::IStrategy,
                           public ember::IModelStateStrategy,
                           public ember::IShardedCheckpoint,
                           public ember::IGradientNormClip,
                           public ember::ITensorBroadcast,
                           public ember::IUnitHooks {
 public:
  ZeroStrategy(ember::IHost& host, const ember::IConfig& cfg, ZeroOptions o)
      : host_(host), comm_(o.name, host, cfg), o_(std::move(o)), buffers_(o_.broadcast_buffers), copies_(c10::Device(c10::kCPU), false) {}

  // The model may be gone by now (plugins are destroyed in reverse order of their kinds): the
  // unit hooks were taken back in teardown().
  ~ZeroStrategy() override { teardown(); }

  void* query_interface(const char* iid) override {
    if (std::strcmp(iid, ember::kModelStateStrategyIid) == 0) return static_cast<ember::IModelStateStrategy*>(this);
    if (std::strcmp(iid, ember::kShardedCheckpointIid) == 0) return static_cast<ember::IShardedCheckpoint*>(this);
    if (std::strcmp(iid, ember::kGradientNormClipIid) == 0) return static_cast<ember::IGradientNormClip*>(this);
    if (std::strcmp(iid, ember::kTensorBroadcastIid) == 0) return static_cast<ember::ITensorBroadcast*>(this);
    return nullptr;
  }

  // ---- IStrategy ----
  bool launch(const ember::LaunchRequest& request, int* exit_code) override {
    const bool go_on = comm_.launch(request, exit_code);
    if (go_on) copies_ = HostCopies(comm_.device(), o_.pin_memory);
    return go_on;
  }
  c10::Device root_device() const override { return comm_.device(); }
  int64_t rank() const override { return comm_.rank(); }
  int64_t world_size() const override { return comm_.world(); }
  int64_t local_rank() const override { return comm_.info().local_rank; }

  void setup(torch::nn::Module& /*module*/, std::shared_ptr<torch::optim::Optimizer>& /*optimizer*/) override {
    throw ember::RunError(o_.name + " needs an engine with strategy contract 2 (SDK 1.2 or newer): upgrade the engine");
  }

  ember::Batch batch_to_device(ember::Batch batch) override { return comm_.batch_to_device(std::move(batch)); }

  void backward(const at::Tensor& loss, ember::IPrecision& precision, bool sync_gradients) override {
    // Stage 1 keeps whole gradients until the updating micro-batch; stages 2 and 3 keep only
    // their shard, so every micro-batch reduce-scatters (offload: moves them to the host).
    syncing_ = o_.stage >= 2 || sync_gradients;
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
    ZeroStep wrapped(step, *this);
    const bool taken = precision.optimizer_step(wrapped);
    if (taken) ++stats_.steps;
    // Stages 1 and 2 keep whole parameters for the next forward: gather the updated shards
    // (offload: the updated masters, in the compute dtype).
    if (o_.stage < 3 && taken) gather_all_into_parameters();
    return taken;
  }

  // Clipping by norm needs the norm over all shards: the local sum of squares is all-reduced.
  void clip_gradients(torch::optim::Optimizer& optimizer, double max, ember::ClipAlgorithm algorithm) override {
    if (algorithm == ember::ClipAlgorithm::value) {
      ember::clip_gradients_in_place(ember::grads_of(optimizer), max, algorithm);
      return;
    }
    clip_gradients_norm(optimizer, max);
  }
  at::Tensor clip_gradients_norm(torch::optim::Optimizer& optimizer, double max) override {
    auto grads = ember::grads_of(optimizer);
    if (comm_.world() == 1) return ember::clip_gradients_norm_in_place(grads, max);
    const c10::Device where = grads.empty() ? comm_.device() : grads.front().device();
    at::Tensor sumsq = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(where));
    for (const auto& g : grads)
      if (g.numel() > 0) sumsq += g.detach().to(at::kDouble).pow(2).sum();
    comm_.label("gradient norm");
    std::vector<at::Tensor> v{sumsq.to(comm_.device())};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    comm_.backend().allreduce(v, opts)->wait();
    at::Tensor total = v.front().to(where).sqrt();
    auto coef = (max / (total + 1e-6)).clamp_max(1.0);
    for (const auto& g : grads) g.mul_(coef.to(g.scalar_type()));
    return total.reshape({}).to(at::kFloat);
  }

  at::Tensor reduce(const at::Tensor& value, ember::ReduceOp op) override { return comm_.reduce(value, op); }
  void barrier(const char* name) override { comm_.barrier(name); }
  bool broadcast_flag(bool value) override { return comm_.broadcast_flag(value); }
  at::Tensor broadcast(const at::Tensor& value, int64_t src) override { return comm_.broadcast(value, src); }

  void teardown() override {
    if (units_) {
      units_->set_unit_hooks(nullptr);
      units_ = nullptr;
    }
    std::string line;
    if (ready_) {  // not after a set-up that failed
      // One rank runs no collective: its gathers are copies from the shards, and a group's
      // gradients are its part as they are.
      const bool alone = world() == 1;
      line = o_.name + ": stage " + std::to_string(o_.stage) + ", " + std::to_string(groups_.size()) + " groups, " +
             std::to_string(stats_.gathers) + (alone ? " weight fetches (" : " all-gathers (") + std::to_string(stats_.prefetched) +
             " prefetched), " + std::to_string(stats_.scatters) + (alone ? " gradient groups (" : " reduce-scatters (") +
             std::to_string(stats_.scatters_early) + (alone ? " ready" : " started") + " while backward was still running)";
      if (o_.offload)
        line += "; " + std::to_string(stats_.host_copies) + " gradient copies to the host (" + std::to_string(stats_.host_copies_early) +
                " while backward was still running, " + describe_bytes(stats_.host_bytes) + "), " + std::to_string(stats_.steps) +
                " host optimizer steps";
    }
    comm_.teardown(line);
  }

  c10::IValue state_dict() const override {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert("world_size", static_cast<int64_t>(comm_.world()));
    d.insert("stage", static_cast<int64_t>(o_.stage));
    return d;
  }
  void load_state_dict(const c10::IValue& state) override {
    if (!state.isGenericDict()) return;
    auto d = state.toGenericDict();
    if (d.contains("world_size") && d.at("world_size").toInt() != comm_.world())
      host_.log(ember::LogLevel::info, o_.name + ": the checkpoint was written by " + std::to_string(d.at("world_size").toInt()) +
                                           " ranks and is re-sharded onto " + std::to_string(comm_.world()) +
                                           "; each rank's share of the data differs from here on");
  }

  // ---- strategy contract 2 ----
  void setup_module(ember::IModel& model) override;
  std::shared_ptr<torch::optim::Optimizer> setup_optimizer(ember::IOptimizerFactory& factory) override;

  void forward_begin(bool grad_enabled) override {
    buffers_.before_forward(*module_, comm_);
    forward_grad_ = grad_enabled;
    if (o_.stage == 3)
      for (size_t g = 0; g < groups_.size(); ++g)
        if (groups_[g].unit < 0) materialize(g);
  }
  void forward_end() override {
    // Without a backward to come, what no unit holds is freed now; otherwise after backward.
    if (o_.stage == 3 && !forward_grad_) release_all();
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
    if (o_.stage < 3) gather_all_into_parameters();
    else release_all();
  }

  c10::Dict<std::string, at::Tensor> full_model_state(bool rank0_only) override;
  void load_full_model_state(const c10::Dict<std::string, at::Tensor>& state) override;
  std::string full_optimizer_state(bool rank0_only) override;
  void load_full_optimizer_state(const std::string& bytes) override;

  // ---- sharded checkpoints ----
  bool sharded_checkpoints() const override { return o_.sharded_checkpoints; }
  c10::IValue sharded_state() override;
  void load_sharded_state(int64_t saved_world, const std::function<c10::IValue(int64_t)>& read_part) override;

  // ---- IUnitHooks (stage 3) ----
  void before_unit_forward(int64_t unit) override {
    const size_t g = group_of_unit(unit);
    if (g == kNone) return;
    materialize(g);
    if (o_.prefetch) prefetch_unit(unit + 1);
  }
  void after_unit_forward(int64_t unit) override {
    const size_t g = group_of_unit(unit);
    if (g != kNone) release(g);
  }
  void before_unit_backward(int64_t unit) override {
    const size_t g = group_of_unit(unit);
    if (g == kNone) return;
    materialize(g);
    if (o_.prefetch) prefetch_unit(unit - 1);
  }

  // Called by ZeroStep after the closure: every rank learns whether some rank's shard holds a
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
      flag = at::logical_not(at::isfinite(norms.sum())).to(at::kFloat).reshape({1}).to(comm_.device());
    }
    comm_.label("non-finite gradient vote");
    std::vector<at::Tensor> v{flag};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MAX;
    comm_.backend().allreduce(v, opts)->wait();
    if (flag.item<float>() > 0 && !grads.empty()) grads.front().view(-1)[0].fill_(std::numeric_limits<float>::infinity());
  }

 private:
  friend class ZeroStep;
  struct Stats {
    int64_t gathers = 0, prefetched = 0, scatters = 0, scatters_early = 0, steps = 0;
    int64_t host_copies = 0, host_copies_early = 0, host_bytes = 0;  // offload: gradient parts to the host
  };

  size_t group_of_unit(int64_t unit) const {
    if (unit < 0 || unit >= static_cast<int64_t>(unit_group_.size())) return kNone;
    return unit_group_[static_cast<size_t>(unit)];
  }

  void build_groups(ember::IModel& model);
  void place_parameters();
  void offload_parameters();
  void hook_gradients();
  void check_host_memory(int64_t need, const std::string& what);
  int64_t world() const { return comm_.world(); }
  // Sharded without offload, one rank, stages 1-2: the shard is the parameter itself.
  bool shard_is_parameter() const { return !o_.offload && world() == 1 && o_.stage < 3; }

  // ---- gather (all-gather; one rank: a copy from the shard) ----
  void start_gather(size_t g) {
    auto& grp = groups_[g];
    if (grp.gather_pending) return;
    at::NoGradGuard no_grad;
    const auto& first = params_[grp.params.front()];
    // In the parameters' dtype and on their device (offload: host masters go in compute dtype).
    const auto options = first.param.options().requires_grad(false);
    ++stats_.gathers;
    grp.gather_pending = true;
    if (world() == 1) {
      grp.gather_out = at::empty({grp.row}, options);
      if (o_.offload && copies_.async()) {
        // Converted to the compute dtype on the host, then one asynchronous copy per group.
        grp.gather_in = at::empty({grp.row}, first.shard.options().dtype(options.dtype()).pinned_memory(copies_.pinned()));
        for (size_t k : grp.params) grp.gather_in.narrow(0, params_[k].offset, params_[k].valid).copy_(params_[k].shard.detach());
        grp.copied = copies_.to_device(grp.gather_out, grp.gather_in);
      } else {
        for (size_t k : grp.params) grp.gather_out.narrow(0, params_[k].offset, params_[k].valid).copy_(params_[k].shard.detach());
      }
      return;
    }
    grp.gather_in = at::zeros({grp.row}, options);
    for (size_t k : grp.params) {
      const auto& p = params_[k];
      if (p.valid > 0) grp.gather_in.narrow(0, p.offset, p.valid).copy_(p.shard.detach());
    }
    grp.gather_out = at::empty({grp.row * world()}, grp.gather_in.options());
    comm_.label("all-gather of " + grp.name);
    grp.gather_work = comm_.backend()._allgather_base(grp.gather_out, grp.gather_in);
  }
  // Rank r's chunks of parameter p, joined: the whole tensor (a view into the gather buffer).
  at::Tensor whole_from_gather(const ShardGroup& grp, const ShardedParam& p) const {
    return grp.gather_out.view({world(), grp.row}).narrow(1, p.offset, p.chunk).reshape({-1}).narrow(0, 0, p.numel).view(p.shape);
  }
  void wait_gather(ShardGroup& grp) {
    if (grp.gather_work) grp.gather_work->wait();
    copies_.use_on_device(grp.copied);
    grp.gather_work.reset();
    grp.copied.reset();
    grp.gather_pending = false;
  }
  void finish_gather(size_t g) {
    auto& grp = groups_[g];
    wait_gather(grp);
    at::NoGradGuard no_grad;
    for (size_t k : grp.params) {
      auto& p = params_[k];
      if (o_.stage == 3) allocate_storage(p.param);
      unversioned_view(p.param).copy_(whole_from_gather(grp, p));
    }
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
    if (g == kNone || groups_[g].materialized || groups_[g].gather_pending) return;
    start_gather(g);
    ++stats_.prefetched;
  }
  void release(size_t g) {
    auto& grp = groups_[g];
    if (o_.stage < 3) return;
    if (grp.gather_pending) {  // a prefetch nobody used: it still has to complete
      wait_gather(grp);
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
    if (shard_is_parameter()) return;
    if (world() == 1) {  // one group's buffer at a time: no second copy of the whole model
      for (size_t g = 0; g < groups_.size(); ++g) {
        groups_[g].materialized = false;
        materialize(g);
      }
      return;
    }
    for (size_t g = 0; g < groups_.size(); ++g) {
      groups_[g].materialized = false;
      start_gather(g);
    }
    for (size_t g = 0; g < groups_.size(); ++g) finish_gather(g);
  }

  // ---- reduce-scatter (one rank: the gradient itself), and where this rank's part goes ----
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
    // Offload: parts whose reduce-scatter already completed go to the host while backward runs.
    if (o_.offload && world() > 1)
      for (size_t i = 0; i < next_; ++i) {
        auto& grp = groups_[order_[i]];
        if (grp.scatter_work && grp.scatter_work->isCompleted()) finish_scatter(order_[i]);
      }
  }
  void launch_scatter(size_t g) {
    auto& grp = groups_[g];
    at::NoGradGuard no_grad;
    grp.launched = true;
    ++stats_.scatters;
    if (pending_params_ > 0) ++stats_.scatters_early;
    if (world() == 1) {
      // Nothing to reduce: each gradient is this rank's part, delivered now (offload: its copy
      // to the host starts while backward goes on).
      for (size_t k : grp.params) {
        auto& p = params_[k];
        if (!p.trainable || !p.param.grad().defined()) continue;
        deliver(p, p.param.grad().reshape({-1}));
        if (o_.stage >= 2) p.param.mutable_grad() = at::Tensor();
      }
      if (o_.stage == 3 && grp.unit >= 0) release(g);
      return;
    }
    const auto& first = params_[grp.params.front()];
    grp.scatter_in = at::zeros({world(), grp.row}, first.param.options().requires_grad(false));
    for (size_t k : grp.params) {
      auto& p = params_[k];
      if (!p.trainable || !p.param.grad().defined()) continue;
      at::Tensor padded = at::zeros({world() * p.chunk}, grp.scatter_in.options());
      padded.narrow(0, 0, p.numel).copy_(p.param.grad().reshape({-1}));
      grp.scatter_in.narrow(1, p.offset, p.chunk).copy_(padded.view({world(), p.chunk}));
      // Stage 2 and 3 keep no whole gradient.
      if (o_.stage >= 2) p.param.mutable_grad() = at::Tensor();
    }
    grp.scatter_out = at::empty({grp.row}, grp.scatter_in.options());
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::AVG;
    comm_.label("reduce-scatter of " + grp.name);
    at::Tensor flat = grp.scatter_in.view({-1});
    grp.scatter_work = comm_.backend()._reduce_scatter_base(grp.scatter_out, flat, opts);
    // Stage 3: this unit's backward is done, its parameters can go.
    if (o_.stage == 3 && grp.unit >= 0) release(g);
  }
  // Waits for group g's reduce-scatter and hands this rank's part of each gradient on.
  void finish_scatter(size_t g) {
    auto& grp = groups_[g];
    at::NoGradGuard no_grad;
    grp.scatter_work->wait();
    for (size_t k : grp.params) {
      auto& p = params_[k];
      if (p.trainable) deliver(p, grp.scatter_out.narrow(0, p.offset, p.valid));
    }
    grp.scatter_work.reset();
    grp.scatter_in = grp.scatter_out = at::Tensor();
  }
  // This rank's reduced gradient part of p (on the compute device) joins p's shard gradient.
  void deliver(ShardedParam& p, const at::Tensor& part) {
    if (o_.offload) {
      ++stats_.host_copies;
      if (in_backward_ && pending_params_ > 0) ++stats_.host_copies_early;
      stats_.host_bytes += part.numel() * static_cast<int64_t>(part.element_size());
      if (copies_.async()) {
        const size_t k = static_cast<size_t>(&p - params_.data());
        if (!p.shard.grad().defined()) {
          // The step's first gradient: converted to fp32 on the device (cheap there) and copied
          // straight into the pinned fp32 buffer, which becomes the shard's gradient once the
          // copies landed (end_backward). No compute-dtype staging copy on the host: 2 bytes a
          // parameter less, and no conversion on the host.
          copies_.to_host(p.host_grad, part.to(p.host_grad.scalar_type()));
          stats_.host_bytes += part.numel() * static_cast<int64_t>(p.host_grad.element_size() - part.element_size());
          landed_.push_back(k);
        } else {
          // Accumulating (accumulate_grad_batches > 1): staged in the compute dtype and added into
          // the fp32 gradient on the host once landed. The staging buffer is made at the first
          // accumulating step (pinned, so the copy stays asynchronous).
          if (!p.staging.defined()) {
            check_host_memory(p.valid * static_cast<int64_t>(part.element_size()), "the gradient staging buffer of '" + p.name + "'");
            p.staging = copies_.host_zeros(p.valid, part.scalar_type(), "the gradient staging buffer of '" + p.name + "'");
            host_bytes_ += p.valid * static_cast<int64_t>(part.element_size());
          }
          copies_.to_host(p.staging, part);
          staged_.push_back(k);
        }
      } else {
        land_on_host(p, part);
      }
      return;
    }
    if (o_.stage == 1 && p.param.grad().defined() && p.param.grad().is_contiguous()) {
      // Stage 1 keeps whole gradients: this rank's reduced part goes into its own slice of the
      // whole gradient, and the shard's gradient is a view of that slice (no extra copy).
      at::Tensor mine = p.param.grad().view({-1}).narrow(0, std::min(comm_.rank() * p.chunk, p.numel), p.valid);
      if (!mine.is_same(part)) mine.copy_(part);
      p.shard.mutable_grad() = mine;
    } else if (p.shard.grad().defined()) {
      p.shard.mutable_grad().add_(part);
    } else {
      p.shard.mutable_grad() = part.clone();
    }
  }
  // Offload: the host fp32 gradient buffer becomes (or accumulates) the shard's gradient.
  void land_on_host(ShardedParam& p, const at::Tensor& host_part) {
    if (p.shard.grad().defined()) {
      p.shard.mutable_grad().add_(host_part);
    } else {
      p.host_grad.copy_(host_part);
      p.shard.mutable_grad() = p.host_grad;
    }
  }
  void end_backward() {
    if (!syncing_) {
      in_backward_ = false;
      if (o_.stage == 3) release_all();
      return;
    }
    // Backward has returned: what starts now does not overlap it. Groups whose parameters got
    // no gradient (unused in this step) reduce zeros, in order.
    pending_params_ = 0;
    for (; next_ < order_.size(); ++next_) launch_scatter(order_[next_]);
    if (world() > 1)
      for (size_t g : order_)
        if (groups_[g].scatter_work) finish_scatter(g);
    if (!staged_.empty() || !landed_.empty()) {
      copies_.wait_host();
      for (size_t k : landed_) params_[k].shard.mutable_grad() = params_[k].host_grad;
      for (size_t k : staged_) land_on_host(params_[k], params_[k].staging);
      landed_.clear();
      staged_.clear();
    }
    in_backward_ = false;
    if (o_.stage == 3) release_all();
  }
  void abandon_backward() {
    for (auto& grp : groups_)
      if (grp.scatter_work) grp.scatter_work->wait();
    copies_.wait_host();
    landed_.clear();
    staged_.clear();
    in_backward_ = false;
    if (o_.stage == 3) release_all();
  }

  // Whole value of one shard-shaped tensor (a parameter's shard, or an optimizer state field).
  at::Tensor gather_whole(const ShardedParam& p, const at::Tensor& part) {
    at::NoGradGuard no_grad;
    if (world() == 1) return part.detach().reshape({-1}).narrow(0, 0, p.numel).view(p.shape);
    // Collectives run on the compute device (NCCL needs device tensors); the result goes back
    // where `part` lives.
    at::Tensor in = at::zeros({p.chunk}, part.options().device(comm_.device()).requires_grad(false));
    if (p.valid > 0) in.narrow(0, 0, p.valid).copy_(part.detach().reshape({-1}));
    at::Tensor out = at::empty({p.chunk * world()}, in.options());
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
  ZeroOptions o_;
  BufferBroadcast buffers_;
  HostCopies copies_;

  torch::nn::Module* module_ = nullptr;
  ember::IUnitModel* units_ = nullptr;
  std::vector<ShardedParam> params_;
  std::vector<ShardGroup> groups_;
  std::vector<size_t> unit_group_;  // unit -> its group (kNone: the unit is gathered with the step)
  std::vector<size_t> order_;       // reduce-scatter order: backward's
  std::vector<size_t> landed_;      // offload on a GPU: fp32 gradient copies in flight to host_grad
  std::vector<size_t> staged_;      // offload on a GPU: accumulating gradient copies in flight to staging
  std::unordered_map<const void*, size_t> param_of_shard_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  bool in_backward_ = false, syncing_ = false, forward_grad_ = false, ready_ = false;
  size_t next_ = 0, pending_params_ = 0;
  int64_t host_bytes_ = 0;  // offload: host memory this rank took for masters, gradients, staging
  Stats stats_;
};

at::Tensor ZeroStep::closure() {
  at::Tensor loss = inner_.closure();
  s_.agree_on_finite();
  return loss;
}

void ZeroStrategy::check_host_memory(int64_t need, const std::string& what) {
  const HostMemory m = host_memory_available(o_.max_host_bytes, host_bytes_);
  if (need <= m.available) return;
  throw ember::RunError(o_.name + ": not enough host memory for " + what + ": " + describe_bytes(need) + " needed, " +
                        describe_bytes(m.available) + " available (" + m.source +
                        (o_.max_host_bytes > 0 ? ", " + o_.where_max_host : std::string()) +
                        "); use a smaller model, more ranks (each offloads its shard), or a host with more memory");
}

void ZeroStrategy::setup_module(ember::IModel& model) {
  module_ = &model.module();
  build_groups(model);
  const int64_t rank = comm_.rank();
  for (auto& p : params_) {
    p.chunk = (p.numel + world() - 1) / world();
    p.valid = std::clamp<int64_t>(p.numel - rank * p.chunk, 0, p.chunk);
  }
  for (auto& grp : groups_) {
    grp.row = 0;
    for (size_t k : grp.params) {
      params_[k].offset = grp.row;
      grp.row += params_[k].chunk;
    }
  }
  if (o_.offload) offload_parameters();
  else place_parameters();
  for (auto& p : params_) {
    p.shard.set_requires_grad(p.trainable);
    param_of_shard_[p.shard.unsafeGetTensorImpl()] = static_cast<size_t>(&p - params_.data());
  }
  hook_gradients();
  if (o_.stage == 3) {
    release_all();
    if (units_) units_->set_unit_hooks(this);
  } else if (o_.offload) {
    gather_all_into_parameters();  // the compute-dtype weights from the masters
  }
  int64_t total = 0, mine = 0;
  for (const auto& p : params_) {
    total += p.numel;
    mine += p.valid;
  }
  std::string where = o_.offload ? "; masters, gradients and optimizer state in " + std::string(copies_.pinned() ? "pinned " : "") +
                                       "host memory (" + describe_bytes(host_bytes_) + " so far), weights on " + comm_.device().str() +
                                       " in " + std::string(c10::toString(params_.front().param.scalar_type())) +
                                       (o_.stage == 3 ? ", one unit at a time" : "")
                                 : "";
  host_.log(ember::LogLevel::info, o_.name + ": stage " + std::to_string(o_.stage) + ", " + std::to_string(params_.size()) +
                                       " parameters in " + std::to_string(groups_.size()) + " groups (" +
                                       std::to_string(unit_group_.size()) + " units declared by the model); this rank trains " +
                                       std::to_string(mine) + " of " + std::to_string(total) + " elements" + where);
}

// Sharded: the module moves to the device whole; stages 1-2 train a view into each parameter (no
// second copy), stage 3 a part of its own (the parameter is freed).
void ZeroStrategy::place_parameters() {
  module_->to(comm_.device());
  comm_.broadcast_module_from_zero(*module_);  // every rank starts from rank 0's weights and buffers
  at::NoGradGuard no_grad;
  for (auto& p : params_) {
    at::Tensor part = my_part(p, p.param.detach());
    p.shard = o_.stage < 3 ? part : part.clone();
  }
}

// Offload: this rank's part of each parameter becomes an fp32 (fp64 under fp64 precision) master in
// host memory, with an fp32 gradient buffer; the module's parameters are replaced by compute-dtype
// tensors on the device (left empty here: filled from the masters, or freed under stage 3), so the
// whole model never has to fit on the device at once.
void ZeroStrategy::offload_parameters() {
  const c10::Device device = comm_.device();
  auto master_dtype = [](const at::Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; };
  int64_t need = 0;
  for (const auto& p : params_) {
    if (!at::isFloatingType(p.param.scalar_type()))
      throw ember::RunError(o_.name + ": parameter '" + p.name + "' is not floating point (" + c10::toString(p.param.scalar_type()) +
                            "); only floating-point parameters can be offloaded");
    const int64_t master = p.valid * static_cast<int64_t>(c10::elementSize(master_dtype(p.param)));
    need += 2 * master;  // master + gradient
  }
  check_host_memory(need, "the " + std::to_string(params_.size()) + " master weights and their gradients");
  at::NoGradGuard no_grad;
  for (auto& p : params_) {
    at::Tensor whole = p.param.detach();
    if (world() > 1) {  // every rank starts from rank 0's weights (through the device: NCCL)
      whole = whole.to(device).clone();
      comm_.broadcast_from_zero(whole, "initial parameter '" + p.name + "'");
    }
    const auto mdt = master_dtype(p.param);
    p.shard = copies_.host_zeros(p.valid, mdt, "the master weights of '" + p.name + "'");
    p.shard.copy_(my_part(p, whole));
    p.host_grad = copies_.host_zeros(p.valid, mdt, "the gradient of '" + p.name + "'");
    host_bytes_ += 2 * p.valid * static_cast<int64_t>(c10::elementSize(mdt));
    const auto dtype = o_.compute_dtype.value_or(p.param.scalar_type());
    p.param.set_data(at::empty(p.shape, p.param.options().device(device).dtype(dtype)));
    if (o_.stage == 3) free_storage(p.param);
  }
  for (auto& b : module_->buffers()) b.set_data(b.to(device));
  int i = 0;
  for (auto& b : module_->buffers()) comm_.broadcast_from_zero(b, "initial buffer " + std::to_string(i++));
  // Stage 3 frees parameters: everything gathered starts released.
  for (auto& grp : groups_) grp.materialized = o_.stage < 3;
}

std::shared_ptr<torch::optim::Optimizer> ZeroStrategy::setup_optimizer(ember::IOptimizerFactory& factory) {
  std::vector<ember::NamedTensor> named;
  for (const auto& p : params_) named.push_back({p.name, p.shard});
  optimizer_ = factory.build(named);
  for (auto& group : optimizer_->param_groups())
    for (auto& t : group.params())
      if (!param_of_shard_.count(t.unsafeGetTensorImpl()))
        throw ember::RunError(o_.name + ": the optimizer holds a tensor that is not one of this strategy's shards (a bug)");
  if (o_.offload) {
    // The optimizer creates its state on the first step: make sure the host has room for it now.
    int64_t need = 0;
    for (auto& group : optimizer_->param_groups())
      for (auto& t : group.params())
        need += state_tensors_per_element(group) * t.numel() * static_cast<int64_t>(t.element_size());
    check_host_memory(need, "the optimizer state");
    host_bytes_ += need;
  }
  ready_ = true;
  return optimizer_;
}

// Groups: one per unit the model declares (when it has at least auto_wrap_min_params), and the
// remaining parameters in runs of consecutive ones of about bucket_cap_mb.
void ZeroStrategy::build_groups(ember::IModel& model) {
  std::unordered_map<const void*, size_t> index_of;
  for (const auto& item : module_->named_parameters()) {
    ShardedParam p;
    p.name = item.key();
    p.param = item.value();
    p.shape = p.param.sizes().vec();
    p.numel = p.param.numel();
    p.trainable = p.param.requires_grad();
    if (!p.param.is_contiguous())
      throw ember::RunError(o_.name + ": parameter '" + p.name + "' is not contiguous; make it contiguous in the model");
    index_of[p.param.unsafeGetTensorImpl()] = params_.size();
    params_.push_back(std::move(p));
  }
  if (params_.empty()) throw ember::RunError(o_.name + ": the model has no parameters");
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
        throw ember::RunError(o_.name + ": unit '" + units_->unit_name(u) + "' has a parameter that is not in the model's module()");
      if (placed[it->second]) continue;  // shared with an earlier unit: it stays there
      members.push_back(it->second);
      count += params_[it->second].numel;
    }
    if (members.empty() || count < o_.min_unit_params) continue;
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
        (last + 1 != k || params_[current.params.front()].param.scalar_type() != p.param.scalar_type() || bytes >= o_.bucket_cap_bytes))
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
        throw ember::RunError(o_.name + ": " + grp.name + " mixes parameter dtypes; a unit must hold one dtype");
      params_[k].group = g;
      grp.max_index = std::max(grp.max_index, k);
    }
    order_.push_back(g);
  }
  // Backward produces gradients roughly from the last parameter to the first.
  std::sort(order_.begin(), order_.end(), [&](size_t a, size_t b) { return groups_[a].max_index > groups_[b].max_index; });
}

void ZeroStrategy::hook_gradients() {
  for (size_t k = 0; k < params_.size(); ++k) {
    if (!params_[k].trainable) continue;
    auto acc = torch::autograd::impl::grad_accumulator(params_[k].param);
    if (!acc) throw ember::RunError(o_.name + ": parameter '" + params_[k].name + "' is not a leaf tensor that requires grad");
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, k](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list& /*inputs*/) {
          on_gradient_ready(k);
          return outputs;
        }));
    accumulators_.push_back(std::move(acc));
  }
}

c10::Dict<std::string, at::Tensor> ZeroStrategy::full_model_state(bool rank0_only) {
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

void ZeroStrategy::load_full_model_state(const c10::Dict<std::string, at::Tensor>& state) {
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
std::string ZeroStrategy::full_optimizer_state(bool rank0_only) {
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

void ZeroStrategy::load_full_optimizer_state(const std::string& bytes) {
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
c10::IValue ZeroStrategy::sharded_state() {
  using Dict = c10::impl::GenericDict;
  Dict part(c10::StringType::get(), c10::AnyType::get());
  part.insert("world_size", static_cast<int64_t>(world()));
  part.insert("rank", static_cast<int64_t>(comm_.rank()));
  part.insert("stage", static_cast<int64_t>(o_.stage));
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
void ZeroStrategy::load_sharded_state(int64_t saved_world, const std::function<c10::IValue(int64_t)>& read_part) {
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


ember::IStrategy* make(ember::IHost& host, const ember::IConfig& cfg, ZeroOptions o) { return new ZeroStrategy(host, cfg, std::move(o)); }

}  // namespace

ZeroOptions read_zero_options(std::string name, const ember::IConfig& cfg) {
  ZeroOptions o;
  o.name = std::move(name);
  o.bucket_cap_bytes = std::max<int64_t>(1, static_cast<int64_t>(cfg.get_float("bucket_cap_mb") * 1024.0 * 1024.0));
  o.prefetch = cfg.get_bool("prefetch");
  o.min_unit_params = cfg.get_int("auto_wrap_min_params");
  o.broadcast_buffers = cfg.get_bool("broadcast_buffers");
  o.sharded_checkpoints = cfg.get_string("state_dict_type") == "sharded";
  return o;
}

ember::IStrategy* make_zero_strategy(ember::IHost& host, const ember::IConfig& cfg, ZeroOptions options) {
  return make(host, cfg, std::move(options));
}

}  // namespace ember_shard
