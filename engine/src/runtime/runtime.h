// ember::engine::Runtime: the one object that drives the strategy and the precision handler
// (Lightning's Strategy holding its Precision; Marian's GraphGroup). Every loop goes through it:
// the engine's TrainingLoop (fit, evaluation, predict, the tuners' trial steps) and ember::Fabric
// (the program's own loop). Nothing else in the engine calls IStrategy or IPrecision for a step,
// a set-up or a collective; docs/engine.md has the call sequence.
//
// Life cycle (each call Requires the ones before it):
//   Runtime rt(strategy);               the strategy object, made from the plan
//   rt.launch(request, &code)           processes and ranks (false: this process only launched others)
//   rt.set_precision(precision)         made after launch, on the rank's own process
//   rt.setup(model, factory)            precision converts, strategy places/shards, builds the optimizer
//   ... forward / backward / optimizer_step / clip / zero_grad / collectives / state ...
//   rt.teardown()                       once, success or not (the destructor does not)
#pragma once
#include <ember/model.h>
#include <ember/pipeline.h>
#include <ember/precision.h>
#include <ember/strategy.h>

#include <c10/core/Device.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/background_write.h"
#include "checkpoint/sharded_checkpoint.h"
#include "registry/named.h"

namespace ember {
class IConfig;
}

namespace ember::engine {

struct OmittedParameters;

class Runtime {
 public:
  explicit Runtime(Named<IStrategy> strategy);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // ---- launch
  // The LaunchRequest of a [trainer] table (devices, num_nodes, accelerator), a [parallelism]
  // table (the mesh's degrees, data_parallel_shard's -1 resolved) and a command line: the one
  // place it is built (the engine's run and Fabric's). Throws ConfigError, naming the key's
  // file:line and the arithmetic, when the degrees do not multiply to devices x num_nodes.
  static LaunchRequest launch_request(const IConfig& trainer, const IConfig& parallelism, std::vector<std::string> argv);
  // [parallelism]'s pipeline settings (schedule, micro-batches, virtual stages, stage units), with
  // where each comes from, for launch().
  static PipelineOptions pipeline_options(const IConfig& parallelism);
  // Starts the ranks. Returns true on a process that trains (then rank() and the rest are valid;
  // the log is tagged with the rank); false on a process that only launched others, whose exit
  // code is *exit_code. Calling it again after true does nothing and returns true.
  // With request.pipeline_parallel > 1 the strategy must answer kPipelineParallelIid (a
  // ConfigError otherwise) and gets `pipeline` once launched.
  bool launch(const LaunchRequest& request, int* exit_code, const PipelineOptions& pipeline = {});
  bool launched() const { return launched_; }
  // The strategy's pipeline when the mesh has stages (the strategy owns the micro-batch window:
  // the loops hand it whole batches); nullptr otherwise.
  IPipelineParallel* pipeline() const { return pipeline_; }
  // Through the pipeline: a training batch (forward and backward of its micro-batches, the loss
  // divided by `loss_divisor`; zero_grad is the caller's) and an evaluation batch. Requires
  // pipeline(); the forward region is the caller's.
  at::Tensor pipeline_train_batch(const Batch& batch, IModel& model, IStepContext& ctx, double loss_divisor, bool sync_gradients);
  at::Tensor pipeline_evaluate_batch(const Batch& batch, IModel& model, IStepContext& ctx);
  // Requires launched(). What the data and the metric sums split over: the strategy's
  // data-parallel rank and size when it has a device mesh (ember/tensor_parallel.h), else the
  // global ones.
  int64_t data_parallel_rank() const;
  int64_t data_parallel_size() const;
  // Requires launched(). The precision handler of the run (made after launch).
  void set_precision(Named<IPrecision> precision);
  bool has_precision() const { return precision_.object != nullptr; }

  // ---- set-up (Lightning's order, docs/strategy.md): the precision handler converts the
  // module, the strategy places/wraps/shards it, then builds the optimizer through `factory` over
  // what it trains. Requires set_precision; once. Ensures: optimizer() is valid.
  std::shared_ptr<torch::optim::Optimizer> setup(IModel& model, IOptimizerFactory& factory);
  bool is_setup() const { return optimizer_ != nullptr; }

  // ---- the step
  // A host batch on the training device, cast as the precision handler wants it.
  Batch to_device(Batch batch);
  // The forward region of a step (training, evaluation, prediction, a tuner's pass): the
  // strategy's (parameters gathered) around the precision handler's (autocast). Both ends run even
  // when the step throws.
  class ForwardRegion {
   public:
    ForwardRegion(ForwardRegion&& other) noexcept : rt_(other.rt_) { other.rt_ = nullptr; }
    ForwardRegion(const ForwardRegion&) = delete;
    ForwardRegion& operator=(const ForwardRegion&) = delete;
    ~ForwardRegion();

   private:
    friend class Runtime;
    explicit ForwardRegion(Runtime* rt) : rt_(rt) {}
    Runtime* rt_;
  };
  [[nodiscard]] ForwardRegion forward(bool grad_enabled);
  // Drops the gradients of everything this rank trains.
  void zero_grad();
  // Backward of one micro-batch (scaled if the precision scales); `sync_gradients` is false while
  // gradients accumulate (no communication then).
  void backward(const at::Tensor& loss, bool sync_gradients);
  // One optimizer step: strategy -> precision -> step.closure(), unscale, step.before_step(),
  // step.step() unless the gradients are inf/NaN. Returns false when the step was skipped.
  // Throws RunError naming the plugins when none of them ran the closure (a plugin bug).
  bool optimizer_step(IOptimizerStep& step);
  // Inside a step's before_step (the precision handler has unscaled): clips in place, without a
  // host sync; sharding strategies take the norm across ranks.
  void clip_gradients(double max, ClipAlgorithm algorithm);
  // Between backward and optimizer_step, outside a step (Fabric): unscales first (once per step),
  // then clips. Returns the total 2-norm before clipping for ClipAlgorithm::norm (a device tensor,
  // over all ranks' shards), undefined for value clipping.
  at::Tensor unscale_and_clip_gradients(double max, ClipAlgorithm algorithm);

  // ---- collectives (identity on one process)
  at::Tensor reduce(const at::Tensor& value, ReduceOp op);
  // True on every rank when `flag` is true on any rank: the vote for decisions that change
  // control flow (stop, a failed write). No collective on one process.
  bool any_rank(bool flag);
  void barrier(const char* name);
  bool broadcast_flag(bool value);
  // Rank `src`'s tensor on every rank (IStrategy::broadcast; the tensor itself on one process).
  at::Tensor broadcast(const at::Tensor& value, int64_t src);

  // ---- state (Requires is_setup())
  // The strategy, for the model-state calls the loops make themselves (trained_parameters,
  // parameters_changed).
  IStrategy& state() { return *strategy_.object; }
  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  const std::shared_ptr<torch::optim::Optimizer>& optimizer_ptr() const { return optimizer_; }
  // Whether the strategy reads sharded checkpoint directories (kShardedCheckpointsIid), and
  // whether this run writes them.
  bool reads_sharded_checkpoints() const { return sharded_; }
  bool writes_sharded_checkpoints() const { return sharded_ && strategy_.object->sharded_checkpoints(); }
  // Collective: gathers the full model state (when with_model) and the optimizer's (when
  // with_optimizer; "" otherwise), calls `write` with them on rank 0, and makes every rank throw
  // when rank 0's write failed (so no rank is left waiting in a later collective); rank 0 rethrows
  // its own error. `what` names the file in that message.
  using FullStateWriter = std::function<void(const c10::Dict<std::string, at::Tensor>& model, const std::string& optimizer)>;
  void save_full(bool with_model, bool with_optimizer, const FullStateWriter& write, const std::string& what);

  // ---- checkpoints: one document, a file or a sharded directory (docs/checkpoint.md) ----
  // Collective. Writes the checkpoint `path`: under a strategy whose checkpoints are sharded (and
  // when the model and optimizer are both saved) a directory of one part per rank plus meta.ckpt,
  // nothing gathered; otherwise one file with the model's state (when with_model) and the
  // optimizer's (when with_optimizer), gathered on rank 0. `meta` builds the rest of the document
  // (header, loop position, RNG, plugin states); it runs on rank 0 only. Atomic either way: a
  // failed or killed save leaves the previous `path` whole, and every rank throws when one failed.
  // `own_states`: this rank's own callback states (loop/rank_states.h), written into its part of a
  // sharded directory; None, or a file, writes none.
  using CheckpointMeta = std::function<c10::impl::GenericDict()>;
  void save_checkpoint(const std::string& path, bool with_model, bool with_optimizer, const CheckpointMeta& meta,
                       const c10::IValue& own_states = c10::IValue());
  // The same written in the background (ITrainerAsyncCheckpoints, docs/checkpoint.md): the state
  // is gathered and copied to the host here (host_snapshot), then a thread of this rank writes it
  // (rank 0 the file; every rank its part of a sharded directory) while training goes on. First
  // finishes a background save still pending. Collective. The save stays pending until the loop
  // settles it: `committed` runs then, on every rank at the same step.
  // The same state goes to each of `paths`, in order.
  void save_checkpoint_async(const std::vector<std::string>& paths, bool with_model, bool with_optimizer, const CheckpointMeta& meta,
                             std::function<void()> committed, const c10::IValue& own_states = c10::IValue());
  // This rank's part of the stop vote for the pending background save: 0 none, or written here;
  // 1 still writing; 2 failed here. Never blocks.
  double background_save_vote();
  // Every rank, at the same point, with the largest vote over the ranks: 0 commits the pending
  // save (a sharded directory swapped into place: collective) and runs its `committed`; 2 throws
  // RunError on every rank (the writer's reason on the rank that failed); 1 does nothing.
  void settle_background_save(double worst_vote);
  // Blocks until the pending background save is written on this rank, then settles it with the
  // other ranks. Collective; nothing (no collective either) when none is pending.
  void finish_background_save();
  // After a failure (teardown): waits for this rank's writer without collectives and logs what
  // became of the pending save; a file already renamed into place stays, a sharded directory not
  // yet committed does not replace the previous one.
  void abandon_background_save();

  // What load_checkpoint restores besides the run's own tables, which stay the caller's.
  enum class Part { required, if_present, skip };
  // Restores the model's state (`model`) and the optimizer's (`optimizer`) from a checkpoint file
  // or a sharded directory (re-sharded onto this run's ranks; it always carries both, and with
  // `optimizer` skip only the model's part is read where the strategy answers IShardedModelState). Returns the
  // document's other tables (header, loops, rng, plugins, ...). Throws RunError starting with
  // "checkpoint PATH" for a missing required part, a state that does not fit, or a sharded
  // directory under a strategy that cannot read one (naming `engine checkpoint consolidate`).
  // `optimizer_fix` ends the line of an optimizer state that does not fit ("resume with the same
  // [optimizer] settings" for the engine's runs).
  c10::impl::GenericDict load_checkpoint(const std::filesystem::path& path, Part model, Part optimizer,
                                         const std::string& optimizer_fix = "resume with the same [optimizer] settings");
  // The callback states rank `k` of the saving run wrote into its part of sharded directory `dir`
  // (None when it wrote none): kept from load_checkpoint's read of that part, else read now.
  c10::IValue part_callback_states(const std::filesystem::path& dir, int64_t k);
  // [model] init_checkpoint: the model's state from checkpoint file `path` (full or weights only;
  // its optimizer, loop and plugin states are not read), each tensor from where `pick` says (all
  // from the checkpoint where `pick` is empty): init_exclude's keep this run's own initial values,
  // and what a plugin added to the model (LoRA's adapters) comes from the checkpoint where it holds
  // it (the names that kept their values because it does not go to `kept_absent`; a directory's
  // strategy logs their count). Or from a sharded directory, under a strategy that answers
  // IShardedModelState(Selective) (each rank reads its shards). Returns the document's other tables. Throws
  // RunError starting with "checkpoint PATH" for a sharded directory another strategy cannot read
  // (naming consolidate), a file without a model state, or a state that lacks or misfits a tensor
  // that must come from it.
  c10::impl::GenericDict load_initial_weights(const std::filesystem::path& path, const std::function<InitialTensor(const std::string&)>& pick,
                                              std::vector<std::string>* kept_absent = nullptr);
  // Checkpoint files written from here on leave out these (frozen) parameters, recording them
  // (omitted_parameters.h); loading such a file takes them from this run's model, or those of
  // `from_base` from `base` (the run's init_checkpoint, absolute). Sharded directories and
  // `engine checkpoint consolidate` keep everything. Loading a checkpoint file that left out the
  // same parameters takes its record's source instead (a resume goes on from what it held).
  void omit_from_checkpoints(std::vector<std::string> names, std::string base = {}, std::vector<std::string> from_base = {}) {
    omitted_ = std::move(names);
    omitted_base_ = std::move(base);
    omitted_from_base_ = std::move(from_base);
  }

  // ---- identity
  int64_t rank() const { return strategy_.object->rank(); }
  int64_t world_size() const { return strategy_.object->world_size(); }
  int64_t local_rank() const { return strategy_.object->local_rank(); }
  c10::Device root_device() const { return strategy_.object->root_device(); }
  const Named<IStrategy>& strategy() const { return strategy_; }
  const Named<IPrecision>& precision() const { return precision_; }
  // Plugin objects that ask for the trainer (ITrainerAware) get it through the loop; these are
  // the objects themselves, for that and for state_dict().
  IStrategy& strategy_object() { return *strategy_.object; }
  IPrecision& precision_object() { return *precision_.object; }

  // Ends the strategy (processes, communicators); once, after a successful or a failed run.
  // Never throws: a failure is logged.
  void teardown();

 private:
  // A checkpoint document's model state, with the parameters it left out (omitted_parameters)
  // filled from this run's own model, after those its record says came from a base checkpoint
  // were read from that into the model.
  // `record`, when asked for: the file's omitted_parameters record (its base found from `path`).
  c10::Dict<std::string, at::Tensor> model_state_of(const c10::impl::GenericDict& ck, const std::filesystem::path& path,
                                                    std::optional<OmittedParameters>* record = nullptr);
  void load_omitted_from_base(const OmittedParameters& omitted, const std::string& where);
  // Throws RunError naming `where` (if not empty) when `state` holds tensors the model does not have: another
  // model's (more layers, a plugin's additions), which loading what fits would silently cut down.
  void refuse_foreign_tensors(const c10::Dict<std::string, at::Tensor>& state, const std::string& where) const;
  void refuse_foreign_tensors(const std::vector<std::string>& names, const std::string& where) const;
  // The same for a sharded directory, from the names its meta.ckpt records.
  void refuse_foreign_tensors(const c10::impl::GenericDict& sharded_meta, const std::string& where) const;
  std::set<std::string> model_tensors_;  // the whole model's parameter and buffer names (setup)
  int base_depth_ = 0;  // bases read within bases (a LoRA run started from another's checkpoint)
  // Declaration order is destruction order reversed: the strategy outlives the precision handler
  // and the optimizer it placed.
  Named<IStrategy> strategy_;
  Named<IPrecision> precision_;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  IGradientUnscaler* unscaler_ = nullptr;  // the precision handler's, when it scales the loss
  bool sharded_ = false;                   // the strategy answers kShardedCheckpointsIid
  IPipelineParallel* pipeline_ = nullptr;  // the strategy's, when the mesh has pipeline stages
  // Frozen parameters checkpoint files leave out, and their fingerprint (computed at the first save).
  std::vector<std::string> omitted_;
  std::optional<int64_t> omitted_fingerprint_;
  std::string omitted_base_;
  std::vector<std::string> omitted_from_base_;
  // Rank 0's model state as a checkpoint file holds it: without the omitted parameters, recorded in
  // `ck` (the base also relative to the folder of `paths`, the files it is written to).
  c10::Dict<std::string, at::Tensor> saved_model_state(const c10::Dict<std::string, at::Tensor>& state, c10::impl::GenericDict& ck,
                                                       const std::vector<std::string>& paths);
  bool launched_ = false, torn_down_ = false;
  // The background save started and not yet settled (the same on every rank).
  struct PendingSave {
    std::vector<std::string> paths;
    bool sharded = false;
    std::function<void()> committed;
    bool written_here = false;  // this rank's writer has ended and was collected
    std::string error;          // what it threw
  };
  std::unique_ptr<PendingSave> pending_save_;
  // The callback states of the parts the last load of a sharded directory read, by saved rank.
  std::filesystem::path states_dir_;
  std::map<int64_t, c10::IValue> part_callback_states_;
  std::unique_ptr<BackgroundWrite> writer_;
  ShardedWrite sharded_write();
  c10::impl::GenericDict sharded_meta(const CheckpointMeta& meta);
};

}  // namespace ember::engine
