// ddp: multi-process data parallel on LibTorch's c10d. One rank per device; gradients are
// all-reduced in buckets while backward runs (grad_buckets.h); ranks come from the local
// launcher (trainer.devices = N), torchrun, mpirun or srun, and talk through NCCL on GPUs or
// Open MPI on CPUs (sdk/distributed: Ember::distributed, docs/decisions.md).
#include <ember/error.h>
#include <ember/plugin.h>
#include <ember/support/replicating_strategy.h>
#include <ember/strategy.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <ember/distributed/communicator.h>
#include "grad_buckets.h"

namespace {

using namespace ember_dist;
using ember_ddp::GradBuckets;

constexpr EmberConfigKey kKeys[] = {
    EMBER_DIST_CONFIG_KEYS,
    ember::key::Float("bucket_cap_mb", "25.0",
                      "Gradients are all-reduced in buckets of about this many megabytes, each starting as soon as its gradients are ready.")
        .above(0.0),
    ember::key::Bool("find_unused_parameters", "false",
                     "PyTorch DDP's flag: a parameter that no rank used in a step keeps no gradient (so the optimizer and "
                     "weight decay leave it alone), at the cost of reading a small mask back each step; false: a parameter "
                     "without a gradient is an error naming it."),
    ember::key::Bool("broadcast_buffers", "true",
                     "Every rank takes rank 0's buffers (batch-norm statistics) before each forward in training mode, and once before "
                     "evaluating after one (PyTorch DDP's broadcast_buffers), so all ranks evaluate with the same statistics."),
};

class Ddp final : public ember::ReplicatingStrategy {
 public:
  Ddp(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        comm_("ddp", host, cfg),
        bucket_cap_bytes_(static_cast<int64_t>(cfg.get_float("bucket_cap_mb") * 1024.0 * 1024.0)),
        find_unused_(cfg.get_bool("find_unused_parameters")),
        buffers_(cfg.get_bool("broadcast_buffers")) {
    if (bucket_cap_bytes_ < 1) bucket_cap_bytes_ = 1;
  }

  ~Ddp() override { teardown(); }

  bool launch(const ember::LaunchRequest& request, int* exit_code) override { return comm_.launch(request, exit_code); }

  c10::Device root_device() const override { return comm_.device(); }
  int64_t rank() const override { return comm_.rank(); }
  int64_t world_size() const override { return comm_.world(); }
  int64_t local_rank() const override { return comm_.info().local_rank; }

  void place_module(torch::nn::Module& module) override {
    module.to(comm_.device());
    comm_.broadcast_module_from_zero(module);  // every rank starts from rank 0's weights and buffers
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    for (auto& p : module.named_parameters())
      if (p.value().requires_grad()) {
        params.push_back(p.value());
        names.push_back(p.key());
      }
    buckets_ = std::make_unique<GradBuckets>(params, names, bucket_cap_bytes_, comm_.backend_ptr(), comm_.world(), find_unused_,
                                             [this](std::string l) { comm_.label(std::move(l)); });
  }

  void forward_begin(bool /*grad_enabled*/) override { buffers_.before_forward(state_.module(), comm_); }

  ember::Batch batch_to_device(ember::Batch batch) override { return comm_.batch_to_device(std::move(batch)); }

  void backward(const at::Tensor& loss, ember::IPrecision& precision, bool sync_gradients) override {
    buckets_->begin(sync_gradients);
    try {
      precision.backward(loss);
    } catch (...) {
      buckets_->abandon();
      throw;
    }
    if (sync_gradients) buckets_->finish();
  }

  bool optimizer_step(ember::IOptimizerStep& step, ember::IPrecision& precision) override {
    return precision.optimizer_step(step);
  }

  // Clipping: ReplicatingStrategy's; gradients are identical on every rank after the sync.

  at::Tensor reduce(const at::Tensor& value, ember::ReduceOp op) override { return comm_.reduce(value, op); }
  void barrier(const char* name) override { comm_.barrier(name); }
  bool broadcast_flag(bool value) override { return comm_.broadcast_flag(value); }
  at::Tensor broadcast(const at::Tensor& value, int64_t src) override { return comm_.broadcast(value, src); }

  void teardown() override {
    std::string stats;
    if (buckets_) {
      const auto& s = buckets_->stats();
      stats = "ddp: " + std::to_string(s.syncs) + " gradient syncs, " + std::to_string(s.all_reduces) + " bucket all-reduces in " +
              std::to_string(s.buckets) + " buckets, " + std::to_string(s.started_early) + " started while backward was still running";
    }
    comm_.teardown(stats);
  }

  // What a checkpoint records: the world size, so a resume on another number of ranks says that
  // the data order changes from there on.
  c10::IValue state_dict() const override {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert("world_size", static_cast<int64_t>(comm_.world()));
    return d;
  }
  void load_state_dict(const c10::IValue& state) override {
    if (!state.isGenericDict()) return;
    auto d = state.toGenericDict();
    if (!d.contains("world_size")) return;
    const int64_t saved = d.at("world_size").toInt();
    if (saved != comm_.world())
      host_.log(ember::LogLevel::warn, "ddp: the checkpoint was written by " + std::to_string(saved) + " ranks and is resumed on " +
                                           std::to_string(comm_.world()) + ": each rank's share of the data differs from here on");
  }

 private:
  ember::IHost& host_;
  Communicator comm_;
  int64_t bucket_cap_bytes_;
  bool find_unused_;
  BufferBroadcast buffers_;
  std::unique_ptr<GradBuckets> buckets_;
};

ember::IStrategy* make(ember::IHost& host, const ember::IConfig& cfg) { return new Ddp(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IStrategy, "ddp", "0.1.0", "Apache-2.0",
             "Multi-process data parallel: one rank per device, bucketed gradient all-reduce overlapping backward (" EMBER_DIST_BACKENDS ").",
             EMBER_CONFIG_KEYS(kKeys), make)
