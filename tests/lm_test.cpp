// Language models (issue "Train and fine-tune language models"): the gpt network against Hugging
// Face transformers (GPT-2 and Llama layouts), its key/value cache against the full forward, the
// character tokenizer, and the gpt + text_lm plugins in real engine runs: training, perplexity,
// `engine generate` (cached == uncached, seeded sampling), exact mid-epoch resume, export that
// transformers loads, and the one-line errors for bad input. lora's runs are in lora_test.cpp.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "char_vocabulary.h"
#include "checkpoint_support.h"
#include "gpt_net.h"
#include "lm_tokenizer.h"
#include "lm_runs.h"
#include "support.h"
#include <ember/error.h>
#include <ember/support/safetensors.h>

using namespace ember::test;
using namespace ember::test::lm_runs;
namespace fs = std::filesystem;

namespace {

fs::path ember_test_cache_dir() {
  if (const char* c = std::getenv("EMBER_CACHE"); c != nullptr && *c != '\0') return c;
  const char* home = std::getenv("HOME");
  return fs::path(home != nullptr ? home : ".") / ".cache" / "ember";
}

ember_gpt::GptShape small_shape(ember_gpt::Flavour flavour) {
  ember_gpt::GptShape s;
  s.flavour = flavour;
  s.vocab_size = 50;
  s.context_length = 32;
  s.layers = 2;
  s.heads = 4;
  s.kv_heads = flavour == ember_gpt::Flavour::llama ? 2 : 4;
  s.width = 32;
  s.ff_width = 48;
  s.bias = flavour == ember_gpt::Flavour::gpt2;
  s.tied = flavour == ember_gpt::Flavour::gpt2;
  return s;
}

}  // namespace

#ifdef EMBER_TEST_PYTHON
// transformers' GPT2LMHeadModel and LlamaForCausalLM (grouped-query attention, untied and tied
// output), saved with save_pretrained, load into GptNet under their own names and give the same
// logits to 1e-5.
TEST(GptNet, SameLogitsAsTransformersForGpt2AndLlama) {
  TempDir dir("gpt_parity");
  auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/lm/reference.py").string(), "tiny-models",
                        dir.path().string()},
                       dir.path(), {}, 600);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::ifstream f(dir / "reference.json");
  const auto ref = nlohmann::json::parse(f);
  const at::Tensor ids = tensor_from_json(ref["input_ids"]).to(at::kLong);
  for (const std::string kind : {"gpt2", "llama", "llama_tied"}) {
    const auto shape = ember_gpt::GptShape::from_hf_config((dir / kind / "config.json").string());
    ember_gpt::GptNet net(shape);
    const auto unused = net.load_safetensors((dir / kind / "model.safetensors").string());
    EXPECT_TRUE(unused.empty()) << kind << ": unused " << unused.front();
    net.eval();
    torch::NoGradGuard no_grad;
    const at::Tensor logits = net.forward(ids).to(at::kDouble);
    const at::Tensor want = tensor_from_json(ref["logits"][kind]);
    ASSERT_EQ(logits.sizes(), want.sizes()) << kind;
    EXPECT_LT((logits - want).abs().max().item<double>(), 1e-5) << kind;
  }
  EXPECT_EQ(ember_gpt::GptShape::from_hf_config((dir / "llama" / "config.json").string()).rope_theta, 500.0);
}
#endif

// Generation with the key/value cache sees what the full forward sees: a prompt, then one token
// at a time, then several at once after cached ones (the offset causal mask) give the logits of
// one pass over the whole sequence.
TEST(GptNet, CachedForwardEqualsTheFullForward) {
  for (const auto flavour : {ember_gpt::Flavour::gpt2, ember_gpt::Flavour::llama}) {
    torch::manual_seed(3);
    ember_gpt::GptNet net(small_shape(flavour));
    net.eval();
    torch::NoGradGuard no_grad;
    const at::Tensor ids = at::randint(0, 50, {2, 12}, at::kLong);
    const at::Tensor full = net.forward(ids);
    auto cache = net.new_cache(2, 32);
    std::vector<at::Tensor> parts;
    parts.push_back(net.forward(ids.narrow(1, 0, 5), &cache));
    for (int64_t t = 5; t < 9; ++t) parts.push_back(net.forward(ids.narrow(1, t, 1), &cache));
    parts.push_back(net.forward(ids.narrow(1, 9, 3), &cache));
    EXPECT_EQ(cache.length, 12);
    EXPECT_LT((at::cat(parts, 1) - full).abs().max().item<double>(), 1e-5) << (flavour == ember_gpt::Flavour::gpt2 ? "gpt2" : "llama");
  }
  // Past the context: one line naming the lengths.
  ember_gpt::GptNet net(small_shape(ember_gpt::Flavour::gpt2));
  try {
    net.forward(at::zeros({1, 33}, at::kLong));
    ADD_FAILURE() << "no error for 33 tokens in a context of 32";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("a sequence of 33 tokens is longer than the model's context of 32 positions"), std::string::npos)
        << e.what();
  }
}

// Activation checkpointing recomputes, it does not approximate: full (every block) gives
// bit-identical gradients to keeping everything, also with dropout (the recompute replays the
// forward's random masks); selective (every block's MLP) the same up to float rounding (the
// residual's two gradients are summed in another order).
TEST(GptNet, ActivationCheckpointingGivesIdenticalGradients) {
  for (const auto flavour : {ember_gpt::Flavour::gpt2, ember_gpt::Flavour::llama}) {
    auto shape = small_shape(flavour);
    shape.dropout = 0.1;
    std::vector<std::vector<at::Tensor>> grads;
    for (const auto mode : {ember::ActivationCheckpointing::none, ember::ActivationCheckpointing::full, ember::ActivationCheckpointing::selective}) {
      torch::manual_seed(5);
      ember_gpt::GptNet net(shape);
      ember::ModelUnits units;
      net.declare_units(units);
      units.set_checkpointing(mode == ember::ActivationCheckpointing::full ? mode : ember::ActivationCheckpointing::none);
      net.set_selective_checkpointing(mode == ember::ActivationCheckpointing::selective);
      net.train();
      const at::Tensor ids = at::randint(0, 50, {3, 16}, at::kLong);
      torch::manual_seed(9);  // the dropout masks
      const at::Tensor logits = net.forward(ids);
      at::cross_entropy_loss(logits.reshape({-1, 50}), ids.roll(1, 1).reshape({-1})).backward();
      std::vector<at::Tensor> g;
      for (const auto& p : net.parameters()) g.push_back(p.grad().clone());
      grads.push_back(g);
    }
    for (size_t k = 0; k < grads[0].size(); ++k) {
      EXPECT_TRUE(at::equal(grads[0][k], grads[1][k])) << "full: parameter " << k << " differs by "
                                                       << (grads[0][k] - grads[1][k]).abs().max().item<double>();
      EXPECT_LE((grads[0][k] - grads[2][k]).abs().max().item<double>(), 1e-6 * (1.0 + grads[0][k].abs().max().item<double>()))
          << "selective: parameter " << k;
    }
  }
}

// A transformers config.json is downloaded: a shape value of the wrong type or size is one line
// naming the file and the key (it was nlohmann's "type must be number, but is string", a
// "vector<bool>::_M_fill_insert" from a negative layer count, a LibTorch stack from a negative
// vocabulary).
TEST(GptNet, ConfigJsonValuesAreCheckedByKey) {
  TempDir dir("gpt_config");
  const std::string file = (dir / "config.json").string();
  auto error_of = [&](const std::string& json) -> std::string {
    write_file(dir / "config.json", json);
    try {
      ember_gpt::GptShape::from_hf_config(file);
    } catch (const ember::RunError& e) {
      return e.what();
    }
    return "(read)";
  };
  const std::string gpt2 = R"({"model_type":"gpt2","vocab_size":100,"n_positions":64,"n_embd":32,"n_layer":2,"n_head":2)";
  EXPECT_EQ(error_of(gpt2 + "}"), "(read)");
  EXPECT_EQ(error_of(R"({"model_type":"gpt2","vocab_size":"x","n_positions":64,"n_embd":32,"n_layer":2,"n_head":2})"),
            file + ": \"vocab_size\" = \"x\" is not a positive integer");
  EXPECT_EQ(error_of(R"({"model_type":"gpt2","vocab_size":100,"n_positions":64,"n_embd":32,"n_layer":-2,"n_head":2})"),
            file + ": \"n_layer\" = -2 is not a positive integer");
  EXPECT_EQ(error_of(R"({"model_type":"gpt2","vocab_size":100,"n_positions":64.5,"n_embd":32,"n_layer":2,"n_head":2})"),
            file + ": \"n_positions\" = 64.5 is not a positive integer");
  EXPECT_EQ(error_of(gpt2 + R"(,"n_inner":0})"), file + ": \"n_inner\" = 0 is not a positive integer");
  EXPECT_EQ(error_of(gpt2 + R"(,"layer_norm_epsilon":"a"})"), file + ": \"layer_norm_epsilon\" = \"a\" is not a number");
  EXPECT_EQ(error_of(gpt2 + R"(,"tie_word_embeddings":1})"), file + ": \"tie_word_embeddings\" = 1 is not true or false");
  EXPECT_EQ(error_of(R"({"model_type":"llama","vocab_size":100,"max_position_embeddings":64,"hidden_size":32,"num_hidden_layers":2,)"
                     R"("num_attention_heads":4,"intermediate_size":64,"head_dim":"8"})"),
            file + ": \"head_dim\" = \"8\" is not a positive integer");
}

TEST(CharVocabulary, RoundTripsUtf8AndRefusesMalformedBytes) {
  std::vector<uint32_t> cps;
  size_t bad = 0;
  ASSERT_TRUE(ember_text_lm::decode_utf8("Émile, 中文!\n", cps, bad));
  ember_text_lm::CharVocabulary vocab(cps);
  EXPECT_EQ(vocab.size(), 11);  // É m i l e , space 中 文 ! newline
  std::string back;
  for (uint32_t cp : cps) ember_text_lm::append_utf8(back, vocab.symbol(vocab.id(cp)));
  EXPECT_EQ(back, "Émile, 中文!\n");
  EXPECT_EQ(vocab.symbols().front(), static_cast<uint32_t>('\n'));  // code point order
  EXPECT_EQ(vocab.id('z'), -1);
  EXPECT_FALSE(ember_text_lm::decode_utf8(std::string("ab\xC3", 3), cps, bad));
  EXPECT_EQ(bad, 2u);
  EXPECT_FALSE(ember_text_lm::decode_utf8(std::string("\xC0\xAF", 2), cps, bad));  // overlong '/'
  EXPECT_FALSE(ember_text_lm::decode_utf8(std::string("\xED\xA0\x80", 3), cps, bad));  // a surrogate
}

// Trains gpt on text_lm, logs validation loss and perplexity, then `engine generate` continues a
// prompt: greedy decoding with the key/value cache prints exactly what the uncached path prints,
// and seeded sampling repeats itself.
TEST(LanguageModel, TrainsThenGeneratesTheSameTextWithAndWithoutTheCache) {
  TempDir dir("lm_train_generate");
  write_lm_run(dir);
  auto r = run_engine_ok(dir, {"run.toml"}, 600);
  EXPECT_NE(r.err.find("text_lm: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("characters of the corpus (vocabulary 34)"), std::string::npos) << r.err;
  const auto rows = read_csv(dir / "runs/run/version_0/metrics.csv");
  std::vector<double> val_loss;
  double ppl = -1, loss_at_ppl = -1;
  for (const auto& row : rows) {
    if (row.count("val_loss") && !row.at("val_loss").empty()) val_loss.push_back(std::stod(row.at("val_loss")));
    if (row.count("val_ppl") && !row.at("val_ppl").empty()) ppl = std::stod(row.at("val_ppl"));
  }
  ASSERT_EQ(val_loss.size(), 2u) << "validation at steps 20 and 40";
  loss_at_ppl = val_loss.back();
  EXPECT_LT(val_loss[1], val_loss[0]);
  EXPECT_LT(val_loss[1], std::log(34.0));  // better than uniform over the vocabulary
  EXPECT_NEAR(ppl, std::exp(loss_at_ppl), 1e-3 * ppl);

  const std::vector<std::string> greedy = {"generate", "--ckpt", "last", "--prompt", "It is a ", "--max-new-tokens", "40", "--temperature", "0",
                                           "run.toml"};
  auto cached = run_engine_ok(dir, greedy);
  auto uncached_args = greedy;
  uncached_args.insert(uncached_args.begin() + 1, "--no-kv-cache");
  auto uncached = run_engine_ok(dir, uncached_args);
  EXPECT_EQ(cached.out.rfind("It is a ", 0), 0u) << cached.out;
  EXPECT_EQ(cached.out.size(), std::string("It is a ").size() + 40 + 1) << cached.out;  // one character a token, then a newline
  EXPECT_EQ(cached.out, uncached.out);
  EXPECT_NE(cached.err.find("generated 40 tokens after a prompt of 8 (key/value cache)"), std::string::npos) << cached.err;
  // Past the context (32 positions): the cache starts again from the last 32 tokens, as the
  // uncached path crops; both still agree.
  auto long_cached = greedy, long_uncached = uncached_args;
  long_cached[6] = long_uncached[7] = "60";
  EXPECT_EQ(run_engine_ok(dir, long_cached).out, run_engine_ok(dir, long_uncached).out);

  const std::vector<std::string> sample = {"generate", "--ckpt", "last", "--prompt", "The ", "--max-new-tokens", "30", "--top-k", "10",
                                           "--top-p", "0.9", "--seed", "7", "run.toml"};
  auto a = run_engine_ok(dir, sample), b = run_engine_ok(dir, sample);
  EXPECT_EQ(a.out, b.out);
  auto other_seed = sample;
  other_seed[12] = "8";
  EXPECT_NE(run_engine_ok(dir, other_seed).out, a.out);
  // The prompt on standard input (a piped line), and the run folder keeps the text.
  auto piped = run_process({"/bin/bash", "-c", "echo 'It is a ' | \"$0\" \"$@\"", engine_path().string(), "generate", "--ckpt", "last",
                            "--max-new-tokens", "40", "--temperature", "0", "run.toml"},
                           dir.path(), {{"EMBER_PLUGIN_PATH", ""}}, 240);
  EXPECT_EQ(piped.exit_code, 0) << piped.err;
  EXPECT_EQ(piped.out, cached.out);
  bool kept = false;
  for (const auto& e : fs::directory_iterator(dir / "runs/run"))
    if (fs::exists(e.path() / "generated.txt") && read_file(e.path() / "generated.txt") == cached.out) kept = true;
  EXPECT_TRUE(kept);
}

// A run stopped in the middle of an epoch and resumed ends with exactly the weights of an
// uninterrupted run: text_lm's windows are a pure function of the sample index, and the engine's
// sampler resumes its permutation.
TEST(LanguageModel, MidEpochResumeIsExact) {
  TempDir full("lm_resume"), split("lm_resume");
  write_lm_run(full);
  write_lm_run(split);
  run_engine_ok(full, {"run.toml", "--set", "trainer.max_steps=24"}, 600);
  run_engine_ok(split, {"run.toml", "--set", "trainer.max_steps=13"}, 600);
  auto r = run_engine_ok(split, {"run.toml", "--set", "trainer.max_steps=24", "--resume", "last"}, 600);
  EXPECT_NE(r.err.find("(batch 13 of the epoch)"), std::string::npos) << r.err;  // stopped at step 13, mid-epoch
  EXPECT_EQ(max_weight_difference(last_checkpoint(full), last_checkpoint(split)).value, 0.0);
}

#ifdef EMBER_TEST_PYTHON
// `engine export` writes a folder that transformers' AutoModelForCausalLM loads, for both layouts,
// and it gives Ember's logits. A gpt2 built without biases (nanoGPT's bias = False, the Austen
// config's) exports zero biases, which GPT2LMHeadModel always has: the same logits.
TEST(LanguageModel, ExportLoadsInTransformersWithTheSameLogits) {
  TempDir dir("lm_export");
  write_lm_run(dir);
  struct Case {
    std::string flavour;
    bool bias;
  };
  int version = 0;
  for (const Case c : {Case{"gpt2", true}, Case{"llama", true}, Case{"gpt2", false}}) {
    const std::string name = c.flavour + (c.bias ? "" : "_nobias");
    run_engine_ok(dir, {"run.toml", "--set", "trainer.max_steps=5", "--set", "model.flavour=\"" + c.flavour + "\"", "--set",
                        "trainer.version=" + std::to_string(version), "--set", std::string("model.bias=") + (c.bias ? "true" : "false")},
                  600);
    const fs::path ckpt = dir / ("runs/run/version_" + std::to_string(version++) + "/checkpoints/last.ckpt");
    const fs::path out = dir / ("export_" + name);
    run_engine_ok(dir, {"export", ckpt.string(), out.string()});
    auto shape = ember_gpt::GptShape::from_hf_config((out / "config.json").string());
    // The model as trained (without biases where it had none): the export's biases are zeros and
    // nothing else.
    shape.bias = c.bias;
    ember_gpt::GptNet net(shape);
    const auto unused = net.load_safetensors((out / "model.safetensors").string());
    if (c.bias) {
      EXPECT_TRUE(unused.empty()) << unused.front();
    } else {
      EXPECT_EQ(unused.size(), 2u * 6 + 1) << "per block ln_1, c_attn, c_proj, ln_2, c_fc, mlp.c_proj; and ln_f";
      ember::support::SafetensorsFile exported((out / "model.safetensors").string());
      for (const auto& u : unused) {
        EXPECT_NE(u.find(".bias"), std::string::npos) << u;
        EXPECT_EQ(exported.tensor(u).abs().max().item<double>(), 0.0) << u;
      }
    }
    net.eval();
    torch::NoGradGuard no_grad;
    const at::Tensor ids = at::randint(0, 34, {2, 9}, at::kLong);
    write_file(dir / "ids.json", json_from_tensor(ids).dump());
    auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/lm/reference.py").string(), "logits", out.string(),
                          (dir / "ids.json").string(), (dir / "hf.json").string()},
                         dir.path(), {}, 600);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    std::ifstream f(dir / "hf.json");
    const auto hf = nlohmann::json::parse(f);
    EXPECT_EQ(hf["architecture"], c.flavour == "gpt2" ? "GPT2LMHeadModel" : "LlamaForCausalLM");
    EXPECT_LT((net.forward(ids).to(at::kDouble) - tensor_from_json(hf["logits"])).abs().max().item<double>(), 1e-5) << name;
  }
}
#endif


// ZeRO stage 3 on 2 CPU ranks (every block a unit, gathered one at a time) trains gpt to the
// weights single_device reaches with the same global batch.
TEST(LanguageModel, ShardedStage3OnTwoRanksMatchesSingleDevice) {
  EMBER_SKIP_WITHOUT_MPI();
  TempDir dir("lm_sharded");
  write_lm_run(dir);
  const std::vector<std::string> common = {"run.toml", "--set", "trainer.max_steps=6", "--set", "trainer.accelerator=\"cpu\"", "--set",
                                           "data.shuffle=false", "--set", "trainer.val_check_interval=6"};
  auto single = common, sharded = common;
  for (const char* s : {"--set", "trainer.name=\"single\"", "--set", "data.batch_size=8"}) single.push_back(s);
  for (const char* s : {"--plugins", "sharded", "--set", "sharded.stage=3", "--set", "trainer.devices=2", "--set", "trainer.name=\"sharded\"",
                        "--set", "data.batch_size=4"})
    sharded.push_back(s);
  run_engine_ok(dir, single, 600);
  auto r = run_engine_ok(dir, sharded, 600);
  EXPECT_NE(r.err.find("2 units declared by the model"), std::string::npos) << r.err;
  EXPECT_LE(max_weight_difference(dir / "runs/single/version_0/checkpoints/last.ckpt", dir / "runs/sharded/version_0/checkpoints/last.ckpt"),
            1e-5);
}

// trainer.activation_checkpointing in engine runs: full and selective train gpt to exactly the
// weights of a run without it (single_device), and full under ddp and sharded stage 3 on 2 ranks
// to single_device's within 1e-5; a model without units is refused in one line.
TEST(LanguageModel, ActivationCheckpointingTrainsTheSameWeightsUnderEveryStrategy) {
  TempDir dir("lm_checkpointing");
  write_lm_run(dir);
  const std::vector<std::string> common = {"run.toml", "--set", "trainer.max_steps=6", "--set", "trainer.accelerator=\"cpu\"", "--set",
                                           "data.shuffle=false", "--set", "trainer.val_check_interval=6", "--set", "model.dropout=0.1"};
  auto with = [&](std::vector<std::string> extra) {
    auto args = common;
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  run_engine_ok(dir, with({"--set", "trainer.name=\"none\"", "--set", "data.batch_size=8"}), 600);
  for (const std::string mode : {"full", "selective"}) {
    auto r = run_engine_ok(dir, with({"--set", "trainer.name=\"" + mode + "\"", "--set", "data.batch_size=8", "--set",
                                      "trainer.activation_checkpointing=\"" + mode + "\""}),
                           600);
    EXPECT_NE(r.err.find("activation checkpointing: " + mode + " (2 units recomputed in backward"), std::string::npos) << r.err;
    // full: bit for bit; selective: up to float rounding (see GptNet.ActivationCheckpointingGivesIdenticalGradients).
    EXPECT_LE(max_weight_difference(dir / "runs/none/version_0/checkpoints/last.ckpt", dir / ("runs/" + mode + "/version_0/checkpoints/last.ckpt")).value,
              mode == "full" ? 0.0 : 1e-6)
        << mode;
  }
  if (EMBER_TEST_WITH_MPI) {
    // Without dropout: ranks draw their own masks, so only a deterministic forward compares.
    run_engine_ok(dir, with({"--set", "trainer.name=\"none0\"", "--set", "data.batch_size=8", "--set", "model.dropout=0.0"}), 600);
    for (const std::string strategy : {"ddp", "sharded"}) {
      run_engine_ok(dir, with({"--plugins", strategy, "--set", "trainer.devices=2", "--set", "trainer.name=\"" + strategy + "\"", "--set",
                               "data.batch_size=4", "--set", "model.dropout=0.0", "--set", "trainer.activation_checkpointing=\"full\""}),
                    600);
      EXPECT_LE(max_weight_difference(dir / "runs/none0/version_0/checkpoints/last.ckpt", dir / ("runs/" + strategy + "/version_0/checkpoints/last.ckpt")),
                1e-5)
          << strategy;
    }
  }
  write_file(dir / "cnn.toml", "[trainer]\nmax_steps = 1\nactivation_checkpointing = \"full\"\n[model]\nname = \"cnn\"\n[data]\nname = \"synthetic\"\n");
  auto cnn = run_engine({"cnn.toml"}, dir.path());
  EXPECT_EQ(cnn.exit_code, 2) << cnn.err;
  EXPECT_NE(cnn.err.find("trainer.activation_checkpointing = \"full\": model 'cnn' declares no units to recompute"), std::string::npos)
      << cnn.err;
}

// model.chunked_loss = true (ember::linear_cross_entropy, the output layer's gradients made in the
// loss's forward) and model.fused_cross_entropy = true (ember::cross_entropy's two passes on the
// whole logits) train the weights LibTorch's cross-entropy (the default) trains, to float32
// rounding. Train metrics need the logits: with the chunked loss the run stops at its first batch,
// naming the key, and without it computes them.
TEST(LanguageModel, ChunkedAndFusedLossesTrainTheSameWeightsAndTrainMetricsNeedTheLogits) {
  TempDir dir("lm_chunked_loss");
  write_lm_run(dir);
  const std::vector<std::string> common = {"run.toml", "--set", "trainer.max_steps=6", "--set", "trainer.accelerator=\"cpu\"", "--set",
                                           "data.shuffle=false", "--set", "trainer.val_check_interval=6"};
  auto with = [&](std::vector<std::string> extra) {
    auto args = common;
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  // SGD: Adam's normalised steps would magnify float32 rounding of near-zero gradients.
  run_engine_ok(dir, with({"--set", "trainer.name=\"chunked\"", "--set", "optimizer.name=\"sgd\"", "--set", "optimizer.lr=0.5", "--set",
                           "model.chunked_loss=true"}),
                600);
  run_engine_ok(dir, with({"--set", "trainer.name=\"whole\"", "--set", "optimizer.name=\"sgd\"", "--set", "optimizer.lr=0.5"}), 600);
  run_engine_ok(dir, with({"--set", "trainer.name=\"fused\"", "--set", "optimizer.name=\"sgd\"", "--set", "optimizer.lr=0.5", "--set",
                           "model.fused_cross_entropy=true"}),
                600);
  const auto diff = max_weight_difference(dir / "runs/chunked/version_0/checkpoints/last.ckpt", dir / "runs/whole/version_0/checkpoints/last.ckpt");
  EXPECT_LE(diff.value, 1e-6);
  EXPECT_LE(max_weight_difference(dir / "runs/fused/version_0/checkpoints/last.ckpt", dir / "runs/whole/version_0/checkpoints/last.ckpt").value, 1e-6);
  // The bound means something: half the learning rate lands far outside it.
  run_engine_ok(dir, with({"--set", "trainer.name=\"half_lr\"", "--set", "optimizer.name=\"sgd\"", "--set", "optimizer.lr=0.25", "--set",
                           "model.chunked_loss=true"}),
                600);
  EXPECT_GT(max_weight_difference(dir / "runs/chunked/version_0/checkpoints/last.ckpt", dir / "runs/half_lr/version_0/checkpoints/last.ckpt").value, 1e-3);

  write_file(dir / "metrics.toml", lm_toml(dir) + "[metrics]\nnames = [\"perplexity\"]\nsplits = [\"train\", \"val\"]\non_step = true\n");
  auto refused = run_engine({"metrics.toml", "--set", "trainer.max_steps=400", "--set", "trainer.name=\"refused\"", "--set", "model.chunked_loss=true"},
                            dir.path());
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.err.find("the model handed no predictions on the train split"), std::string::npos) << refused.err;
  EXPECT_NE(refused.err.find("model.chunked_loss = false"), std::string::npos) << refused.err;
  // At the first batch, before any checkpoint (every_n_train_steps = 10), not at the epoch's end.
  EXPECT_FALSE(fs::exists(dir / "runs/refused/version_0/checkpoints/last.ckpt"));
  run_engine_ok(dir, {"metrics.toml", "--set", "trainer.max_steps=6", "--set", "trainer.name=\"metrics\""}, 600);
  bool train_ppl = false;
  for (const auto& row : read_csv(dir / "runs/metrics/version_0/metrics.csv"))
    for (const auto& [name, value] : row)
      if (name.rfind("train_perplexity", 0) == 0 && !value.empty()) train_ppl = true;
  EXPECT_TRUE(train_ppl);
}

#ifdef EMBER_TEST_PYTHON
// tokenizer = "sentencepiece": a BPE tokenizer trained on the corpus once (cached with the token
// file) gives the ids Python's sentencepiece gives with the same model, text decodes back exactly
// (a prompt comes out of `engine generate` as it went in), and gpt trains on it.
TEST(LanguageModel, SentencePieceTokensMatchPythonAndRoundTrip) {
  TempDir dir("lm_sentencepiece");
  write_lm_run(dir);
  const std::vector<std::string> sp = {"--set", "data.tokenizer=\"sentencepiece\"", "--set", "data.sentencepiece_vocab_size=320", "--set",
                                       "model.vocab_size=320", "--set", "trainer.max_steps=10"};
  auto train = sp;
  train.insert(train.begin(), "run.toml");
  auto r = run_engine_ok(dir, train, 600);
  EXPECT_NE(r.err.find("SentencePiece bpe trained on the corpus (vocabulary 320)"), std::string::npos) << r.err;
  fs::path folder;
  for (const auto& e : fs::directory_iterator(dir / "tokens"))
    if (fs::exists(e.path() / "tokenizer.model")) folder = e.path();
  ASSERT_FALSE(folder.empty());
  auto py = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/lm/reference.py").string(), "sentencepiece-ids",
                         (folder / "tokenizer.model").string(), (dir / "corpus.txt").string(), (dir / "sp.json").string()},
                        dir.path(), {}, 600);
  ASSERT_EQ(py.exit_code, 0) << py.err;
  std::ifstream f(dir / "sp.json");
  const auto want = nlohmann::json::parse(f)["ids"].get<std::vector<int64_t>>();
  const std::string bytes = read_file(folder / "tokens.u16");
  ASSERT_EQ(bytes.size(), want.size() * 2);
  int64_t differ = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const int64_t id = static_cast<unsigned char>(bytes[2 * i]) | (static_cast<unsigned char>(bytes[2 * i + 1]) << 8);
    differ += id != want[i];
  }
  EXPECT_EQ(differ, 0) << "of " << want.size() << " tokens";
  EXPECT_LT(want.size(), corpus_text().size() * 3 / 4) << "BPE merges: fewer tokens than characters";
  // A prompt with a character the corpus never has (byte fallback) and a newline comes back as it went in.
  auto gen = sp;
  for (const char* a : {"generate", "--ckpt", "last", "--prompt", "Zoë said:\nIt is", "--max-new-tokens", "5", "run.toml"}) gen.push_back(a);
  gen.erase(gen.begin() + 6, gen.begin() + 8);  // no trainer.max_steps for generate
  auto g = run_engine_ok(dir, gen);
  EXPECT_EQ(g.out.rfind("Zoë said:\nIt is", 0), 0u) << g.out;
}
#endif

// tokenizer = "bytelevel_bpe": GPT-2-style byte-level BPE from a Hugging Face tokenizer.json gives
// `tokenizers`' ids on the whole Jane Austen corpus (scripts/setup.sh installs it), and the small
// test corpus trains and generates through it.
TEST(LanguageModel, ByteLevelBpeGivesHuggingFaceIdsOnTheWholeCorpus) {
  const fs::path austen = ember_test_cache_dir() / "austen";
  if (!fs::exists(austen)) GTEST_SKIP() << "no " << austen << ": run scripts/setup.sh";
  TempDir dir("lm_bytelevel");
  write_lm_run(dir);
  auto py = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/lm/reference.py").string(), "bytelevel-bpe",
                         austen.string(), "1000", (dir / "hf").string()},
                        dir.path(), {}, 600);
  ASSERT_EQ(py.exit_code, 0) << py.err;
  const std::vector<std::string> bpe = {"--set", "data.tokenizer=\"bytelevel_bpe\"", "--set", "data.tokenizer_json=\"" + (dir / "hf/tokenizer.json").string() + "\"",
                                        "--set", "model.vocab_size=1000"};
  auto args = bpe;
  for (const char* a : {"run.toml", "--set", "trainer.max_steps=1", "--set", "trainer.val_check_interval=1"}) args.push_back(a);
  args.push_back("--set");
  args.push_back("data.corpus=\"" + austen.string() + "\"");
  auto r = run_engine_ok(dir, args, 600);
  EXPECT_NE(r.err.find("byte-level BPE " + (dir / "hf/tokenizer.json").string() + " (vocabulary 1000)"), std::string::npos) << r.err;
  fs::path folder;
  for (const auto& e : fs::directory_iterator(dir / "tokens"))
    if (fs::exists(e.path() / "tokenizer.json")) folder = e.path();
  ASSERT_FALSE(folder.empty());
  std::ifstream f(dir / "hf/ids.json");
  const auto want = nlohmann::json::parse(f)["ids"].get<std::vector<int64_t>>();
  const std::string bytes = read_file(folder / "tokens.u16");
  ASSERT_EQ(bytes.size(), want.size() * 2);
  int64_t differ = 0, first = -1;
  for (size_t i = 0; i < want.size(); ++i) {
    const int64_t id = static_cast<unsigned char>(bytes[2 * i]) | (static_cast<unsigned char>(bytes[2 * i + 1]) << 8);
    if (id != want[i] && first < 0) first = static_cast<int64_t>(i);
    differ += id != want[i];
  }
  EXPECT_EQ(differ, 0) << "of " << want.size() << " tokens; the first at " << first;
  // The small corpus: train, then a prompt with a character Austen never wrote comes back as it went in.
  auto small = bpe;
  for (const char* a : {"run.toml", "--set", "trainer.max_steps=5"}) small.push_back(a);
  run_engine_ok(dir, small, 600);
  auto gen = bpe;
  for (const char* a : {"generate", "--ckpt", "last", "--prompt", "Zoë said:\n 'It is", "--max-new-tokens", "5", "run.toml"}) gen.push_back(a);
  auto g = run_engine_ok(dir, gen);
  EXPECT_EQ(g.out.rfind("Zoë said:\n 'It is", 0), 0u) << g.out;
}

// A tokenizer.json is read with every value's type checked: a damaged or foreign file is one line
// naming the file and the value, never nlohmann's own exception or an id past the table (found by
// fuzzing: tests/fuzz/model_file_inputs.h). The base is a real file written by `tokenizers`.
TEST(LanguageModel, TokenizerJsonValuesAreCheckedOneByOne) {
  TempDir dir("lm_tokenizer_json");
  const std::string seed = read_file(source_dir() / "tests/fuzz/corpus/model_files/bytelevel.tokenizer.json").substr(1);
  const nlohmann::json good = nlohmann::json::parse(seed);
  const fs::path path = dir / "tokenizer.json";
  auto load = [&](const std::string& text) {
    write_file(path, text);
    return ember_text_lm::load_bytelevel_bpe(path);
  };
  auto refused = [&](const std::string& text) -> std::string {
    try {
      load(text);
    } catch (const ember::RunError& e) {
      return e.what();
    }
    return "(accepted)";
  };
  auto with = [&](auto change) {
    nlohmann::json j = good;
    change(j);
    return j.dump(1);
  };
  const std::string p = path.string() + ": ";
  const int64_t a = good["model"]["vocab"]["a"].get<int64_t>(), b = good["model"]["vocab"]["b"].get<int64_t>();
  const auto first_merge = good["model"]["merges"][0];
  const std::vector<std::pair<std::string, std::string>> cases = {
      {seed.substr(0, 200), p + "not valid JSON (parse error at line"},
      {with([](auto& j) { j["model"]["merges"][3] = nlohmann::json::array({1, 2}); }), p + "merge 3 ([1,2]) is not two symbols"},
      {with([](auto& j) { j["model"]["merges"][0] = "a b c"; }), p + "merge 0 (\"a b c\") is not two symbols"},
      {with([](auto& j) { j["model"]["merges"][1] = nlohmann::json::array({"a", "\u0100zz"}); }),
       p + "merge 1 ([\"a\",\"\u0100zz\"]) makes or uses \"\u0100zz\", which is not in model.vocab"},
      {with([](auto& j) { j["model"]["vocab"]["a"] = -1; }), p + "token \"a\" has id -1: an id is an integer from 0 to 2147483647"},
      {with([](auto& j) { j["model"]["vocab"]["a"] = "5"; }), p + "token \"a\" has id \"5\": an id is an integer"},
      {with([](auto& j) { j["model"]["vocab"]["a"] = 1099511627776LL; }), p + "token \"a\" has id 1099511627776: an id"},
      {with([&](auto& j) { j["model"]["vocab"]["a"] = b; }), "is given to both"},
      {with([&](auto& j) { j["added_tokens"][0]["id"] = a; }), p + "id " + std::to_string(a) + " is given to both \"a\" and \"<|endoftext|>\""},
      {with([](auto& j) { j["model"]["vocab"]["\n"] = 1000; j["model"]["vocab"]["x\ny"] = 1000; }), "\"\\n\" and \"x\\ny\""},
      {with([](auto& j) { j["model"]["ignore_merges"] = "yes"; }), p + "model.ignore_merges is string, not true or false"},
      {with([](auto& j) { j["model"]["type"] = 7; }), p + "model.type is number, not a string"},
      {with([](auto& j) { j["model"].erase("vocab"); }), p + "model.vocab is not an object of tokens and their ids"},
      {with([](auto& j) { j["model"]["merges"] = nlohmann::json::object(); }), p + "model.merges is not a list of merges"},
      {with([](auto& j) { j["added_tokens"] = 3; }), p + "added_tokens is not a list"},
      {with([](auto& j) { j["added_tokens"][0].erase("id"); }), p + "an added token ({"},
      {with([](auto& j) { j["pre_tokenizer"]["add_prefix_space"] = 1; }), p + "pre_tokenizer.add_prefix_space is number, not true or false"},
  };
  for (const auto& [text, want] : cases) {
    const std::string got = refused(text);
    EXPECT_NE(got.find(want), std::string::npos) << "want: " << want << "\ngot:  " << got;
    EXPECT_EQ(got.find('\n'), std::string::npos) << got;
  }
  // Ids may leave gaps (an added token far past the vocabulary): the size counts up to it, the
  // gap decodes as a clean error, and text still round-trips.
  const auto gap = load(with([](auto& j) { j["added_tokens"].push_back({{"id", 100000}, {"content", "<|gap|>"}}); }));
  EXPECT_EQ(gap->vocab_size(), 100001);
  const std::string text = "It is a truth<|gap|> universally<|endoftext|> acknowledged.";
  const auto ids = gap->encode(text);
  EXPECT_NE(std::find(ids.begin(), ids.end(), 100000), ids.end());
  EXPECT_EQ(gap->decode(ids), text);
  EXPECT_THROW(gap->decode({99999}), ember::RunError);
  // A repeated merge keeps its last rank, as `tokenizers` does: the file still reads.
  EXPECT_NO_THROW(load(with([&](auto& j) { j["model"]["merges"].push_back(first_merge); })));
}

// The language-model configs resolve: every key is one their plugins know, with a valid value.
TEST(LanguageModel, ConfigsResolve) {
  TempDir dir("lm_configs");
  for (const char* config : {"austen_char_gpt.toml", "austen_bpe_llama.toml", "gpt2_124m_gpu.toml"}) {
    auto r = run_engine({"config", (source_dir() / "configs" / config).string()}, dir.path());
    EXPECT_EQ(r.exit_code, 0) << config << ": " << r.err;
    EXPECT_NE(r.out.find("name = 'gpt'"), std::string::npos) << config;
  }
}

// Bad input is one line that says what and how to fix it, and nothing trains.
TEST(LanguageModel, BadInputIsOneLineWithTheFix) {
  TempDir dir("lm_bad");
  write_lm_run(dir);
  auto missing = run_engine({"run.toml", "--set", "data.corpus=\"nowhere.txt\""}, dir.path());
  EXPECT_EQ(missing.exit_code, 2) << missing.err;
  EXPECT_NE(missing.err.find("corpus = \"nowhere.txt\" (--set data.corpus=\"nowhere.txt\"): no file or folder"), std::string::npos) << missing.err;
  auto small_vocab = run_engine({"run.toml", "--set", "model.vocab_size=30"}, dir.path());
  EXPECT_EQ(small_vocab.exit_code, 1) << small_vocab.err;
  EXPECT_NE(small_vocab.err.find("makes token ids up to 33 (characters of the corpus (vocabulary 34)) but model 'gpt' knows 30 tokens: set "
                                 "model.vocab_size = 34 or more"),
            std::string::npos)
      << small_vocab.err;
  auto long_block = run_engine({"run.toml", "--set", "data.block_size=40"}, dir.path());
  EXPECT_EQ(long_block.exit_code, 1) << long_block.err;
  EXPECT_NE(long_block.err.find("a sequence of 40 tokens is longer than the model's context of 32 positions: shorten it (data.block_size"),
            std::string::npos)
      << long_block.err;
  // A model too large to allocate is an error, not an abort: text_lm's libsentencepiece, loaded
  // unisolated, had made every LibTorch enforce failure fatal (tests/abi_test.cpp).
  auto huge = run_engine({"run.toml", "--set", "model.vocab_size=100000000000", "--set", "model.width=32000"}, dir.path());
  EXPECT_EQ(huge.exit_code, 2) << huge.err;
  EXPECT_NE(huge.err.find("error plugin 'gpt': "), std::string::npos) << huge.err;
  EXPECT_NE(huge.err.find("DefaultCPUAllocator: can't allocate memory: you tried to allocate 12800000000000000 bytes"), std::string::npos)
      << huge.err;
  // A tokenizer.model that is not one: what it means, not the library's source line.
  write_file(dir / "not.model", "this is not a SentencePiece model\n");
  auto not_model = run_engine({"run.toml", "--set", "data.tokenizer=\"sentencepiece\"", "--set",
                               "data.sentencepiece_model=\"" + (dir / "not.model").string() + "\""},
                              dir.path());
  EXPECT_EQ(not_model.exit_code, 1) << not_model.err;
  EXPECT_NE(not_model.err.find("not.model is not a SentencePiece model: it does not parse as one (a tokenizer.model file is a "
                               "serialized ModelProto)\n"),
            std::string::npos)
      << not_model.err;
  EXPECT_EQ(not_model.err.find("sentencepiece_processor.cc"), std::string::npos) << not_model.err;
  auto no_vocab = run_engine({"run.toml", "--set", "model.vocab_size=0"}, dir.path());
  EXPECT_EQ(no_vocab.exit_code, 2) << no_vocab.err;
  EXPECT_NE(no_vocab.err.find("vocab_size is not set"), std::string::npos) << no_vocab.err;
  run_engine_ok(dir, {"run.toml", "--set", "trainer.max_steps=2"}, 600);
  auto foreign = run_engine({"generate", "--ckpt", "last", "--prompt", "Zebra", "run.toml"}, dir.path());
  EXPECT_EQ(foreign.exit_code, 1) << foreign.err;
  EXPECT_NE(foreign.err.find("the character U+005A 'Z' is not in the vocabulary of"), std::string::npos) << foreign.err;
  auto too_long = run_engine({"generate", "--ckpt", "last", "--prompt", std::string(33, 'e'), "run.toml"}, dir.path());
  EXPECT_EQ(too_long.exit_code, 2) << too_long.err;
  EXPECT_NE(too_long.err.find("the prompt is 33 tokens, longer than the model's context of 32 tokens: shorten it"), std::string::npos)
      << too_long.err;
  auto bad_p = run_engine({"generate", "--top-p", "0", "--prompt", "a", "run.toml"}, dir.path());
  EXPECT_EQ(bad_p.exit_code, 2) << bad_p.err;
  // text_lm holds no test split out by default: `engine test` names the key that would.
  auto no_test = run_engine({"test", "--ckpt", "last", "run.toml"}, dir.path());
  EXPECT_EQ(no_test.exit_code, 1) << no_test.err;
  EXPECT_NE(no_test.err.find("data 'text_lm' has no test batches: its test split is empty; hold one out with data.test_fraction = 0.0 (default)"),
            std::string::npos)
      << no_test.err;
  auto no_limit = run_engine({"test", "--ckpt", "last", "--set", "data.test_fraction=0.1", "--set", "trainer.limit_test_batches=0", "run.toml"},
                             dir.path());
  EXPECT_NE(no_limit.err.find("--set trainer.limit_test_batches=0: trainer.limit_test_batches = 0 leaves no test batches: remove it"),
            std::string::npos)
      << no_limit.err;
  run_engine_ok(dir, {"test", "--ckpt", "last", "--set", "data.test_fraction=0.1", "run.toml"});
  // A checkpoint of a bigger model (or one a plugin added to) is another model's: loading only
  // what fits would evaluate, resume or start from a model silently cut down.
  std::string last;  // the 2-step run's (failed runs before it may have taken version numbers)
  for (const auto& e : fs::directory_iterator(dir / "runs/run"))
    if (fs::exists(e.path() / "checkpoints/last.ckpt")) last = (e.path() / "checkpoints/last.ckpt").string();
  ASSERT_FALSE(last.empty());
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"validate", "--ckpt", "last", "--set", "model.layers=1", "run.toml"},
           {"run.toml", "--set", "model.layers=1", "--set", "trainer.max_steps=3", "--resume", last},
           {"run.toml", "--set", "model.layers=1", "--set", "trainer.max_steps=1", "--set", "model.init_checkpoint=\"" + last + "\""}}) {
    auto smaller = run_engine(args, dir.path());
    EXPECT_EQ(smaller.exit_code, 1) << args.front() << ": " << smaller.err;
    EXPECT_NE(smaller.err.find("tensors this model does not have, e.g. 'transformer.h.1."), std::string::npos) << smaller.err;
    EXPECT_NE(smaller.err.find("it was saved from another model (other [model] settings, or a plugin that changed the model, such as lora): "
                               "load it with the settings and plugins it was trained with"),
              std::string::npos)
        << smaller.err;
  }
  // A language model does not predict classes: the line names the command that writes its text.
  auto predict = run_engine({"predict", "--ckpt", "last", "run.toml"}, dir.path());
  EXPECT_EQ(predict.exit_code, 2) << predict.err;
  EXPECT_NE(predict.err.find("it is a language model: engine generate --ckpt CKPT --prompt TEXT run.toml writes its text"), std::string::npos)
      << predict.err;
}
