// The loader's sampling: reproducible shuffles, equal distributed shards, workers in order.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ember/error.h>

#include <algorithm>
#include <iterator>
#include <set>

#include "data/data_loader.h"

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
    return ember::Batch{.tensors = {t}, .size = count};
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

// Exact evaluation: 10 samples on 3 ranks are 4 + 3 + 3, every sample once, and every rank still
// takes the same number of batches: the padded tail (DistributedSampler repeats samples 0 and 1
// for ranks 1 and 2) is cut from a rank's last batch, or, when it is the whole batch, loaded with
// Batch::size 0 so that it counts for nothing.
TEST(DataLoader, ExactEvaluationCountsEverySampleOnceWithEqualBatchCounts) {
  Counting data(10);
  for (int64_t bs : {2, 3}) {
    std::multiset<int64_t> seen;
    for (int64_t r = 0; r < 3; ++r) {
      LoaderOptions o;
      o.batch_size = bs;
      o.world_size = 3;
      o.rank = r;
      o.exact = true;
      EXPECT_EQ(real_samples_on_rank(10, o), r == 0 ? 4 : 3);
      DataLoader loader(data, ember::Split::train, o);
      auto pass = loader.pass(0, 0, loader.num_batches());
      std::vector<int64_t> sizes;
      ember::Batch b;
      while (pass->next(b)) {
        sizes.push_back(b.size);
        for (int64_t i = 0; i < b.size; ++i) seen.insert(b[0][i].item<int64_t>());
        if (b.size == 0) EXPECT_EQ(b[0].size(0), 1) << "a padding-only batch still holds its sample";
      }
      EXPECT_EQ(static_cast<int64_t>(sizes.size()), loader.num_batches()) << "bs " << bs << " rank " << r;
      const std::vector<int64_t> expected = bs == 2 ? std::vector<int64_t>{2, r == 0 ? 2 : 1} : std::vector<int64_t>{3, r == 0 ? 1 : 0};
      EXPECT_EQ(sizes, expected) << "bs " << bs << " rank " << r;
    }
    EXPECT_EQ(seen, (std::multiset<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9})) << "bs " << bs;
  }
  // Without it (training), the padding is served as DistributedSampler serves it.
  LoaderOptions o;
  o.batch_size = 2;
  o.world_size = 3;
  o.rank = 1;
  EXPECT_EQ(collect(DataLoader(data, ember::Split::train, o), 0), (std::vector<int64_t>{1, 4, 7, 0}));
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

namespace {
// Counting data whose sample i has a length drawn once from a seeded generator (1..512).
class CountingWithLengths final : public ember::IDataModule, public ember::ISampleLengths {
 public:
  explicit CountingWithLengths(int64_t n) : inner_(n) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
    auto t = at::randint(1, 513, {n}, gen, at::kLong);
    lengths_.assign(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
  }
  void setup(const ember::DataSetup& s) override { inner_.setup(s); }
  int64_t size(ember::Split s) const override { return inner_.size(s); }
  ember::Batch get_batch(ember::Split s, const int64_t* idx, int64_t count) const override { return inner_.get_batch(s, idx, count); }
  int64_t sample_length(ember::Split, int64_t i) const override { return lengths_.at(static_cast<size_t>(i)); }
  const std::vector<int64_t>& lengths() const { return lengths_; }

 private:
  Counting inner_;
  std::vector<int64_t> lengths_;
};

// Padded tokens of an epoch: each batch costs its size times its longest sample.
int64_t padded_tokens(const std::vector<int64_t>& order, const std::vector<int64_t>& lengths, int64_t batch) {
  int64_t total = 0;
  for (size_t b = 0; b < order.size(); b += static_cast<size_t>(batch)) {
    int64_t longest = 0, count = 0;
    for (size_t i = b; i < std::min(order.size(), b + static_cast<size_t>(batch)); ++i, ++count)
      longest = std::max(longest, lengths[static_cast<size_t>(order[i])]);
    total += longest * count;
  }
  return total;
}
}  // namespace

// data.group_by_length: Hugging Face's LengthGroupedSampler rule, every sample once, reproducible.
TEST(DataLoader, GroupByLengthSortsMegaBatchesLongestFirst) {
  CountingWithLengths data(1000);
  const auto& len = data.lengths();
  LoaderOptions o;
  o.batch_size = 8;
  o.shuffle = true;
  o.seed = 5;
  o.group_by_length = true;
  DataLoader loader(data, ember::Split::train, o, &data);
  const auto order = collect(loader, 3);
  ASSERT_EQ(order.size(), 1000u);
  EXPECT_EQ(std::set<int64_t>(order.begin(), order.end()).size(), 1000u);
  EXPECT_EQ(order, collect(loader, 3));
  EXPECT_NE(order, collect(loader, 4));
  // The longest sample of the epoch comes first.
  EXPECT_EQ(len[static_cast<size_t>(order[0])], *std::max_element(len.begin(), len.end()));
  // Mega-batches of min(1000 / (8 * 4), 50) = 31 batches = 248 samples, each sorted longest first,
  // but for the two places the swap touched: position 0 and the head of the longest's mega-batch.
  const size_t mega = 248;
  int64_t unsorted = 0;
  for (size_t begin = 0; begin < order.size(); begin += mega) {
    for (size_t i = std::max<size_t>(begin, 1) + 1; i < std::min(order.size(), begin + mega); ++i)
      unsorted += len[static_cast<size_t>(order[i - 1])] < len[static_cast<size_t>(order[i])];
  }
  EXPECT_LE(unsorted, 1);
  // Each mega-batch holds the samples of the same stretch of the shuffled order: grouping reorders
  // within a stretch, never across stretches (but for the one swapped sample).
  o.group_by_length = false;
  const auto shuffled = epoch_indices(1000, o, 3);
  for (size_t begin = mega; begin < order.size(); begin += mega) {
    const size_t end = std::min(order.size(), begin + mega);
    std::multiset<int64_t> a(order.begin() + begin, order.begin() + end), b(shuffled.begin() + begin, shuffled.begin() + end);
    if (a != b) {  // the stretch that gave up its head to the front
      std::vector<int64_t> only;
      std::set_symmetric_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(only));
      EXPECT_EQ(only.size(), 2u) << "stretch at " << begin;
    }
  }
  // The point of it: far less padding than the plain shuffled order.
  EXPECT_LT(padded_tokens(order, len, 8) * 10, padded_tokens(shuffled, len, 8) * 7);
}

TEST(DataLoader, GroupByLengthAcrossRanksKeepsEachStepsBatchesAlike) {
  CountingWithLengths data(1000);
  const auto& len = data.lengths();
  LoaderOptions o;
  o.batch_size = 8;
  o.shuffle = true;
  o.world_size = 2;
  o.group_by_length = true;
  std::vector<std::vector<int64_t>> ranks;
  std::set<int64_t> seen;
  for (int64_t r = 0; r < 2; ++r) {
    o.rank = r;
    ranks.push_back(epoch_indices(1000, o, 1, len));
    EXPECT_EQ(ranks.back().size(), 500u);
    seen.insert(ranks.back().begin(), ranks.back().end());
  }
  EXPECT_EQ(seen.size(), 1000u);
  // Rank 0's and rank 1's k-th batches come from the same 16 neighbours in the grouped order, so a
  // step pads alike on both ranks: their longest samples differ little (lengths are 1..512).
  int64_t worst = 0;
  for (size_t b = 8; b < 500; b += 8) {  // past the first batch, which holds the swapped longest sample
    int64_t l0 = 0, l1 = 0;
    for (size_t i = b; i < std::min<size_t>(500, b + 8); ++i) {
      l0 = std::max(l0, len[static_cast<size_t>(ranks[0][i])]);
      l1 = std::max(l1, len[static_cast<size_t>(ranks[1][i])]);
    }
    worst = std::max(worst, std::abs(l0 - l1));
  }
  EXPECT_LT(worst, 64);
  EXPECT_THROW(epoch_indices(1000, o, 1, std::vector<int64_t>(999, 1)), ember::RunError);
}

// Grouped data (ember::ISampleGroups, e.g. tar shards): the epoch is one sequence whatever the
// number of ranks: the groups in a seeded permutation, shuffle_groups of them shuffled together,
// rank r taking the r-th contiguous part (the tail padded with the start, or dropped).
TEST(DataLoader, GroupedDataIsOneSequenceOnAnyNumberOfRanks) {
  // Groups of 4, 3, 5, 2 and 6 samples, their ids not in index order.
  const std::vector<int64_t> sizes = {4, 3, 5, 2, 6}, ids = {30, 10, 40, 20, 0};
  std::vector<int64_t> groups;
  for (size_t g = 0; g < sizes.size(); ++g) groups.insert(groups.end(), static_cast<size_t>(sizes[g]), ids[g]);
  const int64_t n = static_cast<int64_t>(groups.size());
  LoaderOptions o;
  o.shuffle = true;
  o.seed = 3;
  o.shuffle_groups = 2;
  o.batch_size = 4;
  const auto one = epoch_indices(n, o, 0, {}, groups);
  ASSERT_EQ(static_cast<int64_t>(one.size()), n);
  EXPECT_EQ(std::set<int64_t>(one.begin(), one.end()).size(), static_cast<size_t>(n));
  EXPECT_EQ(one, epoch_indices(n, o, 0, {}, groups)) << "reproducible";
  EXPECT_NE(one, epoch_indices(n, o, 1, {}, groups)) << "each epoch its own order";
  // Between a group's first and last sample there are samples of two groups at most (its window).
  for (int64_t id : ids) {
    size_t first = one.size(), last = 0;
    for (size_t k = 0; k < one.size(); ++k)
      if (groups[static_cast<size_t>(one[k])] == id) first = std::min(first, k), last = k;
    std::set<int64_t> seen;
    for (size_t k = first; k <= last; ++k) seen.insert(groups[static_cast<size_t>(one[k])]);
    EXPECT_LE(seen.size(), 2u) << "group " << id;
  }
  // shuffle_groups = 1: every group's samples are contiguous.
  LoaderOptions single = o;
  single.shuffle_groups = 1;
  const auto whole = epoch_indices(n, single, 0, {}, groups);
  for (size_t k = 1; k < whole.size(); ++k)
    if (groups[static_cast<size_t>(whole[k])] != groups[static_cast<size_t>(whole[k - 1])])
      for (size_t j = k + 1; j < whole.size(); ++j) EXPECT_NE(groups[static_cast<size_t>(whole[j])], groups[static_cast<size_t>(whole[k - 1])]);
  for (bool drop_last : {false, true})
    for (int64_t world : {2, 3}) {
      std::vector<int64_t> joined;
      int64_t real = 0;
      for (int64_t rank = 0; rank < world; ++rank) {
        LoaderOptions r = o;
        r.world_size = world;
        r.rank = rank;
        r.drop_last = drop_last;
        const auto part = epoch_indices(n, r, 0, {}, groups);
        EXPECT_EQ(static_cast<int64_t>(part.size()), drop_last ? n / world : (n + world - 1) / world);
        joined.insert(joined.end(), part.begin(), part.end());
        real += real_samples_on_rank(n, r, /*contiguous=*/true);
        // The real samples of a rank are the start of its part.
        const int64_t mine = real_samples_on_rank(n, r, true);
        for (int64_t k = 0; k < mine; ++k) EXPECT_EQ(part[static_cast<size_t>(k)], one[static_cast<size_t>(rank * static_cast<int64_t>(part.size()) + k)]);
      }
      EXPECT_EQ(real, drop_last ? (n / world) * world : n) << world;
      for (size_t k = 0; k < joined.size(); ++k) EXPECT_EQ(joined[k], one[k % one.size()]) << "world " << world << " position " << k;
    }
  // Unshuffled: the index order, cut in contiguous parts.
  LoaderOptions plain = o;
  plain.shuffle = false;
  plain.world_size = 2;
  plain.rank = 1;
  const auto second = epoch_indices(n, plain, 0, {}, groups);
  ASSERT_EQ(second.size(), 10u);
  for (int64_t k = 0; k < 10; ++k) EXPECT_EQ(second[static_cast<size_t>(k)], 10 + k);
}
