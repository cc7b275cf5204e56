// StateFiles::Direct() (state_store/state_files.h): the same bytes as the buffered file system
// for every write the store makes — whole snapshots of any size (below a block, across blocks,
// across several of its staging chunks) and log appends at unaligned offsets, including the
// rewrite of a torn tail — whatever the file system (one without O_DIRECT falls back); and the
// same bytes whether the data comes as one string or as a ByteSource in pieces of any size
// (gathered into chunks by StateFiles::WriteSource).
#include "state_store/state_files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "base/status_macros.h"
#include "gtest/gtest.h"
#include "state_store/byte_source.h"
#include "tests/base/scoped_temp_dir.h"

namespace sdm {
namespace {

std::string RandomBytes(std::mt19937_64& rng, size_t n) {
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(rng() & 0xff);
  return out;
}

std::string ReadAll(const std::filesystem::path& path) {
  absl::StatusOr<std::string> got = StateFiles::Default()->Read(path);
  EXPECT_TRUE(got.ok()) << got.status();
  return got.ok() ? *got : std::string();
}

// WriteAtomically's temporary files in `dir`.
int TempFiles(const std::filesystem::path& dir) {
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() == ".tmp") ++n;
  }
  return n;
}

// `data` in pieces of random sizes (empty ones too), as an encoder emits a snapshot; with
// fail_after set, Emit() fails once that many bytes are out (a source whose producer fails).
// With `deferred` offsets, EmitOnePass() passes zeros for the 8 bytes at each and gives their
// values as patches (a checksum placed before what it covers); it counts Emit() calls.
class PiecewiseSource : public ByteSource {
 public:
  PiecewiseSource(absl::string_view data, uint64_t seed, int64_t fail_after = -1,
                  std::vector<uint64_t> deferred = {})
      : data_(data), seed_(seed), fail_after_(fail_after), deferred_(std::move(deferred)) {
    zeroed_ = std::string(data);
    for (uint64_t at : deferred_) std::memset(zeroed_.data() + at, 0, 8);
  }
  uint64_t size() const override { return data_.size(); }
  absl::Status Emit(Sink sink) const override {
    ++emits_;
    return EmitFrom(data_, sink);
  }
  absl::Status EmitOnePass(Sink sink, std::vector<Patch>& patches) const override {
    SDM_RETURN_IF_ERROR(EmitFrom(zeroed_, sink));
    for (uint64_t at : deferred_) {
      Patch p{at, 0};
      std::memcpy(&p.value, data_.data() + at, 8);
      patches.push_back(p);
    }
    return absl::OkStatus();
  }
  int emits() const { return emits_; }

 private:
  absl::Status EmitFrom(absl::string_view data, Sink sink) const {
    std::mt19937_64 rng(seed_);
    size_t at = 0;
    while (at < data.size()) {
      const size_t sizes[] = {0, 1, 7, 600, 4096, 70000, size_t{5} << 20};
      const size_t n = std::min(data.size() - at, sizes[rng() % 7] + rng() % 3);
      if (fail_after_ >= 0 && at + n > static_cast<size_t>(fail_after_)) {
        return absl::InternalError("the producer failed");
      }
      if (absl::Status s = sink(data.substr(at, n)); !s.ok()) return s;
      at += n;
    }
    return absl::OkStatus();
  }

  absl::string_view data_;
  std::string zeroed_;  // data_ with the deferred fields zero
  uint64_t seed_;
  int64_t fail_after_;
  std::vector<uint64_t> deferred_;
  mutable std::atomic<int> emits_{0};
};

// Deferred fields for a source of `size` bytes written at file offset `at`: none below 8 bytes;
// else the first and last 8 bytes, one across the end of the writer's first 4 MiB chunk (which
// ends at a block boundary of the file), one across a block boundary, and a few anywhere.
std::vector<uint64_t> DeferredFields(std::mt19937_64& rng, size_t size, uint64_t at) {
  std::vector<uint64_t> out;
  if (size < 8) return out;
  const uint64_t first_chunk = (uint64_t{4} << 20) - at % 4096;
  const uint64_t to_block_end = 4096 - at % 4096;  // 1 to 4096
  std::vector<uint64_t> candidates = {0, size - 8, first_chunk - 3};
  // 5 bytes before the block boundary; within 5 bytes of `at`, the field at 0 crosses it (and
  // the difference would wrap: a field before the source, as once here: 1 record in 1,000).
  if (to_block_end >= 5) candidates.push_back(to_block_end - 5);
  for (uint64_t candidate : candidates) {
    if (candidate + 8 <= size) out.push_back(candidate);
  }
  for (int i = 0; i < 3; ++i) out.push_back(rng() % (size - 7));
  // Fields do not overlap in a real source: keep the first of any two that would.
  std::sort(out.begin(), out.end());
  std::vector<uint64_t> apart;
  for (uint64_t f : out) {
    if (apart.empty() || f >= apart.back() + 8) apart.push_back(f);
  }
  return apart;
}

TEST(StateFilesTest, SourcePrefixStopsWhereAsked) {
  std::mt19937_64 rng(3);
  const std::string data = RandomBytes(rng, 100000);
  const PiecewiseSource source(data, 5);
  EXPECT_EQ(SourceBytes(source), data);
  EXPECT_EQ(SourcePrefix(source, 0), "");
  EXPECT_EQ(SourcePrefix(source, 72), data.substr(0, 72));
  EXPECT_EQ(SourcePrefix(source, 99999), data.substr(0, 99999));
  EXPECT_EQ(SourcePrefix(source, 200000), data);
  const StringSource whole(data);
  EXPECT_EQ(whole.contiguous(), data.data());
  EXPECT_EQ(source.contiguous(), nullptr);
  // One pass with its fields patched gives the same bytes.
  const PiecewiseSource deferred(data, 5, -1, DeferredFields(rng, data.size(), 0));
  EXPECT_EQ(SourceBytesOnePass(deferred), data);
  EXPECT_EQ(deferred.emits(), 0);
}

TEST(StateFilesTest, ForIoNamesBothModes) {
  EXPECT_EQ(*StateFilesForIo("buffered"), StateFiles::Default());
  EXPECT_EQ(*StateFilesForIo("direct"), StateFiles::Direct());
  EXPECT_NE(StateFiles::Default(), StateFiles::Direct());
  EXPECT_TRUE(absl::IsInvalidArgument(StateFilesForIo("mmap").status()));
}

TEST(StateFilesTest, DirectSnapshotsHoldExactlyTheirBytes) {
  testing::ScopedTempDir dir;
  std::mt19937_64 rng(7);
  // Below a block, exactly one, one plus a byte, and past the 4 MiB staging chunk (several
  // chunks and a partial block at the end).
  const std::vector<size_t> sizes = {
      0, 1, 4095, 4096, 4097, 12288, (4u << 20) - 1, (4u << 20) + 4096, 9437311u, 65536 + 5};
  for (bool sync : {false, true}) {
    for (size_t size : sizes) {
      SCOPED_TRACE(::testing::Message() << "size " << size << " sync " << sync);
      const std::string data = RandomBytes(rng, size);
      const std::filesystem::path path = dir.path() / "s.sdmstate";
      // Over a longer older file: nothing of it may remain.
      ASSERT_TRUE(StateFiles::Default()->WriteAtomically(path, RandomBytes(rng, size + 5000)).ok());
      ASSERT_TRUE(StateFiles::Direct()->WriteAtomically(path, data, sync).ok());
      EXPECT_EQ(ReadAll(path), data);
      EXPECT_EQ(TempFiles(dir.path()), 0);
      // The same bytes from a source in pieces, both ways, with fields patched after the pass
      // (in the last chunk, over chunks already written, across chunk and block boundaries):
      // produced once, never by the two-pass Emit().
      for (StateFiles* files : {StateFiles::Direct(), StateFiles::Default()}) {
        ASSERT_TRUE(
            StateFiles::Default()->WriteAtomically(path, RandomBytes(rng, size + 5000)).ok());
        const PiecewiseSource source(data, size, -1, DeferredFields(rng, size, 0));
        ASSERT_TRUE(files->WriteAtomically(path, source, sync).ok());
        // Not EXPECT_EQ: a failure would print megabytes.
        EXPECT_TRUE(ReadAll(path) == data)
            << (files == StateFiles::Direct() ? "direct" : "buffered");
        EXPECT_EQ(source.emits(), 0);
      }
    }
  }
}

// Whether the page of `path` holding byte `offset` is in the page cache (mincore(2)).
bool InPageCache(const std::filesystem::path& path, uint64_t offset) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const uint64_t size = std::filesystem::file_size(path);
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return false;
  const long page = ::sysconf(_SC_PAGESIZE);
  std::vector<unsigned char> resident((size + page - 1) / page);
  const bool ok = ::mincore(map, size, resident.data()) == 0;
  ::munmap(map, size);
  return ok && (resident[offset / page] & 1) != 0;
}

// Direct I/O: a patch over data already written (a record's checksum, deferred past its 4 MiB
// chunk: WriteSource) reaches the disk directly too, its blocks read and rewritten. Before, it
// went through the page cache alone: a power loss could drop it and keep the record around it,
// written directly, and the record then read as damage (the session quarantined), not as a torn
// tail. Seen through the page cache: a block written with O_DIRECT is not in it afterwards, one
// written through it is (the file's last partial block, the check's control).
TEST(StateFilesTest, DirectPatchesOverWrittenDataBypassThePageCache) {
  testing::ScopedTempDir dir;
  const std::filesystem::path path = dir.path() / "s.sdmlog";
  {
    const int probe = ::open(path.c_str(), O_WRONLY | O_CREAT | O_DIRECT | O_CLOEXEC, 0644);
    if (probe < 0) GTEST_SKIP() << "no O_DIRECT on " << dir.path() << " (tmpfs?)";
    ::close(probe);
  }
  std::mt19937_64 rng(17);
  const std::string data = RandomBytes(rng, (9u << 20) + 123);
  const uint64_t field = 100000;  // in the first chunk: patched once that chunk is out
  const PiecewiseSource source(data, 7, -1, {field});
  ASSERT_TRUE(StateFiles::Direct()->WriteAt(path, 0, source, /*sync=*/false).ok());
  EXPECT_TRUE(InPageCache(path, data.size() - 1));  // the last partial block: buffered
  EXPECT_FALSE(InPageCache(path, field));
  EXPECT_TRUE(ReadAll(path) == data);  // not EXPECT_EQ: a failure would print megabytes
}

// A source whose producer fails part-way: the write fails with its error and the file that was
// there is left as it was (the partial data went to the .tmp, which is removed).
TEST(StateFilesTest, AFailingSourceLeavesTheOldFile) {
  testing::ScopedTempDir dir;
  std::mt19937_64 rng(13);
  const std::filesystem::path path = dir.path() / "s.sdmstate";
  const std::string old = RandomBytes(rng, 10000);
  const std::string data = RandomBytes(rng, (9u << 20) + 123);
  for (StateFiles* files : {StateFiles::Direct(), StateFiles::Default()}) {
    for (int64_t fail_after : {int64_t{0}, int64_t{5000}, int64_t{6} << 20}) {
      ASSERT_TRUE(StateFiles::Default()->WriteAtomically(path, old).ok());
      const absl::Status s =
          files->WriteAtomically(path, PiecewiseSource(data, 3, fail_after), /*sync=*/false);
      EXPECT_EQ(s.message(), "the producer failed");
      EXPECT_EQ(ReadAll(path), old);
      EXPECT_EQ(TempFiles(dir.path()), 0);
    }
  }
}

// An append that fails part-way (a crash stops it the same way) over a longer torn tail leaves
// after its offset a prefix of its data and nothing else: the file is cut at the offset before
// the data is written. Cut only after a complete write, the failure left the old tail's bytes
// after the new ones, which the delta log's reader cannot tell from damage. Both file systems.
TEST(StateFilesTest, AFailedAppendLeavesOnlyAPrefixOfItsData) {
  testing::ScopedTempDir dir;
  std::mt19937_64 rng(19);
  const std::string head = RandomBytes(rng, 1000);
  const std::string tail = RandomBytes(rng, 12u << 20);  // a torn tail longer than the append
  const std::string data = RandomBytes(rng, 9u << 20);
  for (StateFiles* files : {StateFiles::Direct(), StateFiles::Default()}) {
    for (int64_t fail_after : {int64_t{0}, int64_t{5000}, int64_t{6} << 20}) {
      SCOPED_TRACE(::testing::Message() << "fail after " << fail_after);
      const std::filesystem::path path = dir.path() / "s.sdmlog";
      ASSERT_TRUE(StateFiles::Default()->WriteAtomically(path, head + tail).ok());
      const absl::Status s =
          files->WriteAt(path, head.size(), PiecewiseSource(data, 5, fail_after), /*sync=*/false);
      EXPECT_EQ(s.message(), "the producer failed");
      const std::string got = ReadAll(path);
      ASSERT_GE(got.size(), head.size());
      EXPECT_EQ(got.substr(0, head.size()), head);
      EXPECT_LE(got.size() - head.size(), static_cast<size_t>(fail_after));
      EXPECT_EQ(got.substr(head.size()), data.substr(0, got.size() - head.size()));
    }
  }
}

// A delta log as the store writes it: appends of records of any size at the end of the last good
// one (unaligned), and after a torn tail, a record written over it (the file is cut after it).
TEST(StateFilesTest, DirectLogAppendsMatchTheBufferedFileSystem) {
  testing::ScopedTempDir dir;
  const uint64_t fresh = std::random_device{}();
  for (uint64_t seed : {uint64_t{1}, uint64_t{2}, uint64_t{3}, fresh}) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    std::mt19937_64 rng(seed);
    const std::filesystem::path direct = dir.path() / "direct.sdmlog";
    const std::filesystem::path buffered = dir.path() / "buffered.sdmlog";
    StateFiles::Default()->Remove(direct).IgnoreError();
    StateFiles::Default()->Remove(buffered).IgnoreError();
    std::string expected;
    for (int i = 0; i < 14; ++i) {
      // Small records (within a block), ones that cross a block boundary, large ones.
      const size_t kinds[] = {40, 3000, 4096, 5000, 70000, (4u << 20) + 777};
      const size_t size = kinds[rng() % 6] + rng() % 97;
      uint64_t at = expected.size();
      if (i > 0 && rng() % 4 == 0) {
        // A torn tail: the next record goes over the end of an earlier one.
        at -= std::min<uint64_t>(expected.size(), rng() % 6000);
      }
      const std::string data = RandomBytes(rng, size);
      const bool sync = rng() % 4 == 0;
      // As one string or in pieces (the store's deltas), alternately.
      // With fields patched after the pass (a delta's frame checksum), both ways.
      if (rng() % 2 == 0) {
        ASSERT_TRUE(StateFiles::Direct()->WriteAt(direct, at, data, sync).ok());
      } else {
        const PiecewiseSource source(data, rng(), -1, DeferredFields(rng, size, at));
        ASSERT_TRUE(StateFiles::Direct()->WriteAt(direct, at, source, sync).ok());
        EXPECT_EQ(source.emits(), 0);
      }
      ASSERT_TRUE(StateFiles::Default()
                      ->WriteAt(buffered, at,
                                PiecewiseSource(data, rng(), -1, DeferredFields(rng, size, at)),
                                sync)
                      .ok());
      expected.resize(at);
      expected += data;
      ASSERT_EQ(ReadAll(direct), expected) << "record " << i << " at " << at;
      ASSERT_EQ(ReadAll(buffered), expected) << "record " << i << " at " << at;
    }
  }
}

// A source naming a deferred field outside its content (a broken source; an offset so large that
// offset + 8 wraps around, as a field "before" the content would): the write is refused, and
// nothing before the record's offset changes. Both file systems, both write paths.
class BadFieldSource : public ByteSource {
 public:
  explicit BadFieldSource(std::string data) : data_(std::move(data)) {}
  uint64_t size() const override { return data_.size(); }
  absl::Status Emit(Sink sink) const override { return sink(data_); }
  absl::Status EmitOnePass(Sink sink, std::vector<Patch>& patches) const override {
    SDM_RETURN_IF_ERROR(sink(data_));
    patches.push_back({std::numeric_limits<uint64_t>::max() - 3, 0x0102030405060708});
    return absl::OkStatus();
  }

 private:
  std::string data_;
};

TEST(StateFilesTest, AFieldOutsideTheSourceIsRefused) {
  testing::ScopedTempDir dir;
  std::mt19937_64 rng(17);
  const std::string head = RandomBytes(rng, 12287);
  for (StateFiles* files : {StateFiles::Direct(), StateFiles::Default()}) {
    const std::filesystem::path path = dir.path() / "bad.sdmlog";
    ASSERT_TRUE(StateFiles::Default()->WriteAtomically(path, head).ok());
    const absl::Status s =
        files->WriteAt(path, head.size(), BadFieldSource(RandomBytes(rng, 5000)));
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_NE(s.message().find("past the data's end"), std::string::npos) << s;
    EXPECT_EQ(ReadAll(path).substr(0, head.size()), head);
  }
}

// Runs `during` inside each write of a temporary file, after its data is written.
class WatchedWriteFiles : public StateFiles {
 public:
  explicit WatchedWriteFiles(std::function<void(const std::filesystem::path&)> during)
      : during_(std::move(during)) {}

 protected:
  absl::Status WriteAndSync(const std::filesystem::path& path, const ByteSource& data,
                            bool sync) override {
    SDM_RETURN_IF_ERROR(StateFiles::WriteAndSync(path, data, sync));
    during_(path);
    return absl::OkStatus();
  }

 private:
  std::function<void(const std::filesystem::path&)> during_;
};

// Each write has a temporary file of its own (two writers of one path never write one file), and
// holds it locked until it is renamed: RemoveStrayTemp (a store opening a shared directory)
// leaves it then, and removes it once no writer holds it (a crash's leftover).
TEST(StateFilesTest, EachWriteHasItsOwnTemporaryFileLockedUntilRenamed) {
  testing::ScopedTempDir dir;
  const std::filesystem::path path = dir.path() / "s.sdmstate";
  std::vector<std::string> names;
  WatchedWriteFiles files([&](const std::filesystem::path& tmp) {
    names.push_back(tmp.filename().string());
    const absl::Status removed = files.RemoveStrayTemp(tmp);
    EXPECT_TRUE(absl::IsFailedPrecondition(removed)) << removed;
    EXPECT_TRUE(std::filesystem::exists(tmp));
  });
  for (const char* data : {"first", "second"}) {
    ASSERT_TRUE(files.WriteAtomically(path, data).ok());
    EXPECT_EQ(ReadAll(path), data);
  }
  ASSERT_EQ(names.size(), 2u);
  EXPECT_NE(names[0], names[1]);
  for (const std::string& name : names) {
    EXPECT_TRUE(absl::StartsWith(name, "s.sdmstate.") && absl::EndsWith(name, ".tmp")) << name;
  }
  EXPECT_EQ(TempFiles(dir.path()), 0);

  // A file held by a writer (another process: its own open and flock, as Lock makes them) stays;
  // a leftover goes.
  const std::filesystem::path tmp = dir.path() / "s.sdmstate.1-00000000000000ab-3.tmp";
  ASSERT_TRUE(StateFiles::Default()->WriteAt(tmp, 0, "partial").ok());
  {
    absl::StatusOr<std::unique_ptr<FileLock>> writer = StateFiles::Default()->Lock(tmp, true);
    ASSERT_TRUE(writer.ok()) << writer.status();
    EXPECT_TRUE(absl::IsFailedPrecondition(StateFiles::Default()->RemoveStrayTemp(tmp)));
    EXPECT_TRUE(std::filesystem::exists(tmp));
  }
  EXPECT_TRUE(StateFiles::Default()->RemoveStrayTemp(tmp).ok());
  EXPECT_FALSE(std::filesystem::exists(tmp));
  EXPECT_TRUE(StateFiles::Default()->RemoveStrayTemp(tmp).ok());  // gone already
}

// An append past the file's end (never made by the store, which appends at its good length)
// leaves the gap as a read of a hole gives it: zeros.
TEST(StateFilesTest, DirectWritePastTheEndLeavesZeros) {
  testing::ScopedTempDir dir;
  std::mt19937_64 rng(11);
  const std::filesystem::path path = dir.path() / "gap.sdmlog";
  const std::string head = RandomBytes(rng, 100);
  const std::string tail = RandomBytes(rng, 9000);
  ASSERT_TRUE(StateFiles::Direct()->WriteAt(path, 0, head).ok());
  ASSERT_TRUE(StateFiles::Direct()->WriteAt(path, 300, tail).ok());
  EXPECT_EQ(ReadAll(path), head + std::string(200, '\0') + tail);
}

}  // namespace
}  // namespace sdm
