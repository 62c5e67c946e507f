#include "grad_buckets.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <stdexcept>

namespace ember_ddp {

GradBuckets::GradBuckets(std::vector<at::Tensor> params, std::vector<std::string> names, int64_t bucket_cap_bytes,
                         c10::intrusive_ptr<c10d::Backend> backend, int world_size, bool find_unused,
                         std::function<void(std::string)> label)
    : params_(std::move(params)),
      names_(std::move(names)),
      find_unused_(find_unused),
      cap_bytes_(bucket_cap_bytes),
      backend_(std::move(backend)),
      world_(world_size),
      label_(std::move(label)) {}

// Built at the first backward, not in setup: the precision handler may still change parameter
// dtypes after the strategy's setup (and that replaces their AccumulateGrad nodes).
void GradBuckets::build() {
  built_ = true;
  // Gradients arrive roughly in reverse order of registration, so buckets are filled from the
  // last parameter to the first; a bucket holds one dtype and device.
  Bucket current;
  int64_t bytes = 0;
  auto close = [&] {
    if (current.params.empty()) return;
    buckets_.push_back(std::move(current));
    current = Bucket{};
    bytes = 0;
  };
  bucket_of_.assign(params_.size(), 0);
  for (size_t k = params_.size(); k-- > 0;) {
    const auto& p = params_[k];
    if (!current.params.empty()) {
      const auto& first = params_[current.params.front()];
      if (first.scalar_type() != p.scalar_type() || first.device() != p.device()) close();
    }
    current.params.push_back(k);
    current.numel += p.numel();
    bytes += static_cast<int64_t>(p.numel()) * static_cast<int64_t>(p.element_size());
    bucket_of_[k] = buckets_.size();
    if (bytes >= cap_bytes_) close();
  }
  close();
  ready_.assign(params_.size(), false);
  stats_.buckets = static_cast<int64_t>(buckets_.size());
  accumulators_.assign(params_.size(), nullptr);
  hook_trained();
}

// A parameter frozen for now (optimizer.backbone_unfreeze_at_epoch) has no AccumulateGrad node:
// it is hooked once it trains. The node stays the same across later freezes, as it is kept here.
void GradBuckets::hook_trained() {
  for (size_t k = 0; k < params_.size(); ++k) {
    if (accumulators_[k] || !params_[k].requires_grad()) continue;
    auto acc = torch::autograd::impl::grad_accumulator(params_[k]);
    if (!acc) throw std::runtime_error("ddp: parameter '" + names_.at(k) + "' is not a leaf tensor");
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, k](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list& /*inputs*/) {
          on_ready(k);
          return outputs;
        }));
    accumulators_[k] = std::move(acc);
  }
}

void GradBuckets::begin(bool sync) {
  if (!built_) build();
  else hook_trained();
  // Alone in the group, a gradient's all-reduce is the gradient itself: skip the copies and the
  // collective (what makes ddp with one rank cost what single_device costs).
  syncing_ = sync && world_ > 1;
  if (sync && world_ == 1) ++stats_.syncs;
  if (!sync) return;
  std::fill(ready_.begin(), ready_.end(), false);
  missing_.clear();
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.ready = b.launched = false;
    b.work.reset();
  }
  next_ = 0;
  pending_params_ = params_.size();
  // Frozen for now: the same on every rank (it follows the epoch), so a bucket need not wait for them.
  for (size_t k = 0; k < params_.size(); ++k)
    if (!params_[k].requires_grad()) on_ready(k);
}

void GradBuckets::on_ready(size_t k) {
  if (!syncing_ || ready_[k]) return;
  ready_[k] = true;
  --pending_params_;
  auto& b = buckets_[bucket_of_[k]];
  if (--b.pending == 0) b.ready = true;
  // Strictly in bucket order, the same on every rank.
  while (next_ < buckets_.size() && buckets_[next_].ready) launch(next_++);
}

void GradBuckets::launch(size_t index) {
  at::NoGradGuard no_grad;
  auto& b = buckets_[index];
  const auto& first = params_[b.params.front()];
  // After the gradients, one element per parameter: 1 when this rank has its gradient. Summed
  // with the rest, it tells every rank whether any rank used the parameter.
  const int64_t mask = static_cast<int64_t>(b.params.size());
  b.flat = at::empty({b.numel + mask}, first.options().requires_grad(false));
  int64_t offset = 0, i = 0;
  for (size_t k : b.params) {
    const auto& p = params_[k];
    auto slice = b.flat.narrow(0, offset, p.numel());
    const auto& g = p.grad();
    if (g.defined()) slice.copy_(g.reshape({-1}));
    else {
      slice.zero_();  // unused on this rank, or frozen: contributes zero
      if (p.requires_grad()) missing_.push_back(k);
    }
    b.flat.narrow(0, b.numel + i++, 1).fill_(g.defined() ? 1.0 : 0.0);
    offset += p.numel();
  }
  // Divide first (as DDP does), so the sum is the mean and large values do not overflow.
  if (world_ > 1) b.flat.div_(world_);
  if (label_) label_("gradient bucket " + std::to_string(index));
  std::vector<at::Tensor> tensors{b.flat};
  b.work = backend_->allreduce(tensors);
  b.launched = true;
  ++stats_.all_reduces;
  if (pending_params_ > 0) ++stats_.started_early;
}

void GradBuckets::finish() {
  if (!syncing_) return;
  syncing_ = false;
  ++stats_.syncs;
  // Buckets with a parameter that got no gradient this step start now, still in order.
  while (next_ < buckets_.size()) launch(next_++);
  at::NoGradGuard no_grad;
  for (auto& b : buckets_) {
    b.work->wait();
    // Read back only when asked: on a GPU it is a host sync per step.
    at::Tensor used = find_unused_ ? b.flat.narrow(0, b.numel, static_cast<int64_t>(b.params.size())).to(at::kCPU) : at::Tensor();
    int64_t offset = 0, i = 0;
    for (size_t k : b.params) {
      auto& p = params_[k];
      auto slice = b.flat.narrow(0, offset, p.numel()).view(p.sizes());
      offset += p.numel();
      if (find_unused_ && used[i++].item<double>() == 0.0) continue;  // no rank used it: no gradient
      if (!p.requires_grad()) continue;                               // frozen: no gradient
      if (p.grad().defined()) p.mutable_grad().copy_(slice);
      else p.mutable_grad() = slice.clone();
    }
    b.work.reset();
    b.flat = at::Tensor();
  }
  if (!find_unused_ && !missing_.empty())
    throw std::runtime_error("ddp: parameter '" + names_.at(*std::min_element(missing_.begin(), missing_.end())) + "' got no gradient in this step on this rank (" +
                             std::to_string(missing_.size()) + " such); set ddp.find_unused_parameters = true when the model "
                             "leaves parameters unused, or make them not require grad");
}

void GradBuckets::abandon() {
  // Collectives already started must still complete on every rank; wait for them so the
  // buffers stay alive, then drop the state.
  for (auto& b : buckets_) {
    if (b.work) {
      try {
        b.work->wait();
      } catch (...) {
      }
    }
    b.work.reset();
    b.flat = at::Tensor();
  }
  syncing_ = false;
}

}  // namespace ember_ddp
