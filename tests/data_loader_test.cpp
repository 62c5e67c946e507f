// The loader's sampling: reproducible shuffles, equal distributed shards, workers in order.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <set>

#include "data_loader.h"

using namespace ember::engine;

namespace {
// Data whose sample i is the number i, to see exactly which samples a batch holds.
class Counting final : public ember::IDataModule {
 public:
  explicit Counting(int64_t n) : n_(n) {}
  void setup(const ember::DataSetup&) override {}
  int64_t size(ember::Split s) const override { return s == ember::Split::train ? n_ : 0; }
  ember::Batch get_batch(ember::Split, const int64_t* idx, int64_t count) const override {
    auto t = at::empty({count}, at::kLong);
    for (int64_t i = 0; i < count; ++i) t[i] = idx[i];
    return ember::Batch{{t}, count};
  }

 private:
  int64_t n_;
};

std::vector<int64_t> collect(const DataLoader& loader, int64_t epoch, int64_t first = 0, int64_t count = 1 << 30) {
  std::vector<int64_t> out;
  auto pass = loader.pass(epoch, first, count);
  ember::Batch b;
  while (pass->next(b))
    for (int64_t i = 0; i < b.size; ++i) out.push_back(b[0][i].item<int64_t>());
  return out;
}
}  // namespace

TEST(DataLoader, ShuffleDependsOnSeedAndEpochOnly) {
  LoaderOptions o;
  o.shuffle = true;
  o.seed = 3;
  auto a = epoch_indices(100, o, 0), b = epoch_indices(100, o, 0), c = epoch_indices(100, o, 1);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_EQ(std::set<int64_t>(a.begin(), a.end()).size(), 100u);
}

TEST(DataLoader, DistributedShardsAreEqualAndCoverEverything) {
  LoaderOptions o;
  o.shuffle = true;
  o.world_size = 3;
  std::set<int64_t> seen;
  for (int64_t r = 0; r < 3; ++r) {
    o.rank = r;
    auto mine = epoch_indices(10, o, 2);
    EXPECT_EQ(mine.size(), 4u);  // ceil(10 / 3), padded like DistributedSampler
    seen.insert(mine.begin(), mine.end());
  }
  EXPECT_EQ(seen.size(), 10u);
  o.drop_last = true;
  o.rank = 0;
  EXPECT_EQ(epoch_indices(10, o, 2).size(), 3u);
}

TEST(DataLoader, BatchesDropLastAndResumeOffset) {
  Counting data(10);
  LoaderOptions o;
  o.batch_size = 4;
  DataLoader keep(data, ember::Split::train, o);
  EXPECT_EQ(keep.num_batches(), 3);
  EXPECT_EQ(collect(keep, 0), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(collect(keep, 0, 1), (std::vector<int64_t>{4, 5, 6, 7, 8, 9}));  // skip one batch
  o.drop_last = true;
  DataLoader drop(data, ember::Split::train, o);
  EXPECT_EQ(drop.num_batches(), 2);
  EXPECT_EQ(collect(drop, 0).size(), 8u);
}

TEST(DataLoader, WorkersDeliverTheSameBatchesInOrder) {
  Counting data(1000);
  LoaderOptions o;
  o.batch_size = 7;
  o.shuffle = true;
  DataLoader sync(data, ember::Split::train, o);
  o.num_workers = 3;
  DataLoader threaded(data, ember::Split::train, o);
  EXPECT_EQ(collect(sync, 5), collect(threaded, 5));
  EXPECT_EQ(collect(sync, 5, 10, 20), collect(threaded, 5, 10, 20));
}
