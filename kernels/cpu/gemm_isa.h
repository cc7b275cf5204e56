// Which instruction set the batch-invariant GEMM's micro-kernels use (kernels/cpu/gemm.h), and
// with them the decode attention's loops (kernels/cpu/decode_attention.h).
//
// Every ISA computes the same bits: each output element is one accumulator updated by a fused
// multiply-add for k = 0, 1, ... in order (DotInOrder), so the choice changes only the speed.
// The library is built for x86-64-v3 (AVX2 + FMA); the AVX-512 kernels live in one file built
// with AVX-512 flags (kernels/cpu/gemm_avx512.cc) and run only where the CPU and OS support them.
//
// The ISA in use is decided once, at first use: the best available, or the one the environment
// variable SDM_CPU_ISA=avx512|avx2|generic names (for tests and benchmarks of the lower paths; a
// name above what is available gets the best available below it, an unknown name is ignored with
// a warning). Thread-safe.
#ifndef SDMSERVE_KERNELS_CPU_GEMM_ISA_H_
#define SDMSERVE_KERNELS_CPU_GEMM_ISA_H_

#include <optional>
#include <string_view>
#include <vector>

namespace sdm::kernels::cpu {

// In increasing order of preference.
enum class GemmIsa { kGeneric, kAvx2, kAvx512 };

// "generic", "avx2", "avx512".
const char* GemmIsaName(GemmIsa isa);
std::optional<GemmIsa> ParseGemmIsa(std::string_view name);

// Whether this build holds the ISA's micro-kernels and this machine runs them (kGeneric: always).
bool GemmIsaAvailable(GemmIsa isa);
// Every available ISA, in increasing order.
std::vector<GemmIsa> AvailableGemmIsas();
// The best available ISA not above `cap`.
GemmIsa BestGemmIsa(GemmIsa cap);

// The ISA LinearInvariant uses (see above), and its name.
GemmIsa ActiveGemmIsa();
const char* GemmIsaName();

}  // namespace sdm::kernels::cpu

#endif  // SDMSERVE_KERNELS_CPU_GEMM_ISA_H_
