#include "kernels/cpu/gemm_isa.h"

#include <cstdlib>
#include <string>

#include "base/log.h"
#include "kernels/cpu/gemm_tile.h"

namespace sdm::kernels::cpu {
namespace {

bool CpuRuns(GemmIsa isa) {
#if defined(__x86_64__) || defined(__i386__)
  switch (isa) {
    case GemmIsa::kGeneric:
      return true;
    case GemmIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case GemmIsa::kAvx512:
      // GCC's and Clang's checks include the OS saving the zmm state (XCR0).
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
  }
  return false;
#else
  return isa == GemmIsa::kGeneric;
#endif
}

GemmIsa ChooseIsa() {
  const char* env = std::getenv("SDM_CPU_ISA");
  if (env == nullptr || *env == '\0') return BestGemmIsa(GemmIsa::kAvx512);
  const std::optional<GemmIsa> asked = ParseGemmIsa(env);
  if (!asked.has_value()) {
    SDM_LOG(WARNING) << "SDM_CPU_ISA=" << env << " is not avx512, avx2 or generic; ignored";
    return BestGemmIsa(GemmIsa::kAvx512);
  }
  const GemmIsa isa = BestGemmIsa(*asked);
  SDM_LOG(INFO) << "SDM_CPU_ISA=" << env << ": the CPU GEMM uses " << GemmIsaName(isa);
  return isa;
}

}  // namespace

const char* GemmIsaName(GemmIsa isa) {
  switch (isa) {
    case GemmIsa::kGeneric:
      return "generic";
    case GemmIsa::kAvx2:
      return "avx2";
    case GemmIsa::kAvx512:
      return "avx512";
  }
  return "?";
}

std::optional<GemmIsa> ParseGemmIsa(std::string_view name) {
  for (GemmIsa isa : {GemmIsa::kGeneric, GemmIsa::kAvx2, GemmIsa::kAvx512}) {
    if (name == GemmIsaName(isa)) return isa;
  }
  return std::nullopt;
}

bool GemmIsaAvailable(GemmIsa isa) { return GemmTileKernelsFor(isa) != nullptr && CpuRuns(isa); }

std::vector<GemmIsa> AvailableGemmIsas() {
  std::vector<GemmIsa> out;
  for (GemmIsa isa : {GemmIsa::kGeneric, GemmIsa::kAvx2, GemmIsa::kAvx512}) {
    if (GemmIsaAvailable(isa)) out.push_back(isa);
  }
  return out;
}

GemmIsa BestGemmIsa(GemmIsa cap) {
  for (GemmIsa isa : {GemmIsa::kAvx512, GemmIsa::kAvx2}) {
    if (isa <= cap && GemmIsaAvailable(isa)) return isa;
  }
  return GemmIsa::kGeneric;
}

GemmIsa ActiveGemmIsa() {
  static const GemmIsa isa = ChooseIsa();
  return isa;
}

const char* GemmIsaName() { return GemmIsaName(ActiveGemmIsa()); }

}  // namespace sdm::kernels::cpu
