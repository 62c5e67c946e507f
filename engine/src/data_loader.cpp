#include "data_loader.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <numeric>

namespace ember::engine {

std::vector<int64_t> epoch_indices(int64_t n, const LoaderOptions& o, int64_t epoch) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  if (o.shuffle) {
    // A generator of its own, seeded by (seed, epoch): resuming at epoch k replays epoch k's order.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed * 1000003ull + static_cast<uint64_t>(epoch) + 1);
    auto perm = at::randperm(n, gen, at::TensorOptions().dtype(at::kLong));
    std::copy_n(perm.data_ptr<int64_t>(), n, order.begin());
  } else {
    std::iota(order.begin(), order.end(), 0);
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

DataLoader::DataLoader(const IDataModule& data, Split split, LoaderOptions options)
    : data_(data), split_(split), options_(options), size_(data.size(split)) {}

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
    : loader_(loader), indices_(epoch_indices(loader.size_, loader.options_, epoch)) {
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
  Batch b = loader_.data_.get_batch(loader_.split_, indices_.data() + begin, count);
  if (b.size == 0) b.size = count;
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
