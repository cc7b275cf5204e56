// A StateFiles that knows what a power loss (or a kernel crash) would leave of the files written
// through it, for tests of --persist_sync=write: CopyDurable() writes that into another directory,
// where a new store opens it as a restarted server would.
//
// The model is the weakest order a journaling file system keeps, XFS's: every change of names and
// sizes (a file created or cut, a rename, a removal) is durable at once, in the order made, and a
// file's data only once it is fsynced (Sync(), a write with sync) or written back (WriteBack()).
// Data written otherwise is lost, and what is lost is the file's end (a size reaches the disk
// with its data): a file created and renamed without its data written out is found empty under
// its new name. Real file systems keep more (ext4 writes a file renamed over another first, and
// writes back dirty data within seconds); what survives here survives there.
//
// Everything else is FaultInjectionFiles (its faults and counters work as there). Thread-safe.
#ifndef SDMSERVE_TESTS_STATE_STORE_POWER_LOSS_FILES_H_
#define SDMSERVE_TESTS_STATE_STORE_POWER_LOSS_FILES_H_

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "state_store/byte_source.h"
#include "tests/state_store/fault_injection_files.h"

namespace sdm::testing {

class PowerLossFiles : public FaultInjectionFiles {
 public:
  // Writes what a power loss at this instant would leave of the regular files under `dir` into
  // `to` (created), with the same relative names. Files never written through this object (the
  // directory's lock) are copied as they are.
  void CopyDurable(const std::filesystem::path& dir, const std::filesystem::path& to) const {
    absl::MutexLock lock(&mu_);
    for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
      if (!entry.is_regular_file()) continue;
      const std::filesystem::path target = to / std::filesystem::relative(entry.path(), dir);
      std::filesystem::create_directories(target.parent_path());
      const auto known = durable_.find(Key(entry.path()));
      if (known == durable_.end()) {
        std::filesystem::copy_file(entry.path(), target);
        continue;
      }
      std::ofstream(target, std::ios::binary | std::ios::trunc) << known->second;
    }
  }

  using FaultInjectionFiles::WriteAt;
  absl::Status WriteAt(const std::filesystem::path& path, uint64_t offset, const ByteSource& data,
                       bool sync) override {
    const absl::Status status = FaultInjectionFiles::WriteAt(path, offset, data, sync);
    absl::MutexLock lock(&mu_);
    std::string& durable = durable_[Key(path)];
    if (sync && status.ok()) {
      durable = Current(path);
    } else if (durable.size() > offset) {
      durable.resize(offset);  // the cut is durable; the appended data is not
    }
    return status;
  }
  absl::Status Sync(const std::filesystem::path& path) override {
    const absl::Status status = FaultInjectionFiles::Sync(path);
    if (status.ok()) MakeDurable(path);
    return status;
  }
  absl::Status WriteBack(const std::filesystem::path& path) override {
    const absl::Status status = FaultInjectionFiles::WriteBack(path);
    if (status.ok()) MakeDurable(path);
    return status;
  }
  absl::Status Rename(const std::filesystem::path& from, const std::filesystem::path& to) override {
    const absl::Status status = FaultInjectionFiles::Rename(from, to);
    if (!status.ok()) return status;
    absl::MutexLock lock(&mu_);
    auto node = durable_.extract(Key(from));
    // Renamed with whatever of its data is durable (none, for a file this object never saw).
    durable_[Key(to)] = node.empty() ? std::string() : std::move(node.mapped());
    return status;
  }
  absl::Status Remove(const std::filesystem::path& path) override {
    const absl::Status status = FaultInjectionFiles::Remove(path);
    if (status.ok()) {
      absl::MutexLock lock(&mu_);
      durable_.erase(Key(path));
    }
    return status;
  }

 protected:
  absl::Status WriteAndSync(const std::filesystem::path& path, const ByteSource& data,
                            bool sync) override {
    const absl::Status status = FaultInjectionFiles::WriteAndSync(path, data, sync);
    absl::MutexLock lock(&mu_);
    // Created or cut to nothing (durable at once), then written: durable only when synced.
    durable_[Key(path)] = sync && status.ok() ? Current(path) : std::string();
    return status;
  }

 private:
  static std::string Key(const std::filesystem::path& path) {
    return std::filesystem::weakly_canonical(path).string();
  }
  // The file's bytes now (empty if it is gone), read without counting as the store's read.
  static std::string Current(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  void MakeDurable(const std::filesystem::path& path) {
    absl::MutexLock lock(&mu_);
    durable_[Key(path)] = Current(path);
  }

  mutable absl::Mutex mu_;
  // Path (canonical) -> the bytes a power loss would leave in it.
  std::map<std::string, std::string> durable_ ABSL_GUARDED_BY(mu_);
};

}  // namespace sdm::testing

#endif  // SDMSERVE_TESTS_STATE_STORE_POWER_LOSS_FILES_H_
