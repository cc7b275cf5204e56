// Just enough of cuBLASLt for kernels/cuda/gemm.h to compile (testing only).
#pragma once
#include <cstdint>
typedef struct EmuLtContext* cublasLtHandle_t;
typedef struct {
  uint64_t data[8];
} cublasLtMatmulAlgo_t;
// Opaque descriptor types (held by gemm.h's cached plans; never created here).
struct cublasLtMatmulDescOpaque_t;
struct cublasLtMatrixLayoutOpaque_t;
