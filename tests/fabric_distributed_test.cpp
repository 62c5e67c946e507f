// ember::Fabric on 2 CPU ranks (this binary started again by the launcher): broadcast through
// the communicator and the gradient norm across shards, a program's own tensor-parallel plan
// against a plain LibTorch loop, and metrics synchronised over the whole data.
#include <gtest/gtest.h>

#include <ember/error.h>
#include <ember/fabric.h>
#include <ember/support/metrics.h>
#include <ember/support/tensor_parallel.h>
#include <torch/torch.h>

#include <filesystem>
#include <limits>

#include "fabric_support.h"
#include "support.h"

namespace {

using ember::test::TempDir;
using namespace ember::test::fabric;

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
