// Plugin "pruning": Lightning's ModelPruning. At the end of chosen epochs it prunes the chosen
// parameters with one of PyTorch's methods (pruning_methods.h): L1 or random, entry by entry
// (each parameter on its own, or all of them ranked together), or whole channels by their Ln norm
// or at random. Training goes on with the pruned entries held at zero. How much: `amount` at each
// pruning, or `final_sparsity` reached over the prunings on a cubic (or linear) schedule.
//
// PyTorch keeps a pruned parameter as weight_orig x weight_mask. Here the weights themselves hold
// the zeros, so checkpoints, `engine export` and every reader see the pruned model as it is, and
// there is nothing to make permanent. The effective weights train exactly as PyTorch's do:
//   - at a pruning: the pruned entries of the weight and of its optimizer state (momentum, Adam's
//     moments) are set to zero;
//   - at every optimizer step (on_before_optimizer_step, before clipping): their gradients are
//     zeroed too, so the gradient norm is PyTorch's (whose weight_orig gets mask x gradient), and a
//     zero weight with zero gradient and zero state stays zero under SGD, Adam(W), RMSprop and
//     Adagrad, weight decay included.
// The masks are this plugin's checkpoint state, so a resumed run goes on with them exactly.
//
// With use_lottery_ticket_hypothesis each pruning also resets the kept entries to their values at the
// start of training (Lightning resets weight_orig the same way; its optimizer state is kept too).
//
// Under replicating strategies (single_device, ddp) every rank computes the same masks from the
// same weights (the random methods draw from a generator seeded by `seed` and the number of
// prunings so far). Under a sharding strategy (sharded, offload) each rank trains a shard of each
// tensor: the unstructured methods rank the entries across the ranks (prune_sharded_unstructured)
// and each rank keeps the masks of its shards, which checkpoints hold per rank. Structured methods
// need whole tensors, and tensor or pipeline parallelism whole ones across the ranks: refused.
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/support/callback_base.h>
#include <ember/support/name_patterns.h>
#include <ember/support/optimizer_state_tensors.h>
#include <ember/support/plugin_state.h>
#include <ember/trainer.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "pruning_methods.h"

namespace {

namespace pr = ember::pruning;

// clang-format off
constexpr EmberConfigKey kKeys[] = {
    ember::key::String("pruning_fn", "\"l1_unstructured\"",
        "PyTorch's method: l1_unstructured (smallest magnitudes), random_unstructured, ln_structured (whole channels by their Ln norm, "
        "with pruning_dim and pruning_norm), random_structured (whole channels, with pruning_dim).")
        .choices("l1_unstructured|random_unstructured|ln_structured|random_structured"),
    ember::key::Number("amount", "0.5",
        "At each pruning: a float in [0, 1] is the fraction of the entries (channels) not pruned yet to prune; an int, how many."),
    ember::key::Bool("use_global_unstructured", "true",
        "Rank the entries of every chosen parameter together (torch.nn.utils.prune.global_unstructured); false: each parameter on its own. "
        "Structured methods need false."),
    ember::key::StringList("parameter_names", "[\"weight\", \"bias\"]", "Which parameters of each chosen module to prune, by their own name."),
    ember::key::StringList("modules", "[]",
        "Modules whose parameters to prune (\"encoder\" takes encoder.*; or a regular expression over whole parameter names); "
        "empty: every module."),
    ember::key::Int("pruning_dim", nullptr, "Structured methods: the dimension whose slices are pruned whole (0: output channels)."),
    ember::key::Float("pruning_norm", nullptr, "ln_structured: the norm that ranks the channels (1, 2, inf, ...)."),
    ember::key::Float("final_sparsity", nullptr,
        "Instead of amount: the fraction pruned after the last pruning, reached gradually (Zhu & Gupta's automated gradual pruning): "
        "after the j-th of n prunings final_sparsity x (1 - (1 - j/n)^3) is pruned (sparsity_schedule = \"cubic\").").above(0).at_most(1),
    ember::key::String("sparsity_schedule", "\"cubic\"", "With final_sparsity: cubic (prunes most early) or linear (final_sparsity x j/n).")
        .choices("cubic|linear"),
    ember::key::IntList("epochs", "[]", "Epochs (from 0) at whose end to prune; empty: every epoch."),
    ember::key::Bool("prune_on_train_epoch_end", "true",
        "Prune at the end of the training epoch; false: at the end of each validation of a chosen epoch during fit."),
    ember::key::Int("verbose", "1", "0: no log lines; 1: one line per pruning; 2: a line per parameter too.").at_least(0).at_most(2),
    ember::key::Int("seed", "0", "Seed of the random methods (the n-th pruning draws from a generator seeded with seed + n)."),
    ember::key::Bool("use_lottery_ticket_hypothesis", "false",
        "After each pruning, reset the kept entries to their values when training started (Frankle & Carbin's rewinding; "
        "Lightning's default is true). Keeps a copy of the chosen parameters in host memory and in checkpoints."),
    ember::key::Elsewhere("make_pruning_permanent", "the weights always hold their zeros, so there is nothing to make permanent"),
    ember::key::Elsewhere("parameters_to_prune", "choose them with modules and parameter_names"),
    ember::key::Elsewhere("apply_pruning", "list the epochs at whose end to prune in epochs"),
};
// clang-format on

std::string thousands(int64_t n) {
  const std::string digits = std::to_string(n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string percent_of(double fraction) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f%%", 100.0 * fraction);
  return buf;
}

std::string percent(int64_t part, int64_t whole) {
  return percent_of(whole > 0 ? static_cast<double>(part) / static_cast<double>(whole) : 0.0);
}

std::string shape_text(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

class Pruning final : public ember::Callback {
 public:
  Pruning(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        name_(cfg.section()),
        method_name_(cfg.get_string("pruning_fn")),
        method_(pr::method_named(method_name_)),
        global_(cfg.get_bool("use_global_unstructured")),
        parameter_names_(cfg.get_string_list("parameter_names")),
        modules_(cfg.get_string_list("modules"), ember::NameRule::module),
        epochs_(cfg.get_int_list("epochs")),
        on_train_epoch_end_(cfg.get_bool("prune_on_train_epoch_end")),
        verbose_(cfg.get_int("verbose")),
        seed_(cfg.get_int("seed")),
        lottery_(cfg.get_bool("use_lottery_ticket_hypothesis")),
        where_amount_(cfg.where("amount")),
        where_modules_(cfg.where("modules")),
        where_names_(cfg.where("parameter_names")) {
    const std::string key = "[" + name_ + "] ";
    if (cfg.has("final_sparsity")) {
      if (where_amount_ != "default")
        throw ember::ConfigError(key + "amount (" + where_amount_ + ") and final_sparsity (" + cfg.where("final_sparsity") +
                                 ") both say how much to prune: keep one");
      final_sparsity_ = cfg.get_float("final_sparsity");
      cubic_ = cfg.get_string("sparsity_schedule") == "cubic";
    } else if (cfg.where("sparsity_schedule") != "default") {
      throw ember::ConfigError(key + "sparsity_schedule (" + cfg.where("sparsity_schedule") + ") shapes the way to final_sparsity, "
                               "which is not set: set final_sparsity, or remove it");
    }
    if (cfg.is_integer("amount")) {
      amount_.is_count = true;
      amount_.count = cfg.get_int("amount");
      if (amount_.count < 0)
        throw ember::ConfigError(key + "amount = " + std::to_string(amount_.count) + " (" + where_amount_ +
                                 ") is negative: give how many entries to prune (an int) or a fraction in [0, 1] (a float)");
    } else {
      amount_.fraction = cfg.get_float("amount");
      if (!(amount_.fraction >= 0.0 && amount_.fraction <= 1.0))
        throw ember::ConfigError(key + "amount = " + std::to_string(amount_.fraction) + " (" + where_amount_ +
                                 ") is outside [0, 1]: a float is the fraction of the entries not pruned yet (an int counts them)");
    }
    if (pr::is_structured(method_)) {
      if (global_)
        throw ember::ConfigError(key + "pruning_fn = \"" + method_name_ + "\" (" + cfg.where("pruning_fn") +
                                 ") prunes each parameter's channels on its own: set use_global_unstructured = false");
      if (!cfg.has("pruning_dim"))
        throw ember::ConfigError(key + "pruning_fn = \"" + method_name_ + "\" needs pruning_dim: the dimension whose slices are pruned "
                                 "whole, e.g. pruning_dim = 0 (output channels)");
      dim_ = cfg.get_int("pruning_dim");
      if (method_ == pr::Method::ln_structured) {
        if (!cfg.has("pruning_norm"))
          throw ember::ConfigError(key + "pruning_fn = \"ln_structured\" needs pruning_norm: the norm that ranks the channels, e.g. "
                                   "pruning_norm = 2.0");
        norm_ = cfg.get_float("pruning_norm");
      }
    } else {
      for (const char* k : {"pruning_dim", "pruning_norm"})
        if (cfg.has(k))
          throw ember::ConfigError(key + k + " (" + cfg.where(k) + ") applies to structured methods only; pruning_fn is \"" + method_name_ +
                                   "\": remove it or choose ln_structured or random_structured");
    }
    if (method_ == pr::Method::random_structured && cfg.has("pruning_norm"))
      throw ember::ConfigError(key + "pruning_norm (" + cfg.where("pruning_norm") + ") ranks channels for ln_structured; random_structured "
                               "draws them: remove it");
    if (parameter_names_.empty())
      throw ember::ConfigError(key + "parameter_names (" + where_names_ + ") is empty: name the parameters to prune, e.g. [\"weight\"]");
    for (int64_t e : epochs_)
      if (e < 0)
        throw ember::ConfigError(key + "epochs (" + cfg.where("epochs") + ") lists " + std::to_string(e) + ": epochs count from 0");
  }

  void on_fit_start(ember::ITrainer& t) override {
    fitting_ = true;
    prepare(t);
    if (lottery_ && initial_.empty()) {
      if (state_loaded_)
        throw ember::RunError(name_ + ": use_lottery_ticket_hypothesis rewinds to the weights the run started with, and the checkpoint "
                              "this run resumes was written without them: resume without it, or start the run anew");
      auto trained = weights(t).trained_parameters();
      for (const auto& target : targets_) initial_.push_back(trained[target.index].tensor.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true));
    }
    if (final_sparsity_ > 0.0) {
      scheduled_ = static_cast<int64_t>(epochs_.size());
      if (epochs_.empty()) {
        if (t.max_epochs() < 0)
          throw ember::ConfigError("[" + name_ + "] final_sparsity is reached over the prunings of a known number of epochs, and "
                                   "trainer.max_epochs is unlimited: list the epochs to prune at in epochs, e.g. epochs = [0, 1, 2, 3]");
        scheduled_ = t.max_epochs();
      }
    }
    const int64_t last = t.max_epochs() < 0 ? -1 : *std::max_element(epochs_.begin(), epochs_.end());
    if (!epochs_.empty() && t.max_epochs() >= 0 && last >= t.max_epochs() && t.is_global_zero())
      host_.log(ember::LogLevel::warn, "[" + name_ + "] epochs lists epoch " + std::to_string(last) + ", but trainer.max_epochs = " +
                                           std::to_string(t.max_epochs()) + " ends the run before it: that pruning will not happen" +
                                           (final_sparsity_ > 0.0 ? ", and final_sparsity will not be reached" : ""));
  }
  void on_fit_end(ember::ITrainer&) override { fitting_ = false; }

  void on_load_checkpoint(ember::ITrainer& t) override { prepare(t); }

  void on_train_epoch_end(ember::ITrainer& t) override {
    if (on_train_epoch_end_ && chosen(t.current_epoch())) prune(t);
  }
  void on_validation_end(ember::ITrainer& t) override {
    if (!on_train_epoch_end_ && fitting_ && !t.sanity_checking() && chosen(t.current_epoch())) prune(t);
  }

  // The pruned entries get no gradient: PyTorch's weight_orig gets mask x gradient.
  void on_before_optimizer_step(ember::ITrainer& t) override {
    if (prunings_ == 0) return;
    prepare(t);
    auto trained = weights(t).trained_parameters();
    at::NoGradGuard no_grad;
    for (const auto& target : targets_) {
      at::Tensor g = trained[target.index].tensor.grad();
      if (g.defined()) g.masked_fill_(target.pruned, 0);
    }
  }

  c10::IValue state_dict() const override {
    auto d = ember::support::new_state();
    d.insert("prunings", prunings_);
    c10::Dict<std::string, at::Tensor> masks;
    // Before the first pruning every mask keeps everything: nothing to save.
    if (prunings_ > 0)
      for (const auto& target : targets_) masks.insert(target.name, target.mask.to(at::kCPU).clone());
    d.insert("masks", masks);
    if (lottery_) {
      c10::Dict<std::string, at::Tensor> initial;
      for (size_t i = 0; i < initial_.size() && i < targets_.size(); ++i) initial.insert(targets_[i].name, initial_[i]);
      d.insert("initial", initial);
    }
    return d;
  }

  void load_state_dict(const c10::IValue& state) override {
    if (state.isNone()) return;
    ember::support::StateReader r(state, name_);
    prunings_ = r.get_int("prunings");
    const c10::IValue masks = r.get("masks");
    if (!masks.isGenericDict()) r.fail("'masks' is a " + std::string(masks.tagKind()) + ", not a dict");
    loaded_.clear();
    for (const auto& entry : masks.toGenericDict()) loaded_[entry.key().toStringRef()] = entry.value().toTensor();
    loaded_initial_.clear();
    if (lottery_ && r.has("initial")) {
      const c10::IValue initial = r.get("initial");
      if (!initial.isGenericDict()) r.fail("'initial' is a " + std::string(initial.tagKind()) + ", not a dict");
      for (const auto& entry : initial.toGenericDict()) loaded_initial_[entry.key().toStringRef()] = entry.value().toTensor();
    }
    have_loaded_ = state_loaded_ = true;
  }

 private:
  struct Target {
    std::string name;
    size_t index = 0;   // in named_parameters() and trained_parameters()
    at::Tensor mask;    // bool, true = kept; on the trained tensor's device
    at::Tensor pruned;  // its negation, for masked_fill_
    int64_t numel = 0;  // of the whole parameter (a mask under a sharding strategy covers this rank's shard)
  };

  static ember::ITrainerWeights& weights(ember::ITrainer& t) { return ember::trainer_service<ember::ITrainerWeights>(t, "pruning"); }

  bool chosen(int64_t epoch) const { return epochs_.empty() || std::find(epochs_.begin(), epochs_.end(), epoch) != epochs_.end(); }

  // Chooses the parameters once (on_fit_start) and takes masks read from a checkpoint.
  void prepare(ember::ITrainer& t) {
    if (!selected_) select(t);
    if (!have_loaded_) return;
    have_loaded_ = false;
    if (lottery_ && !loaded_initial_.empty()) {
      initial_.clear();
      for (const auto& target : targets_) {
        auto it = loaded_initial_.find(target.name);
        if (it == loaded_initial_.end() || it->second.sizes() != target.mask.sizes())
          throw ember::RunError(name_ + ": the checkpoint's starting weights for use_lottery_ticket_hypothesis lack '" + target.name +
                                "' in its shape " + shape_text(target.mask.sizes()) + ": resume with the same model, modules and parameter_names");
        initial_.push_back(it->second);
      }
      loaded_initial_.clear();
    }
    if (prunings_ == 0) {  // e.g. a rollback to before the first pruning: everything is kept again
      for (auto& target : targets_) {
        target.mask.fill_(true);
        target.pruned = target.mask.logical_not();
      }
      loaded_.clear();
      return;
    }
    std::set<std::string> ours;
    for (auto& target : targets_) {
      ours.insert(target.name);
      auto it = loaded_.find(target.name);
      if (it == loaded_.end())
        throw ember::RunError(name_ + ": the checkpoint has no pruning mask for '" + target.name +
                              "': resume with the modules and parameter_names the run was pruned with");
      if (it->second.sizes() != target.mask.sizes())
        throw ember::RunError(name_ + ": the checkpoint's pruning mask for '" + target.name + "' has shape " + shape_text(it->second.sizes()) +
                              ", the parameter " + shape_text(target.mask.sizes()) + ": resume with the same model");
      target.mask = it->second.to(target.mask.device(), at::kBool).contiguous();
      target.pruned = target.mask.logical_not();
    }
    for (const auto& [n, m] : loaded_)
      if (!ours.count(n))
        throw ember::RunError(name_ + ": the checkpoint prunes '" + n + "', which this run does not choose: resume with the modules and "
                              "parameter_names the run was pruned with");
    loaded_.clear();
  }

  void select(ember::ITrainer& t) {
    selected_ = true;
    const auto params = t.module().named_parameters(/*recurse=*/true);
    const auto trained = weights(t).trained_parameters();
    if (trained.size() != params.size())
      throw ember::RunError(name_ + ": the strategy trains " + std::to_string(trained.size()) + " tensors for the model's " +
                            std::to_string(params.size()) + " parameters; pruning needs one tensor (or this rank's shard of it) per parameter");
    std::vector<bool> module_used(modules_.size(), false);
    std::set<std::string> names_used;
    std::vector<std::string> all;
    for (size_t i = 0; i < params.size(); ++i) {
      const std::string& full = params[i].key();
      all.push_back(full);
      const auto dot = full.rfind('.');
      const std::string own = dot == std::string::npos ? full : full.substr(dot + 1);
      bool in_module = modules_.empty();
      for (size_t m = 0; m < modules_.size(); ++m)
        if (modules_.matches(full, m)) in_module = module_used[m] = true;
      if (!in_module) continue;
      if (std::find(parameter_names_.begin(), parameter_names_.end(), own) == parameter_names_.end()) continue;
      names_used.insert(own);
      const at::Tensor& p = params[i].value();
      const at::Tensor& w = trained[i].tensor;
      if (!p.is_floating_point()) continue;
      if (w.sizes() != p.sizes()) {
        if (pr::is_structured(method_))
          throw ember::ConfigError("[" + name_ + "] pruning_fn = \"" + method_name_ + "\" prunes whole channels, and the strategy trains '" +
                                   full + "' as shards of shape " + shape_text(w.sizes()) + ", not " + shape_text(p.sizes()) +
                                   ": use an unstructured method, or single_device or ddp");
        if (w.dim() != 1 || w.numel() > p.numel())
          throw ember::RunError(name_ + ": the strategy trains '" + full + "' as a tensor of shape " + shape_text(w.sizes()) + ", neither " +
                                shape_text(p.sizes()) + " nor a 1-D shard of it");
        sharded_ = true;
      }
      if (pr::is_structured(method_) && (w.dim() < 2 || dim_ < -w.dim() || dim_ >= w.dim()))
        throw ember::ConfigError("[" + name_ + "] pruning_dim = " + std::to_string(dim_) + " does not fit '" + full + "' of shape " +
                                 shape_text(w.sizes()) + " (structured pruning needs a dimension of a tensor of at least two): " +
                                 "choose that parameter's dimension, or leave it out with parameter_names (" + where_names_ + ") or modules");
      Target target;
      target.name = full;
      target.index = i;
      target.numel = p.numel();
      target.mask = at::ones(w.sizes(), w.options().dtype(at::kBool));
      target.pruned = target.mask.logical_not();
      targets_.push_back(std::move(target));
    }
    auto some = [&] {
      std::string s;
      for (size_t i = 0; i < all.size() && i < 8; ++i) s += (i ? ", " : "") + all[i];
      return s + (all.size() > 8 ? ", ..." : "");
    };
    for (size_t m = 0; m < modules_.size(); ++m)
      if (!module_used[m])
        throw ember::ConfigError("[" + name_ + "] modules (" + where_modules_ + "): '" + modules_.entries()[m] +
                                 "' names no module of this model; its parameters are " + some());
    for (const auto& n : parameter_names_)
      if (!names_used.count(n) && n != "bias")  // a model without biases keeps the default list valid
        throw ember::ConfigError("[" + name_ + "] parameter_names (" + where_names_ + "): no chosen module has a parameter named '" + n +
                                 "'; the model's parameters are " + some());
    if (targets_.empty())
      throw ember::ConfigError("[" + name_ + "] chooses no floating-point parameter to prune: check modules (" + where_modules_ +
                               ") and parameter_names (" + where_names_ + ")");
    if (t.world_size() > 1) {
      // The same decision on every rank (a rank's shard of a one-element parameter may be whole),
      // and shards that make whole tensors over all ranks: data-parallel sharding only.
      auto& ranks = ember::trainer_service<ember::ITrainerCollectives>(t, "pruning");
      sharded_ = ranks.any_rank(sharded_);
      if (sharded_) {
        const auto one = at::ones({1}, at::TensorOptions().dtype(at::kDouble).device(t.root_device()));
        const int64_t holders = static_cast<int64_t>(ranks.reduce(one, ember::ReduceOp::sum).item<double>());
        if (holders != t.world_size())
          throw ember::RunError(name_ + ": the parameters are sharded over " + std::to_string(holders) + " data-parallel ranks of " +
                                std::to_string(t.world_size()) + " (tensor or pipeline parallelism): pruning ranks whole tensors; use "
                                "sharded or ddp without tensor or pipeline parallelism");
      }
    }
    // A count larger than what the first pruning can take is refused now, not after an epoch.
    if (final_sparsity_ == 0.0 && amount_.is_count && prunings_ == 0) {
      int64_t smallest = -1;
      std::string which;
      for (const auto& target : targets_) {
        const int64_t n = pr::is_structured(method_) ? target.mask.size(dim_ < 0 ? dim_ + target.mask.dim() : dim_) : target.numel;
        if (smallest < 0 || n < smallest) smallest = n, which = target.name;
      }
      if (!pr::is_structured(method_) && global_) smallest = total_count(), which = "the chosen parameters together";
      if (amount_.count > smallest)
        throw ember::ConfigError("[" + name_ + "] amount = " + std::to_string(amount_.count) + " (" + where_amount_ + ") is more than the " +
                                 std::to_string(smallest) + (pr::is_structured(method_) ? " channels of " : " entries of ") + which +
                                 ": give a smaller count or a fraction (a float)");
    }
  }

  void prune(ember::ITrainer& t) {
    prepare(t);
    auto trained = weights(t).trained_parameters();
    // Under a sharding strategy each rank draws its own numbers for its own shards.
    const uint64_t stream = sharded_ ? 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(t.rank() + 1) : 0;
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed_ + prunings_) + stream);
    const pr::Amount amount = amount_now();
    const auto before_each = counts(t);
    try {
      if (sharded_) {
        std::vector<at::Tensor> values, masks;
        for (auto& target : targets_) {
          values.push_back(trained[target.index].tensor);
          masks.push_back(target.mask);
        }
        auto& ranks = ember::trainer_service<ember::ITrainerCollectives>(t, "pruning");
        const c10::Device root = t.root_device();
        pr::ShardedRanks across{t.rank(), t.world_size(), [&](const at::Tensor& x) { return ranks.reduce(x.to(root), ember::ReduceOp::sum); }};
        pr::prune_sharded_unstructured(method_, values, masks, amount, global_, gen, across);
      } else if (!pr::is_structured(method_) && global_) {
        std::vector<at::Tensor> values, masks;
        for (auto& target : targets_) {
          values.push_back(trained[target.index].tensor);
          masks.push_back(target.mask);
        }
        pr::prune_global_unstructured(method_, values, masks, amount, gen);
      } else {
        for (auto& target : targets_) {
          const at::Tensor& w = trained[target.index].tensor;
          try {
            if (pr::is_structured(method_)) pr::prune_structured(method_, w, target.mask, amount, dim_, norm_, gen);
            else pr::prune_unstructured(method_, w, target.mask, amount, gen);
          } catch (const std::invalid_argument& e) {
            throw std::invalid_argument("'" + target.name + "': " + e.what());
          }
        }
      }
    } catch (const std::invalid_argument& e) {
      throw ember::ConfigError("[" + name_ + "] at the end of epoch " + std::to_string(t.current_epoch()) + ": " + e.what() + " (amount, " +
                               where_amount_ + ")");
    }
    auto& state = t.optimizer().state();
    at::NoGradGuard no_grad;
    for (auto& target : targets_) {
      target.pruned = target.mask.logical_not();
      at::Tensor w = trained[target.index].tensor;
      w.masked_fill_(target.pruned, 0);
      auto it = state.find(w.unsafeGetTensorImpl());
      if (it == state.end()) continue;
      try {
        ember::for_each_state_tensor(*it->second, [&](const char*, at::Tensor& s) {
          if (s.sizes() == w.sizes()) s.masked_fill_(target.pruned, 0);
        });
      } catch (const std::runtime_error& e) {
        throw ember::RunError(name_ + ": cannot zero the pruned entries of '" + target.name + "' in the optimizer's state: " + e.what());
      }
    }
    if (lottery_) {
      // Frankle & Carbin's step 4: the kept entries start again from their values at the start.
      for (size_t i = 0; i < targets_.size(); ++i) {
        at::Tensor w = trained[targets_[i].index].tensor;
        w.copy_(initial_.at(i));
        w.masked_fill_(targets_[i].pruned, 0);
      }
    }
    weights(t).parameters_changed();
    ++prunings_;
    const auto after_each = counts(t);
    int64_t before = 0, after = 0;
    for (size_t i = 0; i < targets_.size(); ++i) before += before_each[i], after += after_each[i];
    const int64_t total = total_count();
    t.log_metric(name_ + "_sparsity", total > 0 ? static_cast<double>(after) / static_cast<double>(total) : 0.0);
    if (verbose_ == 0 || !t.is_global_zero()) return;
    host_.log(ember::LogLevel::info, name_ + ": epoch " + std::to_string(t.current_epoch()) + ": " + method_name_ +
                                         (pr::is_structured(method_) ? "" : global_ ? " (global)" : " (per parameter)") + " pruned " +
                                         thousands(after - before) + " more of " + thousands(total) + " entries in " +
                                         std::to_string(targets_.size()) + " parameters: " + thousands(before) + " (" +
                                         percent(before, total) + ") -> " + thousands(after) + " (" + percent(after, total) + ")" +
                                         (final_sparsity_ > 0.0 ? "; pruning " + std::to_string(prunings_) + " of " + std::to_string(scheduled_) +
                                                                      " towards final_sparsity " + percent_of(final_sparsity_)
                                                                : std::string()));
    if (verbose_ < 2) return;
    for (size_t i = 0; i < targets_.size(); ++i) {
      const auto& target = targets_[i];
      const int64_t n = target.numel, now = after_each[i];
      host_.log(ember::LogLevel::info, name_ + ":   " + target.name + ": " + thousands(before_each[i]) + " (" + percent(before_each[i], n) +
                                           ") -> " + thousands(now) + " (" + percent(now, n) + ") of " + thousands(n));
    }
  }

  // The fraction pruned after the j-th of the scheduled prunings (0 before the first).
  double scheduled_sparsity(int64_t j) const {
    if (j <= 0) return 0.0;
    const double progress = std::min(1.0, static_cast<double>(j) / static_cast<double>(scheduled_));
    return final_sparsity_ * (cubic_ ? 1.0 - (1.0 - progress) * (1.0 - progress) * (1.0 - progress) : progress);
  }

  // What this pruning takes: `amount`, or the step of the schedule towards final_sparsity as a
  // fraction of what is not pruned yet (so each parameter, or all of them together, follows it).
  pr::Amount amount_now() const {
    if (final_sparsity_ == 0.0) return amount_;
    pr::Amount a;
    const double was = scheduled_sparsity(prunings_), next = scheduled_sparsity(prunings_ + 1);
    a.fraction = was >= 1.0 ? 0.0 : std::clamp((next - was) / (1.0 - was), 0.0, 1.0);
    return a;
  }


  // Pruned entries of each chosen parameter, over all ranks' shards under a sharding strategy
  // (collective there).
  std::vector<int64_t> counts(ember::ITrainer& t) const {
    std::vector<at::Tensor> local;
    for (const auto& target : targets_) local.push_back(target.pruned.sum().to(at::kCPU));
    at::Tensor all = at::stack(local);
    if (sharded_) all = ember::trainer_service<ember::ITrainerCollectives>(t, "pruning").reduce(all.to(t.root_device()), ember::ReduceOp::sum).to(at::kCPU);
    std::vector<int64_t> out;
    for (int64_t i = 0; i < all.numel(); ++i) out.push_back(all[i].item<int64_t>());
    return out;
  }
  int64_t total_count() const {
    int64_t n = 0;
    for (const auto& target : targets_) n += target.numel;
    return n;
  }

  ember::IHost& host_;
  std::string name_;
  std::string method_name_;
  pr::Method method_;
  bool global_;
  std::vector<std::string> parameter_names_;
  ember::NamePatterns modules_;
  std::vector<int64_t> epochs_;
  bool on_train_epoch_end_;
  int64_t verbose_, seed_;
  bool lottery_;
  std::string where_amount_, where_modules_, where_names_;
  pr::Amount amount_;
  double final_sparsity_ = 0.0;  // 0: prune `amount` each time
  bool cubic_ = true;
  int64_t scheduled_ = 0;        // prunings the schedule spreads final_sparsity over
  int64_t dim_ = 0;
  double norm_ = 2.0;

  bool selected_ = false, fitting_ = false;
  bool sharded_ = false;  // the strategy trains shards of the chosen parameters
  std::vector<Target> targets_;
  int64_t prunings_ = 0;
  std::map<std::string, at::Tensor> loaded_;
  bool have_loaded_ = false, state_loaded_ = false;
  std::vector<at::Tensor> initial_;  // use_lottery_ticket_hypothesis: the chosen parameters at the start, on the host
  std::map<std::string, at::Tensor> loaded_initial_;
};

ember::ICallback* make(ember::IHost& host, const ember::IConfig& cfg) { return new Pruning(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "pruning", "0.1.0", "Apache-2.0",
             "Prunes parameters at chosen epochs with PyTorch's methods and trains on with the pruned entries at zero (Lightning's ModelPruning).",
             EMBER_CONFIG_KEYS(kKeys), make)
