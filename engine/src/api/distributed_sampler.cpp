// ember::DistributedSampler (engine/include/ember/fabric.h): torch.utils.data.DistributedSampler's
// rules, so a rank's share is the one PyTorch would give it for the same seed and epoch.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ember/error.h>
#include <ember/fabric.h>

namespace ember {

DistributedSampler::DistributedSampler(int64_t size, int64_t num_replicas, int64_t rank, bool shuffle, uint64_t seed,
                                       bool drop_last)
    : size_(size), num_replicas_(num_replicas), rank_(rank), shuffle_(shuffle), seed_(seed), drop_last_(drop_last) {
  if (size < 0) throw ConfigError("DistributedSampler: size = " + std::to_string(size) + " must be >= 0");
  if (num_replicas < 1 || rank < 0 || rank >= num_replicas)
    throw ConfigError("DistributedSampler: rank " + std::to_string(rank) + " is not one of " + std::to_string(num_replicas) + " replicas");
  // PyTorch: with drop_last the tail that does not split evenly goes (ceil((size - R) / R), which
  // is floor(size / R) then); otherwise ceil(size / R) per rank, the first indices repeating.
  num_samples_ = drop_last_ ? size_ / num_replicas_ : (size_ + num_replicas_ - 1) / num_replicas_;
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> all;
  if (shuffle_) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed_ + static_cast<uint64_t>(epoch_));
    auto perm = at::randperm(size_, gen, at::TensorOptions().dtype(at::kLong));
    const int64_t* p = perm.data_ptr<int64_t>();
    all.assign(p, p + size_);
  } else {
    all.resize(static_cast<size_t>(size_));
    for (int64_t i = 0; i < size_; ++i) all[static_cast<size_t>(i)] = i;
  }
  const auto total = static_cast<size_t>(total_size());
  if (all.size() < total && !all.empty()) {
    const size_t n = all.size();
    for (size_t i = 0; all.size() < total; ++i) all.push_back(all[i % n]);
  }
  all.resize(std::min(all.size(), total));
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(num_samples_));
  for (size_t i = static_cast<size_t>(rank_); i < all.size(); i += static_cast<size_t>(num_replicas_)) mine.push_back(all[i]);
  return mine;
}

}  // namespace ember
