// Gradient all-reduce in buckets that start while backward is still running (what PyTorch's
// DDP Reducer does): a post-hook on every parameter's AccumulateGrad node marks its gradient
// ready; when every gradient of a bucket is ready the bucket is flattened and its asynchronous
// all-reduce starts. Buckets start in a fixed order on every rank (the collective order must
// match), and finish() waits for them and writes the averaged gradients back.
#pragma once
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ember_ddp {

struct BucketStats {
  int64_t syncs = 0;           // backward passes that synchronized gradients
  int64_t all_reduces = 0;     // bucket all-reduces started
  int64_t started_early = 0;   // ... while some gradient of the model was not computed yet
  int64_t buckets = 0;
};

class GradBuckets {
 public:
  // `label` names the next collective for error messages (may be empty). `names[i]` is params[i]'s
  // name. find_unused (PyTorch DDP's find_unused_parameters): a parameter that got no gradient on
  // any rank keeps no gradient (each bucket carries a used-mask, read back after the reduction);
  // without it, a parameter without a gradient on this rank fails the step with a line naming it.
  GradBuckets(std::vector<at::Tensor> params, std::vector<std::string> names, int64_t bucket_cap_bytes,
              c10::intrusive_ptr<c10d::Backend> backend, int world_size, bool find_unused, std::function<void(std::string)> label);
  // Before backward. sync = false: gradients accumulate locally, nothing is communicated.
  void begin(bool sync);
  // After backward of a synchronizing micro-batch: starts what is left (buckets holding
  // parameters that got no gradient), waits, and leaves every rank with the mean gradient.
  void finish();
  // After a failed backward: forget the half-done sync.
  void abandon();
  const BucketStats& stats() const { return stats_; }

 private:
  struct Bucket {
    std::vector<size_t> params;
    int64_t numel = 0;
    size_t pending = 0;
    bool ready = false, launched = false;
    at::Tensor flat;
    c10::intrusive_ptr<c10d::Work> work;
  };
  void build();
  void hook_trained();
  void on_ready(size_t param);
  void launch(size_t bucket);

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  bool find_unused_ = false;
  std::vector<size_t> missing_;  // parameters without a gradient on this rank in this sync
  int64_t cap_bytes_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  int world_;
  std::function<void(std::string)> label_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;
  std::vector<bool> ready_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // keeps the hooked nodes alive
  size_t next_ = 0, pending_params_ = 0;
  bool built_ = false, syncing_ = false;
  BucketStats stats_;
};

}  // namespace ember_ddp
