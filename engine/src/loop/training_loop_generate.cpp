// The generate loop (`engine generate`): a prompt through the data's tokenizer, then one token at
// a time from the model's key/value cache, streamed to the caller as soon as it is decoded.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/module.h>
#include <torch/utils.h>

#include "common/log.h"
#include "loop/generation.h"
#include "loop/training_loop.h"

namespace ember::engine {

LanguageModelPair TrainingLoop::check_can_generate() {
  if (world_size() > 1)
    throw UsageError("engine generate runs on one process: set trainer.devices = 1 and trainer.num_nodes = 1");
  return language_model_pair(*plugins_.model.object, plugins_.model.name, *plugins_.data.object, plugins_.data.name);
}

std::string TrainingLoop::generate(const GenerationOptions& options, std::ostream& out) {
  const auto lm = check_can_generate();
  auto& model = *lm.model;
  auto& tokenizer = *lm.tokenizer;
  const int64_t end = tokenizer.end_of_text_id();
  std::vector<int64_t> ids = tokenizer.encode(options.prompt);
  if (ids.empty()) {
    if (end < 0)
      throw UsageError("give a prompt (--prompt TEXT, or the text on standard input): " + tokenizer.describe() +
                       " has no end-of-text token to start from");
    ids.push_back(end);
  }
  const int64_t context = model.context_length();
  if (static_cast<int64_t>(ids.size()) > context)
    throw UsageError("the prompt is " + std::to_string(ids.size()) + " tokens, longer than the model's context of " + std::to_string(context) +
                     " tokens: shorten it");
  const size_t prompt_tokens = ids.size();
  // An empty prompt starts from the end-of-text token, which is not printed.
  const auto skip = static_cast<std::ptrdiff_t>(options.prompt.empty() ? 1 : 0);
  auto decode = [&] { return tokenizer.decode(std::vector<int64_t>(ids.begin() + skip, ids.end())); };
  const c10::Device device = runtime_->root_device();
  auto tensor_of = [&](std::vector<int64_t>::const_iterator first, std::vector<int64_t>::const_iterator last) {
    std::vector<int64_t> v(first, last);
    return at::tensor(v, at::kLong).view({1, -1}).to(device);
  };
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(options.seed);

  const bool was_training = module().is_training();
  module().eval();
  std::string printed = decode();
  out << printed << std::flush;
  const std::string prompt_text = printed;
  {
    torch::NoGradGuard no_grad;
    for (int64_t step = 0; step < options.max_new_tokens; ++step) {
      at::Tensor logits;
      {
        auto region = runtime_->forward(/*grad_enabled=*/false);
        const auto window_begin = ids.end() - std::min<int64_t>(static_cast<int64_t>(ids.size()), context);
        if (!options.use_cache) {
          // Every step sees the last `context` tokens (nanoGPT's crop).
          logits = model.logits(tensor_of(window_begin, ids.end()));
        } else if (step == 0 || model.cached_length() + 1 > context) {
          // The prompt, or a full cache: start again from the last `context` tokens (the same
          // window the uncached path sees).
          model.begin_generation(1, context);
          logits = model.generation_step(tensor_of(window_begin, ids.end()));
        } else {
          logits = model.generation_step(tensor_of(ids.end() - 1, ids.end()));
        }
      }
      // Only tokens the tokenizer knows: a model's vocabulary may be padded past it (nanoGPT's
      // 50,304 for GPT-2's 50,257), and those ids decode to nothing.
      const at::Tensor last = logits[0][logits.size(1) - 1].narrow(0, 0, std::min<int64_t>(logits.size(2), tokenizer.vocab_size()));
      const int64_t next = sample_next_token(last.to(at::kCPU), options, generator);
      if (next == end) break;
      ids.push_back(next);
      const std::string text = decode();
      const size_t whole = complete_utf8_prefix(text);
      if (whole > printed.size()) {
        out << text.substr(printed.size(), whole - printed.size()) << std::flush;
        printed = text.substr(0, whole);
      }
    }
    if (options.use_cache) model.end_generation();
  }
  if (was_training) module().train();
  const std::string all = decode();
  if (all.size() > printed.size()) out << all.substr(printed.size());
  out << "\n" << std::flush;
  log::info("generated " + std::to_string(ids.size() - prompt_tokens) + " tokens after a prompt of " + std::to_string(prompt_tokens) +
            (options.use_cache ? " (key/value cache)" : " (no cache)"));
  return all.substr(std::min(all.size(), prompt_text.size()));
}

}  // namespace ember::engine
