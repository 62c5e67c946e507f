// Runs a batch through a model cut into pipeline stages (ember/pipeline.h) on one rank of the
// mesh's pipeline dimension: splits the batch into micro-batches, walks this rank's actions of the
// schedule (pipeline_schedule.h), sends each stage's output to the next stage's rank and each
// input's gradient back, and makes the run look like one model (the batch loss, and the values
// the last stage logs, reach every stage). A strategy owns one and calls it for every batch.
#pragma once
#include <ember/model.h>
#include <ember/pipeline.h>

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "ember/distributed/device_mesh.h"
#include "ember/distributed/pipeline_schedule.h"

namespace ember_dist {

class PipelineRunner {
 public:
  // `stages`: every stage's units (ranks x virtual_stages of them, in order); this rank holds
  // stages c * ranks + group.rank().
  PipelineRunner(MeshGroup& group, PipelineScheduleKind kind, int64_t microbatches, std::vector<ember::UnitRange> stages);

  // This rank's stages, in order.
  std::vector<ember::UnitRange> my_stages() const;
  const std::vector<ember::UnitRange>& all_stages() const { return stages_; }
  int64_t microbatches() const { return microbatches_; }
  PipelineScheduleKind kind() const { return kind_; }
  // "stages [layer1..layer2] [layer3..layer4]; 1f1b over 4 micro-batches" for the log.
  std::string describe(const std::function<std::string(int64_t)>& unit_name) const;

  // Training: forward and backward of every micro-batch on the schedule. `backward_loss(loss)`
  // runs the backward of the last stage's (already weighted) micro-batch loss (the precision
  // handler scales it); the other stages' backwards run here. Returns the batch loss (the
  // micro-batches' losses weighted by their sizes) on every rank of the group.
  at::Tensor train(const ember::Batch& batch, ember::IPipelineModel& model, ember::IStepContext& ctx,
                   const std::function<void(const at::Tensor&)>& backward_loss);
  // Where the training batches' time went on this rank: waiting for another stage's message (the
  // measured bubble, with the transfers) against the whole schedule.
  struct Stats {
    int64_t batches = 0;
    double seconds = 0, waiting = 0;
  };
  const Stats& stats() const { return stats_; }
  // Forward only (no_grad is the caller's): evaluation, or a tuner's forward pass.
  at::Tensor evaluate(const ember::Batch& batch, ember::IPipelineModel& model, ember::IStepContext& ctx);

 private:
  struct Logged;
  class RecordingContext;
  int64_t microbatches_for(int64_t batch_size) const;
  const std::vector<std::vector<PipelineAction>>& schedule_for(int64_t microbatches);
  std::vector<ember::Batch> split(const ember::Batch& batch) const;
  int64_t rank_of(int64_t stage) const { return stage % group_.size(); }
  int tag(bool gradient, int64_t stage, int64_t microbatch, int part) const;
  void send_activation(const at::Tensor& t, int64_t stage, int64_t microbatch);
  at::Tensor recv_activation(int64_t stage, int64_t microbatch, const c10::Device& device);
  // The last stage's logs and loss to every stage; replays the logs into `ctx` off the last stage.
  at::Tensor finish(const std::vector<Logged>& logged, at::Tensor loss, bool has_loss, ember::IStepContext& ctx);

  MeshGroup& group_;
  PipelineScheduleKind kind_;
  int64_t microbatches_;
  std::vector<ember::UnitRange> stages_;
  std::map<int64_t, std::vector<std::vector<PipelineAction>>> schedules_;  // by micro-batch count
  Stats stats_;
  double* waiting_ = nullptr;  // where receives add their wait (training only)
};

}  // namespace ember_dist
