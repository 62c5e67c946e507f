#include "ember/distributed/pipeline_runner.h"

#include <ember/error.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <utility>

namespace ember_dist {

// A value the last stage logged, combined over the batch's micro-batches as its Reduce says
// (mean: weighted by the micro-batches' sizes), as every stage logs it once for the batch.
struct PipelineRunner::Logged {
  std::string name;
  double value = 0;
  double weight = 0;
  bool explicit_weight = false;  // the model gave LogOptions::batch_size
  ember::LogOptions options;
};

// The context a stage's forward logs through: on the last stage it records (the engine gets the
// combined values once the batch is through, on every rank); elsewhere nothing (only the last
// stage's logs count, so every rank logs the same names).
class PipelineRunner::RecordingContext final : public ember::IStepContext {
 public:
  RecordingContext(ember::IStepContext& ctx, bool last) : ctx_(ctx), last_(last) {}
  void set_micro_batch(int64_t size) { micro_batch_ = size; }
  void log(std::string_view name, const at::Tensor& value, const ember::LogOptions& options) override {
    if (last_) record(name, value.detach().to(at::kCPU).to(at::kDouble).item<double>(), options);
  }
  void log(std::string_view name, double value, const ember::LogOptions& options) override {
    if (last_) record(name, value, options);
  }
  ember::Stage stage() const override { return ctx_.stage(); }
  int64_t batch_idx() const override { return ctx_.batch_idx(); }
  // The last stage's predictions go straight to the engine's [metrics] table (its states add up
  // over micro-batches); the other stages have none.
  void update_metrics(const at::Tensor& preds, const at::Tensor& target) override {
    if (last_) ctx_.update_metrics(preds, target);
  }
  std::vector<Logged> combined() const {
    std::vector<Logged> out = logged_;
    for (auto& l : out) {
      if (l.options.reduce == ember::Reduce::mean && l.weight > 0) l.value /= l.weight;
      l.options.batch_size = l.explicit_weight ? static_cast<int64_t>(l.weight) : -1;
    }
    return out;
  }

 private:
  void record(std::string_view name, double v, const ember::LogOptions& given) {
    ember::LogOptions o;
    std::memcpy(static_cast<void*>(&o), &given, std::min<size_t>(sizeof(o), given.struct_size));
    o.struct_size = sizeof(o);
    const double w = static_cast<double>(o.batch_size >= 0 ? o.batch_size : micro_batch_);
    auto it = std::find_if(logged_.begin(), logged_.end(), [&](const Logged& l) { return l.name == name; });
    if (it == logged_.end()) {
      logged_.push_back({std::string(name), o.reduce == ember::Reduce::mean ? v * w : v, w, o.batch_size >= 0, o});
      return;
    }
    switch (it->options.reduce) {
      case ember::Reduce::mean: it->value += v * w; break;
      case ember::Reduce::sum: it->value += v; break;
      case ember::Reduce::max: it->value = std::max(it->value, v); break;
      case ember::Reduce::min: it->value = std::min(it->value, v); break;
    }
    it->weight += w;
  }
  ember::IStepContext& ctx_;
  bool last_;
  int64_t micro_batch_ = 0;
  std::vector<Logged> logged_;
};

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// The logs as bytes (name, value, options), and back.
template <class T>
void put(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
template <class T>
T take(const std::string& in, size_t& at) {
  if (at + sizeof(T) > in.size()) throw ember::RunError("pipeline: a truncated log message from the last stage (an Ember bug)");
  T v;
  std::memcpy(&v, in.data() + at, sizeof(T));
  at += sizeof(T);
  return v;
}

}  // namespace

PipelineRunner::PipelineRunner(MeshGroup& group, PipelineScheduleKind kind, int64_t microbatches, std::vector<ember::UnitRange> stages)
    : group_(group), kind_(kind), microbatches_(microbatches), stages_(std::move(stages)) {
  const int64_t p = group_.size();
  const int64_t v = static_cast<int64_t>(stages_.size()) / p;
  schedules_[microbatches_] = pipeline_schedule(kind_, p, microbatches_, v);
  // Tags name (kind, receiving stage, micro-batch, part): MPI guarantees 32767 of them.
  if (static_cast<int64_t>(stages_.size()) * microbatches_ * 4 > 32767)
    throw ember::ConfigError("parallelism.microbatches = " + std::to_string(microbatches_) + " x " + std::to_string(stages_.size()) +
                             " stages is more messages per batch than a pipeline tells apart (at most 8,191): use fewer micro-batches");
}

std::vector<ember::UnitRange> PipelineRunner::my_stages() const {
  std::vector<ember::UnitRange> out;
  for (size_t s = static_cast<size_t>(group_.rank()); s < stages_.size(); s += static_cast<size_t>(group_.size())) out.push_back(stages_[s]);
  return out;
}

std::string PipelineRunner::describe(const std::function<std::string(int64_t)>& unit_name) const {
  std::string line = "pipeline stage";
  const auto mine = my_stages();
  if (mine.size() > 1) line += "s";
  for (size_t c = 0; c < mine.size(); ++c) {
    const int64_t stage = static_cast<int64_t>(c) * group_.size() + group_.rank();
    line += c == 0 ? " " : ", ";
    line += std::to_string(stage) + " of " + std::to_string(stages_.size()) + " [" + unit_name(mine[c].begin);
    if (mine[c].end - mine[c].begin > 1) line += ".." + unit_name(mine[c].end - 1);
    line += "]";
  }
  return line + "; " + schedule_name(kind_) + " over " + std::to_string(microbatches_) + " micro-batches";
}

// A batch smaller than the micro-batches (an epoch's last) runs as many micro-batches as it has
// samples (interleaved: a multiple of the ranks).
int64_t PipelineRunner::microbatches_for(int64_t n) const {
  const int64_t p = group_.size();
  int64_t m = std::min(microbatches_, n);
  if (kind_ == PipelineScheduleKind::interleaved_1f1b) m = (m / p) * p;
  if (m < 1)
    throw ember::ConfigError("pipeline: a batch of " + std::to_string(n) + " sample" + (n == 1 ? "" : "s") + " cannot feed interleaved_1f1b over " +
                          std::to_string(p) + " ranks, which needs a multiple of " + std::to_string(p) +
                          " micro-batches: make every batch at least that large (data.drop_last = true drops a short last one)");
  return m;
}

const std::vector<std::vector<PipelineAction>>& PipelineRunner::schedule_for(int64_t m) {
  auto it = schedules_.find(m);
  if (it == schedules_.end())
    it = schedules_.emplace(m, pipeline_schedule(kind_, group_.size(), m, static_cast<int64_t>(stages_.size()) / group_.size())).first;
  return it->second;
}

std::vector<ember::Batch> PipelineRunner::split(const ember::Batch& batch) const {
  const int64_t n = batch.size, m = microbatches_for(n);
  std::vector<ember::Batch> out(static_cast<size_t>(m));
  int64_t offset = 0;
  for (int64_t i = 0; i < m; ++i) {
    const int64_t size = n / m + (i < n % m ? 1 : 0);
    auto& mb = out[static_cast<size_t>(i)];
    mb.size = size;
    for (const auto& t : batch.tensors)
      mb.tensors.push_back(t.defined() && t.dim() > 0 && t.size(0) == n ? t.narrow(0, offset, size) : t);
    offset += size;
  }
  return out;
}

int PipelineRunner::tag(bool gradient, int64_t stage, int64_t microbatch, int part) const {
  return static_cast<int>((((gradient ? 1 : 0) * static_cast<int64_t>(stages_.size()) + stage) * microbatches_ + microbatch) * 2 + part);
}

// An activation travels as a header (rank, sizes, dtype) and its data: the next stage does not
// know its shape (the last micro-batch may be smaller, a model may change widths).
void PipelineRunner::send_activation(const at::Tensor& t, int64_t stage, int64_t microbatch) {
  if (t.dim() > 8) throw ember::RunError("pipeline: a stage's output has more than 8 dimensions");
  at::Tensor header = at::zeros({10}, at::kLong);
  auto* h = header.data_ptr<int64_t>();
  h[0] = t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) h[1 + d] = t.size(d);
  h[9] = static_cast<int64_t>(t.scalar_type());
  group_.send(header, rank_of(stage), tag(false, stage, microbatch, 0));
  group_.send(t.detach().contiguous(), rank_of(stage), tag(false, stage, microbatch, 1));
}

at::Tensor PipelineRunner::recv_activation(int64_t stage, int64_t microbatch, const c10::Device& device) {
  at::Tensor header = at::zeros({10}, at::kLong);
  const auto start = std::chrono::steady_clock::now();
  group_.recv(header, rank_of(stage - 1), tag(false, stage, microbatch, 0));
  if (waiting_) *waiting_ += seconds_since(start);
  const auto* h = header.data_ptr<int64_t>();
  std::vector<int64_t> sizes(h + 1, h + 1 + h[0]);
  at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(static_cast<at::ScalarType>(h[9])));
  group_.recv(t, rank_of(stage - 1), tag(false, stage, microbatch, 1));
  return t.to(device);
}

at::Tensor PipelineRunner::train(const ember::Batch& batch, ember::IPipelineModel& model, ember::IStepContext& ctx,
                                 const std::function<void(const at::Tensor&)>& backward_loss) {
  const auto micro = split(batch);
  const auto& schedule = schedule_for(static_cast<int64_t>(micro.size()));
  const auto start = std::chrono::steady_clock::now();
  const int64_t last = static_cast<int64_t>(stages_.size()) - 1;
  RecordingContext rec(ctx, rank_of(last) == group_.rank());
  double waiting = 0;
  waiting_ = &waiting;
  struct Stop {
    double*& w;
    ~Stop() { w = nullptr; }
  } stop{waiting_};
  struct Live {
    at::Tensor input, output;
  };
  std::map<std::pair<int64_t, int64_t>, Live> live;  // (stage, micro-batch) between forward and backward
  at::Tensor loss = at::zeros({}, at::kDouble);
  const c10::Device device = batch.tensors.empty() ? c10::Device(c10::kCPU) : batch[0].device();
  {
    for (const auto& a : schedule[static_cast<size_t>(group_.rank())]) {
      const auto& mb = micro[static_cast<size_t>(a.microbatch)];
      if (!a.backward) {
        Live l;
        if (a.stage > 0) {
          l.input = recv_activation(a.stage, a.microbatch, device);
          if (l.input.is_floating_point()) l.input.requires_grad_(true);
        }
        rec.set_micro_batch(mb.size);
        at::Tensor out = model.pipeline_forward(stages_[static_cast<size_t>(a.stage)], mb, l.input, rec);
        if (a.stage == last) {
          if (!out.defined() || out.numel() != 1 || !out.requires_grad())
            throw ember::RunError("pipeline: the last stage's training step must return a scalar loss that requires grad");
          const double weight = static_cast<double>(mb.size) / static_cast<double>(batch.size);
          l.output = out * weight;
          loss += l.output.detach().to(at::kCPU).to(at::kDouble).reshape({});
        } else {
          if (!out.defined()) throw ember::RunError("pipeline: stage " + std::to_string(a.stage) + " returned no output");
          send_activation(out, a.stage + 1, a.microbatch);
          l.output = out;
        }
        live[{a.stage, a.microbatch}] = std::move(l);
        continue;
      }
      auto node = live.extract({a.stage, a.microbatch});
      Live& l = node.mapped();
      if (a.stage == last) {
        backward_loss(l.output);
      } else if (l.output.is_floating_point()) {
        at::Tensor grad = at::empty(l.output.sizes(), l.output.options().device(c10::kCPU).requires_grad(false));
        const auto wait = std::chrono::steady_clock::now();
        group_.recv(grad, rank_of(a.stage + 1), tag(true, a.stage + 1, a.microbatch, 0));
        waiting += seconds_since(wait);
        if (l.output.requires_grad()) torch::autograd::backward({l.output}, {grad.to(l.output.device())});
      }
      if (a.stage > 0 && l.input.is_floating_point()) {
        at::Tensor g = l.input.grad();
        if (!g.defined()) g = at::zeros_like(l.input);
        group_.send(g.detach().to(at::kCPU).contiguous(), rank_of(a.stage - 1), tag(true, a.stage, a.microbatch, 0));
      }
    }
  }
  group_.complete_sends();
  ++stats_.batches;
  stats_.seconds += seconds_since(start);
  stats_.waiting += waiting;
  return finish(rec.combined(), loss, true, ctx);
}

at::Tensor PipelineRunner::evaluate(const ember::Batch& batch, ember::IPipelineModel& model, ember::IStepContext& ctx) {
  const auto micro = split(batch);
  const int64_t last = static_cast<int64_t>(stages_.size()) - 1, p = group_.size();
  RecordingContext rec(ctx, rank_of(last) == group_.rank());
  at::Tensor loss = at::zeros({}, at::kDouble);
  bool has_loss = true;
  const c10::Device device = batch.tensors.empty() ? c10::Device(c10::kCPU) : batch[0].device();
  // Micro-batch by micro-batch, each through this rank's stages in order: every receive waits
  // for a stage that comes earlier in this order on its own rank.
  for (int64_t i = 0; i < static_cast<int64_t>(micro.size()); ++i)
    for (int64_t stage = group_.rank(); stage <= last; stage += p) {
      const auto& mb = micro[static_cast<size_t>(i)];
      at::Tensor input;
      if (stage > 0) input = recv_activation(stage, i, device);
      rec.set_micro_batch(mb.size);
      at::Tensor out = model.pipeline_forward(stages_[static_cast<size_t>(stage)], mb, input, rec);
      if (stage == last) {
        if (!out.defined() || out.numel() != 1) has_loss = false;
        else loss += out.detach().to(at::kCPU).to(at::kDouble).reshape({}) * (static_cast<double>(mb.size) / static_cast<double>(batch.size));
      } else {
        if (!out.defined()) throw ember::RunError("pipeline: stage " + std::to_string(stage) + " returned no output");
        send_activation(out, stage + 1, i);
      }
    }
  group_.complete_sends();
  return finish(rec.combined(), loss, has_loss, ctx);
}

at::Tensor PipelineRunner::finish(const std::vector<Logged>& logged, at::Tensor loss, bool has_loss, ember::IStepContext& ctx) {
  const int64_t last_rank = rank_of(static_cast<int64_t>(stages_.size()) - 1);
  std::string bytes;
  if (group_.rank() == last_rank) {
    put(bytes, static_cast<uint8_t>(has_loss ? 1 : 0));
    put(bytes, loss.item<double>());
    put(bytes, static_cast<uint64_t>(logged.size()));
    for (const auto& l : logged) {
      put(bytes, static_cast<uint64_t>(l.name.size()));
      bytes += l.name;
      put(bytes, l.value);
      put(bytes, static_cast<int32_t>(l.options.on_step));
      put(bytes, static_cast<int32_t>(l.options.on_epoch));
      put(bytes, static_cast<uint8_t>(l.options.prog_bar));
      put(bytes, static_cast<uint8_t>(l.options.logger));
      put(bytes, static_cast<int32_t>(l.options.reduce));
      put(bytes, static_cast<uint8_t>(l.options.sync_dist));
      put(bytes, l.options.batch_size);
    }
  }
  const std::string from_last = group_.all_gather_bytes(bytes)[static_cast<size_t>(last_rank)];
  size_t at = 0;
  const bool defined = take<uint8_t>(from_last, at) != 0;
  const double value = take<double>(from_last, at);
  const uint64_t count = take<uint64_t>(from_last, at);
  for (uint64_t k = 0; k < count; ++k) {
      const auto len = take<uint64_t>(from_last, at);
      if (at + len > from_last.size()) throw ember::RunError("pipeline: a truncated log message from the last stage (an Ember bug)");
      std::string name = from_last.substr(at, len);
      at += len;
      const double v = take<double>(from_last, at);
      ember::LogOptions o;
      o.on_step = take<int32_t>(from_last, at);
      o.on_epoch = take<int32_t>(from_last, at);
      o.prog_bar = take<uint8_t>(from_last, at) != 0;
      o.logger = take<uint8_t>(from_last, at) != 0;
      o.reduce = static_cast<ember::Reduce>(take<int32_t>(from_last, at));
      o.sync_dist = take<uint8_t>(from_last, at) != 0;
      o.batch_size = take<int64_t>(from_last, at);
      ctx.log(name, v, o);
    }
  if (!defined) return at::Tensor();
  return at::scalar_tensor(value, at::kDouble).to(at::kFloat);
}

}  // namespace ember_dist
