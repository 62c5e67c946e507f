// ember::Fabric's checkpoints: save/load continues identically (Adam moments included),
// save_async writes the state of the call and reports a failed write, `engine --resume` of a
// Fabric checkpoint (the engine binary), and sharded checkpoint directories on 2 CPU ranks (this
// binary started again by the launcher).
#include <gtest/gtest.h>

#include <ember/error.h>
#include <ember/fabric.h>
#include <torch/torch.h>

#include <filesystem>
#include <optional>

#include "fabric_support.h"
#include "support.h"

namespace {

using ember::test::TempDir;
using namespace ember::test::fabric;

TEST(Fabric, SaveLoadRoundTripContinuesIdentically) {
  TempDir tmp("fabric_save_load");
  const Data d = make_data(128);
  const std::string path = (tmp / "state.ckpt").string();
  ember::Fabric f({.accelerator = "cpu"});
  auto net = make_net(11);
  f.setup(net, adam());
  fabric_steps(f, *net, d, 5);
  const auto full = f.full_model_state();
  ASSERT_EQ(full.size(), 4u);
  EXPECT_TRUE(full.at("fc1.weight").equal(net->fc1->weight.detach()));
  EXPECT_TRUE(full.at("head.bias").equal(net->head->bias.detach()));
  ember::FabricState state;
  state.global_step = 5;
  state.epoch = 0;
  state.values["iteration"] = int64_t{5};
  state.values["best"] = 0.25;
  state.values["ema"] = torch::arange(4, at::kFloat);
  f.save(path, state);
  fabric_steps(f, *net, d, 3, 5);  // the original goes on

  ember::Fabric g({.accelerator = "cpu"});
  auto copy = make_net(99);  // other initial weights: load must replace them
  g.setup(copy, adam());
  auto loaded = g.load(path);
  EXPECT_TRUE(loaded.model);
  EXPECT_TRUE(loaded.optimizer);
  EXPECT_EQ(loaded.global_step, 5);
  EXPECT_EQ(loaded.values.at("iteration").toInt(), 5);
  EXPECT_DOUBLE_EQ(loaded.values.at("best").toDouble(), 0.25);
  EXPECT_TRUE(loaded.values.at("ema").toTensor().equal(torch::arange(4, at::kFloat)));
  fabric_steps(g, *copy, d, 3, 5);  // with the loaded Adam moments, the same three steps
  EXPECT_EQ(max_difference(weights(*net), weights(*copy)), 0.0);

  // A damaged file is refused with one line naming it.
  {
    std::string bytes = ember::test::read_file(path);
    bytes[bytes.size() / 2] ^= 0x5a;
    ember::test::write_file(tmp / "damaged.ckpt", bytes);
  }
  try {
    g.load((tmp / "damaged.ckpt").string());
    FAIL() << "a damaged checkpoint loaded";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("damaged.ckpt"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
  }
}

// save_async: the state of the call is copied before it returns and written while the program
// trains on (the weights change under it), so loading it continues exactly as loading the
// synchronous save of the same moment does; a write that fails (its folder is a file) is
// reported by finish_saves, and the Fabric saves again afterwards.
TEST(Fabric, SaveAsyncWritesTheStateOfTheCallAndReportsAFailedWrite) {
  TempDir tmp("fabric_save_async");
  const Data d = make_data(128);
  ember::Fabric f({.accelerator = "cpu"});
  auto net = make_net(13);
  f.setup(net, adam());
  fabric_steps(f, *net, d, 4);
  ember::FabricState state;
  state.global_step = 4;
  state.values["note"] = std::string("in the background");
  f.save((tmp / "sync.ckpt").string(), state);
  f.save_async((tmp / "async.ckpt").string(), state);
  fabric_steps(f, *net, d, 3, 4);  // trains on while the write goes on
  f.finish_saves();
  ASSERT_TRUE(std::filesystem::is_regular_file(tmp / "async.ckpt"));
  const auto went_on = weights(*net);

  std::vector<std::vector<at::Tensor>> resumed;
  for (const char* name : {"sync.ckpt", "async.ckpt"}) {
    ember::Fabric g({.accelerator = "cpu"});
    auto copy = make_net(99);
    g.setup(copy, adam());
    const auto loaded = g.load((tmp / name).string());
    EXPECT_EQ(loaded.global_step, 4) << name;
    EXPECT_EQ(loaded.values.at("note").toStringRef(), "in the background") << name;
    fabric_steps(g, *copy, d, 3, 4);
    resumed.push_back(weights(*copy));
  }
  EXPECT_EQ(max_difference(resumed[0], resumed[1]), 0.0);
  EXPECT_EQ(max_difference(resumed[1], went_on), 0.0);

  ember::test::write_file(tmp / "a_file", "not a folder");
  f.save_async((tmp / "a_file" / "x.ckpt").string(), state);
  try {
    f.finish_saves();
    FAIL() << "a failed background write was not reported";
  } catch (const ember::RunError& e) {
    EXPECT_NE(std::string(e.what()).find("x.ckpt"), std::string::npos) << e.what();
  }
  f.save_async((tmp / "after.ckpt").string(), state);
  f.finish_saves();
  f.finish_saves();  // nothing pending: nothing to do
  EXPECT_TRUE(std::filesystem::is_regular_file(tmp / "after.ckpt"));
}

TEST(Fabric, EngineResumesAFabricCheckpoint) {
  TempDir tmp("fabric_engine_resume");
  const Data d = make_data(64);
  {
    ember::Fabric f({.accelerator = "cpu"});
    auto net = make_net(2);
    f.setup(net, adam(1e-3));
    fabric_steps(f, *net, d, 4);
    f.save((tmp / "fabric.ckpt").string(), {.global_step = 4, .epoch = 0});
  }
  ember::test::write_file(tmp / "run.toml", ember::test::tiny_mlp_toml(2, "num_train = 64\nnum_val = 0\nnum_test = 0\nbatch_size = 16\n"));
  auto r = ember::test::run_engine({"--resume", "fabric.ckpt", "run.toml"}, tmp.path(), {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("resumed from fabric.ckpt at epoch 0, step 4"), std::string::npos) << r.err;
  // Epoch 1 only (4 batches): the last checkpoint is at step 8.
  auto rows = ember::test::read_csv(tmp / "runs/run/version_0/metrics.csv");
  ASSERT_FALSE(rows.empty());
  EXPECT_EQ(rows.back().at("epoch"), "1");
  EXPECT_TRUE(std::filesystem::exists(tmp / "runs/run/version_0/checkpoints/epoch=1-step=8.ckpt")) << r.err;
}

// Under a strategy whose checkpoints are sharded, Fabric::save goes through the same runtime as the
// engine's loop: a directory of one part per rank plus meta.ckpt, nothing gathered on rank 0; and
// Fabric::load reads it back, so steps taken from the loaded state equal the steps taken after it
// was saved (Adam moments included); save_async's directory, written in the background, too. 2 CPU ranks: this binary started again by the launcher.
TEST(Fabric, TwoCpuRanksSaveAndLoadShardedCheckpoints) {
  EMBER_SKIP_WITHOUT_MPI();
  const char* rank_dir = std::getenv("EMBER_FABRIC_TEST_DIR");
  std::optional<TempDir> tmp;
  if (!rank_dir) {
    tmp.emplace("fabric_sharded");
    ::setenv("EMBER_FABRIC_TEST_DIR", tmp->path().c_str(), 1);
  }
  const std::filesystem::path dir = rank_dir ? std::filesystem::path(rank_dir) : tmp->path();
  ember::Fabric f({.accelerator = "cpu", .strategy = "sharded", .devices = 2,
                   .plugin_config = "[sharded]\nstate_dict_type = \"sharded\"\ntimeout = 30.0\n",
                   .argv = {std::filesystem::read_symlink("/proc/self/exe").string(),
                            "--gtest_filter=Fabric.TwoCpuRanksSaveAndLoadShardedCheckpoints"}});
  const int code = f.launch([&](ember::Fabric& fab) {
    const int64_t r = fab.rank();
    const Data d = make_data(64);
    auto net = make_net(21);
    fab.setup(net, adam());
    auto steps = [&](int64_t first, int64_t n) {  // each rank its own half of each batch of 32
      for (int64_t s = first; s < first + n; ++s) {
        fab.zero_grad();
        at::Tensor loss;
        {
          auto region = fab.autocast();
          const int64_t at = (s * 32 + r * 16) % d.x.size(0);
          loss = torch::cross_entropy_loss(net->forward(d.x.narrow(0, at, 16)), d.y.narrow(0, at, 16));
        }
        fab.backward(loss);
        EXPECT_TRUE(fab.optimizer_step());
      }
    };
    steps(0, 2);
    const std::string path = (dir / "state.ckpt").string();
    ember::FabricState state;
    state.global_step = 2;
    state.values["note"] = std::string("sharded");
    fab.save(path, state);
    EXPECT_TRUE(std::filesystem::is_regular_file(dir / "state.ckpt" / "meta.ckpt"));
    EXPECT_TRUE(std::filesystem::is_regular_file(dir / "state.ckpt" / "rank0.ckpt"));
    EXPECT_TRUE(std::filesystem::is_regular_file(dir / "state.ckpt" / "rank1.ckpt"));
    // The same moment in the background: each rank writes its part while the steps go on, and
    // the load below finishes (commits) it first.
    const std::string async_path = (dir / "async.ckpt").string();
    fab.save_async(async_path, state);
    steps(2, 3);
    const auto went_on = fab.full_model_state(/*rank0_only=*/false);
    for (const auto& from : {path, async_path}) {
      const auto loaded = fab.load(from);
      EXPECT_TRUE(loaded.model);
      EXPECT_TRUE(loaded.optimizer);
      EXPECT_EQ(loaded.global_step, 2);
      EXPECT_EQ(loaded.values.at("note").toStringRef(), "sharded");
      steps(2, 3);
      const auto again = fab.full_model_state(/*rank0_only=*/false);
      ASSERT_EQ(went_on.size(), again.size());
      for (const auto& e : went_on) EXPECT_TRUE(e.value().equal(again.at(e.key()))) << e.key() << " on rank " << r << " from " << from;
    }
    EXPECT_TRUE(std::filesystem::is_regular_file(dir / "async.ckpt" / "rank1.ckpt"));
  });
  if (!rank_dir) {
    ::unsetenv("EMBER_FABRIC_TEST_DIR");
    EXPECT_EQ(code, 0) << "a rank failed (its output is above)";
  }
}

}  // namespace
