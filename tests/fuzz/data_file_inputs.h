// One fuzz input through the readers of the data files users bring: .npy arrays (tensor_files,
// webdataset), JPEG and PNG images (image_folder, webdataset), CSV and JSON Lines tables
// (text_classification, image_folder) and WebDataset tar shards. Shared by the libFuzzer target
// fuzz_data_files (EMBER_FUZZ=ON) and the bounded test in the suite
// (tests/data_files_fuzz_test.cpp). Findings and clean errors as in fuzz_inputs.h; here a clean
// error is ember::RunError, one line, naming the file.
#pragma once
#include <string>
#include <string_view>

namespace ember::fuzz {

// The first byte picks the kind (its value modulo 5), the rest is the file's bytes:
//   0 .npy: read copied and viewed in place (as tensor_files maps files), every byte touched;
//   1 image: the header probed, then decoded at full size and at half size (JPEG), each of the
//     size the header gave;
//   2 CSV table, 3 JSON Lines table: columns "text" and "label" read;
//   4 tar shard: indexed for .npy and .cls fields (incomplete samples skipped), every indexed
//     member inside the file, every .npy member read.
// Files are written under $TMPDIR (or /tmp) in a folder of this process's own.
bool data_file_one(std::string_view input, std::string* error = nullptr);

}  // namespace ember::fuzz
