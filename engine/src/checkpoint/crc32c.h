// CRC32C (Castagnoli, as iSCSI/ext4/RocksDB), the checksum of every record of a checkpoint
// (docs/checkpoint.md): SSE4.2's crc32 instruction when the CPU has it, Boost.CRC otherwise.
// crc32c("123456789") == 0xE3069283.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace ember::engine {

uint32_t crc32c(const void* data, size_t size);
// The CRC32C of the bytes whose CRC32C is `crc` followed by `data` (crc32c_extend(0, d, n) ==
// crc32c(d, n)): a record checked in chunks, never whole in memory (`engine checkpoint verify`).
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t size);
uint32_t crc32c_portable(const void* data, size_t size);  // Boost.CRC only (tests compare both)
uint32_t crc32c_portable_extend(uint32_t crc, const void* data, size_t size);
// 8 lowercase hex digits, as the manifest writes a checksum.
std::string hex32(uint32_t v);

}  // namespace ember::engine
