// ember::Fabric in process, on single_device (engine/include/ember/fabric.h): the same weights as a
// hand-written LibTorch loop, amp16's skipped step, clipping and the norm it returns (16-mixed
// too), save/load, logging, the distributed sampler against PyTorch's, bad input as one-line
// errors, and `engine --resume` of a Fabric checkpoint (the one test here that runs the engine
// binary); on 2 CPU ranks (this binary started again): broadcast through the communicator and the
// gradient norm across shards.
#include <gtest/gtest.h>

#include <ember/support/metrics.h>

#include <optional>

#include <ember/error.h>
#include <ember/fabric.h>
#include <ember/support/tensor_parallel.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "checkpoint/checkpoint_io.h"
#include "support.h"

namespace {

using ember::test::TempDir;

// The mlp model plugin's parameter names and shapes (input_size 8, hidden [4], 10 classes), so the
// engine can resume what Fabric saved.
struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 4));
    head = register_module("head", torch::nn::Linear(4, 10));
  }
  at::Tensor forward(const at::Tensor& x) { return head(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, head{nullptr};
};

std::shared_ptr<Net> make_net(uint64_t seed) {
  torch::manual_seed(seed);
  return std::make_shared<Net>();
}

struct Data {
  at::Tensor x, y;
};
Data make_data(int64_t n) {
  torch::manual_seed(1234);
  return {torch::randn({n, 8}), torch::randint(0, 10, {n})};
}

ember::OptimizerFactory adam(double lr = 1e-2) {
  return [lr](std::vector<at::Tensor> p) {
    return std::make_shared<torch::optim::Adam>(std::move(p), torch::optim::AdamOptions(lr));
  };
}

std::vector<at::Tensor> weights(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

double max_difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) d = std::max(d, (a[i] - b[i]).abs().max().item<double>());
  return d;
}

// The total 2-norm of the module's gradients, in double.
double gradient_norm(torch::nn::Module& m) {
  double sq = 0;
  for (const auto& p : m.parameters())
    if (p.grad().defined()) sq += p.grad().to(at::kDouble).pow(2).sum().item<double>();
  return std::sqrt(sq);
}

// Trains `steps` batches of 16 with Fabric's loop.
void fabric_steps(ember::Fabric& f, Net& net, const Data& d, int64_t steps, int64_t first = 0) {
  for (int64_t s = first; s < first + steps; ++s) {
    auto x = f.to_device(d.x.narrow(0, (s * 16) % d.x.size(0), 16));
    auto y = f.to_device(d.y.narrow(0, (s * 16) % d.y.size(0), 16));
    f.zero_grad();
    at::Tensor loss;
    {
      auto region = f.autocast();
      loss = torch::cross_entropy_loss(net.forward(x), y);
    }
    f.backward(loss);
    EXPECT_TRUE(f.optimizer_step());
  }
}

TEST(Fabric, SingleDeviceFp32MatchesHandWrittenLoop) {
  const Data d = make_data(128);
  auto reference = make_net(7);
  torch::optim::Adam ref_opt(reference->parameters(), torch::optim::AdamOptions(1e-2));
  for (int64_t s = 0; s < 24; ++s) {
    auto x = d.x.narrow(0, (s * 16) % 128, 16), y = d.y.narrow(0, (s * 16) % 128, 16);
    ref_opt.zero_grad();
    auto loss = torch::cross_entropy_loss(reference->forward(x), y);
    loss.backward();
    ref_opt.step();
  }

  ember::Fabric f({.accelerator = "cpu", .strategy = "single_device", .precision = "32-true"});
  auto net = make_net(7);
  f.setup(net, adam());
  EXPECT_EQ(f.world_size(), 1);
  EXPECT_TRUE(f.is_global_zero());
  EXPECT_EQ(f.device().type(), c10::kCPU);
  EXPECT_EQ(f.strategy_name(), "single_device");
  EXPECT_EQ(f.precision_name(), "fp32");
  fabric_steps(f, *net, d, 24);
  EXPECT_LE(max_difference(weights(*reference), weights(*net)), 1e-6);
  EXPECT_GT(max_difference(weights(*make_net(7)), weights(*net)), 1e-3);  // it did train
}

TEST(Fabric, Amp16SkipsTheStepOnAnInfGradientAndBacksOff) {
  const Data d = make_data(32);
  ember::Fabric f({.accelerator = "cpu", .strategy = "single_device", .precision = "16-mixed",
                   .plugin_config = "[amp16]\ninit_scale = 1024.0\n"});
  EXPECT_EQ(f.precision_name(), "amp16");
  auto net = make_net(3);
  f.setup(net, adam());
  auto step = [&](bool poison) {
    f.zero_grad();
    at::Tensor loss;
    {
      auto region = f.autocast();
      loss = torch::cross_entropy_loss(net->forward(f.to_device(d.x.narrow(0, 0, 16))), d.y.narrow(0, 0, 16));
    }
    f.backward(loss);
    if (poison) net->head->weight.mutable_grad().view(-1)[0] = std::numeric_limits<float>::infinity();
    return f.optimizer_step();
  };
  const auto before = weights(*net);
  EXPECT_FALSE(step(true));
  EXPECT_EQ(max_difference(before, weights(*net)), 0.0);  // skipped: nothing moved
  EXPECT_TRUE(step(false));
  EXPECT_GT(max_difference(before, weights(*net)), 0.0);
  // The scale backed off from 1024 to 512 on the inf step: amp16's state, saved with the checkpoint
  // and restored by load().
  TempDir tmp("fabric_amp16");
  auto scaler_state = [](const std::filesystem::path& file) {
    auto ck = ember::engine::load_checkpoint_file(file);
    return ck.at("plugins").toGenericDict().at("precision").toGenericDict();
  };
  f.save((tmp / "a.ckpt").string());
  auto saved = scaler_state(tmp / "a.ckpt");
  EXPECT_EQ(saved.at("scale").toDouble(), 512.0);
  EXPECT_EQ(saved.at("skipped_steps").toInt(), 1);
  ember::Fabric g({.accelerator = "cpu", .precision = "16-mixed"});
  auto copy = make_net(0);
  g.setup(copy, adam());
  g.load((tmp / "a.ckpt").string());
  EXPECT_EQ(max_difference(weights(*net), weights(*copy)), 0.0);
  g.save((tmp / "b.ckpt").string());
  EXPECT_EQ(scaler_state(tmp / "b.ckpt").at("scale").toDouble(), 512.0);
}

TEST(Fabric, ClipGradientsByNormAndByValue) {
  const Data d = make_data(16);
  for (auto algorithm : {ember::ClipAlgorithm::norm, ember::ClipAlgorithm::value}) {
    ember::Fabric f({.accelerator = "cpu"});
    auto net = make_net(5);
    f.setup(net, [](std::vector<at::Tensor> p) {
      return std::make_shared<torch::optim::SGD>(std::move(p), torch::optim::SGDOptions(1.0));
    });
    const auto before = weights(*net);
    f.zero_grad();
    at::Tensor loss;
    {
      auto region = f.autocast();
      loss = 1000.0 * torch::cross_entropy_loss(net->forward(d.x), d.y);
    }
    f.backward(loss);
    const double unclipped = gradient_norm(*net);
    ASSERT_GT(unclipped, 0.1);
    const at::Tensor norm = f.clip_gradients(0.01, algorithm);
    if (algorithm == ember::ClipAlgorithm::norm) {
      // torch's clip_grad_norm_: the total norm before clipping.
      ASSERT_TRUE(norm.defined());
      EXPECT_EQ(norm.dim(), 0);
      EXPECT_NEAR(norm.item<double>(), unclipped, 1e-5 * unclipped);
    } else {
      EXPECT_FALSE(norm.defined());  // Lightning returns None for clip_val
    }
    ASSERT_TRUE(f.optimizer_step());
    // SGD with lr 1 moves every weight by exactly minus its (clipped) gradient.
    double sq = 0, max_abs = 0;
    auto after = weights(*net);
    for (size_t i = 0; i < after.size(); ++i) {
      auto delta = (after[i] - before[i]).to(at::kDouble);
      sq += delta.pow(2).sum().item<double>();
      max_abs = std::max(max_abs, delta.abs().max().item<double>());
    }
    if (algorithm == ember::ClipAlgorithm::norm) {
      EXPECT_NEAR(std::sqrt(sq), 0.01, 1e-5);
    } else {
      EXPECT_NEAR(max_abs, 0.01, 1e-6);
      EXPECT_GT(std::sqrt(sq), 0.01);  // value clipping does not bound the norm
    }
  }
}

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
  ember::test::write_file(tmp / "run.toml", R"(
[trainer]
max_epochs = 2
enable_progress_bar = false
enable_model_summary = false
[model]
name = "mlp"
input_size = 8
hidden = [4]
[data]
name = "synthetic"
shape = [8]
num_train = 64
num_val = 0
num_test = 0
batch_size = 16
)");
  auto r = ember::test::run_engine({"--resume", "fabric.ckpt", "run.toml"}, tmp.path(), {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("resumed from fabric.ckpt at epoch 0, step 4"), std::string::npos) << r.err;
  // Epoch 1 only (4 batches): the last checkpoint is at step 8.
  auto rows = ember::test::read_csv(tmp / "runs/run/version_0/metrics.csv");
  ASSERT_FALSE(rows.empty());
  EXPECT_EQ(rows.back().at("epoch"), "1");
  EXPECT_TRUE(std::filesystem::exists(tmp / "runs/run/version_0/checkpoints/epoch=1-step=8.ckpt")) << r.err;
}

TEST(Fabric, LogsThroughALoggerPluginOnRankZero) {
  TempDir tmp("fabric_log");
  std::string dir;
  {
    ember::Fabric f({.accelerator = "cpu", .loggers = {"csv"}, .root_dir = tmp.path().string(), .name = "own_loop"});
    f.log("loss", 2.5, 0);
    f.log_dict({{"loss", 1.5}, {"acc", 0.75}}, 1);
    dir = f.log_dir();
  }
  EXPECT_EQ(dir, (tmp.path() / "own_loop" / "version_0").string());
  auto rows = ember::test::read_csv(std::filesystem::path(dir) / "metrics.csv");
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].at("step"), "0");
  EXPECT_EQ(std::stod(rows[0].at("loss")), 2.5);
  EXPECT_EQ(std::stod(rows[1].at("acc")), 0.75);
}

TEST(Fabric, DistributedSamplerMatchesPyTorch) {
  // torch.utils.data.DistributedSampler(range(10), num_replicas=3, seed=7), set_epoch(2), PyTorch 2.11.
  const std::vector<std::vector<int64_t>> padded = {{0, 7, 9, 3}, {5, 6, 1, 0}, {8, 2, 4, 5}};
  const std::vector<std::vector<int64_t>> dropped = {{0, 7, 9}, {5, 6, 1}, {8, 2, 4}};
  for (int64_t r = 0; r < 3; ++r) {
    ember::DistributedSampler a(10, 3, r, true, 7, false), b(10, 3, r, true, 7, true);
    a.set_epoch(2);
    b.set_epoch(2);
    EXPECT_EQ(a.indices(), padded[static_cast<size_t>(r)]);
    EXPECT_EQ(b.indices(), dropped[static_cast<size_t>(r)]);
    EXPECT_EQ(a.num_samples(), 4);
    EXPECT_EQ(b.num_samples(), 3);
  }
  ember::DistributedSampler s(10, 2, 1, false);
  EXPECT_EQ(s.indices(), (std::vector<int64_t>{1, 3, 5, 7, 9}));
  ember::DistributedSampler e0(100, 1, 0, true, 1), e1(100, 1, 0, true, 1);
  e1.set_epoch(1);
  EXPECT_NE(e0.indices(), e1.indices());  // a new order every epoch
  EXPECT_THROW(ember::DistributedSampler(10, 2, 2), ember::ConfigError);
}

// One line, naming what was wrong.
template <class E = ember::ConfigError, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error thrown";
  return "";
}

// 16-mixed: clip_gradients unscales first, so the norm it returns and the clipping are in true
// gradient units, and the step that follows does not unscale a second time.
TEST(Fabric, Amp16ClipGradientsUnscalesFirstAndReturnsTheTrueNorm) {
  const Data d = make_data(16);
  auto reference = make_net(5);
  torch::cross_entropy_loss(reference->forward(d.x), d.y).backward();
  const double true_norm = gradient_norm(*reference);

  ember::Fabric f({.accelerator = "cpu", .precision = "16-mixed", .plugin_config = "[amp16]\ninit_scale = 1024.0\n"});
  auto net = make_net(5);
  f.setup(net, [](std::vector<at::Tensor> p) {
    return std::make_shared<torch::optim::SGD>(std::move(p), torch::optim::SGDOptions(1.0));
  });
  auto backward = [&](bool poison) {
    f.zero_grad();
    at::Tensor loss;
    {
      auto region = f.autocast();
      loss = torch::cross_entropy_loss(net->forward(f.to_device(d.x)), d.y);
    }
    f.backward(loss);
    if (poison) net->head->weight.mutable_grad().view(-1)[0] = std::numeric_limits<float>::infinity();
  };
  backward(false);
  EXPECT_NEAR(gradient_norm(*net), 1024.0 * true_norm, 0.02 * 1024.0 * true_norm);  // still scaled
  const double max = true_norm / 4;
  const at::Tensor norm = f.clip_gradients(max);
  EXPECT_NEAR(norm.item<double>(), true_norm, 0.02 * true_norm);  // float16 autocast: ~1e-3 apart
  EXPECT_NEAR(gradient_norm(*net), max, 1e-3 * max);               // unscaled, then clipped
  const auto before = weights(*net);
  ASSERT_TRUE(f.optimizer_step());
  double sq = 0;
  const auto after = weights(*net);
  for (size_t i = 0; i < after.size(); ++i) sq += (after[i] - before[i]).to(at::kDouble).pow(2).sum().item<double>();
  EXPECT_NEAR(std::sqrt(sq), max, 1e-3 * max);  // SGD lr 1: the update is the clipped gradient, not unscaled twice

  // An inf gradient: the norm says so and the step is still skipped.
  backward(true);
  EXPECT_FALSE(std::isfinite(f.clip_gradients(max).item<double>()));
  EXPECT_FALSE(f.optimizer_step());
  EXPECT_EQ(max_difference(after, weights(*net)), 0.0);
}

// Two CPU ranks (this test binary started again by ddp's launcher, the rank in the environment):
// broadcast from rank 1 through the communicator for several dtypes and shapes, a sparse tensor
// refused on both ranks, and the gradient norm clip_gradients returns under `sharded` (each rank
// holds half of the gradients) equal to the whole model's, on both ranks.
TEST(Fabric, TwoCpuRanksBroadcastAndClipAcrossShards) {
  EMBER_SKIP_WITHOUT_MPI();
  // A rank runs the strategy its launcher started, named in the environment it inherits.
  const char* rank_strategy = std::getenv("EMBER_FABRIC_TEST_STRATEGY");
  std::vector<std::string> strategies = {"ddp", "sharded"};
  if (rank_strategy) strategies = {rank_strategy};
  for (const auto& strategy : strategies) {
    if (!rank_strategy) ::setenv("EMBER_FABRIC_TEST_STRATEGY", strategy.c_str(), 1);
    ember::Fabric f({.accelerator = "cpu", .strategy = strategy, .devices = 2,
                     .argv = {std::filesystem::read_symlink("/proc/self/exe").string(),
                              "--gtest_filter=Fabric.TwoCpuRanksBroadcastAndClipAcrossShards"}});
    const int code = f.launch([&](ember::Fabric& fab) {
      const int64_t r = fab.rank();
      ASSERT_EQ(fab.world_size(), 2);
      // Rank 1's tensors arrive whole on rank 0, whatever rank 0 passed (here: nothing, or a
      // tensor of another shape and dtype).
      auto ints = fab.broadcast(r == 1 ? torch::arange(6, at::kLong).reshape({2, 3}) + 100 : at::Tensor(), 1);
      EXPECT_EQ(ints.scalar_type(), at::kLong);
      EXPECT_EQ(ints.sizes(), (std::vector<int64_t>{2, 3}));
      EXPECT_TRUE(ints.equal(torch::arange(6, at::kLong).reshape({2, 3}) + 100));
      auto flags = fab.broadcast(r == 1 ? torch::tensor({true, false, true}) : torch::zeros({7}), 1);
      EXPECT_TRUE(flags.equal(torch::tensor({true, false, true})));
      auto halves = fab.broadcast(r == 1 ? torch::full({5}, 1.5, at::kBFloat16) : torch::zeros({5}, at::kBFloat16), 1);
      EXPECT_TRUE(halves.equal(torch::full({5}, 1.5, at::kBFloat16)));
      const auto z = torch::complex(torch::tensor({1.0f, -2.0f}), torch::tensor({std::numeric_limits<float>::infinity(), 3.0f}));
      EXPECT_TRUE(fab.broadcast(r == 1 ? z : torch::zeros({2}, at::kComplexFloat), 1).equal(z));
      EXPECT_EQ(fab.broadcast(torch::scalar_tensor(static_cast<double>(r + 7)), 0).item<double>(), 7.0);  // 0-dim
      EXPECT_EQ(fab.broadcast(torch::empty({0, 4}), 1).sizes(), (std::vector<int64_t>{0, 4}));
      const auto sparse = torch::eye(3).to_sparse();
      auto m = error_of<ember::RunError>([&] { fab.broadcast(r == 1 ? sparse : at::Tensor(), 1); });
      EXPECT_NE(m.find("sparse"), std::string::npos) << m;
      EXPECT_EQ(fab.broadcast(torch::full({1}, r == 1 ? 5.0 : 0.0), 1).item<double>(), 5.0);  // still in step

      // clip_gradients' norm: that of the mean gradient over both ranks' batches (what ddp and
      // sharded synchronise), computed here on a whole copy of the module.
      const Data d = make_data(32);
      auto net = make_net(11);
      auto reference = make_net(11);
      (0.5 * (torch::cross_entropy_loss(reference->forward(d.x.narrow(0, 0, 16)), d.y.narrow(0, 0, 16)) +
              torch::cross_entropy_loss(reference->forward(d.x.narrow(0, 16, 16)), d.y.narrow(0, 16, 16))))
          .backward();
      const double whole = gradient_norm(*reference);
      fab.setup(net, adam());
      fab.zero_grad();
      at::Tensor loss;
      {
        auto region = fab.autocast();
        loss = torch::cross_entropy_loss(net->forward(d.x.narrow(0, 16 * r, 16)), d.y.narrow(0, 16 * r, 16));
      }
      fab.backward(loss);
      const double norm = fab.clip_gradients(1e9).item<double>();
      EXPECT_NEAR(norm, whole, 1e-5 * whole) << fab.strategy_name() << " rank " << r;
      EXPECT_TRUE(fab.optimizer_step());
    });
    if (!rank_strategy) {
      ::unsetenv("EMBER_FABRIC_TEST_STRATEGY");
      EXPECT_EQ(code, 0) << strategy << ": a rank failed (its output is above)";
    }
  }
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

TEST(Fabric, BadInputsAreOneLineErrors) {
  auto m = error_of([] { ember::Fabric f({.strategy = "dpp"}); });
  EXPECT_NE(m.find("FabricOptions.strategy"), std::string::npos) << m;
  EXPECT_NE(m.find("ddp"), std::string::npos) << m;  // did you mean
  m = error_of([] { ember::Fabric f({.precision = "bf17-mixed"}); });
  EXPECT_NE(m.find("FabricOptions.precision"), std::string::npos) << m;
  EXPECT_NE(m.find("bf16-mixed"), std::string::npos) << m;  // the accepted strings
  m = error_of([] { ember::Fabric f({.strategy = "fp32"}); });
  EXPECT_NE(m.find("is a precision plugin, not a strategy plugin"), std::string::npos) << m;
  m = error_of([] { ember::Fabric f({.plugin_config = "[single_device]\nbogus = 1\n"}); });
  EXPECT_NE(m.find("FabricOptions.plugin_config:2"), std::string::npos) << m;
  EXPECT_NE(m.find("bogus"), std::string::npos) << m;
  m = error_of([] { ember::Fabric f({.precision = "16-mixed", .plugin_config = "[amp16]\ninit_scale = \"big\"\n"}); });
  EXPECT_NE(m.find("FabricOptions.plugin_config:2"), std::string::npos) << m;
  m = error_of([] { ember::Fabric f({.plugin_config = "[ddp\n"}); });
  EXPECT_NE(m.find("FabricOptions.plugin_config:1"), std::string::npos) << m;
  m = error_of([] { ember::Fabric f({.plugin_config = "[trainer]\nmax_epochs = 3\n"}); });
  EXPECT_NE(m.find("[trainer] is an engine section"), std::string::npos) << m;
  m = error_of([] { ember::Fabric f({.devices = 0}); });
  EXPECT_NE(m.find("FabricOptions.devices = 0"), std::string::npos) << m;
  m = error_of([] { ember::Fabric f({.loggers = {"checkpoint"}}); });
  EXPECT_NE(m.find("Fabric runs no callbacks"), std::string::npos) << m;

  // Calls in the wrong order.
  ember::Fabric f({.accelerator = "cpu"});
  m = error_of<ember::RunError>([&] { f.zero_grad(); });
  EXPECT_NE(m.find("call setup("), std::string::npos) << m;
  auto net = make_net(1);
  f.setup(net, adam());
  m = error_of<ember::RunError>([&] { f.optimizer_step(); });
  EXPECT_NE(m.find("call backward(loss) first"), std::string::npos) << m;
  m = error_of<ember::RunError>([&] { f.setup(net, adam()); });
  EXPECT_NE(m.find("called twice"), std::string::npos) << m;
  m = error_of<ember::RunError>([&] { f.backward(torch::ones({2}, torch::requires_grad())); });
  EXPECT_NE(m.find("scalar"), std::string::npos) << m;
  m = error_of([&] { f.clip_gradients(0.0); });
  EXPECT_NE(m.find("must be > 0"), std::string::npos) << m;
  ember::Fabric two({.accelerator = "cpu", .strategy = "ddp", .devices = 2});
  m = error_of<ember::RunError>([&] { two.setup(make_net(1), adam()); });
  EXPECT_NE(m.find("fabric.launch(fn)"), std::string::npos) << m;
}

TEST(Fabric, LaunchRunsTheFunctionAndTurnsErrorsIntoExitCodes) {
  ember::Fabric f({.accelerator = "cpu"});
  int calls = 0;
  EXPECT_EQ(f.launch([&](ember::Fabric& fabric) {
              ++calls;
              EXPECT_EQ(&fabric, &f);
              EXPECT_EQ(fabric.all_reduce(torch::ones({2})).sum().item<double>(), 2.0);
              EXPECT_EQ(fabric.broadcast(torch::full({1}, 3.0)).item<double>(), 3.0);
              EXPECT_TRUE(fabric.broadcast(true));
              fabric.barrier();
            }),
            0);
  EXPECT_EQ(calls, 1);
  ember::Fabric g({.accelerator = "cpu"});
  EXPECT_EQ(g.launch([](ember::Fabric&) { throw ember::RunError("boom"); }), 1);
  ember::Fabric h({.accelerator = "cpu"});
  EXPECT_EQ(h.launch([](ember::Fabric&) { throw ember::ConfigError("bad"); }), 2);
}

}  // namespace

namespace {

// A program's own tensor-parallel module and plan (Lightning's ModelParallelStrategy: the user
// writes the parallelize function): fc1 column-parallel, fc2 row-parallel.
struct SplitNet : torch::nn::Module {
  SplitNet() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 10));
  }
  at::Tensor forward(const at::Tensor& x) {
    if (!group) return fc2(torch::relu(fc1(x)));
    const at::Tensor h = torch::relu(at::linear(ember::copy_to_tensor_parallel(x, *group), fc1->weight, fc1->bias));
    return ember::reduce_from_tensor_parallel(at::linear(h, fc2->weight), *group) + fc2->bias;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  ember::ITensorParallelGroup* group = nullptr;
};

std::vector<ember::TensorShard> split_net_plan(torch::nn::Module& module, ember::ITensorParallelGroup& group) {
  auto& net = dynamic_cast<SplitNet&>(module);
  std::vector<ember::TensorShard> shards = {{"fc1.weight", 0, 1}, {"fc1.bias", 0, 1}, {"fc2.weight", 1, 1}};
  auto params = net.named_parameters();
  for (const auto& s : shards) ember::keep_shard(params[s.name], s, group.rank(), group.size());
  net.group = &group;
  return shards;
}

}  // namespace

// Fabric with tensor parallelism on 2 CPU ranks (this binary started again): the program's plan
// splits its module, both ranks take the same batches, and after 5 Adam steps the whole weights
// (gathered from the slices by full_model_state) equal a plain LibTorch loop's on one process.
TEST(Fabric, TwoCpuRanksTrainTheProgramsTensorParallelPlan) {
  EMBER_SKIP_WITHOUT_MPI();
  const Data d = make_data(40);
  torch::manual_seed(31);
  auto reference = std::make_shared<SplitNet>();
  torch::optim::Adam ref_opt(reference->parameters(), torch::optim::AdamOptions(1e-2));
  for (int s = 0; s < 5; ++s) {
    ref_opt.zero_grad();
    torch::cross_entropy_loss(reference->forward(d.x.narrow(0, 8 * s, 8)), d.y.narrow(0, 8 * s, 8)).backward();
    ref_opt.step();
  }
  ember::FabricOptions o{.accelerator = "cpu", .strategy = "ddp", .devices = 2,
                         .plugin_config = "[ddp]\ntimeout = 30.0\n",
                         .argv = {std::filesystem::read_symlink("/proc/self/exe").string(),
                                  "--gtest_filter=Fabric.TwoCpuRanksTrainTheProgramsTensorParallelPlan"}};
  o.tensor_parallel = 2;
  o.parallelize = split_net_plan;
  ember::Fabric f(o);
  const int code = f.launch([&](ember::Fabric& fab) {
    torch::manual_seed(31);
    auto net = std::make_shared<SplitNet>();
    fab.setup(net, adam());
    EXPECT_EQ(net->fc1->weight.size(0), 8);  // this rank's half of the hidden units
    EXPECT_EQ(net->fc2->weight.size(1), 8);
    for (int s = 0; s < 5; ++s) {
      fab.zero_grad();
      at::Tensor loss = torch::cross_entropy_loss(net->forward(d.x.narrow(0, 8 * s, 8)), d.y.narrow(0, 8 * s, 8));
      fab.backward(loss);
      EXPECT_TRUE(fab.optimizer_step());
    }
    const auto whole = fab.full_model_state(/*rank0_only=*/false);
    for (const auto& p : reference->named_parameters())
      EXPECT_LE((whole.at(p.key()) - p.value().detach()).abs().max().item<double>(), 1e-5) << p.key() << " on rank " << fab.rank();
  });
  EXPECT_EQ(code, 0);
  // Tensor parallelism without a plan is refused before anything starts.
  ember::FabricOptions bad{.accelerator = "cpu", .strategy = "ddp", .devices = 2};
  bad.tensor_parallel = 2;
  auto m = error_of<ember::ConfigError>([&] { ember::Fabric g(bad); });
  EXPECT_NE(m.find("FabricOptions.tensor_parallel = 2 needs FabricOptions.parallelize"), std::string::npos) << m;
}

// Fabric::sync: a program's own evaluation loop gets the metrics of <ember/support/metrics.h>
// exactly over its ranks. Rank 0 sees 37 samples, rank 1 the other 26: after the sync both ranks
// compute the whole data's F1, exact AUROC (its scores gathered) and confusion matrix.
TEST(Fabric, TwoCpuRanksSyncMetricsOverTheWholeData) {
  EMBER_SKIP_WITHOUT_MPI();
  const bool launched = std::getenv("EMBER_FABRIC_TEST_METRICS") != nullptr;
  if (!launched) ::setenv("EMBER_FABRIC_TEST_METRICS", "1", 1);
  ember::Fabric f({.accelerator = "cpu", .strategy = "ddp", .devices = 2,
                   .argv = {std::filesystem::read_symlink("/proc/self/exe").string(),
                            "--gtest_filter=Fabric.TwoCpuRanksSyncMetricsOverTheWholeData"}});
  namespace m = ember::metrics;
  const int code = f.launch([&](ember::Fabric& fab) {
    torch::manual_seed(5);
    const at::Tensor scores = torch::randn({63, 3}), target = torch::randint(0, 3, {63}, at::kLong);
    auto make = [] {
      m::MetricCollection c;
      c.add("f1", m::f1(3));
      c.add("auroc", std::make_unique<m::ExactCurve>(m::CurveKind::auroc, m::Task::multiclass, 3));
      c.add("confusion", std::make_unique<m::ConfusionMatrix>(3));
      return c;
    };
    m::MetricCollection whole = make(), mine = make();
    whole.update(scores, target);
    const int64_t begin = fab.rank() == 0 ? 0 : 37, count = fab.rank() == 0 ? 37 : 26;
    mine.update(scores.narrow(0, begin, count), target.narrow(0, begin, count));
    fab.sync(mine);
    const auto got = mine.compute(), want = whole.compute();
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i].second, want[i].second, 1e-12) << got[i].first << " on rank " << fab.rank();
    EXPECT_TRUE(dynamic_cast<const m::ConfusionMatrix&>(*mine.metrics()[2].second).matrix().equal(
        dynamic_cast<const m::ConfusionMatrix&>(*whole.metrics()[2].second).matrix()));
  });
  if (!launched) {
    ::unsetenv("EMBER_FABRIC_TEST_METRICS");
    EXPECT_EQ(code, 0) << "a rank failed (its output is above)";
  }
}
