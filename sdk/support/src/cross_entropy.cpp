// Ember::losses: see <ember/support/cross_entropy.h>.
#include <ember/support/cross_entropy.h>

#include "cross_entropy_rows.h"

#include <ember/error.h>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/custom_function.h>

namespace ember {
namespace {

struct Prepared {
  at::Tensor logits, targets;
};

Prepared prepare(const at::Tensor& logits, const at::Tensor& targets) {
  const at::ScalarType t = logits.scalar_type();
  if (logits.dim() != 2 || !(t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf))
    throw RunError(c10::str("cross_entropy: logits ", t, " ", logits.sizes(),
                            ": expected [N, V] of float32, float64, bf16 or float16 (reshape to rows of classes)"));
  if (targets.numel() != logits.size(0) || at::isFloatingType(targets.scalar_type()) || targets.is_complex())
    throw RunError(c10::str("cross_entropy: targets ", targets.scalar_type(), " ", targets.sizes(), " for ", logits.size(0),
                            " rows: expected one integer class index per row"));
  return {logits.contiguous(), targets.reshape({-1}).to(logits.device(), at::kLong).contiguous()};
}

// The mean over counted targets, and their count (0-dim int64, on the device: no synchronisation).
std::pair<at::Tensor, at::Tensor> mean_loss(const cross_entropy_rows::RowStats& stats, const at::Tensor& targets, int64_t ignore_index) {
  at::Tensor count = targets.ne(ignore_index).sum();
  return {stats.loss.sum() / count, count};
}

struct CrossEntropyFunction : torch::autograd::Function<CrossEntropyFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const cross_entropy_rows::RowStats stats = cross_entropy_rows::rows_forward(logits, targets, ignore_index);
    auto [loss, count] = mean_loss(stats, targets, ignore_index);
    ctx->save_for_backward({logits});
    ctx->saved_data["targets"] = targets;
    ctx->saved_data["max"] = stats.max;
    ctx->saved_data["log_sum"] = stats.log_sum;
    ctx->saved_data["count"] = count;
    ctx->saved_data["ignore_index"] = ignore_index;
    return loss;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor logits = ctx->get_saved_variables()[0];
    cross_entropy_rows::RowStats stats;
    stats.max = ctx->saved_data["max"].toTensor();
    stats.log_sum = ctx->saved_data["log_sum"].toTensor();
    // 0-dim, on the device: the upstream gradient over the counted targets, in the stats' dtype.
    const at::Tensor scale = grads[0].to(stats.max.scalar_type()) / ctx->saved_data["count"].toTensor();
    at::Tensor grad = at::empty_like(logits);
    cross_entropy_rows::rows_gradient(logits, ctx->saved_data["targets"].toTensor(), ctx->saved_data["ignore_index"].toInt(), stats, scale, grad);
    return {grad, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool cross_entropy_has_own_kernels(const at::Tensor& logits) { return cross_entropy_rows::own_kernels(logits); }

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index) {
  const Prepared p = prepare(logits, targets);
  if (!at::GradMode::is_enabled() || !logits.requires_grad()) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    return mean_loss(cross_entropy_rows::rows_forward(p.logits, p.targets, ignore_index), p.targets, ignore_index).first;
  }
  return CrossEntropyFunction::apply(p.logits, p.targets, ignore_index);
}

}  // namespace ember
