// lora (plugins/callbacks/lora) on the gpt model in real engine runs: only the adapters train,
// `engine export` folds them in or writes PEFT's adapter folder (which PEFT loads), checkpoints
// hold the adapters only, and sharded stage 3 trains and resumes the adapters single_device does.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "checkpoint_support.h"
#include "lm_runs.h"
#include "support.h"
#include <ember/support/safetensors.h>

using namespace ember::test;
using namespace ember::test::lm_runs;
namespace fs = std::filesystem;

#ifdef EMBER_TEST_PYTHON
// `engine export --format peft` writes a LoRA run's adapters as PEFT's folder: PEFT itself loads
// them onto the base model (exported from a run without lora whose weights never moved: learning
// rate 1e-30) and gives the logits transformers gives for the folded export, for GPT-2's Conv1D
// layout (fan_in_fan_out) and Llama's linear layers.
TEST(LanguageModel, PeftExportLoadsInPeftWithTheFoldedModelsLogits) {
  TempDir dir("lm_peft");
  write_lm_run(dir);
  const at::Tensor ids = at::randint(0, 34, {2, 9}, at::kLong);
  write_file(dir / "ids.json", json_from_tensor(ids).dump());
  auto python = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/lm/reference.py").string()});
    auto r = run_process(args, dir.path(), {}, 600);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    std::ifstream f(args.back());
    return nlohmann::json::parse(f);
  };
  for (const std::string flavour : {"gpt2", "llama"}) {
    const std::vector<std::string> common = {"run.toml", "--set", "trainer.accelerator=\"cpu\"", "--set", "model.flavour=\"" + flavour + "\"",
                                             "--set", "trainer.max_steps=6", "--set", "trainer.val_check_interval=6"};
    auto base = common, lora = common;
    base.insert(base.end(), {"--set", "optimizer.lr=1e-30", "--set", "trainer.name=\"base_" + flavour + "\""});
    lora.insert(lora.end(), {"--plugins", "lora", "--set", "lora.rank=4", "--set", "lora.alpha=8.0", "--set", "trainer.name=\"lora_" + flavour + "\""});
    run_engine_ok(dir, base, 600);
    run_engine_ok(dir, lora, 600);
    const std::string base_ckpt = (dir / ("runs/base_" + flavour + "/version_0/checkpoints/last.ckpt")).string();
    const std::string lora_ckpt = (dir / ("runs/lora_" + flavour + "/version_0/checkpoints/last.ckpt")).string();
    const fs::path base_out = dir / ("base_" + flavour), peft_out = dir / ("peft_" + flavour), folded_out = dir / ("folded_" + flavour);
    run_engine_ok(dir, {"export", base_ckpt, base_out.string()});
    run_engine_ok(dir, {"export", lora_ckpt, folded_out.string()});
    auto r = run_engine_ok(dir, {"export", lora_ckpt, "--format", "peft", peft_out.string()});
    const std::string layers = flavour == "gpt2" ? "2" : "4";  // c_attn; q_proj and v_proj, of 2 blocks
    EXPECT_NE(r.err.find("lora: " + layers + " adapted layers in PEFT's format"), std::string::npos) << r.err;
    const auto config = nlohmann::json::parse(read_file(peft_out / "adapter_config.json"));
    EXPECT_EQ(config["peft_type"], "LORA");
    EXPECT_EQ(config["task_type"], "CAUSAL_LM");
    EXPECT_EQ(config["r"], 4);
    EXPECT_EQ(config["fan_in_fan_out"], flavour == "gpt2") << flavour;
    EXPECT_EQ(config["target_modules"].size(), 2u * (flavour == "gpt2" ? 1 : 2)) << config.dump();
    ember::support::SafetensorsFile adapters((peft_out / "adapter_model.safetensors").string());
    for (const auto& name : adapters.names()) EXPECT_EQ(name.rfind("base_model.model.", 0), 0u) << name;
    const auto peft = python({"peft-logits", base_out.string(), peft_out.string(), (dir / "ids.json").string(), (dir / "peft.json").string()});
    const auto folded = python({"logits", folded_out.string(), (dir / "ids.json").string(), (dir / "folded.json").string()});
    for (const auto& b : peft["lora_b_max"]) EXPECT_GT(b.get<double>(), 0.0) << "PEFT loaded an adapter that did not train";
    EXPECT_LT((tensor_from_json(peft["logits"]) - tensor_from_json(folded["logits"])).abs().max().item<double>(), 1e-5) << flavour;
  }
  // A checkpoint without adapters has nothing to export in that format.
  auto none = run_engine({"export", (dir / "runs/base_gpt2/version_0/checkpoints/last.ckpt").string(), "--format", "peft",
                          (dir / "nothing").string()},
                         dir.path());
  EXPECT_EQ(none.exit_code, 2) << none.err;
  EXPECT_NE(none.err.find("--format peft exports the adapters of a plugin that adds them (lora)"), std::string::npos) << none.err;
}
#endif


// lora: the model's weights stay as they were, only the adapters (lora_A, lora_B on c_attn) train;
// `engine export` folds them in (W + alpha/r B A, Conv1D's [in, out] layout), and the folded model
// loaded back through model_dir generates exactly the text the adapted one does. Under sharded
// stage 3 on 2 ranks it trains the adapters single_device does, and it runs under bf16-mixed.
TEST(LanguageModel, LoraTrainsOnlyTheAdaptersAndExportFoldsThemIn) {
  TempDir dir("lm_lora");
  write_lm_run(dir);
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {"--plugins", "lora", "run.toml", "--set", "trainer.accelerator=\"cpu\"", "--set", "data.shuffle=false",
                                     "--set", "trainer.val_check_interval=6", "--set", "lora.rank=4", "--set", "lora.alpha=8.0"};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  // The checkpoints keep the frozen weights here, to show they did not move.
  auto r = run_engine_ok(dir, with({"--set", "trainer.max_steps=1", "--set", "trainer.name=\"one\"", "--set", "data.batch_size=8", "--set",
                                    "lora.save_frozen=true"}), 600);
  EXPECT_NE(r.err.find("lora: rank 4, alpha 8 on 2 of 8 linear layers (transformer.h.0.attn.c_attn, ...): 1024 trainable parameters"),
            std::string::npos)
      << r.err;
  run_engine_ok(dir, with({"--set", "trainer.max_steps=6", "--set", "trainer.name=\"six\"", "--set", "data.batch_size=8", "--set",
                           "lora.save_frozen=true"}), 600);
  const auto one = weights(dir / "runs/one/version_0/checkpoints/last.ckpt"), six = weights(dir / "runs/six/version_0/checkpoints/last.ckpt");
  ASSERT_EQ(one.size(), six.size());
  int adapters = 0;
  for (const auto& [name, t] : six) {
    if (name.find(".lora_") != std::string::npos) {
      ++adapters;
      EXPECT_FALSE(at::equal(t, one.at(name))) << name << " did not train";
    } else {
      EXPECT_TRUE(at::equal(t, one.at(name))) << name << " is frozen but changed";
    }
  }
  EXPECT_EQ(adapters, 4);  // lora_A and lora_B on the two c_attn layers
  EXPECT_GT(six.at("transformer.h.1.attn.c_attn.lora_B").abs().max().item<double>(), 0.0);

  // Export folds the adapters in.
  const fs::path out = dir / "folded";
  run_engine_ok(dir, {"export", (dir / "runs/six/version_0/checkpoints/last.ckpt").string(), out.string()});
  ember::support::SafetensorsFile exported((out / "model.safetensors").string());
  for (const auto& name : exported.names()) EXPECT_EQ(name.find("lora"), std::string::npos) << name;
  for (int layer = 0; layer < 2; ++layer) {
    const std::string p = "transformer.h." + std::to_string(layer) + ".attn.c_attn.";
    const at::Tensor want = six.at(p + "weight") + 2.0 * at::matmul(six.at(p + "lora_B"), six.at(p + "lora_A")).t();
    EXPECT_LT((exported.tensor(p + "weight") - want).abs().max().item<double>(), 1e-6) << p;
  }
  const std::vector<std::string> greedy = {"generate", "--ckpt", (dir / "runs/six/version_0/checkpoints/last.ckpt").string(), "--prompt", "It is a ",
                                           "--max-new-tokens", "30", "--temperature", "0", "--set", "trainer.accelerator=\"cpu\""};
  auto adapted = greedy;
  adapted.insert(adapted.begin(), {"--plugins", "lora", "--set", "lora.rank=4", "--set", "lora.alpha=8.0"});
  adapted.push_back("run.toml");
  auto folded = greedy;
  folded.erase(folded.begin() + 1, folded.begin() + 3);  // no --ckpt: the weights come from model_dir
  for (const std::string& a : std::vector<std::string>{"--set", "model.model_dir=\"" + out.string() + "\"", "run.toml"}) folded.push_back(a);
  const auto a = run_engine_ok(dir, adapted), b = run_engine_ok(dir, folded);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.out.size(), std::string("It is a ").size() + 30 + 1) << a.out;

  if (EMBER_TEST_WITH_MPI) {
    run_engine_ok(dir, with({"--plugins", "sharded", "--set", "sharded.stage=3", "--set", "trainer.devices=2", "--set", "trainer.max_steps=6",
                             "--set", "trainer.name=\"sharded\"", "--set", "data.batch_size=4", "--set", "lora.save_frozen=true"}),
                  600);
    EXPECT_LE(max_weight_difference(dir / "runs/six/version_0/checkpoints/last.ckpt", dir / "runs/sharded/version_0/checkpoints/last.ckpt"), 1e-5);
  }
  run_engine_ok(dir, with({"--set", "trainer.max_steps=3", "--set", "trainer.name=\"bf16\"", "--set", "trainer.precision=\"bf16-mixed\""}), 600);

  auto none = run_engine(with({"--set", "lora.target_modules=[\"nothing_here\"]", "--set", "trainer.max_steps=1"}), dir.path());
  EXPECT_EQ(none.exit_code, 2) << none.err;
  EXPECT_NE(none.err.find("matches none of model 'gpt''s 8 linear layers (e.g. transformer.h.0.attn.c_attn)"), std::string::npos) << none.err;
  write_file(dir / "cnn.toml", "[trainer]\nmax_steps = 1\n[model]\nname = \"cnn\"\n[data]\nname = \"synthetic\"\n");
  auto cnn = run_engine({"--plugins", "lora", "cnn.toml"}, dir.path());
  EXPECT_EQ(cnn.exit_code, 2) << cnn.err;
  EXPECT_NE(cnn.err.find("lora: model 'cnn' does not list its linear layers"), std::string::npos) << cnn.err;
}

// lora's checkpoints hold the adapters only (the frozen weights are left out, with a fingerprint):
// a fraction of the size (a quarter for this 28k-parameter model, whose Adam state and tables
// outweigh its 1024 adapter elements), the same adapters as a checkpoint with everything, a resume that ends
// where the uninterrupted run ends (on one process and under sharded stage 3, which gathers the
// frozen weights from the model it built), the same export and the same generated text; a run
// whose base differs (another seed) refuses the checkpoint in one line.
TEST(LanguageModel, LoraCheckpointsHoldTheAdaptersOnly) {
  TempDir dir("lm_lora_adapters");
  write_lm_run(dir);
  auto with = [&](const std::string& name, int steps, std::vector<std::string> extra) {
    std::vector<std::string> args = {"--plugins", "lora", "run.toml", "--set", "trainer.accelerator=\"cpu\"", "--set", "data.shuffle=false",
                                     "--set", "trainer.val_check_interval=6", "--set", "lora.rank=4", "--set", "lora.alpha=8.0",
                                     "--set", "data.batch_size=8", "--set", "trainer.max_steps=" + std::to_string(steps),
                                     "--set", "trainer.name=\"" + name + "\""};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  auto last = [&](const std::string& name) { return dir / ("runs/" + name + "/version_0/checkpoints/last.ckpt"); };
  run_engine_ok(dir, with("full", 6, {"--set", "lora.save_frozen=true"}), 600);
  auto r = run_engine_ok(dir, with("adapters", 6, {}), 600);
  EXPECT_NE(r.err.find("checkpoints leave out the 28 frozen parameters (28032 elements)"), std::string::npos) << r.err;
  const auto full = weights(last("full")), adapters = weights(last("adapters"));
  ASSERT_EQ(adapters.size(), 4u);  // lora_A and lora_B of the two c_attn layers
  for (const auto& [name, t] : adapters) {
    EXPECT_NE(name.find(".lora_"), std::string::npos) << name;
    EXPECT_TRUE(at::equal(t, full.at(name))) << name;
  }
  EXPECT_LT(fs::file_size(last("adapters")) * 3, fs::file_size(last("full")))
      << fs::file_size(last("adapters")) << " vs " << fs::file_size(last("full"));

  // Resumed at step 3: the uninterrupted run's adapters, bit for bit.
  run_engine_ok(dir, with("resumed", 3, {}), 600);
  run_engine_ok(dir, with("resumed", 6, {"--resume", "last"}), 600);
  expect_identical_weights(last("adapters"), last("resumed"));

  // export and generate take the frozen weights from the model they build.
  run_engine_ok(dir, {"export", last("full").string(), (dir / "export_full").string()});
  run_engine_ok(dir, {"export", last("adapters").string(), (dir / "export_adapters").string()});
  ember::support::SafetensorsFile a((dir / "export_full/model.safetensors").string()), b((dir / "export_adapters/model.safetensors").string());
  ASSERT_EQ(a.names().size(), b.names().size());
  for (const auto& name : a.names()) EXPECT_TRUE(at::equal(a.tensor(name), b.tensor(name))) << name;
  auto generate = [&](const fs::path& ckpt) {
    return run_engine_ok(dir, {"--plugins", "lora", "--set", "lora.rank=4", "--set", "lora.alpha=8.0", "generate", "--ckpt", ckpt.string(),
                               "--prompt", "It is a ", "--max-new-tokens", "20", "--temperature", "0", "--set", "trainer.accelerator=\"cpu\"",
                               "run.toml"}).out;
  };
  EXPECT_EQ(generate(last("full")), generate(last("adapters")));

  // Another base: refused in one line, nothing trained.
  auto other = run_engine(with("other", 8, {"--resume", last("adapters").string(), "--set", "trainer.seed=7"}), dir.path(), {}, 600);
  EXPECT_NE(other.exit_code, 0) << other.err;
  EXPECT_NE(other.err.find("frozen parameters differ in this run from the ones it was trained on"), std::string::npos) << other.err;

  if (EMBER_TEST_WITH_MPI) {
    // Sharded stage 3 on 2 ranks: adapter checkpoints saved from shards, resumed into shards.
    auto sharded = [&](int steps, std::vector<std::string> extra) {
      auto args = with("sharded", steps, {"--plugins", "sharded", "--set", "sharded.stage=3", "--set", "trainer.devices=2", "--set",
                                          "data.batch_size=4"});
      args.insert(args.end(), extra.begin(), extra.end());
      return args;
    };
    run_engine_ok(dir, sharded(3, {}), 600);
    run_engine_ok(dir, sharded(6, {"--resume", "last"}), 600);
    EXPECT_EQ(weights(last("sharded")).size(), 4u);
    EXPECT_LE(max_weight_difference(last("adapters"), last("sharded")), 1e-5);
  }
}

// A LoRA fine-tune starts from a pretraining run's checkpoint ([model] init_checkpoint), which has
// no adapters: the base takes the pretrained weights and the adapters keep their initial values
// (lora_B zero: the model starts as the pretrained one), said in the log; from a LoRA run's
// checkpoint the adapters are its own. The same from a sharded directory under sharded stage 3.
TEST(LanguageModel, LoraStartsFromAPretrainingCheckpoint) {
  TempDir dir("lm_lora_init");
  write_lm_run(dir);
  auto run = [&](const std::string& name, std::vector<std::string> extra) {
    std::vector<std::string> args = {"run.toml", "--set", "trainer.accelerator=\"cpu\"", "--set", "data.shuffle=false", "--set",
                                     "trainer.val_check_interval=3", "--set", "trainer.name=\"" + name + "\""};
    args.insert(args.end(), extra.begin(), extra.end());
    return run_engine_ok(dir, args, 600);
  };
  auto last = [&](const std::string& name) { return dir / ("runs/" + name + "/version_0/checkpoints/last.ckpt"); };
  const std::vector<std::string> lora = {"--plugins", "lora", "--set", "lora.rank=4", "--set", "lora.alpha=8.0"};
  // Steps that cannot move a float32 weight: the checkpoint holds what the run started from.
  auto frozen_run = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), {"--set", "optimizer.lr=1e-30", "--set", "trainer.max_steps=1", "--set", "lora.save_frozen=true"});
    extra.insert(extra.begin(), lora.begin(), lora.end());
    return extra;
  };
  run("pre", {"--set", "trainer.max_steps=3"});
  const std::string from_pre = "model.init_checkpoint=\"" + last("pre").string() + "\"";
  const auto r = run("from_pre", frozen_run({"--set", from_pre}));
  EXPECT_NE(r.err.find("except the 4 tensors 'lora' added, which it does not hold (e.g. 'transformer.h.0.attn.c_attn.lora_A'): they keep "
                       "their initial values; the optimizer and the schedule start afresh"),
            std::string::npos)
      << r.err;
  run("fresh", frozen_run({}));
  const auto pre = weights(last("pre")), started = weights(last("from_pre")), fresh = weights(last("fresh"));
  int base = 0, adapters = 0;
  for (const auto& [name, t] : started) {
    if (name.find(".lora_") != std::string::npos) {
      ++adapters;
      EXPECT_LE((t - fresh.at(name)).abs().max().item<double>(), 1e-12) << name << ": not the adapter's own initial value";
    } else {
      ++base;
      ASSERT_TRUE(pre.count(name)) << name;
      EXPECT_LE((t - pre.at(name)).abs().max().item<double>(), 1e-12) << name << ": not the pretrained weight";
    }
  }
  EXPECT_EQ(adapters, 4);
  EXPECT_EQ(base, static_cast<int>(pre.size()));
  EXPECT_GT((pre.at("transformer.h.0.attn.c_attn.weight") - fresh.at("transformer.h.0.attn.c_attn.weight")).abs().max().item<double>(), 1e-4)
      << "the pretraining moved the weights";

  // A LoRA run from init_checkpoint: its checkpoints leave the frozen base out too, recording that
  // its values came from init_checkpoint, and every load (a resume, which does not read
  // init_checkpoint; a start from it; export) reads them from there. Resumed, the run goes on
  // exactly as one that never stopped (the adapters' gradients depend on the base).
  auto trained = lora;
  trained.insert(trained.end(), {"--set", from_pre});
  auto first = trained, straight = trained;
  first.insert(first.end(), {"--set", "trainer.max_steps=3"});
  const auto l = run("lora", first);
  EXPECT_NE(l.err.find("checkpoints leave out the 28 frozen parameters (28032 elements), as 'lora' asks: loading one reads them from "
                       "model.init_checkpoint (" + last("pre").string() + "), which must stay there"),
            std::string::npos)
      << l.err;
  EXPECT_EQ(weights(last("lora")).count("transformer.h.0.attn.c_attn.weight"), 0u) << "the frozen base was saved";
  EXPECT_LT(fs::file_size(last("lora")) * 4, fs::file_size(last("pre"))) << "the checkpoint holds more than the adapters";
  const auto info = run_engine_ok(dir, {"checkpoint", "info", last("lora").string()});
  EXPECT_NE(info.out.find("frozen weights left out: 28 (loading reads 28 of them from " + last("pre").string() +
                          ", its run's model.init_checkpoint)\n"),
            std::string::npos)
      << info.out;
  trained.insert(trained.end(), {"--set", "trainer.max_steps=5", "--resume", "last"});
  const auto resumed = run("lora", trained);
  EXPECT_NE(resumed.err.find("resumed from"), std::string::npos) << resumed.err;
  // Without lora the model lacks the adapters: refused, not evaluated as the bare base.
  const auto bare = run_engine({"validate", "--ckpt", last("lora").string(), "--set", "trainer.accelerator=\"cpu\"", "run.toml"}, dir.path(), {}, 600);
  EXPECT_EQ(bare.exit_code, 1) << bare.err;
  EXPECT_NE(bare.err.find("holds 4 tensors this model does not have, e.g. 'transformer.h.0.attn.c_attn.lora_A'"), std::string::npos) << bare.err;
  straight.insert(straight.end(), {"--set", "trainer.max_steps=5"});
  run("lora_straight", straight);
  expect_identical_weights(last("lora"), last("lora_straight"));

  // What init_exclude kept as built is not read from the base: a resume takes it from the model.
  auto excluded = lora;
  excluded.insert(excluded.end(), {"--set", from_pre, "--set", "model.init_exclude=[\"transformer.h.1.mlp\"]", "--set", "trainer.max_steps=2"});
  run("excluded", excluded);
  const auto excluded_info = run_engine_ok(dir, {"checkpoint", "info", last("excluded").string()});
  EXPECT_NE(excluded_info.out.find("frozen weights left out: 28 (loading reads 24 of them from " + last("pre").string() +
                                   ", its run's model.init_checkpoint, the others from the model as it is built)"),
            std::string::npos)
      << excluded_info.out;
  excluded.insert(excluded.end(), {"--set", "trainer.max_steps=3", "--resume", "last"});
  EXPECT_NE(run("excluded", excluded).err.find("resumed from"), std::string::npos);

  // A LoRA run's checkpoint (adapters trained, the frozen base left out): its adapters are taken,
  // and the base read from its own base.
  const auto again = run("from_lora", frozen_run({"--set", "model.init_checkpoint=\"" + last("lora").string() + "\""}));
  EXPECT_EQ(again.err.find("which it does not hold"), std::string::npos) << again.err;
  const auto lora_trained = weights(last("lora")), from_lora = weights(last("from_lora"));
  for (const auto& [name, t] : lora_trained) EXPECT_LE((t - from_lora.at(name)).abs().max().item<double>(), 1e-12) << name;
  for (const auto& [name, t] : pre) EXPECT_LE((t - from_lora.at(name)).abs().max().item<double>(), 1e-12) << name << ": not the pretrained weight";
  EXPECT_GT(from_lora.at("transformer.h.0.attn.c_attn.lora_B").abs().max().item<double>(), 0.0);

  // Two deep: a run from that LoRA checkpoint leaving its base out names the LoRA checkpoint,
  // whose base is the pretraining run's. Its export (base folded with the adapters) is the one of
  // the same run that kept the base, tensor for tensor; verify checks the whole chain.
  auto chain = frozen_run({"--set", "model.init_checkpoint=\"" + last("lora").string() + "\""});
  chain.insert(chain.end(), {"--set", "lora.save_frozen=false"});
  run("chain", chain);
  run_engine_ok(dir, {"export", last("chain").string(), (dir / "chain.safetensors").string()});
  run_engine_ok(dir, {"export", last("from_lora").string(), (dir / "from_lora.safetensors").string()});
  {
    ember::support::SafetensorsFile a((dir / "chain.safetensors").string()), b((dir / "from_lora.safetensors").string());
    ASSERT_EQ(a.names(), b.names());
    for (const auto& name : a.names()) EXPECT_TRUE(at::equal(a.tensor(name), b.tensor(name))) << name;
  }
  const auto verified = run_engine_ok(dir, {"checkpoint", "verify", last("chain").string()});
  EXPECT_NE(verified.out.find(last("chain").string() + ": its frozen weights come from " + last("lora").string() + ", checked next"),
            std::string::npos) << verified.out;
  EXPECT_NE(verified.out.find(last("lora").string() + ": its frozen weights come from " + last("pre").string() + ", checked next"),
            std::string::npos) << verified.out;

  // The base gone, or another checkpoint in its place: one line, from every kind of load.
  const fs::path aside = dir / "pre_aside.ckpt";
  fs::rename(last("pre"), aside);
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"export", last("chain").string(), (dir / "gone.safetensors").string()},
           {"checkpoint", "verify", last("lora").string()},
           {"run.toml", "--set", "trainer.accelerator=\"cpu\"", "--set", "data.shuffle=false", "--set", "trainer.name=\"lora\"", "--plugins",
            "lora", "--set", "lora.rank=4", "--set", "lora.alpha=8.0", "--set", "trainer.max_steps=6", "--resume", "last"}}) {
    const auto gone = run_engine(args, dir.path(), {}, 600);
    EXPECT_NE(gone.exit_code, 0) << args.front();
    EXPECT_NE(gone.err.find("frozen parameters whose values come from " + last("pre").string() +
                            " (model.init_checkpoint of the run that wrote it), and that is gone: put it (or a link to it) back there"),
              std::string::npos)
        << args.front() << ": " << gone.err;
  }
  fs::copy_file(last("fresh"), last("pre"));
  const auto other = run_engine({"export", last("lora").string(), (dir / "other.safetensors").string()}, dir.path(), {}, 600);
  EXPECT_NE(other.exit_code, 0);
  EXPECT_NE(other.err.find("frozen parameters differ in this run from the ones it was trained on"), std::string::npos) << other.err;
  EXPECT_NE(other.err.find("28 of them come from " + last("pre").string() + ", its run's model.init_checkpoint): put that checkpoint back"),
            std::string::npos) << other.err;
  fs::remove(last("pre"));
  fs::rename(aside, last("pre"));

  // The whole project folder moved (the runs in the same places relative to each other): every
  // base is found relative to the checkpoint that names it, two deep too, and a resume records
  // the new place.
  const fs::path moved = dir / "moved";
  fs::create_directories(moved);
  fs::rename(dir / "runs", moved / "runs");
  // (canonical: the engine resolves a relative base so, whatever links the temporary folder holds)
  auto now = [&](const std::string& name) { return fs::weakly_canonical(moved / ("runs/" + name + "/version_0/checkpoints/last.ckpt")); };
  const auto moved_info = run_engine_ok(dir, {"checkpoint", "info", now("lora").string()});
  EXPECT_NE(moved_info.out.find("frozen weights left out: 28 (loading reads 28 of them from " + now("pre").string() +
                                ", its run's model.init_checkpoint, found relative to this checkpoint: the folders moved since it was written)"),
            std::string::npos)
      << moved_info.out;
  run_engine_ok(dir, {"export", now("chain").string(), (dir / "chain_moved.safetensors").string()});
  {
    ember::support::SafetensorsFile a((dir / "chain.safetensors").string()), b((dir / "chain_moved.safetensors").string());
    ASSERT_EQ(a.names(), b.names());
    for (const auto& name : a.names()) EXPECT_TRUE(at::equal(a.tensor(name), b.tensor(name))) << name;
  }
  const auto moved_verified = run_engine_ok(dir, {"checkpoint", "verify", now("chain").string()});
  EXPECT_NE(moved_verified.out.find(now("lora").string() + ": its frozen weights come from " + now("pre").string() +
                                    " (where it lies relative to it: the folders moved since it was written), checked next"),
            std::string::npos)
      << moved_verified.out;
  auto moved_resume = lora;
  moved_resume.insert(moved_resume.end(), {"--set", "trainer.max_steps=6", "--resume", now("lora").string()});
  const auto mr = run("lora_moved", moved_resume);
  EXPECT_NE(mr.err.find("checkpoint " + now("lora").string() + ": its base is no longer where it was recorded; read from " + now("pre").string()),
            std::string::npos)
      << mr.err;
  const auto resumed_info = run_engine_ok(dir, {"checkpoint", "info", last("lora_moved").string()});
  EXPECT_NE(resumed_info.out.find("(loading reads 28 of them from " + now("pre").string() + ", its run's model.init_checkpoint)\n"),
            std::string::npos)
      << resumed_info.out;
  // Gone from both places: the line names both.
  fs::rename(now("pre"), aside);
  const auto both = run_engine({"checkpoint", "verify", now("lora").string()}, dir.path(), {}, 600);
  EXPECT_NE(both.exit_code, 0);
  EXPECT_NE(both.err.find("whose values come from " + last("pre").string() + " (model.init_checkpoint of the run that wrote it), and that is gone "
                          "(nor is it at " + now("pre").string() + ", where it lay relative to this checkpoint): put it"),
            std::string::npos)
      << both.err;
  fs::rename(aside, now("pre"));
  fs::rename(dir / "runs", dir / "runs_of_the_moved_resume");
  fs::rename(moved / "runs", dir / "runs");

  if (EMBER_TEST_WITH_MPI) {
    const std::vector<std::string> sharded = {"--plugins", "sharded", "--set", "sharded.stage=3", "--set", "trainer.devices=2", "--set",
                                              "data.batch_size=4", "--set", "sharded.timeout=60.0"};
    auto pre_dir = sharded;
    pre_dir.insert(pre_dir.end(), {"--set", "trainer.max_steps=3", "--set", "sharded.state_dict_type=\"sharded\""});
    run("pre_dir", pre_dir);
    const fs::path consolidated = dir / "pre_dir.ckpt";
    const auto c = run_engine({"checkpoint", "consolidate", last("pre_dir").string(), consolidated.string()}, dir.path(), {}, 120);
    ASSERT_EQ(c.exit_code, 0) << c.err;
    // A directory of a bigger model: refused from the names its meta.ckpt keeps, by a start from
    // it and by a resume alike.
    for (const std::string& how : {"model.init_checkpoint=\"" + last("pre_dir").string() + "\"", std::string()}) {
      std::vector<std::string> smaller = {"run.toml", "--set", "trainer.accelerator=\"cpu\"", "--set", "model.layers=1", "--set",
                                          "trainer.max_steps=4", "--set", "trainer.name=\"smaller\""};
      smaller.insert(smaller.end(), sharded.begin(), sharded.end());
      if (how.empty()) smaller.insert(smaller.end(), {"--resume", last("pre_dir").string()});
      else smaller.insert(smaller.end(), {"--set", how});
      const auto r = run_engine(smaller, dir.path(), {}, 120);
      EXPECT_EQ(r.exit_code, 1) << r.err;
      EXPECT_NE(r.err.find("checkpoint " + last("pre_dir").string()), std::string::npos) << how << ": " << r.err;
      EXPECT_NE(r.err.find(" tensors this model does not have, e.g. 'transformer.h.1."), std::string::npos) << how << ": " << r.err;
    }
    auto from_dir = frozen_run({"--set", "model.init_checkpoint=\"" + last("pre_dir").string() + "\""});
    from_dir.insert(from_dir.end(), sharded.begin(), sharded.end());
    const auto d = run("from_dir", from_dir);
    EXPECT_NE(d.err.find("(4 tensors it lacks keep their own values)"), std::string::npos) << d.err;
    const auto whole = weights(consolidated), started_dir = weights(last("from_dir"));
    for (const auto& [name, t] : started_dir) {
      if (name.find(".lora_") != std::string::npos)
        EXPECT_LE((t - fresh.at(name)).abs().max().item<double>(), 1e-12) << name << ": not the adapter's own initial value";
      else
        EXPECT_LE((t - whole.at(name)).abs().max().item<double>(), 1e-12) << name << ": not the pretrained weight";
    }
    // A LoRA run from the directory writing files (state_dict_type "full") leaves the base out
    // too: its resume reads it from the directory (each rank its shards), its export through a
    // consolidated copy; the fingerprint refuses any other values.
    auto dir_lora = lora;
    dir_lora.insert(dir_lora.end(), sharded.begin(), sharded.end());
    dir_lora.insert(dir_lora.end(), {"--set", "model.init_checkpoint=\"" + last("pre_dir").string() + "\""});
    auto dir_first = dir_lora;
    dir_first.insert(dir_first.end(), {"--set", "trainer.max_steps=2"});
    run("dir_lora", dir_first);
    EXPECT_EQ(weights(last("dir_lora")).count("transformer.h.0.attn.c_attn.weight"), 0u) << "the frozen base was saved";
    dir_lora.insert(dir_lora.end(), {"--set", "trainer.max_steps=4", "--resume", "last"});
    EXPECT_NE(run("dir_lora", dir_lora).err.find("resumed from"), std::string::npos);
    run_engine_ok(dir, {"export", last("dir_lora").string(), (dir / "dir_lora.safetensors").string()}, 600);
  }
}
