// Synchronised batch normalisation (SDK 2.19; torch.nn.SyncBatchNorm, Lightning's sync_batchnorm): in
// training, the batch statistics are those of the whole data-parallel batch, every rank's
// samples, instead of each rank's own. It matters when a rank's batch is small (detection,
// segmentation, large models): the normalisation then no longer depends on how the batch was
// split, and N ranks of batch B train like one process of batch N * B.
//
// A model opts in by building its layers as ember::SyncBatchNorm1d/2d/3d (drop-in: they are
// torch::nn::BatchNorm*dImpl with the same parameter and buffer names, so checkpoints, exports
// and swa's batch-norm pass see ordinary batch norms) and by calling
// ember::attach_sync_batch_norm (or SyncBatchNormSetting::attach) from its
// ITrainerAware::attach_trainer; a Fabric program calls ember::set_sync_batch_norm with
// Fabric::all_reduce. Until a trainer of more than one rank is attached, or in evaluation, they
// are plain batch norms. Every rank must run the same number of training forwards (one collective each,
// and one in backward), as with PyTorch's.
//
// The statistics go through ITrainerCollectives::reduce (a sum over the data-parallel ranks), one
// all-reduce forward and one backward. Forward, each rank puts its count, mean and sum of squared
// deviations (exact, from its own batch) in its own row of a [world, 1 + 2C] tensor of zeros, so
// the sum is every rank's row, an all-gather (as PyTorch's SyncBatchNorm gathers them); the
// rows combine with Chan's formula. Sums of x and x^2 would lose the variance to cancellation when
// the mean is large against the spread (float32: ~4e-4 off at mean 50, std 3). Backward sums
// [sum(dy), sum(dy * x_hat)]. Weight and bias gradients stay local, as in PyTorch: the strategy
// averages them with the others.
#pragma once
#include <ember/export.h>
#include <ember/trainer.h>

#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/batchnorm.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ember {

namespace sync_batch_norm_detail {

// Sums a tensor over the data-parallel ranks (every rank gets the sum).
using AllReduceSum = std::function<at::Tensor(const at::Tensor&)>;

// [C] -> broadcastable against [N, C, ...].
inline at::Tensor per_channel(const at::Tensor& t, int64_t dims) {
  std::vector<int64_t> shape(static_cast<size_t>(dims), 1);
  shape[1] = t.size(0);
  return t.view(shape);
}

inline std::vector<int64_t> all_but_channels(int64_t dims) {
  std::vector<int64_t> out{0};
  for (int64_t d = 2; d < dims; ++d) out.push_back(d);
  return out;
}

class Function : public torch::autograd::Function<Function> {
 public:
  // x [N, C, ...]; weight, bias [C] or undefined; running_mean / running_var [C] (updated in
  // place when defined) or undefined; `momentum` the weight of the new statistics; this is rank
  // `rank` of `ranks` (its row in the gathered statistics).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                            at::Tensor running_mean, at::Tensor running_var, double momentum, double eps, const AllReduceSum* reduce,
                            int64_t rank, int64_t ranks) {
    const int64_t dims = x.dim();
    const int64_t channels = x.size(1);
    const auto over = all_but_channels(dims);
    const at::Tensor xf = x.to(at::kFloat);
    const auto [local_var, local_mean] = at::var_mean(xf, over, /*correction=*/0, /*keepdim=*/false);
    const double local_count = static_cast<double>(x.numel() / channels);
    // Everything stays on the device: no host synchronisation beyond the all-reduce itself.
    const at::Tensor rows = at::zeros({ranks, 1 + 2 * channels}, xf.options());
    rows[rank].copy_(at::cat({at::full({1}, local_count, xf.options()), local_mean, local_var * local_count}));
    const at::Tensor gathered = (*reduce)(rows);
    const at::Tensor counts = gathered.narrow(1, 0, 1);  // [ranks, 1]; 0 for a rank outside this group
    const at::Tensor means = gathered.narrow(1, 1, channels);
    const at::Tensor count = counts.sum(0);  // [1]
    const at::Tensor mean = (counts * means).sum(0) / count;
    const at::Tensor m2 = gathered.narrow(1, 1 + channels, channels).sum(0) + (counts * (means - mean).square()).sum(0);
    const at::Tensor var = m2 / count;
    const at::Tensor invstd = (var + eps).rsqrt();
    if (running_mean.defined()) {
      torch::NoGradGuard no_grad;
      running_mean.mul_(1 - momentum).add_(mean.to(running_mean.scalar_type()), momentum);
      running_var.mul_(1 - momentum).add_((var * count / (count - 1)).to(running_var.scalar_type()), momentum);
    }
    const at::Tensor x_hat = (xf - per_channel(mean, dims)) * per_channel(invstd, dims);
    at::Tensor y = x_hat;
    if (weight.defined()) y = y * per_channel(weight.to(at::kFloat), dims) + per_channel(bias.to(at::kFloat), dims);
    ctx->save_for_backward({x_hat, invstd, weight, count});
    ctx->saved_data["reduce"] = reinterpret_cast<int64_t>(reduce);
    return y.to(x.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x_hat = saved[0];
    const at::Tensor& invstd = saved[1];
    const at::Tensor& weight = saved[2];
    const at::Tensor& count = saved[3];
    const auto* reduce = reinterpret_cast<const AllReduceSum*>(ctx->saved_data["reduce"].toInt());
    const int64_t dims = x_hat.dim();
    const int64_t channels = x_hat.size(1);
    const auto over = all_but_channels(dims);
    const at::Tensor dy = grads[0].to(at::kFloat);
    // Local sums: the weight and bias gradients (the strategy averages them over the ranks).
    const at::Tensor sum_dy = dy.sum(over);
    const at::Tensor sum_dy_xhat = (dy * x_hat).sum(over);
    // Global sums for the input gradient: every rank's output depends on every rank's input.
    const at::Tensor total = (*reduce)(at::cat({sum_dy, sum_dy_xhat}));
    const at::Tensor mean_dy = total.narrow(0, 0, channels) / count;
    const at::Tensor mean_dy_xhat = total.narrow(0, channels, channels) / count;
    at::Tensor scale = invstd;
    if (weight.defined()) scale = scale * weight.to(at::kFloat);
    const at::Tensor dx =
        (dy - per_channel(mean_dy, dims) - x_hat * per_channel(mean_dy_xhat, dims)) * per_channel(scale, dims);
    at::Tensor dweight, dbias;
    if (weight.defined()) {
      dweight = sum_dy_xhat.to(weight.scalar_type());
      dbias = sum_dy.to(weight.scalar_type());
    }
    return {dx.to(grads[0].scalar_type()), dweight, dbias, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(),                  at::Tensor()};
  }
};

}  // namespace sync_batch_norm_detail

// What attach_sync_batch_norm finds in a module tree: the synchronisable layers.
class SyncableNorm {
 public:
  virtual ~SyncableNorm() = default;
  // `reduce` sums a tensor over the data-parallel ranks; this process is rank `rank` of `ranks`
  // (all processes, numbered as `reduce`'s group or more widely: a rank outside the group adds
  // nothing). Empty: normalise over this rank's batch.
  virtual void set_all_reduce(sync_batch_norm_detail::AllReduceSum reduce, int64_t rank, int64_t ranks) = 0;
};

// SDK 2.20: whether a synchronisable layer normalises over several ranks now, for a reader in
// another plugin (model_summary labels it BatchNorm2d when it does not, as Lightning converts the
// layers only when it syncs). A base of its own, not a virtual appended to SyncableNorm: a layer
// built against 2.19 lacks it and is simply not found by a dynamic_cast, where a new slot in
// SyncableNorm would be called on a layer that lacks it. Default visibility, so the cast works
// across plugins.
class EMBER_SDK_API SyncedNormStatus {
 public:
  virtual ~SyncedNormStatus() = default;
  virtual bool normalises_over_ranks() const = 0;
};

// torch::nn::BatchNorm{1,2,3}dImpl whose training forward normalises over every rank's batch
// once an all-reduce is set. Its forward hides the base's (the model calls it through the
// SyncBatchNorm*d holder).
template <class Base>
class SyncBatchNormFor : public Base, public SyncableNorm, public SyncedNormStatus {
 public:
  using Base::Base;

  bool normalises_over_ranks() const override { return reduce_ != nullptr && ranks_ > 1; }

  void set_all_reduce(sync_batch_norm_detail::AllReduceSum reduce, int64_t rank, int64_t ranks) override {
    TORCH_CHECK(!reduce || (rank >= 0 && rank < ranks), "sync batch norm: rank ", rank, " of ", ranks);
    reduce_ = reduce ? std::make_shared<sync_batch_norm_detail::AllReduceSum>(std::move(reduce)) : nullptr;
    rank_ = rank;
    ranks_ = ranks;
  }

  at::Tensor forward(const at::Tensor& input) {
    if (!reduce_ || !this->is_training()) return Base::forward(input);
    this->_check_input_dim(input);
    // PyTorch's check: one value per channel is an error alone; over several ranks the others add theirs.
    TORCH_CHECK(ranks_ > 1 || input.numel() / input.size(1) > 1, "Expected more than 1 value per channel when training, got input size ",
                input.sizes());
    // The momentum as torch::nn::BatchNorm takes it: a cumulative average when it is unset.
    double momentum = 0.0;
    if (this->options.track_running_stats()) {
      this->num_batches_tracked += 1;
      momentum = this->options.momentum() ? *this->options.momentum() : 1.0 / this->num_batches_tracked.template item<double>();
    }
    const bool track = this->options.track_running_stats();
    return sync_batch_norm_detail::Function::apply(input, this->options.affine() ? this->weight : at::Tensor(),
                                                   this->options.affine() ? this->bias : at::Tensor(),
                                                   track ? this->running_mean : at::Tensor(), track ? this->running_var : at::Tensor(),
                                                   momentum, this->options.eps(), reduce_.get(), rank_, ranks_);
  }

 private:
  std::shared_ptr<sync_batch_norm_detail::AllReduceSum> reduce_;
  int64_t rank_ = 0;
  int64_t ranks_ = 1;
};

// Classes of their own (not aliases), so that the module's type name, which model summaries
// print (as BatchNorm2d while not synchronised), is SyncBatchNorm2d and not the template's.
class SyncBatchNorm1dImpl final : public SyncBatchNormFor<torch::nn::BatchNorm1dImpl> {
 public:
  using SyncBatchNormFor::SyncBatchNormFor;
};
class SyncBatchNorm2dImpl final : public SyncBatchNormFor<torch::nn::BatchNorm2dImpl> {
 public:
  using SyncBatchNormFor::SyncBatchNormFor;
};
class SyncBatchNorm3dImpl final : public SyncBatchNormFor<torch::nn::BatchNorm3dImpl> {
 public:
  using SyncBatchNormFor::SyncBatchNormFor;
};
TORCH_MODULE(SyncBatchNorm1d);
TORCH_MODULE(SyncBatchNorm2d);
TORCH_MODULE(SyncBatchNorm3d);

// Sets (or, `reduce` empty, clears) the all-reduce of every synchronisable layer in `module`, for
// rank `rank` of `ranks`. Returns how many there are.
inline int64_t set_sync_batch_norm(torch::nn::Module& module, const sync_batch_norm_detail::AllReduceSum& reduce, int64_t rank,
                                   int64_t ranks) {
  int64_t n = 0;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (auto* norm = dynamic_cast<SyncableNorm*>(m.get())) {
      norm->set_all_reduce(reduce, rank, ranks);
      ++n;
    }
  }
  return n;
}

// For ITrainerAware::attach_trainer: with `sync` and a trainer of more than one rank, every
// synchronisable layer of `module` normalises over the data-parallel batch through the trainer's
// collectives; a null trainer (detached) or `sync` false makes them plain batch norms again.
inline void attach_sync_batch_norm(torch::nn::Module& module, ITrainer* trainer, bool sync, std::string_view who) {
  if (trainer == nullptr || !sync || trainer->world_size() <= 1) {
    set_sync_batch_norm(module, nullptr, 0, 1);
    return;
  }
  auto& collectives = trainer_service<ITrainerCollectives>(*trainer, who);
  set_sync_batch_norm(module, [&collectives](const at::Tensor& t) { return collectives.reduce(t, ReduceOp::sum); }, trainer->rank(),
                      trainer->world_size());
}

// A model's `sync_batchnorm` setting, for its ITrainerAware::attach_trainer.
class SyncBatchNormSetting {
 public:
  SyncBatchNormSetting(bool requested, std::string who) : requested_(requested), who_(std::move(who) + " (sync_batchnorm)") {}
  bool requested() const { return requested_; }
  void attach(torch::nn::Module& module, ITrainer* trainer) const { attach_sync_batch_norm(module, trainer, requested_, who_); }

 private:
  bool requested_;
  std::string who_;
};

}  // namespace ember
