// The command line: discovery, plugin listing and info, config printing, and the exit codes and
// one-line errors of bad input.
#include <gtest/gtest.h>

#include <regex>
#include <torch/cuda.h>

#include <sstream>

#include "support.h"

using namespace ember::test;

namespace {
const char* kQuick = R"(
[trainer]
max_epochs = 1
enable_progress_bar = false
[model]
name = "mlp"
input_size = 16
hidden = [8]
[data]
name = "synthetic"
shape = [16]
num_train = 64
num_val = 16
num_test = 16
batch_size = 16
)";
}  // namespace

TEST(Cli, PluginsListShowsEveryBuiltPlugin) {
  TempDir dir("cli");
  auto r = run_engine({"plugins", "list"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* name : {"single_device", "fp32", "csv", "checkpoint", "cnn", "mlp", "fashion_mnist", "synthetic"})
    EXPECT_NE(r.out.find(name), std::string::npos) << name << "\n" << r.out;
}

// --help names every command, and its defaults read as written (0.8, not 0.80000000000000004).
TEST(Cli, HelpNamesEveryCommandWithReadableDefaults) {
  TempDir dir("cli");
  auto r = run_engine({"--help"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* text : {"engine validate|test|predict", "engine generate", "engine config", "engine plugins list", "engine checkpoint consolidate",
                           "engine export", "engine plot", "engine data pack", "--temperature arg (=0.8)", "--top-p arg (=1)"})
    EXPECT_NE(r.out.find(text), std::string::npos) << text << "\n" << r.out;
  EXPECT_EQ(r.out.find("00000000"), std::string::npos) << r.out;
}

TEST(Cli, PluginsListKeepsColumnsApartForLongNames) {
  TempDir dir("cli");
  auto r = run_engine({"plugins", "list"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::istringstream lines(r.out);
  std::string header;
  std::getline(lines, header);
  const size_t kind_at = header.find("KIND"), version_at = header.find("VERSION");
  ASSERT_NE(kind_at, std::string::npos) << header;
  ASSERT_NE(version_at, std::string::npos) << header;
  bool saw_long_name = false;
  for (std::string line; std::getline(lines, line);) {
    // NAME ends before the KIND column with a space to spare, and KIND before VERSION.
    const std::string name = line.substr(0, line.find(' '));
    saw_long_name = saw_long_name || name == "grad_accum_schedule";
    EXPECT_LT(name.size(), kind_at) << line;
    ASSERT_GT(line.size(), version_at) << line;
    EXPECT_EQ(line[kind_at - 1], ' ') << line;
    EXPECT_EQ(line[version_at - 1], ' ') << line;
    const std::string kind = line.substr(kind_at, line.find(' ', kind_at) - kind_at);
    EXPECT_TRUE(kind == "strategy" || kind == "precision" || kind == "callback" || kind == "logger" || kind == "model" ||
                kind == "data" || kind == "scheduler" || kind == "profiler" || kind == "tuner")
        << line;
  }
  EXPECT_TRUE(saw_long_name) << r.out;  // the name (19 characters) that ran into its kind
}

TEST(Cli, PluginInfoShowsKindVersionFileAndEveryKey) {
  TempDir dir("cli");
  auto r = run_engine({"plugins", "info", "checkpoint"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* s : {"kind:        callback", "version:", "libcheckpoint.so", "monitor (string)", "save_top_k (int) = 1",
                        "mode (string) = \"min\"  [min|max]"})
    EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
  // Lightning's old names (EMBER_KEY_ELSEWHERE) are listed apart, with what to write instead, not as keys.
  EXPECT_NE(r.out.find("not keys here"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  period: Lightning 1.x's period is every_n_epochs"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("period (string)"), std::string::npos) << r.out;
  auto unknown = run_engine({"plugins", "info", "chekpoint"}, dir.path());
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_NE(unknown.err.find("did you mean 'checkpoint'"), std::string::npos) << unknown.err;
}

TEST(Cli, DiscoveryFollowsPluginPathAndEnvironment) {
  TempDir dir("cli");
  auto good = test_plugin_dir("good").string();
  EXPECT_EQ(run_engine({"plugins", "info", "hook_recorder"}, dir.path()).exit_code, 2);  // not on the default path
  EXPECT_EQ(run_engine({"--plugin-path", good, "plugins", "info", "hook_recorder"}, dir.path()).exit_code, 0);
  EXPECT_EQ(run_engine({"plugins", "info", "hook_recorder"}, dir.path(), {{"EMBER_PLUGIN_PATH", "/nonexistent:" + good}}).exit_code, 0);
}

TEST(Cli, ConfigPrintsResolvedTomlThatFeedsBack) {
  TempDir dir("cli");
  write_file(dir / "run.toml", kQuick);
  auto first = run_engine({"config", "--set", "optimizer.lr=0.05", "run.toml"}, dir.path());
  ASSERT_EQ(first.exit_code, 0) << first.err;
  EXPECT_NE(first.out.find("lr = 0.05"), std::string::npos) << first.out;
  EXPECT_NE(first.out.find("[checkpoint]"), std::string::npos) << first.out;  // default plugins appear
  EXPECT_NE(first.out.find("max_steps = -1"), std::string::npos) << first.out;  // defaults appear
  write_file(dir / "resolved.toml", first.out);
  auto second = run_engine({"config", "resolved.toml"}, dir.path());
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_EQ(first.out, second.out);

  // A string key whose choices include true and false takes TOML's booleans as those words (its
  // help says "true = always"), and prints the word, which feeds back too; other strings do not.
  write_file(dir / "booleans.toml", std::string(kQuick) + "on_device = true\n");
  auto words = run_engine({"config", "booleans.toml", "--set", "checkpoint.save_last=false"}, dir.path());
  ASSERT_EQ(words.exit_code, 0) << words.err;
  EXPECT_NE(words.out.find("on_device = 'true'"), std::string::npos) << words.out;
  EXPECT_NE(words.out.find("save_last = 'false'"), std::string::npos) << words.out;
  write_file(dir / "resolved.toml", words.out);
  auto fed_back = run_engine({"config", "resolved.toml"}, dir.path());
  EXPECT_EQ(fed_back.out, words.out) << fed_back.err;
  auto not_a_word = run_engine({"config", "run.toml", "--set", "checkpoint.monitor=true"}, dir.path());
  EXPECT_EQ(not_a_word.exit_code, 2);
  EXPECT_NE(not_a_word.err.find("checkpoint.monitor: expected a string, got boolean true"), std::string::npos) << not_a_word.err;
}

// Every config the repository ships resolves as written (its plugins load, every key is known, every
// value has its type) and its resolved form feeds back unchanged: a renamed key or a plugin a
// config forgot to load fails here, not on the user's first run.
TEST(Cli, EveryShippedConfigResolvesAsWritten) {
  TempDir dir("cli");
  std::vector<std::filesystem::path> configs;
  for (const auto& e : std::filesystem::directory_iterator(source_dir() / "configs"))
    if (e.path().extension() == ".toml") configs.push_back(e.path());
  ASSERT_GE(configs.size(), 10u) << "configs/ lost its configs";
  for (const auto& config : configs) {
    auto first = run_engine({"config", config.string()}, dir.path());
    ASSERT_EQ(first.exit_code, 0) << config << ": " << first.err;
    write_file(dir / "resolved.toml", first.out);
    auto second = run_engine({"config", "resolved.toml"}, dir.path());
    ASSERT_EQ(second.exit_code, 0) << config << " resolved: " << second.err;
    EXPECT_EQ(first.out, second.out) << config;
  }
}

TEST(Cli, BadInputExitsTwoWithOneLine) {
  TempDir dir("cli");
  write_file(dir / "run.toml", kQuick);
  write_file(dir / "lightning.toml", std::string("plugins = [\"checkpoint\"]\n[checkpoint]\nfilepath = \"ckpts/best\"\n") + kQuick);
  struct Case {
    std::vector<std::string> args;
    std::string expect;
  } cases[] = {
      {{"run.toml", "--set", "trainer.max_epoch=2"}, "did you mean 'max_epochs'"},
      {{"run.toml", "--set", "trainer.profiler=\"simple\""}, "profilers are callback plugins: --plugins simple_profiler"},
      {{"run.toml", "--set", "trainer.sync_batchnorm=true"}, "set model.sync_batchnorm = true"},
      // A plugin's names from Lightning (EMBER_KEY_ELSEWHERE) say what to write instead.
      {{"run.toml", "--set", "checkpoint.period=2"}, "unknown key 'period' in [checkpoint]; Lightning 1.x's period is every_n_epochs"},
      {{"lightning.toml"}, "lightning.toml:3:12: checkpoint.filepath: unknown key; Lightning 1.x's filepath is two keys: dirpath"},
      // A typo of such a name still gets its advice.
      {{"run.toml", "--set", "checkpoint.perod=2"},
       "unknown key 'perod' in [checkpoint] (did you mean 'period'? Lightning 1.x's period is every_n_epochs)"},
      {{"run.toml", "--set", "trainer.profilr=\"simple\""}, "(did you mean 'profiler'? profilers are callback plugins"},
      {{"run.toml", "--plugins", "csv", "--set", "csv.save_dir=\"logs\""},
       "every logger writes into the run folder <trainer.default_root_dir>/<trainer.name>/version_<trainer.version>"},
      {{"run.toml", "--set", "model.name=mpl"}, "unknown plugin 'mpl' (did you mean 'mlp'?)"},
      {{"run.toml", "--plugins", "chekpoint"}, "did you mean 'checkpoint'"},
      {{"run.toml", "--set", "optimizer.lr=0"}, "optimizer.lr: must be > 0"},
      {{"missing.toml"}, "missing.toml: no such config file"},
      {{"."}, ". is a folder, not a config file: give a run's .toml file"},
      {{"run.toml", "--set", "model.name=synthetic"}, "is a data plugin, not a model plugin"},
      {{"run.toml", "--set", "trainer.precision=17"}, "unknown plugin '17' (did you mean '16'?); searched"},
      {{"run.toml", "--set", "trainer.precision=\"half\""}, "trainer.precision takes 64-true, 32-true, 16-mixed"},
      {{"run.toml", "--set", "trainer.precision=\"bf16-mixd\""}, "unknown plugin 'bf16-mixd' (did you mean 'bf16-mixed'?)"},
      {{"run.toml", "--resume", "nope.ckpt"}, "no such checkpoint file"},
      {{"run.toml", "--set", "trainer.devices=2", "--set", "trainer.strategy=\"single_device\""}, "single_device runs one process on one device"},
      {{"run.toml", "--set", "trainer.devices=\"all\""},
       "trainer.devices: expected an integer, got string 'all' -- Devices (processes for ddp) per node; \"auto\" or -1"},
      {{"run.toml", "--set", "trainer.devices=[0,1]"}, "set CUDA_VISIBLE_DEVICES (e.g. 0,2) and devices to their count"},
      {{"run.toml", "--set", "trainer.strategy=\"fsdp\""}, "Lightning's fsdp is Ember's sharded strategy: trainer.strategy = \"sharded\""},
      {{"run.toml", "--set", "trainer.strategy=\"deepspeed_stage_2\""}, "trainer.strategy = \"sharded\" with sharded.stage = 2"},
      {{"run.toml", "--bogus"}, "unrecognised option '--bogus'"},
      {{"--set", "trainer.max_epochs", "3", "run.toml"}, "--set trainer.max_epochs: expected section.key=value (--set trainer.max_epochs=3, one word"},
      {{"run.toml", "other.toml"}, "expected one config file, got 2 arguments: 'run.toml' 'other.toml'"},
      {{"run.toml", "--plugins", "fp32", "--set", "trainer.precision=\"64-true\""}, "conflicts with the precision plugin 'fp32'"},
      {{"run.toml", "--set", "trainer.limit_train_batches=1.5"}, "a float is a fraction and must be <= 1.0"},
      {{"run.toml", "--set", "data.group_by_length=true"},
       "data.group_by_length = true, but data plugin 'synthetic' does not report sample lengths"},
  };
  for (const auto& c : cases) {
    auto r = run_engine(c.args, dir.path());
    EXPECT_EQ(r.exit_code, 2) << c.expect << "\n" << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.expect << "\n" << r.err;
    // Exactly one error line, and it is a single line.
    size_t errors = 0;
    for (size_t pos = r.err.find("] error "); pos != std::string::npos; pos = r.err.find("] error ", pos + 1)) ++errors;
    EXPECT_EQ(errors, 1u) << r.err;
  }
}

// Adam over float16 parameters with an eps float16 cannot hold trains to NaN (measured on the CPU
// and on an H100): the engine stops before training and names the fix, which then trains.
TEST(Cli, Float16AdamNeedsAnEpsFloat16CanHold) {
  TempDir dir("cli_fp16_adam");
  write_file(dir / "run.toml", std::string(kQuick) + "[optimizer]\nname = \"adam\"\nlr = 0.01\n");
  for (const char* eps : {"", "1e-6"}) {
    std::vector<std::string> args = {"run.toml", "--set", "trainer.precision=\"16-true\""};
    if (*eps) args.insert(args.end(), {"--set", std::string("optimizer.eps=") + eps});
    auto r = run_engine(args, dir.path());
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find("is below float16's smallest normal number"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(*eps ? "--set optimizer.eps=1e-6: " : "run.toml:17:8: optimizer.eps = 1e-08 (adam's default)"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("set optimizer.eps = 1e-4"), std::string::npos) << r.err;
  }
  auto ok = run_engine({"run.toml", "--set", "trainer.precision=\"16-true\"", "--set", "optimizer.eps=1e-4", "--set", "trainer.test_after_fit=true"},
                       dir.path());
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_EQ(ok.out.find("nan"), std::string::npos) << ok.out;
  EXPECT_NE(ok.out.find("test_loss"), std::string::npos) << ok.out;
  // fp32 parameters (16-mixed keeps them) take Adam's default.
  EXPECT_EQ(run_engine({"run.toml", "--set", "trainer.precision=\"16-mixed\"", "--set", "trainer.accelerator=\"cpu\""}, dir.path()).exit_code, 0);
}

// trainer.strategy = "auto" (the default, Lightning's): single_device on one device, ddp on more
// ranks or in an elastic job; a strategy named in plugins wins over "auto". trainer.devices =
// "auto" counts the visible GPUs.
TEST(Cli, StrategyAutoPicksSingleDeviceOrDdp) {
  TempDir dir("cli_auto_strategy");
  write_file(dir / "run.toml", kQuick);
  auto strategy_of = [&](std::vector<std::string> args) {
    args.insert(args.begin(), "config");
    args.push_back("run.toml");
    auto r = run_engine(args, dir.path());
    EXPECT_EQ(r.exit_code, 0) << r.err;
    const auto at = r.out.find("\nstrategy = '");
    return at == std::string::npos ? std::string("none") : r.out.substr(at + 13, r.out.find('\'', at + 13) - at - 13);
  };
  EXPECT_EQ(strategy_of({}), "single_device");
  EXPECT_EQ(strategy_of({"--set", "trainer.strategy=\"auto\""}), "single_device");
  EXPECT_EQ(strategy_of({"--set", "trainer.devices=2"}), "ddp");
  EXPECT_EQ(strategy_of({"--set", "trainer.devices=2", "--set", "trainer.num_nodes=2"}), "ddp");
  EXPECT_EQ(strategy_of({"--set", "trainer.num_nodes=0"}), "ddp");
  EXPECT_EQ(strategy_of({"--set", "trainer.strategy=\"auto\"", "--plugins", "sharded"}), "sharded");
  // devices = "auto" / -1 (Lightning's): every visible GPU, 1 on a CPU; the resolved config says how many.
  const int64_t visible = torch::cuda::is_available() ? static_cast<int64_t>(torch::cuda::device_count()) : 1;
  for (const char* all : {"trainer.devices=\"auto\"", "trainer.devices=-1"}) {
    auto r = run_engine({"config", "--set", all, "run.toml"}, dir.path());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("\ndevices = " + std::to_string(visible) + "\n"), std::string::npos) << all << "\n" << r.out;
    EXPECT_EQ(strategy_of({"--set", all}), visible > 1 ? "ddp" : "single_device") << all;
    auto cpu = run_engine({"config", "--set", all, "--set", "trainer.accelerator=\"cpu\"", "run.toml"}, dir.path());
    EXPECT_NE(cpu.out.find("\ndevices = 1\n"), std::string::npos) << all << " on the cpu\n" << cpu.out;
  }
  auto zero = run_engine({"config", "--set", "trainer.devices=0", "run.toml"}, dir.path());
  EXPECT_EQ(zero.exit_code, 2) << zero.err;
  // The 2 ranks train (CPU, loopback) and sync their gradients.
  auto r = run_engine({"run.toml", "--set", "trainer.devices=2", "--set", "trainer.accelerator=\"cpu\""}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("ddp: starting 2 local ranks"), std::string::npos) << r.err;
}

// trainer.accelerator = "gpu" is Lightning's name for cuda: the same run as "cuda" (on this machine:
// trained on cuda:0, or the same one-line refusal where no CUDA device is visible), never "did you
// mean 'cpu'?".
TEST(Cli, GpuIsLightningsNameForCuda) {
  TempDir dir("cli_gpu");
  write_file(dir / "run.toml", kQuick);
  auto cuda = run_engine({"run.toml", "--set", "trainer.accelerator=\"cuda\""}, dir.path());
  auto gpu = run_engine({"run.toml", "--set", "trainer.accelerator=\"gpu\""}, dir.path());
  EXPECT_EQ(gpu.exit_code, cuda.exit_code) << gpu.err;
  if (torch::cuda::is_available()) {
    EXPECT_NE(gpu.err.find("training on cuda:0"), std::string::npos) << gpu.err;
  } else {
    const std::string refusal = "cuda:0 was asked for but no CUDA device is visible";
    EXPECT_NE(cuda.err.find(refusal), std::string::npos) << cuda.err;
    EXPECT_NE(gpu.err.find(refusal), std::string::npos) << gpu.err;
  }
}

// trainer.cuda_graph: what cannot be captured is refused at start-up in one line, with where the
// key was set (the capture itself runs on a GPU: tests/gpu_paths.sh).
TEST(Cli, CudaGraphRefusesWhatItCannotCapture) {
  TempDir dir("cli_cuda_graph");
  std::string toml = kQuick;
  toml.replace(toml.find("max_epochs = 1\n"), 15, "max_epochs = 1\ncuda_graph = true\n");
  write_file(dir / "run.toml", toml);
  auto on_cpu = run_engine({"run.toml", "--set", "trainer.accelerator=\"cpu\""}, dir.path());
  EXPECT_EQ(on_cpu.exit_code, 2) << on_cpu.err;
  EXPECT_NE(on_cpu.err.find("run.toml:4:14: trainer.cuda_graph = true: CUDA graphs need a CUDA device and this run trains on cpu"),
            std::string::npos)
      << on_cpu.err;
  EXPECT_EQ(on_cpu.err.find("Epoch 0"), std::string::npos) << "refused before training: " << on_cpu.err;
  // What may be captured is a capability the strategy declares (single_device does), not its name:
  // ddp, even with one rank, has gradient hooks and collectives inside the step.
  auto ddp = run_engine({"run.toml", "--plugins", "ddp", "--set", "trainer.accelerator=\"cpu\""}, dir.path());
  EXPECT_EQ(ddp.exit_code, 2) << ddp.err;
  EXPECT_NE(ddp.err.find("run.toml:4:14: trainer.cuda_graph = true: strategy 'ddp' does not declare a capturable step"), std::string::npos)
      << ddp.err;
  EXPECT_EQ(ddp.err.find("Epoch 0"), std::string::npos) << "refused before training: " << ddp.err;
  auto warmup = run_engine({"run.toml", "--set", "trainer.cuda_graph_warmup_steps=0"}, dir.path());
  EXPECT_EQ(warmup.exit_code, 2) << warmup.err;
  EXPECT_NE(warmup.err.find("trainer.cuda_graph_warmup_steps: must be >= 1, got 0"), std::string::npos) << warmup.err;
  // Off (the default), the same config trains.
  EXPECT_EQ(run_engine({"run.toml", "--set", "trainer.cuda_graph=false"}, dir.path()).exit_code, 0);
}

// trainer.fast_dev_run (Lightning's): N batches of training, validation and test in one epoch,
// no sanity check, with the run's plugins all working (checkpoint, csv, the test of the best
// checkpoint), and nothing left on disk afterwards.
TEST(Cli, FastDevRunRunsEveryLoopBrieflyAndLeavesNothing) {
  TempDir dir("cli_fast_dev_run");
  write_file(dir / "run.toml", "plugins = [\"hook_recorder\"]\n" + std::string(kQuick) + "[checkpoint]\nmonitor = \"val_loss\"\n");
  const std::string good = test_plugin_dir("good").string();
  auto count = [](const std::string& text, const std::string& what) {
    size_t n = 0;
    for (size_t p = text.find(what + "\n"); p != std::string::npos; p = text.find(what + "\n", p + 1)) ++n;
    return n;
  };
  for (const auto& [value, n] : {std::pair<std::string, size_t>{"true", 1}, {"3", 3}}) {
    SCOPED_TRACE("fast_dev_run = " + value);
    // Four batches of each split, so that 3 is a limit.
    auto r = run_engine({"run.toml", "--plugin-path", good, "--set", "trainer.max_epochs=5", "--set", "trainer.test_after_fit=true",
                         "--set", "data.num_val=64", "--set", "data.num_test=64", "--set", "trainer.fast_dev_run=" + value},
                        dir.path());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.err.find("fast_dev_run: " + std::to_string(n) + " batch(es) of training, validation and test"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("fast_dev_run: passed; removed"), std::string::npos) << r.err;
    EXPECT_NE(r.out.find("test_loss"), std::string::npos) << r.out;
    const std::string hooks = read_file(dir / "hooks.txt");
    EXPECT_EQ(count(hooks, "on_train_batch_end"), n) << hooks;
    EXPECT_EQ(count(hooks, "on_validation_batch_end"), n) << hooks;
    EXPECT_EQ(count(hooks, "on_test_batch_end"), n) << hooks;
    EXPECT_EQ(count(hooks, "on_train_epoch_end"), 1u) << hooks;
    EXPECT_EQ(count(hooks, "on_sanity_check_start"), 0u) << hooks;
    EXPECT_GE(count(hooks, "on_save_checkpoint"), 1u) << hooks;  // the checkpoint callback ran
    EXPECT_FALSE(std::filesystem::exists(dir / "runs")) << "fast_dev_run left its run folder";
    std::filesystem::remove(dir / "hooks.txt");
  }
  // The same run without it trains five epochs and keeps its folder (the control).
  auto normal = run_engine({"run.toml", "--plugin-path", good, "--set", "trainer.max_epochs=5"}, dir.path());
  ASSERT_EQ(normal.exit_code, 0) << normal.err;
  EXPECT_EQ(count(read_file(dir / "hooks.txt"), "on_train_epoch_end"), 5u);
  EXPECT_TRUE(std::filesystem::exists(dir / "runs/run/version_0/checkpoints/last.ckpt"));
  // Resuming in a run's own folder would overwrite its checkpoints: refused in one line.
  auto resume = run_engine({"run.toml", "--plugin-path", good, "--set", "trainer.fast_dev_run=true", "--resume", "last"}, dir.path());
  EXPECT_EQ(resume.exit_code, 2) << resume.err;
  EXPECT_NE(resume.err.find("trainer.fast_dev_run with --resume last would train in that run's folder"), std::string::npos) << resume.err;
  EXPECT_TRUE(std::filesystem::exists(dir / "runs/run/version_0/checkpoints/last.ckpt"));
  EXPECT_FALSE(std::filesystem::exists(dir / "runs/run/version_1"));
}

// The engine binary runs on tcmalloc when the build found it (EMBER_TCMALLOC), and says which
// allocator it runs on.
TEST(Cli, RunsOnTheAllocatorTheBuildLinked) {
  TempDir dir("cli_allocator");
  write_file(dir / "run.toml", kQuick);
  auto r = run_engine({"run.toml"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string want = EMBER_TEST_WITH_TCMALLOC ? "allocator tcmalloc" : "allocator glibc malloc";
  EXPECT_NE(r.err.find(want), std::string::npos) << r.err;
}

TEST(Cli, MissingDataFileNamesPathAndPackage) {
  TempDir dir("cli");
  write_file(dir / "run.toml", "[model]\nname = \"cnn\"\n[data]\nname = \"fashion_mnist\"\nroot = \"/nonexistent/fm\"\n");
  auto r = run_engine({"run.toml"}, dir.path());
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("/nonexistent/fm/"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("dataset-fashion-mnist"), std::string::npos) << r.err;
}

// A model with fewer outputs than the data has classes (num_classes left at its default, say):
// one line naming the label and the setting, not LibTorch's "Target 9 is out of bounds.".
TEST(Cli, LabelsBeyondTheModelsClassesAreOneLine) {
  TempDir dir("cli");
  write_file(dir / "run.toml", tiny_mlp_toml(1, "num_train = 64\nnum_classes = 10\n"));
  auto r = run_engine({"run.toml", "--set", "model.num_classes=3"}, dir.path());
  EXPECT_EQ(r.exit_code, 1) << r.err;
  const std::regex line("mlp: the data's label ([3-9]) is outside the model's 3 outputs \\(classes 0 \\.\\. 2\\): set \\[model\\] num_classes to "
                        "the number of classes the data has \\(its set-up line says how many\\)");
  EXPECT_TRUE(std::regex_search(r.err, line)) << r.err;
  EXPECT_EQ(r.err.find("out of bounds"), std::string::npos) << r.err;
}

// `engine generate` with a model that cannot generate says so before it looks for the checkpoint:
// that the run has no 'last' checkpoint yet must not be what the user hears about (nor a large
// checkpoint be loaded first).
TEST(Cli, GenerateRefusesAModelThatCannotBeforeReadingTheCheckpoint) {
  TempDir dir("cli");
  write_file(dir / "run.toml", synthetic_mlp_toml({.accelerator = "cpu"}));
  auto r = run_engine({"generate", "--ckpt", "last", "--prompt", "a", "run.toml"}, dir.path());
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("model 'mlp' cannot generate text"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("checkpoint"), std::string::npos) << r.err;
}

TEST(Cli, EndToEndRunWritesLogsCheckpointsAndTestsBest) {
  TempDir dir("cli");
  write_file(dir / "run.toml", std::string(kQuick) + "\n[checkpoint]\nmonitor = \"val_loss\"\n");
  auto r = run_engine({"run.toml", "--set", "trainer.max_epochs=3", "--set", "trainer.test_after_fit=true", "--set",
                       "trainer.log_every_n_steps=2"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto run = dir / "runs/run/version_0";
  EXPECT_TRUE(std::filesystem::exists(run / "checkpoints/last.ckpt"));
  EXPECT_TRUE(std::filesystem::exists(run / "config.toml"));
  EXPECT_TRUE(std::filesystem::exists(run / "hparams.toml"));
  auto rows = read_csv(run / "metrics.csv");
  ASSERT_FALSE(rows.empty());
  for (const char* col : {"epoch", "step", "train_loss_step", "train_loss_epoch", "val_loss", "val_acc", "test_acc"})
    EXPECT_TRUE(rows.front().count(col)) << col;
  EXPECT_NE(r.out.find("test_acc"), std::string::npos) << r.out;
  // A second run gets the next version folder.
  auto again = run_engine({"run.toml"}, dir.path());
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_TRUE(std::filesystem::exists(dir / "runs/run/version_1/metrics.csv"));
}

TEST(Cli, TrainsOnTheRealFashionMnistFiles) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))
    GTEST_SKIP() << "Debian package dataset-fashion-mnist is not installed (scripts/setup.sh installs it)";
  TempDir dir("cli");
  write_file(dir / "run.toml", R"(
[trainer]
max_epochs = 1
limit_val_batches = 10
test_after_fit = true
test_ckpt = "current"
limit_test_batches = 20
[model]
name = "mlp"
hidden = [64]
[data]
name = "fashion_mnist"
limit_train_samples = 6000
batch_size = 64
num_workers = 2
)");
  auto r = run_engine({"run.toml"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("fashion_mnist: 6000 train, 6000 val, 10000 test images"), std::string::npos) << r.err;
  // One epoch on 6,000 real images gets well above chance (0.1).
  auto pos = r.out.find("test_acc");
  ASSERT_NE(pos, std::string::npos) << r.out;
  EXPECT_GT(std::stod(r.out.substr(pos + 8)), 0.6) << r.out;
}

namespace {

// idx files as the Debian package holds them, but written uncompressed (gzread passes them through):
// big-endian magic and counts, then the bytes.
std::string idx_file(uint32_t magic, std::vector<uint32_t> header, size_t data_bytes, unsigned char fill = 0) {
  std::string out;
  header.insert(header.begin(), magic);
  for (uint32_t v : header)
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>((v >> shift) & 0xff));
  out.append(data_bytes, static_cast<char>(fill));
  return out;
}

}  // namespace

TEST(Cli, FashionMnistFilesThatAreWrongAreOneLineNamingTheFile) {
  TempDir dir("cli");
  write_file(dir / "run.toml", "[trainer]\nmax_epochs = 1\n[model]\nname = \"mlp\"\nhidden = [8]\n[data]\nname = \"fashion_mnist\"\nroot = \"idx\"\n");
  std::filesystem::create_directories(dir / "idx");
  const std::string images = "idx/train-images-idx3-ubyte.gz", labels = "idx/train-labels-idx1-ubyte.gz";
  struct Case {
    std::string images, labels, expect;
  } cases[] = {
      {idx_file(2049, {2, 28, 28}, 2 * 784), "", images + ": bad magic number 2049 (expected 2051 for idx3 images)"},
      {idx_file(2051, {2, 32, 32}, 2 * 1024), "", images + ": holds 2 images of 32x32, expected at least one image of 28x28"},
      // A count of four billion images would ask for 3 TB before reading a pixel: the file's size
      // bounds what its header may count.
      {idx_file(2051, {4000000000u, 28, 28}, 784), "", images + ": truncated: its header counts 4000000000 images (3136000000000 bytes of pixels), more than the file can hold"},
      {idx_file(2051, {3, 28, 28}, 2 * 784), "", images + ": truncated: expected 2352 bytes of pixels, found 1568"},
      {idx_file(2051, {2, 28, 28}, 3 * 784), "", images + ": more data than its header's count of images"},
      {idx_file(2051, {2, 28, 28}, 2 * 784), idx_file(2049, {3}, 3), labels + ": holds 3 labels but " + images + " holds 2 images"},
      {idx_file(2051, {2, 28, 28}, 2 * 784), idx_file(2049, {2}, 2, 10), labels + ": label 10 at index 0 is outside [0, "},
  };
  for (const auto& c : cases) {
    write_file(dir / images, c.images);
    std::filesystem::remove(dir / labels);
    if (!c.labels.empty()) write_file(dir / labels, c.labels);
    auto r = run_engine({"run.toml"}, dir.path());
    EXPECT_NE(r.exit_code, 0) << c.expect;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.expect << "\n" << r.err;
    size_t errors = 0;
    for (size_t pos = r.err.find("] error "); pos != std::string::npos; pos = r.err.find("] error ", pos + 1)) ++errors;
    EXPECT_EQ(errors, 1u) << r.err;
  }
}

TEST(Cli, ProgressDoesNotFloodLogsWhenNotATerminal) {
  TempDir dir("cli");
  write_file(dir / "run.toml", std::string(kQuick) + "\n");
  // 2 epochs x 64 batches: in a file, only a few lines per epoch (never one per batch).
  auto r = run_engine({"run.toml", "--set", "trainer.max_epochs=2", "--set", "data.batch_size=1", "--set",
                       "trainer.enable_progress_bar=true"},
                      dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto count = [&](const std::string& needle) {
    size_t n = 0;
    for (size_t p = r.err.find(needle); p != std::string::npos; p = r.err.find(needle, p + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("Epoch 0/1 train_loss_epoch="), 1u) << r.err;  // the epoch summary line
  EXPECT_LE(count("Epoch 0/1"), 11u) << r.err;
  EXPECT_EQ(r.err.find('\r'), std::string::npos);  // no in-place redraws in a file
}

TEST(Cli, ProgressUpdatesInPlaceOnATerminal) {
  if (!std::filesystem::exists("/usr/bin/script")) GTEST_SKIP() << "util-linux `script` is needed to fake a terminal";
  TempDir dir("cli");
  write_file(dir / "run.toml", std::string(kQuick) + "\n");
  // `script` runs the engine on a pseudo-terminal and copies what it printed.
  const std::string cmd = engine_path().string() + " run.toml --set trainer.enable_progress_bar=true --set data.batch_size=1";
  auto r = run_process({"/usr/bin/script", "-qec", cmd, "/dev/null"}, dir.path(), {{"OMP_NUM_THREADS", "1"}});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("\r\033[K"), std::string::npos) << r.out;  // redrawn in place
  EXPECT_NE(r.out.find("[####"), std::string::npos) << r.out;      // with a bar
}

TEST(Cli, ResolvedConfigNamesThePluginsActuallyChosen) {
  TempDir dir("cli");
  write_file(dir / "run.toml", kQuick);
  auto good = test_plugin_dir("good").string();
  auto r = run_engine({"--plugin-path", good, "config", "--plugins", "traced_precision", "run.toml"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("precision = 'traced_precision'"), std::string::npos) << r.out;
  // Fed back without --plugins, it still picks traced_precision.
  write_file(dir / "resolved.toml", r.out);
  auto again = run_engine({"--plugin-path", good, "config", "resolved.toml"}, dir.path());
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(again.out, r.out);
}
