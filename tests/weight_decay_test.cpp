// The parameter groups the engine builds.
//
// optimizer.no_weight_decay and no_weight_decay_1d: the parameters they name form a second group
// with weight_decay = 0, for every optimizer, fused or not, on a rank holding either group alone;
// the same weights as single_device under sharded (a directory checkpoint resumed), tensor and
// pipeline parallelism; and bad settings are one line with their place and the fix.
//
// optimizer.backbone (Lightning's BackboneFinetuning): its parameters form groups of their own at
// lr x backbone_lr_scale, frozen before backbone_unfreeze_at_epoch (or for the whole run); a
// resumed run and ddp ranks end where single_device does.
#include <gtest/gtest.h>

#include <ember/error.h>
#include <ember/model.h>
#include <ember/support/name_patterns.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/optimizer.h>

#include <set>

#include "checkpoint_support.h"
#include "config/engine_schema.h"
#include "config/run_config.h"
#include "mesh_support.h"
#include "runtime/optimizer_factory.h"
#include "support.h"

using namespace ember::test;
using ember::engine::OptimizerFactory;
using ember::engine::RawConfig;
using ember::engine::ResolvedConfig;
using ember::engine::UsageError;
namespace fs = std::filesystem;

namespace {

// wte (10 x 4), fc (4 x 4 and its bias), ln (LayerNorm: weight and bias, 1-d).
struct Net : torch::nn::Module {
  Net() {
    register_module("wte", torch::nn::Embedding(10, 4));
    register_module("fc", torch::nn::Linear(4, 4));
    register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({4})));
  }
};

class NetModel final : public ember::IModel {
 public:
  explicit NetModel(bool own_optimizer = false) : net_(std::make_shared<Net>()), own_optimizer_(own_optimizer) {}
  torch::nn::Module& module() override { return *net_; }
  at::Tensor training_step(const ember::Batch&, ember::IStepContext&) override { return {}; }
  void validation_step(const ember::Batch&, ember::IStepContext&) override {}
  void test_step(const ember::Batch&, ember::IStepContext&) override {}
  std::shared_ptr<torch::optim::Optimizer> configure_optimizers() override {
    if (!own_optimizer_) return nullptr;
    return ember::engine::make_optimizer(section_for_own(), net_->parameters());
  }
  std::vector<ember::NamedTensor> named() {
    std::vector<ember::NamedTensor> out;
    for (const auto& p : net_->named_parameters()) out.push_back({p.key(), p.value()});
    return out;
  }

 private:
  static const ember::engine::Section& section_for_own() {
    static const auto rc = ResolvedConfig::resolve(RawConfig::parse("[optimizer]\nname = \"sgd\"\n", "own.toml"),
                                                   {ember::engine::optimizer_schema()}, {});
    return rc.section("optimizer");
  }
  std::shared_ptr<Net> net_;
  bool own_optimizer_;
};

ResolvedConfig optimizer_config(const std::string& optimizer_table) {
  return ResolvedConfig::resolve(RawConfig::parse("[optimizer]\n" + optimizer_table, "run.toml"), {ember::engine::optimizer_schema()}, {});
}

std::set<std::string> group_names(torch::optim::Optimizer& o, size_t g, NetModel& model) {
  std::set<std::string> names;
  for (const auto& t : o.param_groups().at(g).params())
    for (const auto& p : model.module().named_parameters())
      if (p.value().is_same(t)) names.insert(p.key());
  return names;
}

std::string factory_error(const std::string& optimizer_table, bool own_optimizer = false, bool freeze_fc = false) {
  const auto rc = optimizer_config(optimizer_table);
  NetModel model(own_optimizer);
  if (freeze_fc)
    for (auto& p : model.module().named_children()["fc"]->parameters()) p.set_requires_grad(false);
  try {
    OptimizerFactory factory(model, "net", rc.section("optimizer"));
    factory.build(model.named());
  } catch (const UsageError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(NamePatterns, SuffixAtADotOrAWholeRegularExpression) {
  const ember::NamePatterns p({"bias", "mlp.c_fc", "h\\.[0-1]\\..*weight", "[unclosed"});
  EXPECT_TRUE(p.matches("h.0.attn.c_attn.bias"));
  EXPECT_TRUE(p.matches("bias"));
  EXPECT_FALSE(p.matches("h.0.unbias")) << "a suffix counts at a '.' only";
  EXPECT_TRUE(p.matches("h.3.mlp.c_fc"));
  EXPECT_FALSE(p.matches("h.3.mlp.c_fc.weight")) << "the name's end, not a part in the middle";
  EXPECT_TRUE(p.matches("h.1.ln_1.weight"));
  EXPECT_FALSE(p.matches("h.2.ln_1.weight"));
  EXPECT_TRUE(p.matches("x.[unclosed")) << "an invalid expression still matches as a suffix";
  EXPECT_FALSE(p.matches("h.0.ln_1.weight_"));
}

// NameRule::module (optimizer.backbone, model.init_exclude): a module's name takes what is under it.
TEST(NamePatterns, ModuleRuleTakesEverythingUnderAModule) {
  const ember::NamePatterns p({"encoder", "head.bias", "layer[1-2]\\..*"}, ember::NameRule::module);
  EXPECT_EQ(p.size(), 3u);
  EXPECT_TRUE(p.matches("encoder.layer.0.weight"));
  EXPECT_TRUE(p.matches("encoder"));
  EXPECT_FALSE(p.matches("encoder_2.weight")) << "a module's name is whole";
  EXPECT_FALSE(p.matches("text.encoder.weight")) << "from the start of the name";
  EXPECT_TRUE(p.matches("head.bias"));
  EXPECT_FALSE(p.matches("head.weight"));
  EXPECT_FALSE(p.matches("x.head.bias")) << "not a suffix";
  EXPECT_TRUE(p.matches("layer2.0.conv1.weight"));
  EXPECT_FALSE(p.matches("layer3.0.conv1.weight"));
}

// The groups: the 2-d parameters with the weight decay, the 1-d ones (or those named) without.
TEST(WeightDecay, ExcludedParametersFormASecondGroupWithoutDecay) {
  struct Case {
    std::string table;
    std::set<std::string> undecayed;
  };
  const std::vector<Case> cases = {
      {"no_weight_decay_1d = true\n", {"fc.bias", "ln.weight", "ln.bias"}},
      {"no_weight_decay = [\"bias\"]\n", {"fc.bias", "ln.bias"}},
      {"no_weight_decay = [\"ln\\\\..*\", \"wte.weight\"]\n", {"ln.weight", "ln.bias", "wte.weight"}},
      {"no_weight_decay = [\"wte.weight\"]\nno_weight_decay_1d = true\n", {"fc.bias", "ln.weight", "ln.bias", "wte.weight"}},
  };
  for (const auto& c : cases) {
    const auto rc = optimizer_config("name = \"adamw\"\nweight_decay = 0.5\n" + c.table);
    NetModel model;
    OptimizerFactory factory(model, "net", rc.section("optimizer"));
    auto o = factory.build(model.named());
    ASSERT_EQ(o->param_groups().size(), 2u) << c.table;
    EXPECT_EQ(group_names(*o, 1, model), c.undecayed) << c.table;
    std::set<std::string> all;
    for (const auto& p : model.module().named_parameters()) all.insert(p.key());
    std::set<std::string> decayed;
    for (const auto& n : all)
      if (!c.undecayed.count(n)) decayed.insert(n);
    EXPECT_EQ(group_names(*o, 0, model), decayed) << c.table;
    EXPECT_DOUBLE_EQ(static_cast<torch::optim::AdamWOptions&>(o->param_groups()[0].options()).weight_decay(), 0.5);
    EXPECT_DOUBLE_EQ(static_cast<torch::optim::AdamWOptions&>(o->param_groups()[1].options()).weight_decay(), 0.0);
    EXPECT_NE(factory.weight_decay_summary().find("none on " + std::to_string(c.undecayed.size())), std::string::npos)
        << factory.weight_decay_summary();
  }
  // Unset: one group, as before.
  const auto rc = optimizer_config("name = \"adamw\"\nweight_decay = 0.5\n");
  NetModel model;
  OptimizerFactory factory(model, "net", rc.section("optimizer"));
  EXPECT_EQ(factory.build(model.named())->param_groups().size(), 1u);
  EXPECT_TRUE(factory.weight_decay_summary().empty());
}

// A step with zero gradients moves a parameter only through its weight decay: the undecayed
// group stays exactly where it is and the decayed one moves, for each optimizer, fused or not; a
// rank that holds one group's tensors alone (a shard, a stage) still gets both groups.
TEST(WeightDecay, ZeroGradientStepLeavesTheUndecayedGroupWhereItIs) {
  for (const std::string name : {"sgd", "adam", "adamw", "rmsprop", "adagrad"})
    for (const bool fused : {true, false})
      for (const bool only_undecayed : {false, true}) {
        const auto rc = optimizer_config("name = \"" + name + "\"\nlr = 0.1\nweight_decay = 0.5\nno_weight_decay_1d = true\nfused = " +
                                         (fused ? "true" : "false") + "\n");
        const std::string what = name + (fused ? " fused" : " plain") + (only_undecayed ? ", 1-d tensors alone" : "");
        NetModel model;
        OptimizerFactory factory(model, "net", rc.section("optimizer"));
        auto params = model.named();
        if (only_undecayed) std::erase_if(params, [](const ember::NamedTensor& p) { return p.tensor.dim() >= 2; });
        auto o = factory.build(params);
        ASSERT_EQ(o->param_groups().size(), 2u) << what;
        EXPECT_EQ(o->param_groups()[0].params().empty(), only_undecayed) << what;
        std::map<std::string, at::Tensor> before;
        for (const auto& p : params) {
          before[p.name] = p.tensor.detach().clone();
          p.tensor.mutable_grad() = at::zeros_like(p.tensor);
        }
        o->step();
        for (const auto& p : params) {
          if (p.tensor.dim() < 2)
            EXPECT_TRUE(at::equal(p.tensor, before[p.name])) << what << ": " << p.name << " took weight decay";
          else
            EXPECT_GT((p.tensor - before[p.name]).abs().max().item<double>(), 1e-4) << what << ": " << p.name << " took none";
        }
      }
}

TEST(WeightDecay, BadSettingsAreOneLineWithTheirPlace) {
  const std::string adamw = "name = \"adamw\"\nweight_decay = 0.1\n";
  std::string e = factory_error(adamw + "no_weight_decay = [\"bias\", \"ln_f.weight\"]\n");
  EXPECT_NE(e.find("run.toml:4:"), std::string::npos) << e;
  EXPECT_NE(e.find("entry \"ln_f.weight\" matches none of model 'net''s 5 trained parameters ('wte.weight', 'fc.weight', 'fc.bias', "
                   "'ln.weight', ...)"),
            std::string::npos)
      << e;
  e = factory_error(adamw + "no_weight_decay = [\".*\"]\n");
  EXPECT_NE(e.find("leaves every one of model 'net''s 5 trained parameters without weight decay: set optimizer.weight_decay = 0 instead"),
            std::string::npos)
      << e;
  // Frozen parameters are not trained: a name among them alone matches nothing.
  e = factory_error(adamw + "no_weight_decay = [\"fc.bias\"]\n", false, true);
  EXPECT_NE(e.find("matches none of model 'net''s 3 trained parameters"), std::string::npos) << e;
  e = factory_error("name = \"sgd\"\nno_weight_decay_1d = true\n");
  EXPECT_NE(e.find("run.toml:3:"), std::string::npos) << e;
  EXPECT_NE(e.find("but optimizer.weight_decay is 0: set optimizer.weight_decay"), std::string::npos) << e;
  e = factory_error(adamw + "no_weight_decay_1d = true\n", true);
  EXPECT_NE(e.find("builds its own optimizer (configure_optimizers)"), std::string::npos) << e;
  // adamw's default weight decay (0.01) counts.
  EXPECT_EQ(factory_error("name = \"adamw\"\nno_weight_decay_1d = true\n"), "no error");
}

// A plugin that froze every parameter with fewer than 2 dimensions (lora: only the adapter matrices
// train) leaves no_weight_decay_1d nothing to do in that run: one group, said in the summary, not
// an error (a config shared with full fine-tuning keeps the key). A model with no such parameter
// at all is still refused.
TEST(WeightDecay, OneDimensionalParametersAllFrozenLeaveTheKeyMoot) {
  const auto rc = optimizer_config("name = \"adamw\"\nweight_decay = 0.1\nno_weight_decay_1d = true\n");
  NetModel model(false);
  for (auto& p : model.module().named_parameters())
    if (p.value().dim() < 2) p.value().set_requires_grad(false);
  OptimizerFactory factory(model, "net", rc.section("optimizer"));
  std::vector<ember::NamedTensor> trained;
  for (const auto& p : model.named())
    if (p.tensor.requires_grad()) trained.push_back(p);
  const auto optimizer = factory.build(trained);
  EXPECT_EQ(optimizer->param_groups().size(), 1u);
  EXPECT_NE(factory.weight_decay_summary().find("on all 2 trained parameters (no_weight_decay_1d: the model's 3 parameters with fewer than 2 "
                                                "dimensions are frozen here)"),
            std::string::npos)
      << factory.weight_decay_summary();
  // Frozen matrices are no excuse: with the 1-D ones trained, the key splits as always.
  for (auto& p : model.module().named_parameters()) p.value().set_requires_grad(p.key() != "wte.weight");
  OptimizerFactory other(model, "net", rc.section("optimizer"));
  EXPECT_NE(other.weight_decay_summary().find("on 1 parameters (16 elements), none on 3"), std::string::npos) << other.weight_decay_summary();
}

namespace {

const std::string kRun = transformer_mesh_toml(2);

ProcessResult train(const TempDir& dir, std::vector<std::string> extra) {
  write_file(dir / "run.toml", kRun);
  std::vector<std::string> args = {"run.toml", "--set", "optimizer.weight_decay=0.5"};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_engine_ok(dir, args, 300);
}

std::vector<std::string> ranks(const std::string& strategy, std::vector<std::string> extra) {
  std::vector<std::string> a = {"--set", "optimizer.no_weight_decay_1d=true", "--plugins", strategy, "--set", strategy + ".timeout=60.0",
                                "--set", "trainer.devices=2"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

class WeightDecayRanks : public ::testing::Test {
 protected:
  void SetUp() override { EMBER_SKIP_WITHOUT_MPI(); }
};

}  // namespace

// The two groups on 2 CPU ranks: each rank sorts its shards (sharded stage 3, resumed from a
// directory of parts), slices (tensor parallel) or stage (pipeline) by name and ends with
// single_device's weights; without the key the weights differ (the key is in effect).
TEST_F(WeightDecayRanks, ShardsSlicesAndStagesMatchSingleDevice) {
  TempDir single("weight_decay"), plain("weight_decay");
  auto r = train(single, {"--set", "optimizer.no_weight_decay_1d=true"});
  EXPECT_NE(r.err.find("optimizer: weight decay 0.5 on "), std::string::npos) << r.err;
  train(plain, {});
  EXPECT_GT(max_weight_difference(last_checkpoint(single), last_checkpoint(plain)).value, 1e-4) << "the key changed nothing";

  TempDir sharded("weight_decay");
  auto first = train(sharded, ranks("sharded", {"--set", "sharded.stage=3", "--set", "sharded.state_dict_type=\"sharded\"", "--set",
                                                "trainer.max_epochs=1", "--set", "data.batch_size=6"}));
  const fs::path saved = last_checkpoint(sharded);
  ASSERT_TRUE(fs::is_directory(saved)) << saved;
  TempDir resumed("weight_decay");
  train(resumed, ranks("sharded", {"--set", "sharded.stage=3", "--set", "data.batch_size=6", "--resume", saved.string()}));
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(resumed)), 1e-5) << "sharded stage 3, resumed";

  TempDir tensor("weight_decay"), stages("weight_decay");
  train(tensor, ranks("ddp", {"--set", "parallelism.tensor_parallel=2"}));
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(tensor)), 1e-5) << "tensor parallel";
  train(stages, ranks("ddp", {"--set", "parallelism.pipeline_parallel=2"}));
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(stages)), 1e-5) << "pipeline parallel";
}

namespace {

double group_lr(torch::optim::Optimizer& o, size_t g) { return o.param_groups().at(g).options().get_lr(); }
double group_decay(torch::optim::Optimizer& o, size_t g) {
  return static_cast<torch::optim::AdamWOptions&>(o.param_groups().at(g).options()).weight_decay();
}

}  // namespace

// The head's groups first, then the backbone's at lr x backbone_lr_scale, each split by weight
// decay when some parameters take none.
TEST(Backbone, FormsGroupsOfItsOwnAtTheScaledRate) {
  {
    const auto rc = optimizer_config("name = \"adamw\"\nlr = 0.1\nweight_decay = 0.5\nno_weight_decay_1d = true\n"
                                     "backbone = [\"wte\", \"ln\"]\nbackbone_lr_scale = 0.25\n");
    NetModel model;
    OptimizerFactory factory(model, "net", rc.section("optimizer"));
    auto o = factory.build(model.named());
    ASSERT_EQ(o->param_groups().size(), 4u);
    EXPECT_EQ(group_names(*o, 0, model), (std::set<std::string>{"fc.weight"}));
    EXPECT_EQ(group_names(*o, 1, model), (std::set<std::string>{"fc.bias"}));
    EXPECT_EQ(group_names(*o, 2, model), (std::set<std::string>{"wte.weight"}));
    EXPECT_EQ(group_names(*o, 3, model), (std::set<std::string>{"ln.weight", "ln.bias"}));
    const std::vector<double> lrs = {0.1, 0.1, 0.025, 0.025}, decays = {0.5, 0.0, 0.5, 0.0};
    for (size_t g = 0; g < 4; ++g) {
      EXPECT_DOUBLE_EQ(group_lr(*o, g), lrs[g]) << "group " << g;
      EXPECT_DOUBLE_EQ(group_decay(*o, g), decays[g]) << "group " << g;
    }
    EXPECT_EQ(factory.backbone(), (std::set<std::string>{"wte.weight", "ln.weight", "ln.bias"}));
    EXPECT_NE(factory.backbone_summary().find("backbone of 3 parameters (48 elements, e.g. 'wte.weight') trains at lr x 0.25; the other 2 at lr"),
              std::string::npos)
        << factory.backbone_summary();
  }
  // A parameter's name and a regular expression; no weight-decay split: two groups.
  const auto rc = optimizer_config("name = \"sgd\"\nlr = 0.1\nbackbone = [\"fc.bias\", \"w.*\"]\nbackbone_unfreeze_at_epoch = 3\n");
  NetModel model;
  OptimizerFactory factory(model, "net", rc.section("optimizer"));
  auto o = factory.build(model.named());
  ASSERT_EQ(o->param_groups().size(), 2u);
  EXPECT_EQ(group_names(*o, 1, model), (std::set<std::string>{"fc.bias", "wte.weight"}));
  EXPECT_DOUBLE_EQ(group_lr(*o, 1), 0.1 * 0.1) << "Lightning's initial_denom_lr = 10 by default";
  EXPECT_EQ(factory.backbone_unfreeze_at_epoch(), 3);
  EXPECT_NE(factory.backbone_summary().find(", frozen until epoch 3;"), std::string::npos) << factory.backbone_summary();
  for (const auto& p : model.module().named_parameters()) EXPECT_TRUE(p.value().requires_grad()) << p.key() << ": frozen in the epochs only";
}

// backbone_unfreeze_at_epoch = -1: the backbone never trains, so it is frozen before any strategy
// sees the model and is in no group.
TEST(Backbone, FrozenForTheWholeRunLeavesTheOptimizer) {
  const auto rc = optimizer_config("name = \"adamw\"\nbackbone = [\"wte\", \"fc\"]\nbackbone_unfreeze_at_epoch = -1\n");
  NetModel model;
  OptimizerFactory factory(model, "net", rc.section("optimizer"));
  std::vector<ember::NamedTensor> trained;
  for (const auto& p : model.named())
    if (p.tensor.requires_grad()) trained.push_back(p);
  ASSERT_EQ(trained.size(), 2u) << "ln.weight and ln.bias";
  auto o = factory.build(trained);
  ASSERT_EQ(o->param_groups().size(), 1u) << "the head's group alone";
  EXPECT_EQ(group_names(*o, 0, model), (std::set<std::string>{"ln.weight", "ln.bias"}));
  EXPECT_NE(factory.backbone_summary().find("backbone of 3 parameters (60 elements, e.g. 'wte.weight') frozen for the whole run; the other 2 train"),
            std::string::npos)
      << factory.backbone_summary();
}

TEST(Backbone, BadSettingsAreOneLineWithTheirPlace) {
  std::string e = factory_error("backbone = [\"encoder\"]\n");
  EXPECT_NE(e.find("run.toml:2:"), std::string::npos) << e;
  EXPECT_NE(e.find("optimizer.backbone entry \"encoder\" names no module or parameter among model 'net''s 5 trained parameters ('wte.weight', "
                   "'fc.weight', 'fc.bias', 'ln.weight', ...): give a module's name"),
            std::string::npos)
      << e;
  e = factory_error("backbone = [\"fc.w\"]\n");
  EXPECT_NE(e.find("entry \"fc.w\" names no module"), std::string::npos) << "a module's name is whole: " << e;
  e = factory_error("backbone = [\"wte\", \"fc\", \"ln\"]\n");
  EXPECT_NE(e.find("takes every one of model 'net''s 5 trained parameters, leaving no head to train: name only the pretrained part, or scale "
                   "optimizer.lr instead"),
            std::string::npos)
      << e;
  e = factory_error("backbone_unfreeze_at_epoch = 2\n");
  EXPECT_NE(e.find("run.toml:2:"), std::string::npos) << e;
  EXPECT_NE(e.find("optimizer.backbone_unfreeze_at_epoch is set but optimizer.backbone names no parameters"), std::string::npos) << e;
  e = factory_error("backbone_train_bn = false\n");
  EXPECT_NE(e.find("optimizer.backbone_train_bn is set but optimizer.backbone names no parameters"), std::string::npos) << e;
  e = factory_error("backbone_lr_scale = 0.5\n");
  EXPECT_NE(e.find("optimizer.backbone_lr_scale is set but optimizer.backbone names no parameters"), std::string::npos) << e;
  e = factory_error("backbone = [\"wte\"]\nbackbone_unfreeze_at_epoch = -1\nbackbone_lr_scale = 0.5\n");
  EXPECT_NE(e.find("run.toml:4:"), std::string::npos) << e;
  EXPECT_NE(e.find("frozen for the whole run (backbone_unfreeze_at_epoch = -1), so it has no learning rate"), std::string::npos) << e;
  e = factory_error("backbone = [\"wte\"]\n", true);
  EXPECT_NE(e.find("builds its own optimizer (configure_optimizers), whose parameter groups set the learning rates: remove optimizer.backbone"),
            std::string::npos)
      << e;
  // Parameters a plugin or the model froze are not trained: naming only them matches nothing.
  e = factory_error("backbone = [\"fc\"]\n", false, true);
  EXPECT_NE(e.find("names no module or parameter among model 'net''s 3 trained parameters"), std::string::npos) << e;
}

namespace {

// The transformer run above (layer1, layer2, head) with the backbone = both layers.
ProcessResult finetune(const TempDir& dir, const std::string& unfreeze_at, std::vector<std::string> extra) {
  write_file(dir / "run.toml", kRun);
  std::vector<std::string> args = {"run.toml", "--set", "optimizer.backbone=[\"layer1\", \"layer2\"]", "--set",
                                   "optimizer.backbone_unfreeze_at_epoch=" + unfreeze_at};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_engine_ok(dir, args, 300);
}

// The largest difference between two checkpoints' backbone (or head) tensors.
double part_difference(const fs::path& a, const fs::path& b, bool backbone) {
  auto wa = ember::test::weights(a), wb = ember::test::weights(b);
  double worst = -1;
  for (const auto& [name, t] : wa)
    if ((name.rfind("layer", 0) == 0) == backbone) worst = std::max(worst, (t - wb.at(name)).abs().max().item<double>());
  EXPECT_GE(worst, 0) << "no such tensors in " << a;
  return worst;
}

}  // namespace

// Frozen in epoch 0 (the backbone ends it as it started: as in a run where it never trains),
// trained in epoch 1 at lr x 0.1; resumed from the end of epoch 0 it ends bit for bit where the
// whole run does; backbone_lr_scale = 1 from the start is the same as no backbone (to rounding).
TEST(BackboneRuns, FrozenUntilItsEpochThenTrainedAndResumedExactly) {
  TempDir whole("backbone"), first("backbone"), never("backbone"), resumed("backbone");
  auto r = finetune(whole, "1", {});
  EXPECT_NE(r.err.find("optimizer: backbone of 24 parameters"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("epoch 0: the backbone (24 parameters) is frozen until epoch 1"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("epoch 1: the backbone (24 parameters) trains from now on, at lr x 0.1"), std::string::npos) << r.err;
  finetune(first, "1", {"--set", "trainer.max_epochs=1"});
  r = finetune(never, "-1", {});
  EXPECT_NE(r.err.find("frozen for the whole run; the other 2 train"), std::string::npos) << r.err;
  EXPECT_EQ(part_difference(last_checkpoint(first), last_checkpoint(never), true), 0.0) << "the backbone moved while frozen";
  EXPECT_GT(part_difference(last_checkpoint(first), last_checkpoint(never), false), 1e-3) << "the head did not train";
  EXPECT_GT(part_difference(last_checkpoint(whole), last_checkpoint(first), true), 1e-4) << "the backbone did not train in epoch 1";

  finetune(resumed, "1", {"--resume", last_checkpoint(first).string()});
  EXPECT_EQ(max_weight_difference(last_checkpoint(whole), last_checkpoint(resumed)), 0.0) << "resumed";

  TempDir plain("backbone"), unscaled("backbone");
  write_file(plain / "run.toml", kRun);
  run_engine_ok(plain, {"run.toml"}, 300);
  finetune(unscaled, "0", {"--set", "optimizer.backbone_lr_scale=1.0"});
  // Within rounding: gradient clipping sums the norm over the groups' tensors in their new order.
  EXPECT_LE(max_weight_difference(last_checkpoint(plain), last_checkpoint(unscaled)), 1e-6) << "unscaled";
}

class BackboneRanks : public ::testing::Test {
 protected:
  void SetUp() override { EMBER_SKIP_WITHOUT_MPI(); }
};

// ddp on 2 CPU ranks (half the batch each) ends where single_device does: its gradient buckets
// leave the frozen parameters out, then take them in. A sharding strategy trains shards, not the
// module's parameters: freezing for some epochs is refused in one line, freezing for the whole
// run trains.
TEST_F(BackboneRanks, DdpMatchesSingleDeviceAndShardingIsRefusedInOneLine) {
  TempDir single("backbone"), ddp("backbone"), sharded("backbone"), probe("backbone");
  finetune(single, "1", {});
  auto rank_args = [](const std::string& strategy) {
    return std::vector<std::string>{"--plugins", strategy, "--set", strategy + ".timeout=60.0", "--set", "trainer.devices=2",
                                    "--set", "data.batch_size=6"};
  };
  finetune(ddp, "1", rank_args("ddp"));
  EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(ddp)), 1e-5);

  write_file(sharded / "run.toml", kRun);
  std::vector<std::string> args = {"run.toml", "--set", "optimizer.backbone=[\"layer1\"]", "--set", "optimizer.backbone_unfreeze_at_epoch=1"};
  for (const auto& a : rank_args("sharded")) args.push_back(a);
  auto r = run_engine(args, sharded.path(), {}, 300);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("optimizer.backbone_unfreeze_at_epoch = 1: under strategy 'sharded' the optimizer trains shards or copies of the "
                       "parameters"),
            std::string::npos)
      << r.err;
  finetune(probe, "-1", rank_args("sharded"));
}

// backbone_train_bn (Lightning's train_bn, on by default): in a frozen epoch the backbone's
// batch-norm weights and biases train while its convolutions stay as they were built; off, they
// stay too. (cnn's speedrun layers: conv1, bn1, ..., conv5, bn5, fc.)
TEST(BackboneRuns, BatchNormLayersTrainInFrozenEpochsUnlessAsked) {
  const std::string run = R"([trainer]
max_epochs = 1
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
[model]
name = "cnn"
architecture = "speedrun"
width = 4
image_size = 16
num_classes = 4
[data]
name = "synthetic"
shape = [1, 16, 16]
num_classes = 4
num_train = 64
num_val = 16
num_test = 0
batch_size = 16
[optimizer]
name = "sgd"
lr = 0.1
backbone = ["conv1", "bn1", "conv2", "bn2"]
)";
  TempDir never("backbone"), bn_trains("backbone"), bn_frozen("backbone");
  auto train = [&](const TempDir& dir, const std::string& keys) {
    write_file(dir / "run.toml", run + keys);
    return run_engine_ok(dir, {"run.toml"}, 300);
  };
  train(never, "backbone_unfreeze_at_epoch = -1\n");
  auto r = train(bn_trains, "backbone_unfreeze_at_epoch = 1\n");
  EXPECT_NE(r.err.find("epoch 0: the backbone (2 parameters) is frozen until epoch 1 (its 4 batch-norm parameters train on: backbone_train_bn)"),
            std::string::npos)
      << r.err;
  r = train(bn_frozen, "backbone_unfreeze_at_epoch = 1\nbackbone_train_bn = false\n");
  EXPECT_NE(r.err.find("epoch 0: the backbone (6 parameters) is frozen until epoch 1 (its 2 batch-norm layers keep their running "
                       "statistics)"),
            std::string::npos)
      << r.err;
  const auto built = ember::test::weights(last_checkpoint(never));
  auto moved = [&](const TempDir& dir, const std::string& name) {
    return (ember::test::weights(last_checkpoint(dir)).at(name) - built.at(name)).abs().max().item<double>();
  };
  for (const std::string name : {"conv1.weight", "conv2.weight"}) {
    EXPECT_EQ(moved(bn_trains, name), 0.0) << name;
    EXPECT_EQ(moved(bn_frozen, name), 0.0) << name;
  }
  for (const std::string name : {"bn1.weight", "bn2.bias"}) {
    EXPECT_GT(moved(bn_trains, name), 1e-4) << name << " did not train";
    EXPECT_EQ(moved(bn_frozen, name), 0.0) << name << " trained though backbone_train_bn = false";
  }
  EXPECT_GT(moved(bn_trains, "fc.weight"), 1e-4) << "the head did not train";
  // Their running statistics: updated by the batches when the layers train; kept as built (mean 0,
  // variance 1) when they are frozen too (Lightning's track_running_stats = False), until the
  // backbone trains again.
  auto statistic = [&](const TempDir& dir, const std::string& name) { return ember::test::weights(last_checkpoint(dir)).at(name); };
  EXPECT_GT(statistic(bn_trains, "bn1.running_mean").abs().max().item<double>(), 1e-4);
  EXPECT_TRUE(at::equal(statistic(bn_frozen, "bn1.running_mean"), at::zeros_like(statistic(bn_frozen, "bn1.running_mean"))));
  EXPECT_TRUE(at::equal(statistic(bn_frozen, "bn2.running_var"), at::ones_like(statistic(bn_frozen, "bn2.running_var"))));
  EXPECT_GT(statistic(bn_frozen, "bn3.running_mean").abs().max().item<double>(), 1e-4) << "bn3 is not in the backbone";
  TempDir unfrozen("backbone");
  write_file(unfrozen / "run.toml", run + "backbone_unfreeze_at_epoch = 1\nbackbone_train_bn = false\n");
  run_engine_ok(unfrozen, {"run.toml", "--set", "trainer.max_epochs=2"}, 300);
  EXPECT_GT(statistic(unfrozen, "bn1.running_mean").abs().max().item<double>(), 1e-4) << "epoch 1 did not update them";
}
