// local_sgd: every rank trains on its own share of the data with its own optimizer, and the ranks
// average their parameters (and floating buffers) every `sync_every` optimizer steps: Local SGD
// (Stich 2019; Lin et al. 2020), which trades gradient traffic on every step for one parameter
// all-reduce every k steps. With sync_every = 1 and plain SGD it takes the same steps as ddp.
//
// A checkpoint is a sync point: the ranks average before the state is saved, so the saved model is
// the ranks' consensus and a resume starts every rank from it. The optimizer state saved is rank
// 0's (stateless SGD resumes exactly; momentum or Adam moments of other ranks restart from rank 0's).
//
// Built out of tree against the installed SDK and Ember::distributed (CMakeLists.txt next to it);
// tests/local_sgd_test.cpp builds, installs and trains it.
#include <ember/distributed/communicator.h>
#include <ember/plugin.h>
#include <ember/support/replicating_strategy.h>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <string>
#include <vector>

namespace {

constexpr EmberConfigKey kKeys[] = {
    EMBER_DIST_CONFIG_KEYS,
    ember::key::Int("sync_every", "8", "Optimizer steps each rank takes alone between two parameter averages.").at_least(1),
};

class LocalSgd final : public ember::ReplicatingStrategy {
 public:
  LocalSgd(ember::IHost& host, const ember::IConfig& cfg)
      : comm_("local_sgd", host, cfg), sync_every_(cfg.get_int("sync_every")) {}
  ~LocalSgd() override { teardown(); }

  bool launch(const ember::LaunchRequest& request, int* exit_code) override { return comm_.launch(request, exit_code); }
  c10::Device root_device() const override { return comm_.device(); }
  int64_t rank() const override { return comm_.rank(); }
  int64_t world_size() const override { return comm_.world(); }
  int64_t local_rank() const override { return comm_.info().local_rank; }

  void place_module(torch::nn::Module& module) override {
    module.to(comm_.device());
    comm_.broadcast_module_from_zero(module);  // every rank starts from rank 0's weights
    module_ = &module;
  }
  ember::Batch batch_to_device(ember::Batch batch) override { return comm_.batch_to_device(std::move(batch)); }

  // No gradient communication: each rank's gradients are its own.
  void backward(const at::Tensor& loss, ember::IPrecision& precision, bool /*sync_gradients*/) override {
    precision.backward(loss);
  }
  bool optimizer_step(ember::IOptimizerStep& step, ember::IPrecision& precision) override {
    const bool stepped = precision.optimizer_step(step);
    if (++steps_since_sync_ >= sync_every_) average();
    return stepped;
  }

  // Collective (every rank saves at the same point): the saved model is the average.
  c10::Dict<std::string, at::Tensor> full_model_state(bool rank0_only) override {
    if (steps_since_sync_ > 0) average();
    return ReplicatingStrategy::full_model_state(rank0_only);
  }

  at::Tensor reduce(const at::Tensor& value, ember::ReduceOp op) override { return comm_.reduce(value, op); }
  void barrier(const char* name) override { comm_.barrier(name); }
  bool broadcast_flag(bool value) override { return comm_.broadcast_flag(value); }
  at::Tensor broadcast(const at::Tensor& value, int64_t src) override { return comm_.broadcast(value, src); }
  void teardown() override {
    comm_.teardown("local_sgd: " + std::to_string(averages_) + " parameter averages every " + std::to_string(sync_every_) + " steps");
  }

 private:
  // The ranks' mean of every parameter and floating buffer: one all-reduce per dtype over them
  // all, flattened (Ember::distributed's coalesced collective).
  void average() {
    steps_since_sync_ = 0;
    if (module_ == nullptr) return;
    std::vector<at::Tensor> tensors;
    for (const auto& p : module_->parameters()) tensors.push_back(p);
    for (const auto& b : module_->buffers())
      if (b.is_floating_point()) tensors.push_back(b);
    comm_.all_reduce_coalesced(tensors, ember::ReduceOp::mean, "local_sgd parameter average");
    ++averages_;
  }

  ember_dist::Communicator comm_;
  int64_t sync_every_, steps_since_sync_ = 0, averages_ = 0;
  torch::nn::Module* module_ = nullptr;
};

ember::IStrategy* make(ember::IHost& host, const ember::IConfig& cfg) { return new LocalSgd(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IStrategy, "local_sgd", "0.1.0", "Apache-2.0",
             "Local SGD: ranks step alone and average their parameters every sync_every steps (" EMBER_DIST_BACKENDS ").",
             EMBER_CONFIG_KEYS(kKeys), make)
