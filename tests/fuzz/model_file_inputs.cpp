#include "model_file_inputs.h"

#include <ATen/ATen.h>

#include <ember/error.h>
#include <ember/support/safetensors.h>

#include <filesystem>

#include "bert_net.h"
#include "fuzz_inputs.h"
#include "scratch_folder.h"
#include "gpt_net.h"
#include "lm_tokenizer.h"
#include "wordpiece.h"

namespace ember::fuzz {
namespace {

namespace fs = std::filesystem;

const ScratchFolder& scratch() {
  static const ScratchFolder folder("model-files");
  return folder;
}

// A text with letters, digits, contractions, runs of spaces, a newline, non-ASCII letters and
// GPT-2's added token.
const std::string kSample =
    "It is a truth universally acknowledged, that a single man's fortune: 12 o'clock.\n\n  Caf\xc3\xa9 \xc3\xbc" "ber "
    "\xe4\xb8\xad\xe6\x96\x87!<|endoftext|>The end  ";

void safetensors_one(std::string_view bytes) {
  const fs::path path = scratch().write("model.safetensors", bytes);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  {
    const ember::support::SafetensorsFile file(path.string());
    for (const auto& name : file.names()) tensors.emplace_back(name, file.tensor(name).clone());
  }
  // What was read writes and reads back the same (what `engine export` does with weights).
  const fs::path again = scratch().path() / "again.safetensors";
  ember::support::write_safetensors(again.string(), tensors);
  const ember::support::SafetensorsFile file(again.string());
  if (file.names().size() != tensors.size()) throw Finding("a safetensors file written from what was read holds other tensors");
  for (const auto& [name, t] : tensors) {
    const at::Tensor back = file.tensor(name);
    if (back.scalar_type() != t.scalar_type() || !back.sizes().equals(t.sizes()) ||
        (t.numel() > 0 && !at::equal(back.view(at::kByte), t.contiguous().view(at::kByte))))
      throw Finding("tensor '" + name + "' reads back differently after write_safetensors");
  }
}

void tokenizer_one(std::string_view bytes) {
  const fs::path path = scratch().write("tokenizer.json", bytes);
  const auto tokenizer = ember_text_lm::load_bytelevel_bpe(path);
  const int64_t size = tokenizer->vocab_size();
  if (size < 1) throw Finding("a tokenizer with an empty vocabulary was accepted");
  // Every id decodes or is refused cleanly (a gap in the vocabulary).
  for (int64_t id = 0; id < std::min<int64_t>(size, 100000); ++id) {
    try {
      tokenizer->decode({id});
    } catch (const ember::RunError&) {
    }
  }
  std::vector<int64_t> ids;
  try {
    ids = tokenizer->encode(kSample);
  } catch (const ember::RunError&) {
    return;  // a vocabulary without some byte: refused in a line, as a run would be
  }
  for (int64_t id : ids)
    if (id < 0 || id >= size) throw Finding("encode gave id " + std::to_string(id) + " outside the vocabulary of " + std::to_string(size));
  const std::string back = tokenizer->decode(ids);
  if (back != kSample) throw Finding("decode(encode(text)) is not the text: got '" + back + "'");
}

void gpt_config_one(std::string_view bytes) {
  const fs::path path = scratch().write("config.json", bytes);
  const ember_gpt::GptShape shape = ember_gpt::GptShape::from_hf_config(path.string());
  const std::string described = shape.describe();
  const fs::path again = scratch().write("exported.config.json", shape.hf_config_json());
  const std::string back = ember_gpt::GptShape::from_hf_config(again.string()).describe();
  if (back != described) throw Finding("the exported config.json reads back as another shape: " + described + " vs " + back);
}

void bert_config_one(std::string_view bytes) {
  const fs::path path = scratch().write("config.json", bytes);
  ember_text::BertConfig::from_json_file(path.string());
}

void vocab_one(std::string_view bytes) {
  const fs::path folder = scratch().write("wordpiece/vocab.txt", bytes).parent_path();
  const auto tokenizer = ember_text::WordPieceTokenizer::from_folder(folder.string());
  for (int64_t max_length : {0, 2, 7})
    for (int64_t id : tokenizer.encode(kSample, max_length))
      if (id < 0 || id >= tokenizer.vocab_size())
        throw Finding("WordPiece gave id " + std::to_string(id) + " outside the vocabulary of " + std::to_string(tokenizer.vocab_size()));
}

}  // namespace

bool model_file_one(std::string_view input, std::string* error) {
  return scratch().judge_by_first_byte(input, error, safetensors_one, tokenizer_one, gpt_config_one, bert_config_one, vocab_one);
}

}  // namespace ember::fuzz
