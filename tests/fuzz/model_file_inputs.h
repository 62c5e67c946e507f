// One fuzz input through the readers of a model folder's files, the ones users download (Hugging
// Face folders): safetensors weights, a byte-level BPE tokenizer.json, a gpt or bert config.json
// and a WordPiece vocab.txt. Shared by the libFuzzer target fuzz_model_files (EMBER_FUZZ=ON) and
// the bounded test in the suite (tests/model_files_fuzz_test.cpp). Findings and clean errors as
// in fuzz_inputs.h; here a clean error is ember::RunError (or ConfigError), one line, naming the
// file.
#pragma once
#include <string>
#include <string_view>

namespace ember::fuzz {

// The first byte picks the kind (its value modulo 5), the rest is the file's bytes:
//   0 safetensors: every tensor read, then written with write_safetensors and read back equal;
//   1 tokenizer.json (byte-level BPE): a sample text with an added token encoded, decoded back
//     to the same text, and every id of the vocabulary decoded;
//   2 gpt config.json: the shape read, and the config.json `engine export` writes for it reads
//     back as the same shape;
//   3 bert config.json;
//   4 WordPiece vocab.txt: a sample text encoded, every id inside the vocabulary.
// The file is written under $TMPDIR (or /tmp) in a folder of this process's own.
bool model_file_one(std::string_view input, std::string* error = nullptr);

}  // namespace ember::fuzz
