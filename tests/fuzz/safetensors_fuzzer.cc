// libFuzzer target for safetensors headers (engine/safetensors.h), the first thing read from a
// model directory: any file must give an error or a validated index, never a crash, undefined
// behaviour or a huge allocation (built with ASan and UBSan; see scripts/fuzz.sh).
//
// Input: one mode byte, then the bytes. Mode bit 0 clear: the bytes are the whole file. Mode bit
// 0 set: the bytes are a 2-byte data-region size (little-endian) and the header JSON; the file is
// built around them (length field, header, zero data), so that mutations reach the JSON checks
// instead of being stopped by the length field.
//
// Each file is read both ways the engine reads one, ReadSafetensorsIndex (pread) and
// SafetensorsFile::Open (mmap), which must agree. Properties of every index: the tensors are
// sorted and cover the data region exactly, each tensor's bytes are its elements times its
// dtype's size and lie inside the file, and Find() finds each by name. Memory allocated stays
// within a constant plus a small multiple of the file's size.
//
// `safetensors_fuzzer --write-seeds=DIR` writes a seed corpus of valid files to DIR and exits.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>

#include "absl/status/status.h"
#include "engine/safetensors.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using namespace sdm::fuzz;  // NOLINT: the fuzzers' shared helpers

std::string FileOf(const std::string& header, size_t data_bytes) {
  const uint64_t n = header.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + header + std::string(data_bytes, '\0');
}

// The file under test: an in-memory file (memfd), opened by the readers through its
// /proc/self/fd path like any file, without touching a disk.
int ScratchFd() {
  static const int fd = memfd_create("model.safetensors", MFD_CLOEXEC);
  if (fd < 0) Fail("memfd_create failed");
  return fd;
}

const std::filesystem::path& ScratchFile() {
  static const std::filesystem::path path = "/proc/self/fd/" + std::to_string(ScratchFd());
  return path;
}

bool WriteScratch(const std::string& bytes) {
  const int fd = ScratchFd();
  if (ftruncate(fd, 0) != 0) return false;
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = pwrite(fd, bytes.data() + done, bytes.size() - done, done);
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

void CheckIndex(const sdm::SafetensorsIndex& index, int64_t file_size) {
  if (index.file_size != file_size) Fail("index file size differs from the file's");
  if (index.data_offset < 8 || index.data_offset > file_size) Fail("data offset outside the file");
  int64_t covered = 0;
  for (const sdm::SafetensorsEntry& e : index.tensors) {
    if (e.begin != covered) Fail("tensors do not cover the data region in order");
    int64_t elements = 1;
    for (const int64_t d : e.shape) {
      if (d < 0) Fail("negative dimension");
      elements *= d;  // bounded by the parser (UBSan reports an overflow)
    }
    if (elements != e.num_elements) Fail("num_elements is not the shape's product");
    if (e.end - e.begin != e.num_elements * sdm::TensorDtypeSize(e.dtype)) {
      Fail("tensor bytes are not elements times the dtype's size");
    }
    if (index.Find(e.name) == nullptr) Fail("Find() misses a tensor");
    covered = e.end;
  }
  if (index.data_offset + covered != file_size) Fail("tensors do not end at the file's end");
}

void CheckFile(const std::string& file) {
  if (!WriteScratch(file)) return;
  const int64_t size = static_cast<int64_t>(file.size());
  absl::StatusOr<sdm::SafetensorsIndex> index;
  const size_t bytes = CountAllocations([&] { index = sdm::ReadSafetensorsIndex(ScratchFile()); });
  if (bytes > kAllocationSlack + kAllocationPerBlobByte * file.size()) {
    Fail("reading the header allocated far more memory than the file's size");
  }
  auto opened = sdm::SafetensorsFile::Open(ScratchFile());
  if (index.ok() != opened.ok()) Fail("ReadSafetensorsIndex and SafetensorsFile::Open disagree");
  if (!index.ok()) {
    if (index.status() != opened.status()) Fail("the two readers give different errors");
    const absl::StatusCode code = index.status().code();
    if (code != absl::StatusCode::kInvalidArgument && code != absl::StatusCode::kDataLoss) {
      Fail("error is neither INVALID_ARGUMENT nor DATA_LOSS");
    }
    return;
  }
  CheckIndex(*index, size);
  CheckIndex((*opened)->index(), size);
  for (const sdm::SafetensorsEntry& e : (*opened)->index().tensors) {
    const sdm::TensorView view = (*opened)->View(e);
    if (view.bytes.size() != static_cast<size_t>(e.end - e.begin)) Fail("view of the wrong size");
    if (!view.bytes.empty()) {
      volatile uint8_t last = view.bytes.back();  // inside the mapping (ASan/SEGV otherwise)
      (void)last;
    }
  }
}

void Run(const uint8_t* data, size_t size) {
  if (size == 0) return;
  std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  if ((data[0] & 1) == 0) return CheckFile(bytes);
  if (bytes.size() < 2) return;
  const size_t data_bytes = static_cast<uint8_t>(bytes[0]) | static_cast<uint8_t>(bytes[1]) << 8;
  CheckFile(FileOf(bytes.substr(2), data_bytes));
}

int WriteSeeds(const std::filesystem::path& dir) {
  SeedWriter seeds(dir);
  const std::string headers[] = {
      R"({})",
      R"({"__metadata__":{"format":"pt"}})",
      R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})",
      R"({"b":{"dtype":"BF16","shape":[4],"data_offsets":[24,32]},)"
      R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"__metadata__":{"k":"v"}})",
      R"({"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
      R"("e":{"dtype":"F32","shape":[0,5],"data_offsets":[4,4]}})",
  };
  const size_t data_sizes[] = {0, 0, 24, 32, 4};
  for (size_t i = 0; i < std::size(headers); ++i) {
    const std::string file = FileOf(headers[i], data_sizes[i]);
    CheckFile(file);  // the seeds themselves must pass
    if (!sdm::ReadSafetensorsIndex(ScratchFile()).ok()) Fail("a seed does not parse");
    seeds.Add('\0' + file);
    std::string built = "\1";
    built += static_cast<char>(data_sizes[i] & 0xff);
    built += static_cast<char>(data_sizes[i] >> 8);
    seeds.Add(built + headers[i]);
  }
  return seeds.Finish();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  return sdm::fuzz::InitializeFuzzer(argc, argv, WriteSeeds);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Run(data, size);
  return 0;
}
