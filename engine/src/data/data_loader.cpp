#include "data/data_loader.h"

#include "common/sized_struct.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ember/error.h>

#include <algorithm>
#include <map>
#include <numeric>

namespace ember::engine {

namespace {
// Hugging Face's LengthGroupedSampler (transformers' get_length_grouped_indices), so that a run
// batches as a transformers Trainer with group_by_length does: the epoch's order is cut into
// mega-batches of up to 50 batches (of all ranks together), each is sorted longest first (stable,
// so equal lengths keep the shuffled order), and the longest sample of the epoch is swapped to the
// front so that a batch too large for memory fails in the first step, not hours in.
void group_by_length(std::vector<int64_t>& order, const std::vector<int64_t>& lengths, int64_t batch) {
  const auto n = static_cast<int64_t>(order.size());
  if (n == 0) return;
  const int64_t mult = std::max<int64_t>(1, std::min<int64_t>(n / (batch * 4), 50));
  const int64_t mega = mult * batch;
  auto length = [&](int64_t i) { return lengths[static_cast<size_t>(i)]; };
  size_t longest_at = 0;
  for (int64_t begin = 0; begin < n; begin += mega) {
    auto first = order.begin() + begin, last = order.begin() + std::min(n, begin + mega);
    std::stable_sort(first, last, [&](int64_t a, int64_t b) { return length(a) > length(b); });
    if (length(*first) > length(order[longest_at])) longest_at = static_cast<size_t>(begin);
  }
  std::swap(order[0], order[longest_at]);
}

// Grouped data (ISampleGroups, e.g. tar shards): the epoch is a sequence that does not depend on
// the number of ranks. Shuffled: the groups in a permutation seeded by (seed, epoch), taken
// shuffle_groups at a time, the samples of each such window permuted together (an exact shuffle
// buffer); otherwise the index order. Rank r takes the r-th contiguous part (padded by repeating
// the start, or the tail dropped, as DistributedSampler does), so it reads few groups.
std::vector<int64_t> grouped_epoch_indices(int64_t n, const LoaderOptions& o, int64_t epoch, const std::vector<int64_t>& groups) {
  if (static_cast<int64_t>(groups.size()) != n)
    throw RunError("data loader: " + std::to_string(groups.size()) + " sample groups for " + std::to_string(n) + " samples (an engine bug)");
  std::vector<int64_t> order;
  order.reserve(static_cast<size_t>(n));
  if (o.shuffle) {
    // Members of each group in index order, groups in the order of their ids.
    std::map<int64_t, std::vector<int64_t>> members;
    for (int64_t i = 0; i < n; ++i) members[groups[static_cast<size_t>(i)]].push_back(i);
    std::vector<const std::vector<int64_t>*> list;
    for (const auto& [id, m] : members) list.push_back(&m);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed * 1000003ull + static_cast<uint64_t>(epoch) + 1);
    const auto g = static_cast<int64_t>(list.size());
    const at::Tensor group_perm = at::randperm(g, gen, at::TensorOptions().dtype(at::kLong));
    const int64_t window = std::max<int64_t>(1, o.shuffle_groups);
    std::vector<int64_t> pool;
    for (int64_t begin = 0; begin < g; begin += window) {
      pool.clear();
      for (int64_t k = begin; k < std::min(g, begin + window); ++k) {
        const auto& m = *list[static_cast<size_t>(group_perm[k].item<int64_t>())];
        pool.insert(pool.end(), m.begin(), m.end());
      }
      const at::Tensor perm = at::randperm(static_cast<int64_t>(pool.size()), gen, at::TensorOptions().dtype(at::kLong));
      const int64_t* p = perm.data_ptr<int64_t>();
      for (size_t k = 0; k < pool.size(); ++k) order.push_back(pool[static_cast<size_t>(p[k])]);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) order.push_back(i);
  }
  if (o.world_size <= 1) return order;
  const int64_t per_rank = o.drop_last ? n / o.world_size : (n + o.world_size - 1) / o.world_size;
  const int64_t total = per_rank * o.world_size;
  for (int64_t i = n; i < total; ++i) order.push_back(order[static_cast<size_t>((i - n) % std::max<int64_t>(n, 1))]);
  const auto first = order.begin() + o.rank * per_rank;
  return std::vector<int64_t>(first, first + per_rank);
}
}  // namespace

std::vector<int64_t> epoch_indices(int64_t n, const LoaderOptions& o, int64_t epoch, const std::vector<int64_t>& lengths,
                                   const std::vector<int64_t>& groups) {
  if (!groups.empty()) return grouped_epoch_indices(n, o, epoch, groups);
  std::vector<int64_t> order(static_cast<size_t>(n));
  if (o.shuffle) {
    // A generator of its own, seeded by (seed, epoch): resuming at epoch k replays epoch k's order.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed * 1000003ull + static_cast<uint64_t>(epoch) + 1);
    auto perm = at::randperm(n, gen, at::TensorOptions().dtype(at::kLong));
    std::copy_n(perm.data_ptr<int64_t>(), n, order.begin());
  } else {
    std::iota(order.begin(), order.end(), 0);
  }
  if (o.group_by_length) {
    if (static_cast<int64_t>(lengths.size()) != n)
      throw RunError("data loader: " + std::to_string(lengths.size()) + " sample lengths for " + std::to_string(n) +
                     " samples (an engine bug)");
    // Ranks take every world_size-th sample below, so a mega-batch spans the batches of all ranks:
    // each rank's batch k then holds neighbours in length, and so do the ranks' batches of a step.
    group_by_length(order, lengths, o.batch_size * std::max<int64_t>(o.world_size, 1));
  }
  if (o.world_size <= 1) return order;
  // DistributedSampler's rule: pad by repeating the start so every rank gets the same count
  // (or drop the tail with drop_last), then take every world_size-th sample from rank.
  int64_t per_rank = o.drop_last ? n / o.world_size : (n + o.world_size - 1) / o.world_size;
  int64_t total = per_rank * o.world_size;
  for (int64_t i = n; i < total; ++i) order.push_back(order[static_cast<size_t>((i - n) % std::max<int64_t>(n, 1))]);
  order.resize(static_cast<size_t>(total));
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(per_rank));
  for (int64_t i = o.rank; i < total; i += o.world_size) mine.push_back(order[static_cast<size_t>(i)]);
  return mine;
}

int64_t real_samples_on_rank(int64_t n, const LoaderOptions& o, bool contiguous) {
  if (o.world_size <= 1) return n;
  if (o.drop_last) return n / o.world_size;
  if (contiguous) {  // positions rank * per_rank ... below n are real
    const int64_t per_rank = (n + o.world_size - 1) / o.world_size;
    return std::clamp<int64_t>(n - o.rank * per_rank, 0, per_rank);
  }
  // Positions rank, rank + W, ... below n are real; those at n and beyond repeat the start.
  return n > o.rank ? (n - o.rank + o.world_size - 1) / o.world_size : 0;
}

DataLoader::DataLoader(const IDataModule& data, Split split, LoaderOptions options, const ISampleLengths* lengths,
                       const ISampleGroups* groups)
    : data_(data), split_(split), options_(options), size_(data.size(split)) {
  if (groups != nullptr) {
    groups_.resize(static_cast<size_t>(size_));
    for (int64_t i = 0; i < size_; ++i) groups_[static_cast<size_t>(i)] = groups->sample_group(split, i);
  }
  if (!options_.group_by_length) return;
  if (lengths == nullptr) throw RunError("data loader: group_by_length without the data module's sample lengths (an engine bug)");
  lengths_.resize(static_cast<size_t>(size_));
  for (int64_t i = 0; i < size_; ++i) lengths_[static_cast<size_t>(i)] = lengths->sample_length(split, i);
}

int64_t DataLoader::num_batches() const {
  int64_t n = size_;
  if (options_.world_size > 1)
    n = options_.drop_last ? n / options_.world_size : (n + options_.world_size - 1) / options_.world_size;
  return options_.drop_last ? n / options_.batch_size : (n + options_.batch_size - 1) / options_.batch_size;
}

std::unique_ptr<DataLoader::Pass> DataLoader::pass(int64_t epoch, int64_t first, int64_t count) const {
  return std::make_unique<Pass>(*this, epoch, first, count);
}

DataLoader::Pass::Pass(const DataLoader& loader, int64_t epoch, int64_t first, int64_t count)
    : loader_(loader),
      indices_(epoch_indices(loader.size_, loader.options_, epoch, loader.lengths_, loader.groups_)),
      real_(loader.options_.exact ? real_samples_on_rank(loader.size_, loader.options_, !loader.groups_.empty())
                                  : static_cast<int64_t>(indices_.size())) {
  int64_t total = loader.num_batches();
  next_ = std::min(first, total);
  end_ = std::min(total, next_ + std::max<int64_t>(count, 0));
  next_to_load_ = next_;
  for (int64_t i = 0; i < loader.options_.num_workers && next_ < end_; ++i) threads_.emplace_back([this] { worker(); });
}

DataLoader::Pass::~Pass() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

Batch DataLoader::Pass::load(int64_t batch) const {
  int64_t bs = loader_.options_.batch_size;
  int64_t begin = batch * bs;
  int64_t count = std::min<int64_t>(bs, static_cast<int64_t>(indices_.size()) - begin);
  // Exact evaluation: the padded tail is left out; a batch of padding only still runs (every rank
  // takes the same steps) but holds no sample that counts.
  const int64_t real = std::clamp<int64_t>(real_ - begin, 0, count);
  if (real > 0) count = real;
  Batch b = loader_.data_.get_batch(loader_.split_, indices_.data() + begin, count);
  require_sdk2_fields(b, &Batch::size, "a Batch");
  if (b.size == 0) b.size = count;
  if (real == 0) b.size = 0;
  return b;
}

void DataLoader::Pass::worker() {
  const int64_t window = std::max<int64_t>(1, loader_.options_.num_workers * loader_.options_.prefetch_factor);
  while (true) {
    int64_t mine;
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || next_to_load_ >= end_ || next_to_load_ < next_ + window; });
      if (stopping_ || next_to_load_ >= end_ || error_) return;
      mine = next_to_load_++;
    }
    try {
      Batch b = load(mine);
      std::lock_guard lock(mutex_);
      ready_.emplace(mine, std::move(b));
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
    cv_.notify_all();
  }
}

bool DataLoader::Pass::next(Batch& out) {
  if (next_ >= end_) return false;
  if (threads_.empty()) {
    out = load(next_++);
    return true;
  }
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return error_ || ready_.count(next_) > 0; });
  if (error_) std::rethrow_exception(error_);
  auto it = ready_.find(next_);
  out = std::move(it->second);
  ready_.erase(it);
  ++next_;
  lock.unlock();
  cv_.notify_all();
  return true;
}

}  // namespace ember::engine
