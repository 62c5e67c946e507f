// trainer.cuda_graph's bookkeeping (engine/src/loop/step_graph.h) that runs without a GPU: when a step
// warms up, is captured or replayed, which batches a replay can take, and that loading a batch
// keeps the static tensors the graph reads. The capture and replay themselves run on a GPU
// (tests/gpu_paths.sh: cuda_graph, cuda_graph_16-mixed).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "loop/step_graph.h"

using ember::Batch;
using ember::engine::StepGraph;

namespace {
Batch make_batch(int64_t n, at::ScalarType dtype = at::kFloat) {
  Batch b;
  b.tensors = {at::randn({n, 1, 4, 4}).to(dtype), at::randint(0, 10, {n}, at::kLong)};
  b.size = n;
  return b;
}
}  // namespace

TEST(StepGraph, WarmsUpThenAsksForOneCapture) {
  StepGraph g(c10::Device(c10::kCPU), 2);
  const Batch b = make_batch(8);
  EXPECT_EQ(g.mode_for(b), StepGraph::Mode::eager);
  g.count_eager();
  EXPECT_EQ(g.mode_for(b), StepGraph::Mode::eager);
  g.count_eager();
  EXPECT_EQ(g.mode_for(b), StepGraph::Mode::capture);
  EXPECT_EQ(g.mode_for(make_batch(3)), StepGraph::Mode::capture) << "not captured yet: any batch may be the captured one";
  EXPECT_FALSE(g.captured());
  EXPECT_EQ(g.eager_steps(), 2);
}

TEST(StepGraph, ReplaysTakeOnlyBatchesOfTheCapturedLayout) {
  const Batch b = make_batch(8);
  EXPECT_TRUE(StepGraph::same_layout(make_batch(8), b));
  EXPECT_FALSE(StepGraph::same_layout(make_batch(5), b)) << "an epoch's smaller last batch";
  EXPECT_FALSE(StepGraph::same_layout(make_batch(8, at::kDouble), b));
  Batch wide = make_batch(8);
  wide.tensors[0] = at::randn({8, 2, 4, 4}).contiguous(at::MemoryFormat::ChannelsLast);
  Batch captured_wide = make_batch(8);
  captured_wide.tensors[0] = at::randn({8, 2, 4, 4});
  EXPECT_TRUE(StepGraph::same_layout(wide, captured_wide)) << "another memory format is copied into the captured one";
  captured_wide.tensors[0] = at::randn({8, 3, 4, 4});
  EXPECT_FALSE(StepGraph::same_layout(wide, captured_wide));
  Batch fewer = b;
  fewer.tensors.pop_back();
  EXPECT_FALSE(StepGraph::same_layout(fewer, b));
  Batch other_count = make_batch(8);
  other_count.size = 7;
  EXPECT_FALSE(StepGraph::same_layout(other_count, b));
}

TEST(StepGraph, LoadingABatchWritesIntoTheSameStaticTensors) {
  StepGraph g(c10::Device(c10::kCPU), 1);
  const Batch first = make_batch(8), second = make_batch(8);
  g.load(first);
  ASSERT_EQ(g.batch().tensors.size(), 2u);
  const void* inputs = g.batch().tensors[0].data_ptr();
  EXPECT_NE(inputs, first.tensors[0].data_ptr()) << "a copy: the data loader may reuse its batch";
  EXPECT_TRUE(at::equal(g.batch().tensors[0], first.tensors[0]));
  g.load(second);
  EXPECT_EQ(g.batch().tensors[0].data_ptr(), inputs) << "the graph reads this memory";
  EXPECT_TRUE(at::equal(g.batch().tensors[0], second.tensors[0]));
  EXPECT_TRUE(at::equal(g.batch().tensors[1], second.tensors[1]));
  EXPECT_EQ(g.batch().size, 8);
  Batch channels_last = make_batch(8);
  channels_last.tensors[0] = at::randn({8, 1, 4, 4}).contiguous(at::MemoryFormat::ChannelsLast);
  g.load(channels_last);
  EXPECT_EQ(g.batch().tensors[0].data_ptr(), inputs);
  EXPECT_TRUE(at::equal(g.batch().tensors[0], channels_last.tensors[0]));
}
