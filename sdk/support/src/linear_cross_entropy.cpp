// Ember::losses: see <ember/support/linear_cross_entropy.h>.
#include <ember/support/linear_cross_entropy.h>

#include "cross_entropy_rows.h"

#include <ember/error.h>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

namespace ember {
namespace {

constexpr int64_t kChunkLogits = int64_t{1} << 26;

bool lower_precision(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// The dtype autocast would run the output layer's product in: the inputs' own, or autocast's
// lower-precision dtype where autocast is on for the device and would cast them (not float64).
at::ScalarType compute_dtype(const at::Tensor& input, const at::Tensor& weight) {
  const at::ScalarType own = at::promote_types(input.scalar_type(), weight.scalar_type());
  const auto device = input.device().type();
  if (own != at::kDouble && at::autocast::is_autocast_enabled(device)) return at::autocast::get_autocast_dtype(device);
  return own;
}

struct Pass {
  at::Tensor loss;                  // 0-dim float32 / float64: the mean over counted targets
  at::Tensor count;                 // 0-dim int64: the counted targets
  at::Tensor grad_input, grad_weight;  // unscaled sums, compute dtype; undefined when not wanted
};

// One pass over row slices: the loss, and where wanted the gradients of the summed loss.
Pass run(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& targets, int64_t ignore_index, int64_t chunk_rows,
         bool want_input, bool want_weight) {
  const at::ScalarType compute = compute_dtype(input, weight);
  // The products below are to run in `compute`, whatever autocast would make of them.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const at::Tensor x = input.to(compute), w = weight.to(compute);
  const int64_t n = x.size(0), v = w.size(0);
  const at::Tensor t = targets.to(x.device(), at::kLong).contiguous();
  const at::ScalarType acc = compute == at::kDouble ? at::kDouble : at::kFloat;
  const bool grads = want_input || want_weight;
  const int64_t rows = chunk_rows > 0 ? chunk_rows : std::max<int64_t>(1, kChunkLogits / std::max<int64_t>(v, 1));

  Pass out;
  at::Tensor softmax = want_weight ? at::empty({n, v}, x.options()) : at::Tensor();  // minus one-hot, every row
  if (want_input) out.grad_input = at::empty_like(x);
  at::Tensor loss_sum = at::zeros({}, x.options().dtype(acc));
  for (int64_t r0 = 0; r0 < n; r0 += rows) {
    const int64_t r1 = std::min(n, r0 + rows);
    at::Tensor logits = softmax.defined() ? softmax.slice(0, r0, r1) : at::empty({r1 - r0, v}, x.options());
    at::mm_out(logits, x.slice(0, r0, r1), w.t());
    // One read of the slice: each row's maximum, log-sum-exp and loss, in float32 (cross_entropy_rows.h).
    const at::Tensor target_rows = t.slice(0, r0, r1);
    const cross_entropy_rows::RowStats stats = cross_entropy_rows::rows_forward(logits, target_rows, ignore_index);
    loss_sum.add_(stats.loss.sum());
    if (!grads) continue;
    // d(summed loss)/d(logits) = softmax - one-hot (0 on ignored rows), written over the logits.
    cross_entropy_rows::rows_gradient(logits, target_rows, ignore_index, stats, at::Tensor(), logits);
    // Without the whole softmax (a frozen weight), the input's gradient slice by slice.
    if (want_input && !want_weight) {
      at::Tensor rows_grad = out.grad_input.slice(0, r0, r1);
      at::mm_out(rows_grad, logits, w);
    }
  }
  // With it, one product each: a slice's [rows, vocabulary] x [vocabulary, width] has too few output
  // tiles to fill a large GPU (measured on an H200: 4% slower per GPT-2 step than the unfused loss).
  // Ignored rows are 0 in the softmax, so they add nothing to either.
  if (want_input && want_weight) at::mm_out(out.grad_input, softmax, w);
  if (want_weight) out.grad_weight = at::mm(softmax.t(), x);
  const at::Tensor keep = t.ne(ignore_index);
  out.count = keep.sum();
  out.loss = loss_sum / out.count;
  return out;
}

struct LinearCrossEntropyFunction : torch::autograd::Function<LinearCrossEntropyFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& targets, int64_t ignore_index, int64_t chunk_rows) {
    const bool want_input = input.requires_grad(), want_weight = weight.requires_grad();
    Pass pass = run(input, weight, targets, ignore_index, chunk_rows, want_input, want_weight);
    ctx->saved_data["count"] = pass.count;
    ctx->saved_data["grad_input"] = pass.grad_input;
    ctx->saved_data["grad_weight"] = pass.grad_weight;
    ctx->saved_data["input_dtype"] = static_cast<int64_t>(input.scalar_type());
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    return pass.loss;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const at::Tensor count = ctx->saved_data["count"].toTensor();
    const at::Tensor gi = ctx->saved_data["grad_input"].toTensor(), gw = ctx->saved_data["grad_weight"].toTensor();
    const at::Tensor scale = grads[0] / count;  // 0-dim, on the device: no synchronisation
    // Out of place, so that a second backward (retain_graph) scales the unscaled sums again.
    auto scaled = [&](const at::Tensor& g, const char* dtype_key) {
      if (!g.defined()) return at::Tensor();
      const auto dtype = static_cast<at::ScalarType>(ctx->saved_data[dtype_key].toInt());
      // float16's range: 1 / (counted targets) is subnormal there past 16,384 tokens.
      if (lower_precision(dtype)) return (g.to(at::kFloat) * scale.to(at::kFloat)).to(dtype);
      return g.to(dtype) * scale.to(dtype);
    };
    return {scaled(gi, "input_dtype"), scaled(gw, "weight_dtype"), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor linear_cross_entropy(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& targets, int64_t ignore_index,
                                int64_t chunk_rows) {
  if (input.dim() != 2 || weight.dim() != 2 || input.size(1) != weight.size(1))
    throw RunError(c10::str("linear_cross_entropy: input ", input.sizes(), " and weight ", weight.sizes(),
                            " do not multiply: expected input [N, C] and weight [V, C]"));
  if (targets.numel() != input.size(0) || at::isFloatingType(targets.scalar_type()))
    throw RunError(c10::str("linear_cross_entropy: targets ", targets.scalar_type(), " ", targets.sizes(), " for ", input.size(0),
                            " rows: expected one integer class index per row"));
  const bool want_input = input.requires_grad(), want_weight = weight.requires_grad();
  if (!at::GradMode::is_enabled() || (!want_input && !want_weight))
    return run(input, weight, targets.reshape({-1}), ignore_index, chunk_rows, false, false).loss;
  return LinearCrossEntropyFunction::apply(input, weight, targets.reshape({-1}), ignore_index, chunk_rows);
}

}  // namespace ember
