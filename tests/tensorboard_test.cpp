// The tensorboard logger's record framing (TFRecord with masked CRC-32C). The full format is
// tested from Python with TensorBoard's own reader (tensorboard_readback.sh).
#include <gtest/gtest.h>

#include <cstring>

#include "record_io.h"

TEST(TensorBoardRecord, Crc32cIsCastagnoli) {
  // The check value of CRC-32C (RFC 3720, B.4) and of the empty string.
  EXPECT_EQ(ember_tb::crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(ember_tb::crc32c(""), 0u);
  EXPECT_EQ(ember_tb::masked_crc32c(""), 0xa282ead8u);  // TensorFlow's mask of 0
}

TEST(TensorBoardRecord, FramesLengthCrcDataCrc) {
  const std::string data = "hello event";
  const std::string rec = ember_tb::frame_record(data);
  ASSERT_EQ(rec.size(), data.size() + 16);
  uint64_t len = 0;
  std::memcpy(&len, rec.data(), 8);  // little endian host
  EXPECT_EQ(len, data.size());
  uint32_t len_crc = 0, data_crc = 0;
  std::memcpy(&len_crc, rec.data() + 8, 4);
  std::memcpy(&data_crc, rec.data() + 12 + data.size(), 4);
  EXPECT_EQ(len_crc, ember_tb::masked_crc32c(std::string_view(rec.data(), 8)));
  EXPECT_EQ(rec.substr(12, data.size()), data);
  EXPECT_EQ(data_crc, ember_tb::masked_crc32c(data));
}
