// Activation checkpointing on the GPT-2 124M shape (12 layers x 12 heads x 768 wide, vocabulary
// 50,304, context 1,024; models/gpt): the memory a training forward holds for backward and the
// step time, for trainer.activation_checkpointing = none, full and selective, side by side.
//   bench_activation_memory [batch=1] [seq=1024] [steps=2]
// Memory: the heap in use (glibc mallinfo2: arena + mmapped blocks) after the loss is computed,
// minus before the forward: what the autograd graph keeps (activations, and the logits and their
// log-softmax, which every mode keeps alike: printed apart). Time: forward + backward per step,
// the mean of `steps` steps after one warm-up step.
#include <malloc.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <ATen/ATen.h>
#include <torch/torch.h>

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
  double base_mb = 0, base_s = 0;
  const double logits_mb = 2.0 * static_cast<double>(batch * seq * shape.vocab_size) * 4.0 / (1024.0 * 1024.0);
  std::printf("GPT-2 124M shape, batch %lld x %lld tokens, %d threads; logits + log-softmax (kept by every mode): %.0f MB\n",
              static_cast<long long>(batch), static_cast<long long>(seq), at::get_num_threads(), logits_mb);
  std::printf("| activation_checkpointing | held for backward (MB) | vs none | without the logits (MB) | vs none | s/step | vs none |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  double base_blocks = 0;
  for (int mode = 0; mode < 3; ++mode) {
    torch::manual_seed(0);
    ember_gpt::GptNet net(shape);
    ember::ModelUnits units;
    net.declare_units(units);
    units.set_checkpointing(mode == 1 ? ember::ActivationCheckpointing::full : ember::ActivationCheckpointing::none);
    net.set_selective_checkpointing(mode == 2);
    net.train();
    const at::Tensor ids = at::randint(0, shape.vocab_size, {batch, seq}, at::kLong);
    double held = 0, seconds = 0;
    for (int s = 0; s <= steps; ++s) {
      for (auto& p : net.parameters()) p.mutable_grad() = at::Tensor();
      const double before = heap_mb();
      const auto t0 = std::chrono::steady_clock::now();
      const at::Tensor logits = net.forward(ids);
      const at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, shape.vocab_size}), ids.roll(-1, 1).reshape({-1}));
      const double after = heap_mb();
      loss.backward();
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (s > 0) {
        held += (after - before) / steps;
        seconds += dt / steps;
      }
    }
    if (mode == 0) {
      base_mb = held;
      base_s = seconds;
      base_blocks = held - logits_mb;
    }
    std::printf("| %s | %.0f | %.2f | %.0f | %.2f | %.2f | %.2f |\n", names[mode], held, held / base_mb, held - logits_mb,
                (held - logits_mb) / base_blocks, seconds, seconds / base_s);
    std::fflush(stdout);
  }
  return 0;
}
