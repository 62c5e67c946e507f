// Bounded random-mutation fuzzing of the readers of a model folder's files (safetensors,
// tokenizer.json, config.json, vocab.txt: what users download), over the harness libFuzzer runs
// without a bound (tests/fuzz/model_file_inputs.h, scripts/fuzz.sh).
#include <gtest/gtest.h>

#include "fuzz/bounded_fuzz.h"
#include "fuzz/model_file_inputs.h"

using ember::fuzz::corpus;
using ember::fuzz::fuzz;

namespace {

// JSON and safetensors fragments the mutations splice in: values of the wrong type, sizes at the
// edges of 64 bits, negative and huge ids, dtypes.
const std::vector<std::string> kModelFileTokens = {
    "\"", "{", "}", "[", "]", ",", ":", "null", "true", "false", "-1", "0", "1", "-9223372036854775808",
    "9223372036854775807", "18446744073709551615", "1e308", "1.5", "\"vocab_size\"", "\"n_layer\"", "\"hidden_size\"",
    "\"num_attention_heads\"", "\"num_key_value_heads\"", "\"model_type\"", "\"llama\"", "\"gpt2\"", "\"distilbert\"",
    "\"dtype\"", "\"F32\"", "\"BF16\"", "\"F8_E4M3\"", "\"BOOL\"", "\"I64\"", "\"shape\"", "\"data_offsets\"",
    "\"__metadata__\"", "\"vocab\"", "\"merges\"", "\"added_tokens\"", "\"id\"", "\"content\"", "\"<|endoftext|>\"",
    "\"type\"", "\"BPE\"", "\"ByteLevel\"", "\"ignore_merges\"", "\"\\u0120\"", "\"\\u0000\"", "[UNK]", "[CLS]",
    "\n", "##", "\xff", "\xc3\xa9"};

}  // namespace

TEST(Fuzz, ModelFileSeedsAreAccepted) {
  // Real files written by safetensors, tokenizers and transformers
  // (tests/fuzz/make_model_file_seeds.py) read and pass the harness's checks.
  ember::fuzz::expect_seeds_accepted("model_files", 7, ember::fuzz::model_file_one);
}

TEST(Fuzz, ModelFileInputsThatFoundBugsNowPass) {
  // Each broke a check of the harness (an id past the vocabulary, nlohmann's own exception, a
  // text that did not decode back); now each is read or refused in one line, as it deserves.
  ember::fuzz::replay_regressions("model_files", ember::fuzz::model_file_one);
}

TEST(Fuzz, ModelFileReadersSurviveMutatedFiles) {
  fuzz("model_files", corpus("model_files"), 6000, [](std::string_view in) { return ember::fuzz::model_file_one(in); },
       [](const std::string& seed, std::mt19937_64& rng) {
         // Keep the kind byte: a mutation of a file of one kind, read as that kind.
         return seed.substr(0, 1) + ember::fuzz::mutate(seed.substr(1), rng, kModelFileTokens);
       });
}
