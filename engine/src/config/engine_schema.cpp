#include "config/engine_schema.h"

#include <ember/support/fused_optim.h>
#include <ember/plugin.h>

#include <algorithm>
#include <map>
#include <set>

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

namespace ember::engine {
namespace {
using namespace ember::key;

constexpr EmberConfigKey kTrainerKeys[] = {
    Int("max_epochs", nullptr, "Stop after this many epochs; -1 = no limit. Unset: 1000 unless max_steps is set (Lightning).").at_least(-1),
    Int("max_steps", "-1", "Stop after this many optimizer steps; -1 = no limit.").at_least(-1),
    Number("overfit_batches", "0.0", "Overfit a fixed part of the data (Lightning's overfit_batches): train and validate on the first batches (an int a count, a float a fraction), in the same order every epoch; 0 = off.").at_least(0),
    Int("fast_dev_run", "0", "Smoke-test the whole run with this many batches of training, validation and test (true = 1; Lightning's fast_dev_run): one epoch, no sanity check, and the run folder removed at the end (kept when the run fails); 0 = off.").at_least(0),
    Int("min_epochs", "0", "Train at least this many epochs before a callback's stop request (early_stopping, timer) takes effect; 0 = no minimum (Lightning's min_epochs).").at_least(0),
    Int("min_steps", "0", "Train at least this many optimizer steps before a callback's stop request takes effect; 0 = no minimum (Lightning's min_steps).").at_least(0),
    String("max_time", nullptr, "Stop training after this much wall time, \"DD:HH:MM:SS\" (Lightning's max_time): adds the timer callback with this duration."),
    Number("limit_train_batches", "1.0", "Batches per training epoch: a float is a fraction of the epoch, an int a count.").at_least(0),
    Number("limit_val_batches", "1.0", "Validation batches per run: fraction (float) or count (int); 0 disables validation.").at_least(0),
    Number("limit_test_batches", "1.0", "Test batches: fraction (float) or count (int).").at_least(0),
    Number("limit_predict_batches", "1.0", "`engine predict` batches: fraction (float) or count (int).").at_least(0),
    Number("val_check_interval", "1.0", "Validate every this fraction of an epoch (float) or every this many training batches (int).").above(0),
    Int("check_val_every_n_epoch", "1", "Validate every n epochs; 0 = count val_check_interval batches across epochs (Lightning's None).").at_least(0),
    Int("num_sanity_val_steps", "2", "Validation batches run before training to catch bugs early; -1 = all, 0 = none.").at_least(-1),
    Int("accumulate_grad_batches", "1", "Accumulate gradients over k batches before each optimizer step.").at_least(1),
    Float("gradient_clip_val", nullptr, "Clip gradients to this norm or value; unset or 0 = no clipping.").at_least(0),
    String("gradient_clip_algorithm", "\"norm\"", "How to clip: by total 2-norm or by value.").choices("norm|value"),
    Int("log_every_n_steps", "50", "Send per-step metrics to loggers every n optimizer steps.").at_least(1),
    Int("seed", "0", "Seed for parameters, dropout, shuffling and splits.").at_least(0),
    Bool("deterministic", "false", "Use deterministic algorithms only (torch.use_deterministic_algorithms)."),
    Bool("detect_anomaly", "false",
         "Lightning's detect_anomaly: autograd's anomaly detection for the run (torch.autograd.set_detect_anomaly): a backward that "
         "produces NaN stops with the operation that made it. Slow: for debugging."),
    String("accelerator", "\"auto\"", "Device type: cuda when available, else cpu (auto), or force one (gpu: cuda, Lightning's name).").choices("auto|cpu|cuda|gpu"),
    Int("devices", "1", "Devices (processes for ddp) per node; \"auto\" or -1 (Lightning's): every visible GPU, 1 on a CPU. To pick GPUs, set CUDA_VISIBLE_DEVICES (e.g. 0,2) and devices to their count.").at_least(1),
    Int("num_nodes", "1", "Machines taking part in the run; 0 = as many as the launcher starts (an elastic job: torchrun --nnodes=MIN:MAX, its world may change from one restart to the next).").at_least(0),
    Int("max_restarts", "0", "When a rank of a job the engine launched itself (trainer.devices = N, one node) fails, start the whole group again up to this many times; each restart resumes from the last checkpoint (torchrun's --max-restarts for Ember's own launcher; configuration errors are not retried, nor a job stopped by a signal).").at_least(0),
    String("strategy", "\"auto\"", "Strategy plugin: auto (Lightning's: single_device for one device, ddp for more ranks), single_device, ddp, sharded, offload, or another installed strategy."),
    String("precision", "\"32-true\"", "Precision: 64-true, 32-true, 16-mixed, bf16-mixed, 16-true, bf16-true (or 64, 32, 16, bf16), auto (the fastest the device runs well, printed at start-up), or a precision plugin name."),
    String("default_root_dir", "\"runs\"", "Folder under which runs are written: <default_root_dir>/<name>/version_<n>."),
    String("name", nullptr, "Experiment name; unset = the config file's name without extension."),
    Int("version", nullptr, "Run version folder to use; unset = the next free version_<n>.").at_least(0),
    Bool("logger", "true", "Add the default logger (csv) when no logger plugin is named."),
    Bool("enable_checkpointing", "true", "Add the default checkpoint callback when none is named."),
    Bool("enable_progress_bar", "true", "Show progress (in place on a terminal, periodic lines otherwise)."),
    Bool("enable_model_summary", "true", "Add the default model_summary callback (layer table at fit start) when none is named."),
    Bool("test_after_fit", "false", "Run the test split after fit, on the checkpoint named by test_ckpt."),
    String("test_ckpt", "\"best\"", "Weights to test after fit: this run's best or last checkpoint (an error when it saved none), or the weights in memory (current).").choices("best|last|current"),
    StringList("stop_signals", "[\"SIGINT\", \"SIGTERM\", \"SIGUSR1\"]", "Signals that stop training after the current optimizer step, save last.ckpt and exit with 128+signal (SIGUSR1: Slurm's warning before the time limit, sbatch --signal=B:USR1@120). Any of SIGINT, SIGTERM, SIGUSR1, SIGUSR2, SIGHUP, SIGQUIT, SIGXCPU."),
    Bool("slurm_requeue", "true", "In a Slurm batch job stopped by SIGUSR1 (sbatch --signal=USR1@120), rank 0 runs `scontrol requeue` once last.ckpt is saved, so the job starts again and resumes (Lightning's auto_requeue). False leaves requeueing to the job script."),
    Int("num_threads", "0", "CPU threads for LibTorch's intra-op parallelism; 0 = OMP_NUM_THREADS when set, else the CPUs this process may use (sched_getaffinity), shared by the node's CPU processes.").at_least(0),
    Bool("flush_denormal", "true", "Flush denormal floats to zero on the CPU (torch.set_flush_denormal): x86 computes them up to 100x slower, and training drives many weights and gradients there."),
    String("float32_matmul_precision", "\"highest\"", "torch.set_float32_matmul_precision: highest (full float32), high (TF32 on CUDA tensor cores), medium (also bfloat16 passes).").choices("highest|high|medium"),
    Bool("benchmark", nullptr, "torch.backends.cudnn.benchmark (Lightning's Trainer(benchmark)): time the cuDNN algorithms for each new input shape and keep the fastest; unset = on unless deterministic."),
    Bool("cuda_graph", "false", "Capture forward, loss and backward as one CUDA graph after cuda_graph_warmup_steps and replay it for every batch of the same shapes: one launch instead of hundreds (the optimizer step, loss scaling, clipping and hooks run around it as usual). single_device on a GPU, no gradient accumulation (refused otherwise, at start-up)."),
    Int("cuda_graph_warmup_steps", "3", "Steps run as usual before the capture (cuDNN and cuBLAS settle, the optimizer makes its state).").at_least(1),
    String("activation_checkpointing", "\"none\"", "Trade compute for activation memory in training forwards: full = each unit of the model (a transformer block) keeps only its input and runs again during backward; selective = the model's own choice inside each unit (gpt: the MLP is recomputed, attention kept); none = keep everything. The same gradients either way. Models that declare units (gpt, transformer, bert, mlp).").choices("none|full|selective"),
    Bool("channels_last", "false", "Keep 4-d parameters and input batches in channels-last (NHWC) memory format, which oneDNN and cuDNN convolutions run faster on many devices."),
};

constexpr EmberConfigKey kOptimizerKeys[] = {
    String("name", "\"adam\"", "Optimizer: sgd, adam, adamw, rmsprop or adagrad (unless the model builds its own).").choices("sgd|adam|adamw|rmsprop|adagrad"),
    Float("lr", "0.001", "Learning rate.").above(0),
    Float("weight_decay", nullptr, "L2 penalty (decoupled for adamw); unset = the optimizer's default (0, or 0.01 for adamw).").at_least(0),
    StringList("no_weight_decay", "[]", "Parameters that take no weight decay: those whose name ends with an entry at a '.' (\"bias\", \"ln_f.weight\") or matches an entry as a regular expression (\".*norm.*\"), e.g. Hugging Face's [\"bias\", \"LayerNorm.weight\"]. They form a second parameter group with weight_decay = 0; every entry must match a trained parameter."),
    Bool("no_weight_decay_1d", "false", "Parameters with fewer than 2 dimensions (biases, LayerNorm and RMSNorm scales) take no weight decay, as nanoGPT and timm do; matrices, convolution kernels and embeddings keep optimizer.weight_decay. A second parameter group with weight_decay = 0 (with no_weight_decay, the same group)."),
    StringList("backbone", "[]", "The pretrained part of the model, fine-tuned more gently than the rest (Lightning's BackboneFinetuning, ULMFiT's discriminative rates): modules or parameters by name, an entry naming a module (\"layer1\", \"encoder\" takes encoder.*) or matching whole parameter names as a regular expression. Its parameters form their own groups, trained at lr x backbone_lr_scale (schedulers scale that rate as they scale lr); every entry must match a trained parameter."),
    Float("backbone_lr_scale", "0.1", "The backbone's learning rate as a fraction of lr (Lightning's 1 / initial_denom_lr).").above(0),
    Int("backbone_unfreeze_at_epoch", "0", "The backbone is frozen (no gradients, no updates) for the epochs before this one and trains from it on (Lightning's unfreeze_at_epoch); 0 = never frozen; -1 = frozen for the whole run (linear probing: it leaves the optimizer, under every strategy). Freezing for some epochs needs a strategy that trains the module's own parameters (single_device, ddp).").at_least(-1),
    Bool("backbone_train_bn", "true", "In the frozen epochs before backbone_unfreeze_at_epoch, the backbone's batch-norm layers (BatchNorm1d/2d/3d, sync_batchnorm's too) keep training their weight and bias, as Lightning's train_bn; false freezes them with the rest. Their running statistics update in training mode either way. backbone_unfreeze_at_epoch = -1 freezes everything backbone names: leave batch-norm layers out of it to train them."),
    Float("momentum", nullptr, "Momentum (sgd, rmsprop); unset = 0.").at_least(0),
    Float("dampening", nullptr, "Dampening of momentum (sgd); unset = 0.").at_least(0),
    Bool("nesterov", nullptr, "Nesterov momentum (sgd); unset = false."),
    FloatList("betas", nullptr, "Adam betas [beta1, beta2] (adam, adamw); unset = [0.9, 0.999].").at_least(0).at_most(1),
    Float("eps", nullptr, "Term added for numerical stability (adam, adamw, rmsprop, adagrad); unset = the optimizer's default.").above(0),
    Bool("amsgrad", nullptr, "AMSGrad variant (adam, adamw); unset = false."),
    Float("alpha", nullptr, "Smoothing constant (rmsprop); unset = 0.99.").at_least(0),
    Bool("centered", nullptr, "Centered RMSprop; unset = false."),
    Float("lr_decay", nullptr, "Learning-rate decay (adagrad); unset = 0.").at_least(0),
    Bool("fused", "true", "Step sgd, adam and adamw with ATen's fused kernels (CPU, CUDA; the same results and checkpoints as the plain path); false = the plain per-tensor path. rmsprop and adagrad are never fused."),
};

constexpr EmberConfigKey kModelBaseKeys[] = {
    String("name", nullptr, "Model plugin to train (e.g. cnn, mlp)."),
    String("init_checkpoint", nullptr, "An Ember checkpoint file (full or weights only) whose model weights the run starts from, with a fresh optimizer, schedule and position (Lightning's load_from_checkpoint, then fit): pretraining then fine-tuning, a linear probe then full fine-tuning. A run that resumes (--resume, a restarted job) takes its own checkpoint instead. A sharded checkpoint directory works under sharded and offload (each rank reads only its shards of the weights, init_exclude too); under another strategy, make one file of it first: engine checkpoint consolidate."),
    StringList("init_exclude", "[]", "Parameters and buffers that keep this run's own initial values instead of init_checkpoint's: a module's name (\"head\" takes head.*), a tensor's whole name, or a regular expression matching whole names; e.g. the head when the number of classes changed. Every entry must match a tensor of the model."),
};

constexpr EmberConfigKey kDataBaseKeys[] = {
    String("name", nullptr, "Data plugin to read (e.g. fashion_mnist, synthetic)."),
    Int("batch_size", "32", "Samples per training batch (per process).").at_least(1),
    Int("eval_batch_size", nullptr, "Samples per validation/test batch; unset = batch_size.").at_least(1),
    Bool("shuffle", "true", "Shuffle the training split every epoch (seeded by trainer.seed and the epoch)."),
    Bool("drop_last", "false", "Drop the last incomplete training batch."),
    Bool("group_by_length", "false", "Batch training samples of similar length together so that less padding is computed (data plugins that report lengths, e.g. text_classification): Hugging Face's LengthGroupedSampler, i.e. the shuffled order cut into groups of up to 50 batches, each sorted longest first, the longest sample first of all. Validation, test and predict keep their order."),
    Int("shuffle_groups", "4", "Data stored in shards (data plugins that read group by group, e.g. webdataset): shuffling permutes the shards by seed and epoch, then the samples of this many consecutive shards together; each rank reads one contiguous part of the epoch.").at_least(1),
    Int("num_workers", "0", "Threads that prepare batches ahead of the training loop; 0 = on the loop's thread.").at_least(0),
    Int("prefetch_factor", "2", "Batches each worker prepares ahead.").at_least(1),
    String("on_device", "\"auto\"", "Keep the data set on the training GPU so batches are gathered there (data plugins that support it, e.g. fashion_mnist): auto = when it takes at most a quarter of the GPU's memory, true = always (an error if the plugin cannot), false = never. No effect on the CPU, where the data already is.").choices("auto|true|false"),
    String("predict_split", "\"test\"", "The split `engine predict` writes predictions for.").choices("train|val|test"),
    Bool("pin_memory", "true", "On CUDA: copy host batches from pinned memory, asynchronously on a side stream, one batch ahead of the step. No effect on the CPU or for data kept on the device."),
};

// The device mesh (torchtitan's degrees; docs/parallelism.md). Their product is the run's ranks,
// trainer.devices x trainer.num_nodes.
constexpr EmberConfigKey kParallelismKeys[] = {
    Int("data_parallel_replicate", "1", "Data-parallel replicas: ranks that each hold the whole (or, with data_parallel_shard, a sharded) model and see other batches.").at_least(1),
    Int("data_parallel_shard", "-1", "Data-parallel ranks the strategy shards over (sharded) or replicates over (ddp); -1 = the ranks left over by the other degrees.").at_least(-1),
    Int("tensor_parallel", "1", "Ranks each layer is split over (Megatron's tensor parallelism): they see the same batch; the model must have a tensor-parallel plan and the strategy a device mesh (ddp).").at_least(1),
    Int("pipeline_parallel", "1", "Ranks the model is cut over into pipeline stages at its units (the strategy needs a device mesh with pipeline stages, ddp, and the model must implement ember::IPipelineModel, transformer); each batch is split into micro-batches that flow through the stages on the schedule. CPU ranks only so far.").at_least(1),
    String("schedule", "\"1f1b\"", "Pipeline schedule: gpipe (every forward, then every backward), 1f1b (one forward one backward after filling the pipe; activations of at most pipeline_parallel micro-batches alive), interleaved_1f1b (1f1b over virtual_stages stages per rank: a smaller bubble for more messages).").choices("gpipe|1f1b|interleaved_1f1b"),
    Int("microbatches", "0", "Micro-batches each batch is split into for the pipeline (the bubble is (stages - 1) / (microbatches + stages - 1)); 0 = as many as pipeline_parallel. interleaved_1f1b needs a multiple of pipeline_parallel.").at_least(0),
    Int("virtual_stages", "1", "Pipeline stages per rank (interleaved_1f1b: 2 or more; rank r holds stages r, r + pipeline_parallel, ...).").at_least(1),
    IntList("stage_units", "[]", "Units (layers) per pipeline stage, in order, one count per stage (pipeline_parallel x virtual_stages of them); empty = balanced by the units' parameter counts."),
    Bool("sequence_parallel", "false", "With tensor_parallel > 1: activations outside the split layers (norms, dropout, residuals) are split along the sequence over the tensor-parallel ranks (Megatron's sequence parallelism); the sequence length must divide by tensor_parallel."),
};

// The metrics the engine computes from the model's predictions (IStepContext::update_metrics;
// docs/metrics.md).
constexpr EmberConfigKey kMetricsKeys[] = {
    StringList("names", "[]", "Metrics computed over each evaluated split from the scores and targets the model hands over (the built-in models do): accuracy, precision, recall, f1, fbeta, specificity, auroc, average_precision, calibration_error, confusion_matrix, mae, mse, rmse, r2, perplexity. Logged as <split>_<name> (val_f1, test_auroc), exact over every rank; the confusion matrix is written to <run folder>/<split>_confusion_matrix.csv (and .png)."),
    StringList("splits", "[\"val\", \"test\"]", "Splits the metrics are computed on: train (train_<name> per epoch), val, test."),
    Bool("on_step", "false", "Also log the training metrics over each log_every_n_steps window (train_<name>_step, this rank's batches; the epoch value becomes train_<name>_epoch). Needs \"train\" in splits."),
    String("task", "\"multiclass\"", "binary: one score per sample (the positive class's), targets 0/1; multiclass: scores [N, C], targets class indices; multilabel: scores [N, L], targets 0/1 [N, L].").choices("binary|multiclass|multilabel"),
    Int("num_classes", "0", "Classes (multiclass) or labels (multilabel); 0 = the width of the model's scores.").at_least(0),
    String("average", "\"macro\"", "How per-class values become one: micro (pooled counts), macro (unweighted mean over classes), weighted (by support), none (the mean, plus <split>_<name>_<class> per class). Binary metrics are the positive class's.").choices("micro|macro|weighted|none"),
    Int("top_k", "1", "accuracy: a sample counts when its target is among the k highest scores (multiclass).").at_least(1),
    Float("threshold", "0.5", "binary / multilabel: a probability at or above it predicts 1.").at_least(0).at_most(1),
    Float("beta", "1.0", "fbeta's beta (recall weighs beta times precision).").above(0),
    Int("thresholds", "0", "auroc / average_precision: 0 = exact (every score kept, up to max_samples), else this many score bins (constant memory; torchmetrics' thresholds).").at_least(0),
    Int("max_samples", "1000000", "Exact auroc / average_precision keep every score: the most samples a split may have before the run stops with a message (then set thresholds).").at_least(1),
    Int("bins", "15", "calibration_error: equal-width confidence bins.").at_least(1),
    String("calibration_norm", "\"l1\"", "calibration_error: l1 (expected calibration error), l2 (root mean square), max (maximum calibration error).").choices("l1|l2|max"),
    String("scores", "\"auto\"", "What the model's scores are: logits (softmax / sigmoid applied), probabilities, or auto (per batch: multiclass rows that are non-negative and sum to 1, binary / multilabel scores in [0, 1], are probabilities).").choices("auto|logits|probabilities"),
    Int("ignore_index", "-1", "A target value left out of every metric (padding); -1 = none (perplexity: -100).").at_least(-1),
};

SectionSchema make(const char* name, const char* description, const EmberConfigKey* keys, size_t n) {
  SectionSchema s;
  s.name = name;
  s.description = description;
  s.keys = keys_from_descriptor(keys, static_cast<uint32_t>(n));
  return s;
}

}  // namespace

SectionSchema trainer_schema() {
  SectionSchema s = make("trainer", "the loop (Lightning's Trainer flags)", kTrainerKeys, std::size(kTrainerKeys));
  // Lightning's Trainer flags that are not [trainer] keys here, and what to write instead.
  s.elsewhere = {
      {"callbacks", "callbacks are plugins: name them in the top-level plugins = [\"early_stopping\", ...] or --plugins"},
      {"plugins", "plugins are named at the top level of the file (plugins = [...], before any [section]) or with --plugins"},
      {"profiler", "profilers are callback plugins: --plugins simple_profiler (Lightning's \"simple\") or torch_profiler (\"pytorch\")"},
      {"barebones", "set logger = false, enable_checkpointing = false, enable_progress_bar = false, enable_model_summary = false "
                    "and num_sanity_val_steps = 0 (what Lightning's barebones turns off)"},
      {"inference_mode", "Ember always evaluates without autograd (no_grad); remove the key"},
      {"use_distributed_sampler", "Ember's data plugins always deal the samples to the data-parallel ranks themselves; remove the key"},
      {"sync_batchnorm", "synchronised batch norm is the model's choice, as only a model knows its layers: set model.sync_batchnorm = "
                         "true (cnn's speedrun architecture, resnet; your own model: ember::SyncBatchNorm2d, docs/plugins.md)"},
      {"reload_dataloaders_every_n_epochs", "Ember's data plugins reshuffle every epoch and are not rebuilt; remove the key"},
  };
  return s;
}
SectionSchema parallelism_schema() {
  return make("parallelism", "the device mesh: how the run's ranks split the data and the model", kParallelismKeys,
              std::size(kParallelismKeys));
}
SectionSchema metrics_schema() {
  return make("metrics", "metrics the engine computes from the model's predictions", kMetricsKeys, std::size(kMetricsKeys));
}
SectionSchema optimizer_schema() {
  return make("optimizer", "the optimizer the engine builds", kOptimizerKeys, std::size(kOptimizerKeys));
}
std::vector<KeySchema> model_base_keys() { return keys_from_descriptor(kModelBaseKeys, std::size(kModelBaseKeys)); }
std::vector<KeySchema> data_base_keys() { return keys_from_descriptor(kDataBaseKeys, std::size(kDataBaseKeys)); }

std::string precision_plugin_for(const std::string& p) {
  static const std::map<std::string, std::string> table = {
      {"64-true", "fp64"},       {"64", "fp64"},           {"32-true", "fp32"},  {"32", "fp32"},
      {"16-mixed", "amp16"},     {"16", "amp16"},          {"bf16-mixed", "bf16"}, {"bf16", "bf16"},
      {"16-true", "fp16_true"},  {"bf16-true", "bf16_true"}};
  auto it = table.find(p);
  return it == table.end() ? p : it->second;
}

namespace {

// Adam, RMSprop and Adagrad over float16 parameters (16-true) keep their second moment in float16:
// a gradient below ~2.4e-4 squares to 0 there, and the step then divides by eps alone. An eps below
// float16's smallest normal number (6.1e-5; Adam's default is 1e-8) turns that into huge steps and
// NaN within the first epoch (measured: the synthetic MLP on the CPU, the Fashion-MNIST CNN on an
// H100; 1e-4 trains). Lightning lets it run; Ember stops before training and says what to change.
void refuse_eps_float16_cannot_hold(const Section& s, const std::string& name, const std::vector<at::Tensor>& params) {
  if (name == "sgd") return;
  const bool half = std::any_of(params.begin(), params.end(), [](const at::Tensor& p) { return p.scalar_type() == at::kHalf; });
  if (!half) return;
  // LibTorch's own defaults, for when the config leaves eps unset.
  const double default_eps = name == "adagrad"   ? torch::optim::AdagradOptions().eps()
                             : name == "rmsprop" ? torch::optim::RMSpropOptions().eps()
                                                 : torch::optim::AdamOptions().eps();
  const double eps = s.has("eps") ? s.get_float("eps") : default_eps;
  constexpr double kFloat16SmallestNormal = 6.103515625e-05;
  if (eps >= kFloat16SmallestNormal) return;
  throw UsageError(s.where(s.has("eps") ? "eps" : "name") + ": optimizer.eps = " + c10::str(eps) +
                   (s.has("eps") ? "" : " (" + name + "'s default)") +
                   " is below float16's smallest normal number (6.1e-05) and the parameters are float16 (16-true): " + name +
                   "'s second moment underflows and its steps turn to NaN; set optimizer.eps = 1e-4, or use trainer.precision "
                   "\"bf16-true\" or \"16-mixed\"");
}

}  // namespace

namespace {

// One torch parameter group per planned group, with the options as set, its lr scaled and, where
// it takes none, weight_decay = 0. A single plain group is built as torch builds one from a list
// of tensors.
template <class Optim, class Options>
std::shared_ptr<torch::optim::Optimizer> with_groups(const std::vector<ParamGroupPlan>& plan, const Options& options) {
  if (plan.size() == 1 && plan[0].lr_scale == 1.0 && plan[0].weight_decay) return std::make_shared<Optim>(plan[0].params, options);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const auto& g : plan) {
    auto o = std::make_unique<Options>(options);
    o->lr(options.lr() * g.lr_scale);
    if (!g.weight_decay) o->weight_decay(0.0);
    groups.emplace_back(g.params, std::move(o));
  }
  return std::make_shared<Optim>(std::move(groups), options);
}

}  // namespace

std::shared_ptr<torch::optim::Optimizer> make_optimizer(const Section& s, const std::vector<at::Tensor>& params,
                                                        const std::vector<at::Tensor>* no_decay) {
  std::vector<ParamGroupPlan> plan{{params, 1.0, true}};
  if (no_decay != nullptr) plan.push_back({*no_decay, 1.0, false});
  return make_optimizer(s, plan);
}

std::shared_ptr<torch::optim::Optimizer> make_optimizer(const Section& s, const std::vector<ParamGroupPlan>& plan) {
  const std::string name = s.get_string("name");
  static const std::map<std::string, std::set<std::string>> uses = {
      {"sgd", {"weight_decay", "momentum", "dampening", "nesterov"}},
      {"adam", {"weight_decay", "betas", "eps", "amsgrad"}},
      {"adamw", {"weight_decay", "betas", "eps", "amsgrad"}},
      {"rmsprop", {"weight_decay", "momentum", "eps", "alpha", "centered"}},
      {"adagrad", {"weight_decay", "eps", "lr_decay"}}};
  for (const auto& k : s.schema().keys) {
    static const std::set<std::string> every_optimizer = {"name", "lr", "fused", "no_weight_decay", "no_weight_decay_1d",
                                                          "backbone", "backbone_lr_scale", "backbone_unfreeze_at_epoch", "backbone_train_bn"};
    if (every_optimizer.count(k.key) || !s.has(k.key)) continue;
    if (!uses.at(name).count(k.key))
      throw UsageError(s.where(k.key) + ": optimizer." + k.key + " does not apply to " + name +
                       " (remove it, or choose an optimizer that uses it)");
  }
  for (const auto& g : plan) refuse_eps_float16_cannot_hold(s, name, g.params);
  const double lr = s.get_float("lr");
  const bool fused = s.get_bool("fused");
  auto betas = [&] {
    auto b = s.has("betas") ? s.get_float_list("betas") : std::vector<double>{0.9, 0.999};
    if (b.size() != 2) throw UsageError(s.where("betas") + ": optimizer.betas must have two values, e.g. [0.9, 0.999]");
    return std::make_tuple(b[0], b[1]);
  };
  if (name == "sgd") {
    torch::optim::SGDOptions o(lr);
    if (s.has("momentum")) o.momentum(s.get_float("momentum"));
    if (s.has("dampening")) o.dampening(s.get_float("dampening"));
    if (s.has("nesterov")) o.nesterov(s.get_bool("nesterov"));
    if (s.has("weight_decay")) o.weight_decay(s.get_float("weight_decay"));
    if (o.nesterov() && (o.momentum() <= 0 || o.dampening() != 0))
      throw UsageError(s.where("nesterov") + ": optimizer.nesterov needs momentum > 0 and dampening = 0");
    if (fused) return with_groups<ember::optim::FusedSGD>(plan, o);
    return with_groups<torch::optim::SGD>(plan, o);
  }
  if (name == "adam" || name == "adamw") {
    auto fill = [&](auto o) {
      o.betas(betas());
      if (s.has("eps")) o.eps(s.get_float("eps"));
      if (s.has("amsgrad")) o.amsgrad(s.get_bool("amsgrad"));
      if (s.has("weight_decay")) o.weight_decay(s.get_float("weight_decay"));
      return o;
    };
    if (name == "adam") {
      if (fused) return with_groups<ember::optim::FusedAdam>(plan, fill(torch::optim::AdamOptions(lr)));
      return with_groups<torch::optim::Adam>(plan, fill(torch::optim::AdamOptions(lr)));
    }
    if (fused) return with_groups<ember::optim::FusedAdamW>(plan, fill(torch::optim::AdamWOptions(lr)));
    return with_groups<torch::optim::AdamW>(plan, fill(torch::optim::AdamWOptions(lr)));
  }
  if (name == "rmsprop") {
    torch::optim::RMSpropOptions o(lr);
    if (s.has("momentum")) o.momentum(s.get_float("momentum"));
    if (s.has("eps")) o.eps(s.get_float("eps"));
    if (s.has("alpha")) o.alpha(s.get_float("alpha"));
    if (s.has("centered")) o.centered(s.get_bool("centered"));
    if (s.has("weight_decay")) o.weight_decay(s.get_float("weight_decay"));
    return with_groups<torch::optim::RMSprop>(plan, o);
  }
  torch::optim::AdagradOptions o(lr);
  if (s.has("eps")) o.eps(s.get_float("eps"));
  if (s.has("lr_decay")) o.lr_decay(s.get_float("lr_decay"));
  if (s.has("weight_decay")) o.weight_decay(s.get_float("weight_decay"));
  return with_groups<torch::optim::Adagrad>(plan, o);
}

}  // namespace ember::engine
