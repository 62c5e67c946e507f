// What the checkpoint checksum (CRC32C of every record, docs/checkpoint.md) costs next to the
// write and the load of a large checkpoint. Builds a dict like the engine's (a state_dict of
// float tensors, about SIZE_MB in all), then per round times:
//   save        save_checkpoint_file: pickle, zip records, CRC32C, write, fsync, rename
//   save_v1     the format-1 writer (torch::jit::pickle_save + the same atomic write, no CRC32C)
//   load        load_checkpoint_file: read, verify every CRC32C, unpickle, copy the tensors
//   crc32c      CRC32C over the same bytes alone (what the checksum adds to a save and to a load)
// and once the portable Boost.CRC fallback, for CPUs without SSE4.2.
//   bench_checkpoint_io DIR [SIZE_MB=500] [ROUNDS=3]
#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_io.h"

namespace fs = std::filesystem;
using ember::engine::crc32c;

namespace {
double seconds_of(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DIR [SIZE_MB=500] [ROUNDS=3]\n", argv[0]);
    return 2;
  }
  const fs::path dir = argv[1];
  const int64_t size_mb = argc > 2 ? std::stoll(argv[2]) : 500;
  const int rounds = argc > 3 ? std::stoi(argv[3]) : 3;
  fs::create_directories(dir);
  // 25 MB tensors, like the layers of a mid-sized model.
  const int64_t per_tensor = 25LL << 20;
  c10::Dict<std::string, at::Tensor> sd;
  std::vector<at::Tensor> tensors;
  for (int64_t done = 0, i = 0; done < (size_mb << 20); done += per_tensor, ++i) {
    auto t = at::randn({per_tensor / 4});
    sd.insert("layer" + std::to_string(i) + ".weight", t);
    tensors.push_back(t);
  }
  c10::impl::GenericDict ck(c10::StringType::get(), c10::AnyType::get());
  ck.insert("format", std::string(ember::engine::kCheckpointFormat));
  ck.insert("format_version", ember::engine::kCheckpointFormatVersion);
  ck.insert("weights_only", false);
  ck.insert("state_dict", sd);
  const fs::path file = dir / "bench.ckpt", file_v1 = dir / "bench_v1.ckpt";

  std::vector<double> save, save_v1, load, crc;
  uint32_t sink = 0;
  for (int r = 0; r < rounds; ++r) {
    save.push_back(seconds_of([&] { ember::engine::save_checkpoint_file(file, ck); }));
    save_v1.push_back(seconds_of([&] {
      const auto bytes = torch::jit::pickle_save(ck);
      ember::engine::atomic_write(file_v1, bytes.data(), bytes.size());
    }));
    load.push_back(seconds_of([&] { sink ^= static_cast<uint32_t>(ember::engine::load_checkpoint_file(file).size()); }));
    crc.push_back(seconds_of([&] {
      for (const auto& t : tensors) sink ^= crc32c(t.data_ptr(), t.nbytes());
    }));
  }
  const double portable = seconds_of([&] {
    for (const auto& t : tensors) sink ^= ember::engine::crc32c_portable(t.data_ptr(), t.nbytes());
  });
  const double mb = static_cast<double>(fs::file_size(file)) / (1 << 20);
  std::printf("checkpoint: %.0f MB in %zu tensors, %d rounds, median seconds (file in %s)\n", mb, tensors.size(), rounds,
              dir.c_str());
  std::printf("%-34s %8.3f s  %7.0f MB/s\n", "save (format 2, with CRC32C)", median(save), mb / median(save));
  std::printf("%-34s %8.3f s  %7.0f MB/s\n", "save (format 1, no checksum)", median(save_v1), mb / median(save_v1));
  std::printf("%-34s %8.3f s  %7.0f MB/s\n", "load (with verification)", median(load), mb / median(load));
  std::printf("%-34s %8.3f s  %7.0f MB/s\n", "CRC32C alone (SSE4.2)", median(crc), mb / median(crc));
  std::printf("%-34s %8.3f s  %7.0f MB/s\n", "CRC32C alone (Boost.CRC fallback)", portable, mb / portable);
  std::printf("CRC32C share: %.1f%% of the save, %.1f%% of the load\n", 100 * median(crc) / median(save),
              100 * median(crc) / median(load));
  fs::remove(file);
  fs::remove(file_v1);
  return sink == 0xFFFFFFFFu ? 1 : 0;  // (keeps the checksums from being optimised away)
}
