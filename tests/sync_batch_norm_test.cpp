// sync_batchnorm (ember/support/sync_batch_norm.h): ranks that normalise together give what one
// batch norm over the whole batch gives: outputs, input and weight gradients, running
// statistics. In one process (two threads, each a "rank" with half the batch, summing through an
// in-process all-reduce); in a Fabric program of 2 CPU ranks with uneven batches; and end to end:
// 2 ddp and sharded (stage 3) CPU ranks train bn_mlp to the weights and running statistics of one
// process with the doubled batch, which they miss without it.
#include <gtest/gtest.h>

#include <ember/fabric.h>
#include <ember/support/sync_batch_norm.h>

#include <torch/nn/modules/batchnorm.h>

#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <regex>
#include <string>
#include <thread>

#include "bn_mlp_run.h"
#include "checkpoint_support.h"
#include "support.h"

using namespace ember::test;

namespace {

// An all-reduce (sum) among `n` threads: each thread's call returns the sum of the n tensors of
// the same round.
class ThreadAllReduce {
 public:
  explicit ThreadAllReduce(int n) : n_(n) {}
  at::Tensor operator()(const at::Tensor& t) {
    std::unique_lock<std::mutex> lock(mutex_);
    const int64_t round = round_;
    sum_ = arrived_ == 0 ? t.clone() : sum_ + t;
    if (++arrived_ == n_) {
      result_ = sum_;
      arrived_ = 0;
      ++round_;
      done_.notify_all();
    } else {
      done_.wait(lock, [&] { return round_ != round; });
    }
    return result_.clone();  // valid until every thread of this round has arrived at the next one
  }

 private:
  const int n_;
  std::mutex mutex_;
  std::condition_variable done_;
  int arrived_ = 0;
  int64_t round_ = 0;
  at::Tensor sum_, result_;
};

void expect_close(const at::Tensor& a, const at::Tensor& b, double tolerance, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  EXPECT_LE((a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>(), tolerance) << what;
}

// Two steps of `Sync` on two threads against one `Plain` over the whole batch of shape `shape`,
// whose values sit far from 0 (mean 50, spread 3: sums of x and x^2 would miss the variance by
// ~1e-4 in float32; the tolerances are 10x below that).
template <class Sync, class Plain>
void two_ranks_match_one_batch_norm(std::vector<int64_t> shape) {
  torch::manual_seed(0);
  const int64_t channels = shape[1];
  Plain plain(channels);
  {
    torch::NoGradGuard no_grad;
    plain->weight.uniform_(0.5, 1.5);
    plain->bias.uniform_(-1, 1);
  }
  Sync ranks[2] = {Sync(channels), Sync(channels)};
  ThreadAllReduce all_reduce(2);
  for (int k = 0; k < 2; ++k) {
    torch::NoGradGuard no_grad;
    ranks[k]->weight.copy_(plain->weight);
    ranks[k]->bias.copy_(plain->bias);
    EXPECT_EQ(ember::set_sync_batch_norm(*ranks[k], std::ref(all_reduce), k, 2), 1);
  }
  const int64_t half = shape[0] / 2;
  for (int step = 0; step < 2; ++step) {
    const at::Tensor x = torch::randn(shape) * 3 + 50;
    const at::Tensor probe = torch::randn(shape);  // loss = sum(y * probe): every output matters
    const at::Tensor x_plain = x.clone().requires_grad_();
    const at::Tensor y_plain = plain(x_plain);
    (y_plain * probe).sum().backward();

    at::Tensor x_rank[2], y_rank[2];
    std::thread threads[2];
    for (int k = 0; k < 2; ++k) {
      x_rank[k] = x.narrow(0, k * half, half).clone().requires_grad_();
      threads[k] = std::thread([&, k] {
        y_rank[k] = ranks[k](x_rank[k]);
        (y_rank[k] * probe.narrow(0, k * half, half)).sum().backward();
      });
    }
    for (auto& t : threads) t.join();
    const std::string where = "step " + std::to_string(step) + ", shape " + c10::str(c10::IntArrayRef(shape)) + ": ";
    expect_close(at::cat({y_rank[0], y_rank[1]}), y_plain, 1e-5, where + "outputs");
    expect_close(at::cat({x_rank[0].grad(), x_rank[1].grad()}), x_plain.grad(), 1e-5, where + "input gradients");
    // Weight and bias gradients stay local: their sum over the ranks is the whole batch's.
    expect_close(ranks[0]->weight.grad() + ranks[1]->weight.grad(), plain->weight.grad(), 1e-4, where + "weight gradient");
    expect_close(ranks[0]->bias.grad() + ranks[1]->bias.grad(), plain->bias.grad(), 1e-4, where + "bias gradient");
    expect_close(ranks[0]->running_mean, plain->running_mean, 1e-5, where + "running mean");
    expect_close(ranks[0]->running_var, plain->running_var, 1e-5, where + "running variance (unbiased over the whole batch)");
    EXPECT_TRUE(at::equal(ranks[0]->running_mean, ranks[1]->running_mean)) << where;
    EXPECT_TRUE(at::equal(ranks[0]->running_var, ranks[1]->running_var)) << where;
    EXPECT_EQ(ranks[0]->num_batches_tracked.template item<int64_t>(), step + 1) << where;
    for (auto* m : {static_cast<torch::nn::Module*>(plain.get()), static_cast<torch::nn::Module*>(ranks[0].get()),
                    static_cast<torch::nn::Module*>(ranks[1].get())})
      m->zero_grad();
  }
  // Evaluation uses the running statistics, on each rank alone.
  plain->eval();
  ranks[0]->eval();
  const at::Tensor x = torch::randn(shape) + 50;
  torch::NoGradGuard no_grad;
  expect_close(ranks[0](x), plain(x), 1e-5, "evaluation");
}

}  // namespace

TEST(SyncBatchNorm, TwoRanksTogetherNormaliseLikeOneBatchNormOverTheWholeBatch) {
  two_ranks_match_one_batch_norm<ember::SyncBatchNorm1d, torch::nn::BatchNorm1d>({8, 3});
  two_ranks_match_one_batch_norm<ember::SyncBatchNorm1d, torch::nn::BatchNorm1d>({6, 4, 5});
  two_ranks_match_one_batch_norm<ember::SyncBatchNorm2d, torch::nn::BatchNorm2d>({4, 3, 5, 5});
  two_ranks_match_one_batch_norm<ember::SyncBatchNorm3d, torch::nn::BatchNorm3d>({2, 2, 3, 3, 3});
}

// Without an all-reduce it is torch's batch norm, bit for bit; a half-precision input comes back in
// its own dtype; the type name a model summary prints is its own.
TEST(SyncBatchNorm, WithoutRanksItIsTorchsBatchNorm) {
  torch::manual_seed(1);
  torch::nn::BatchNorm2d plain(3);
  ember::SyncBatchNorm2d sync(3);
  const at::Tensor x = torch::randn({4, 3, 2, 2});
  EXPECT_TRUE(at::equal(sync(x), plain(x)));
  EXPECT_TRUE(at::equal(sync->running_var, plain->running_var));
  EXPECT_EQ(sync->name(), "ember::SyncBatchNorm2dImpl");
  ThreadAllReduce alone(1);
  ember::set_sync_batch_norm(*sync, std::ref(alone), 0, 1);
  const at::Tensor y = sync(x.to(at::kBFloat16));
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  expect_close(y, plain(x), 0.05, "bfloat16 input");
  // One value per channel over every rank cannot be normalised in training.
  EXPECT_THROW(sync(torch::randn({1, 3})), c10::Error);
}


// 2 ranks x batch 8 see the samples of 1 rank x batch 16 in every step (the loader deals shuffled
// sample i to rank i % 2). With sync_batchnorm they train to its weights and running statistics;
// without, each rank normalises over its own 8 samples and they do not.
TEST(SyncBatchNorm, TwoRanksTrainLikeOneProcessWithTheWholeBatch) {
  EMBER_SKIP_WITHOUT_MPI();
  TempDir single("sync_bn"), dir("sync_bn");
  write_file(single / "run.toml", kBnMlpRun);
  write_file(dir / "run.toml", kBnMlpRun);
  // The model summary (on here) names the layer SyncBatchNorm1d only where it synchronises.
  auto summary_type = [](const ProcessResult& r) {
    const std::string all = r.out + r.err;
    if (all.find("SyncBatchNorm1d") != std::string::npos) return std::string("SyncBatchNorm1d");
    return std::regex_search(all, std::regex("(^|[^c])BatchNorm1d")) ? std::string("BatchNorm1d") : std::string("none");
  };
  const auto one = run_engine_ok(single, {"run.toml", "--plugin-path", test_plugin_dir("good").string(), "--set", "data.batch_size=16",
                                          "--set", "trainer.enable_model_summary=true", "--set", "model.sync_batchnorm=true"});
  EXPECT_EQ(summary_type(one), "BatchNorm1d") << "one process does not synchronise";
  struct Case {
    std::vector<std::string> strategy;
    bool sync;
    int version;
  } cases[] = {{{"--plugins", "ddp", "--set", "ddp.timeout=30.0"}, true, 0},
               {{"--plugins", "ddp", "--set", "ddp.timeout=30.0"}, false, 1},
               {{"--plugins", "sharded", "--set", "sharded.timeout=30.0", "--set", "sharded.stage=3"}, true, 2}};
  for (const auto& c : cases) {
    std::vector<std::string> args = {"run.toml", "--plugin-path", test_plugin_dir("good").string(), "--set", "trainer.devices=2",
                                     "--set", std::string("model.sync_batchnorm=") + (c.sync ? "true" : "false"),
                                     "--set", "trainer.enable_model_summary=true"};
    args.insert(args.end(), c.strategy.begin(), c.strategy.end());
    const auto run = run_engine_ok(dir, args);
    EXPECT_EQ(summary_type(run), c.sync ? "SyncBatchNorm1d" : "BatchNorm1d") << c.strategy[1];
    const double difference = max_weight_difference(last_checkpoint(single), last_checkpoint(dir, c.version));
    if (c.sync) EXPECT_LE(difference, 1e-5) << c.strategy[1];
    else EXPECT_GT(difference, 1e-3) << c.strategy[1] << " without sync_batchnorm";
  }
}

// A Fabric program connects the layers itself, through Fabric::all_reduce. Rank 0 holds 5 of the
// 8 samples, rank 1 the other 3: the counts weigh each rank's statistics.
TEST(SyncBatchNorm, FabricProgramsConnectThemThroughAllReduce) {
  EMBER_SKIP_WITHOUT_MPI();
  const bool launched = std::getenv("EMBER_SYNC_BN_FABRIC_TEST") != nullptr;
  if (!launched) ::setenv("EMBER_SYNC_BN_FABRIC_TEST", "1", 1);
  ember::Fabric f({.accelerator = "cpu", .strategy = "ddp", .devices = 2, .plugin_config = "[ddp]\ntimeout = 30.0\n",
                   .argv = {std::filesystem::read_symlink("/proc/self/exe").string(),
                            "--gtest_filter=SyncBatchNorm.FabricProgramsConnectThemThroughAllReduce"}});
  const int code = f.launch([&](ember::Fabric& fab) {
    torch::manual_seed(3);
    const at::Tensor x = torch::randn({8, 4}) * 2 + 20, probe = torch::randn({8, 4});
    torch::nn::BatchNorm1d plain(4);
    const at::Tensor x_plain = x.clone().requires_grad_();
    const at::Tensor y_plain = plain(x_plain);
    (y_plain * probe).sum().backward();

    ember::SyncBatchNorm1d bn(4);
    ember::set_sync_batch_norm(
        *bn, [&fab](const at::Tensor& t) { return fab.all_reduce(t, ember::ReduceOp::sum); }, fab.rank(), fab.world_size());
    const int64_t begin = fab.rank() == 0 ? 0 : 5, count = fab.rank() == 0 ? 5 : 3;
    const at::Tensor mine = x.narrow(0, begin, count).clone().requires_grad_();
    const at::Tensor y = bn(mine);
    (y * probe.narrow(0, begin, count)).sum().backward();
    const std::string where = "rank " + std::to_string(fab.rank()) + ": ";
    expect_close(y, y_plain.narrow(0, begin, count), 1e-5, where + "outputs");
    expect_close(mine.grad(), x_plain.grad().narrow(0, begin, count), 1e-5, where + "input gradients");
    expect_close(bn->running_mean, plain->running_mean, 1e-5, where + "running mean");
    expect_close(bn->running_var, plain->running_var, 1e-5, where + "running variance");
  });
  if (!launched) {
    ::unsetenv("EMBER_SYNC_BN_FABRIC_TEST");
    EXPECT_EQ(code, 0) << "a rank failed (its output is above)";
  }
}
