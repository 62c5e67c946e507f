// Activation checkpointing on the GPT-2 124M shape (12 layers x 12 heads x 768 wide, vocabulary
// 50,304, context 1,024; models/gpt): the memory a training forward holds for backward and the
// step time, for trainer.activation_checkpointing = none, full and selective, side by side.
//   bench_activation_memory [batch=1] [seq=1024] [steps=2]
// Memory: the heap in use (glibc mallinfo2: arena + mmapped blocks) after the loss is computed,
// minus before the forward: what the autograd graph keeps (activations, and for the loss either the
// whole logits' log-softmax, or with gpt's chunked loss the output layer's gradients made in its
// forward). Time: forward + backward per step, the mean of `steps` steps after one warm-up.
#include <malloc.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <ember/support/linear_cross_entropy.h>

#include "gpt_net.h"

namespace {

double heap_mb() {
  const struct mallinfo2 m = mallinfo2();
  return static_cast<double>(m.uordblks + m.hblkhd) / (1024.0 * 1024.0);
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t batch = argc > 1 ? std::atoll(argv[1]) : 1;
  const int64_t seq = argc > 2 ? std::atoll(argv[2]) : 1024;
  const int steps = argc > 3 ? std::atoi(argv[3]) : 2;
  ember_gpt::GptShape shape;
  shape.vocab_size = 50304;
  shape.context_length = 1024;
  shape.layers = 12;
  shape.heads = 12;
  shape.kv_heads = 12;
  shape.width = 768;
  shape.ff_width = 4 * 768;
  const char* names[] = {"none", "full", "selective"};
  // Whole logits: backward needs their float32 log-softmax (the logits themselves are freed).
  const double log_softmax_mb = static_cast<double>(batch * seq * shape.vocab_size) * 4.0 / (1024.0 * 1024.0);
  std::printf("GPT-2 124M shape, batch %lld x %lld tokens, %d threads; the whole logits' log-softmax: %.0f MB\n", static_cast<long long>(batch),
              static_cast<long long>(seq), at::get_num_threads(), log_softmax_mb);
  std::printf("| loss | activation_checkpointing | held for backward (MB) | vs none, same loss | vs none, whole logits | s/step | vs none, whole logits |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  double whole_none_mb = 0, whole_none_s = 0;
  // The loss as gpt trains: whole logits then cross-entropy (model.chunked_loss = false), or
  // ember::linear_cross_entropy over row slices (the default).
  for (const bool chunked : {false, true}) {
    double none_mb = 0;
    for (int mode = 0; mode < 3; ++mode) {
      torch::manual_seed(0);
      ember_gpt::GptNet net(shape);
      ember::ModelUnits units;
      net.declare_units(units);
      units.set_checkpointing(mode == 1 ? ember::ActivationCheckpointing::full : ember::ActivationCheckpointing::none);
      net.set_selective_checkpointing(mode == 2);
      net.train();
      const at::Tensor ids = at::randint(0, shape.vocab_size, {batch, seq}, at::kLong);
      const at::Tensor targets = ids.roll(-1, 1).reshape({-1});
      double held = 0, seconds = 0;
      for (int s = 0; s <= steps; ++s) {
        for (auto& p : net.parameters()) p.mutable_grad() = at::Tensor();
        const double before = heap_mb();
        const auto t0 = std::chrono::steady_clock::now();
        at::Tensor loss;
        if (chunked) {
          const at::Tensor hidden = net.forward_hidden(ids);
          loss = ember::linear_cross_entropy(hidden.reshape({-1, shape.width}), net.output_weight(), targets);
        } else {
          loss = at::cross_entropy_loss(net.forward(ids).reshape({-1, shape.vocab_size}), targets);
        }
        const double after = heap_mb();
        loss.backward();
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (s > 0) {
          held += (after - before) / steps;
          seconds += dt / steps;
        }
      }
      if (mode == 0) none_mb = held;
      if (mode == 0 && !chunked) {
        whole_none_mb = held;
        whole_none_s = seconds;
      }
      std::printf("| %s | %s | %.0f | %.2f | %.2f | %.2f | %.2f |\n", chunked ? "chunked" : "whole logits", names[mode], held, held / none_mb,
                  held / whole_none_mb, seconds, seconds / whole_none_s);
      std::fflush(stdout);
    }
  }
  return 0;
}
