// ember::Fabric: keep your own training loop, and let Ember's strategy and precision plugins do
// the launch, placement, gradient synchronisation, mixed precision and checkpoints (Lightning
// Fabric's API, in C++). docs/library.md has the whole picture.
//
//   ember::Fabric fabric({.strategy = "ddp", .precision = "bf16-mixed", .devices = 2});
//   return fabric.launch([&](ember::Fabric& f) {
//     f.seed_everything(42);
//     auto net = std::make_shared<Net>();
//     auto opt = f.setup(net, [](std::vector<at::Tensor> p) { return std::make_shared<torch::optim::Adam>(p); });
//     for (auto [x, y] : my_batches) {
//       x = f.to_device(x); y = f.to_device(y);
//       f.zero_grad();
//       at::Tensor loss;
//       { auto region = f.autocast(); loss = cross_entropy(net->forward(x), y); }
//       f.backward(loss);
//       f.optimizer_step();
//     }
//   });
//
// A Fabric owns no process-wide state another Fabric would fight over: no signal handlers, no
// default dtype; the global RNG only through seed_everything(). Errors in what the program asked
// (an unknown plugin, a bad plugin setting, calls in the wrong order) are ember::ConfigError or
// ember::RunError with a one-line message; launch() turns them into an exit code.
#pragma once
#include <ember/library.h>
#include <ember/tensor_parallel.h>
#include <ember/types.h>

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch::nn { class Module; }
namespace torch::optim { class Optimizer; }

namespace ember::metrics {
class Metric;
class MetricCollection;
}  // namespace ember::metrics

namespace ember {

struct FabricOptions {
  std::string accelerator = "auto";   // auto | cpu | cuda (gpu: Lightning's name for cuda)
  // A strategy plugin's name (single_device, ddp, sharded, offload, ...); "auto": ddp when
  // devices x num_nodes > 1, else single_device (the engine's trainer.strategy = "auto").
  std::string strategy = "auto";
  // Lightning's strings (64-true, 32-true, 16-mixed, bf16-mixed, 16-true, bf16-true, the aliases
  // 64/32/16/bf16, auto) or a precision plugin's name.
  std::string precision = "32-true";
  int64_t devices = 1;     // ranks per node (what launch() starts)
  int64_t num_nodes = 1;
  // Folders searched for plugins before EMBER_PLUGIN_PATH and the folder installed next to
  // libember.so (<prefix>/lib/ember/plugins).
  std::vector<std::string> plugin_paths;
  // TOML for the plugins' own sections, checked against their schemas as the engine checks a
  // run.toml: "[ddp]\nbackend = \"mpi\"\n[csv]\nflush_logs_every_n_steps = 10\n". A top-level
  // `plugins = [...]` may name logger plugins. Engine sections ([trainer], [model], [data],
  // [optimizer]) are refused: their settings are the program's.
  std::string plugin_config;
  std::vector<std::string> loggers;  // logger plugins for log() ("csv", "tensorboard"), rank 0 only
  std::string root_dir = "runs";     // loggers write into <root_dir>/<name>/version_<n>
  std::string name = "fabric";
  // The program's command line, which launch() re-executes for every rank (ddp's local launcher);
  // empty: read from /proc/self/cmdline.
  std::vector<std::string> argv;
  // Tensor parallelism (docs/parallelism.md; Lightning's ModelParallelStrategy): the ranks each
  // layer is split over (devices x num_nodes must divide by it; a strategy with a device mesh:
  // ddp, sharded, offload), and the program's plan, which setup() calls once on the whole module:
  // it keeps the rank's slices of the module's parameters (<ember/support/tensor_parallel.h>),
  // makes the module's forward use `group`, and returns what it split.
  int64_t tensor_parallel = 1;
  bool sequence_parallel = false;
  std::function<std::vector<TensorShard>(torch::nn::Module& module, ITensorParallelGroup& group)> parallelize;
};

// What save() writes besides the set-up model and optimizer, and what load() gives back.
struct FabricState {
  bool model = true;        // the set-up module's parameters and buffers (the checkpoint's state_dict)
  bool optimizer = true;    // the set-up optimizer's state
  // Loop position, written where the engine's checkpoints keep it: `engine --resume` of this file
  // continues with epoch `epoch + 1` at optimizer step `global_step`.
  int64_t global_step = 0;
  int64_t epoch = 0;
  // The program's own values: tensors, numbers, strings, lists and dicts of them.
  std::map<std::string, c10::IValue> values;
};

// PyTorch's DistributedSampler: this rank's share of the indices 0..size-1, shuffled per epoch
// with `seed + epoch` (the same permutation on every rank, from ATen's randperm), then either
// padded by repeating the first indices (drop_last = false) or cut (drop_last = true) to a
// multiple of the number of ranks, and taken as indices[rank::num_replicas].
class EMBER_API DistributedSampler {
 public:
  DistributedSampler(int64_t size, int64_t num_replicas, int64_t rank, bool shuffle = true, uint64_t seed = 0,
                     bool drop_last = false);
  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  std::vector<int64_t> indices() const;   // this rank's indices for the current epoch
  int64_t num_samples() const { return num_samples_; }  // per rank, every epoch
  int64_t total_size() const { return num_samples_ * num_replicas_; }

 private:
  int64_t size_, num_replicas_, rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  int64_t num_samples_ = 0, epoch_ = 0;
};

// Builds the optimizer over the tensors it is given (the module's parameters in
// named_parameters() order, or this rank's shards of them under a sharding strategy).
using OptimizerFactory = std::function<std::shared_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> params)>;

class EMBER_API Fabric {
 public:
  // Loads the strategy and precision plugins (and loggers), validates plugin_config against their
  // schemas. Throws ember::ConfigError (one line) for an unknown name or a bad setting.
  explicit Fabric(FabricOptions options = {});
  ~Fabric();  // finishes the loggers ("success" unless launch() saw a failure) and the strategy
  Fabric(const Fabric&) = delete;
  Fabric& operator=(const Fabric&) = delete;

  // Starts the ranks as the strategy does (ddp: re-executes the program once per local rank, or
  // joins torchrun/srun/mpirun) and runs fn(*this) on each. Returns the exit code: on a launcher,
  // the job's; on a rank, 0, or 2 (ConfigError) / 1 (any other error, printed as one line).
  int launch(const std::function<void(Fabric&)>& fn);

  // Contract 2 of the strategy (docs/strategy.md): the precision handler converts the module, the
  // strategy places/wraps/shards it (broadcasting rank 0's weights), then builds the optimizer
  // through `make_optimizer`. Returns that optimizer. One model per Fabric. Without launch() it
  // sets up a single process (a job of more ranks must go through launch()).
  std::shared_ptr<torch::optim::Optimizer> setup(std::shared_ptr<torch::nn::Module> module,
                                                 const OptimizerFactory& make_optimizer);

  // A sampler over `size` samples for this rank (rank(), world_size()).
  DistributedSampler distributed_sampler(int64_t size, bool shuffle = true, uint64_t seed = 0, bool drop_last = false);

  // Onto this rank's device, converted by the precision handler (fp64 / true half inputs).
  Batch to_device(Batch batch);
  at::Tensor to_device(const at::Tensor& tensor);

  // The forward region: the strategy's (parameters gathered) around the precision handler's
  // (autocast). Forward and loss go inside; both end when the object goes out of scope.
  class EMBER_API ForwardRegion {
   public:
    ForwardRegion(ForwardRegion&& other) noexcept : fabric_(std::exchange(other.fabric_, nullptr)) {}
    ForwardRegion(const ForwardRegion&) = delete;
    ForwardRegion& operator=(const ForwardRegion&) = delete;
    ForwardRegion& operator=(ForwardRegion&&) = delete;
    ~ForwardRegion();

   private:
    friend class Fabric;
    explicit ForwardRegion(Fabric* fabric) : fabric_(fabric) {}
    Fabric* fabric_;
  };
  // `grad_enabled` = false for a forward no backward follows (evaluation).
  [[nodiscard]] ForwardRegion autocast(bool grad_enabled = true);

  // Backward of the loss through the strategy (gradient sync) and the precision handler (loss
  // scaling). Inside a no_backward_sync() scope gradients accumulate without communication.
  void backward(const at::Tensor& loss);
  class EMBER_API NoBackwardSync {
   public:
    NoBackwardSync(NoBackwardSync&& other) noexcept : fabric_(std::exchange(other.fabric_, nullptr)) {}
    NoBackwardSync(const NoBackwardSync&) = delete;
    NoBackwardSync& operator=(const NoBackwardSync&) = delete;
    NoBackwardSync& operator=(NoBackwardSync&&) = delete;
    ~NoBackwardSync();

   private:
    friend class Fabric;
    explicit NoBackwardSync(Fabric* fabric) : fabric_(fabric) {}
    Fabric* fabric_;
  };
  [[nodiscard]] NoBackwardSync no_backward_sync();

  // Lightning's fabric.clip_gradients: call between backward() and optimizer_step(). The precision
  // handler unscales the gradients first (16-mixed; the step then does not unscale again), then
  // the strategy clips them in place. By norm (max_norm): scales all gradients so their total
  // 2-norm is at most `max` and returns that total norm before clipping (torch's clip_grad_norm_;
  // across ranks when the strategy shards gradients), a float32 scalar on the gradients' device,
  // not read back to the host. By value (clip_val): clamps every gradient element to [-max, max]
  // and returns an undefined tensor (Lightning returns None).
  at::Tensor clip_gradients(double max, ClipAlgorithm algorithm = ClipAlgorithm::norm);
  // strategy.optimizer_step -> precision.optimizer_step (unscale, clip, step unless the gradients
  // are inf/NaN). Call after backward(). Returns false when the precision handler skipped the step.
  bool optimizer_step();
  void zero_grad();  // through the strategy (set to none)

  // Collectives over all ranks (identity on one process).
  at::Tensor all_reduce(const at::Tensor& value, ReduceOp op = ReduceOp::mean);
  void barrier(const std::string& name = "fabric");
  // Rank src's tensor (dtype, shape, values) on every rank, through the strategy's communicator
  // (torch.distributed.broadcast). The other ranks' `value` only names the device they want it
  // on (may be undefined). Any dense dtype; a sparse or quantized tensor is a RunError on every rank.
  at::Tensor broadcast(const at::Tensor& value, int64_t src = 0);
  bool broadcast(bool flag);                                        // rank 0's flag on every rank
  // Metrics of <ember/support/metrics.h> (F1, AUROC, a confusion matrix...) over the whole data:
  // every rank's states reduced by their declared reduction (counts summed over the data-parallel
  // ranks, one collective per reduction and dtype; exact curves' scores gathered), so compute()
  // then gives the same value on every rank. Call on every rank, e.g. after the last evaluation
  // batch; then log compute() and reset().
  void sync(metrics::MetricCollection& metrics);
  void sync(metrics::Metric& metric);

  int64_t rank() const;
  int64_t local_rank() const;
  int64_t world_size() const;
  bool is_global_zero() const { return rank() == 0; }
  c10::Device device() const;
  std::string strategy_name() const;
  std::string precision_name() const;

  // Seeds LibTorch's global generators (CPU and every GPU); the only global state Fabric touches.
  void seed_everything(uint64_t seed);

  // Every parameter and buffer of the set-up module, whole, on the CPU, by name (gathered by the
  // strategy). Collective: every rank calls it; with rank0_only, ranks other than 0 get an empty
  // dict. Read weights through this, not module->parameters(): under a sharding strategy (ZeRO-3)
  // the module's own parameters are only materialised inside the forward region.
  c10::Dict<std::string, at::Tensor> full_model_state(bool rank0_only = false);

  // Writes `state` (and the set-up model and optimizer, gathered by the strategy) to `path` in the
  // engine's checkpoint format, atomically; only rank 0 writes, every rank must call it.
  void save(const std::string& path, const FabricState& state = {});
  // save() in the background (docs/checkpoint.md, "Asynchronous checkpoints"): the state is
  // gathered and copied to host memory here, then a thread of this rank writes it (rank 0 the
  // file, or every rank its part of a sharded directory) while the program goes on. At most one
  // write is in flight: the next save, save_async or load first finishes it. Committed atomically
  // as save() is; finish_saves() waits for it and reports a failed write on every rank. Collective.
  void save_async(const std::string& path, const FabricState& state = {});
  // Blocks until the background save is written and committed on every rank; throws RunError on
  // every rank when it failed (the previous checkpoint at that path stays whole). Collective;
  // nothing when none is pending. launch() calls it when the program's function returns; a
  // Fabric that goes away with a save pending (without launch) finishes this rank's write but
  // commits no sharded directory.
  void finish_saves();
  // Restores the model, optimizer and the plugins' state from `path` (a file written by save() or
  // by the engine) into what setup() made, and returns the rest. Every rank reads the file.
  FabricState load(const std::string& path);

  // Rank-aware logging through the logger plugins: rank 0 writes, other ranks do nothing.
  void log(const std::string& name, double value, int64_t step);
  void log_dict(const std::vector<std::pair<std::string, double>>& values, int64_t step);
  // The loggers' folder (<root_dir>/<name>/version_<n>), "" before the first log() or off rank 0.
  std::string log_dir() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ember
