// Private to Ember::losses: the launchers of cross_entropy_rows.cu. Plain pointers and a stream, so
// that the C++ side needs no CUDA headers and the .cu file no LibTorch headers (nvcc stays fast).
#pragma once
#include <cstdint>

namespace ember::cross_entropy_rows::cuda {

enum class Dtype : int { float32 = 0, bfloat16 = 1, float16 = 2 };

// Each returns nullptr, or the CUDA error the launch raised.
const char* launch_forward(Dtype dtype, const void* logits, int64_t rows, int64_t cols, const int64_t* targets, int64_t ignore_index,
                           float* row_max, float* log_sum, float* row_loss, void* stream);
const char* launch_gradient(Dtype dtype, const void* logits, void* out, int64_t rows, int64_t cols, const int64_t* targets,
                            int64_t ignore_index, const float* row_max, const float* log_sum, const float* scale, void* stream);

}  // namespace ember::cross_entropy_rows::cuda
