#include "store/cache/backing_source.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <tuple>
#include <utility>
#include <vector>

namespace ckptfs::store {
namespace {

uint64_t RoundUp(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

int64_t MtimeNs(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

bool SameVersion(const BlockId& id, const struct stat& st) {
  return static_cast<uint64_t>(st.st_size) == id.size && MtimeNs(st) == id.mtime_ns;
}

Status Stale(const BlockId& id, const struct stat& st) {
  return Status(Code::kAborted, "stale block id: " + id.path + " is now size " +
                                    std::to_string(st.st_size) + " mtime " +
                                    std::to_string(MtimeNs(st)) + ", asked for size " +
                                    std::to_string(id.size) + " mtime " +
                                    std::to_string(id.mtime_ns));
}

}  // namespace

BlockId BlockIdFromStat(std::string path, const struct stat& st) {
  return BlockId{std::move(path), static_cast<uint64_t>(st.st_size), MtimeNs(st)};
}

bool BlockIdLess::operator()(const BlockId& a, const BlockId& b) const {
  return std::tie(a.path, a.size, a.mtime_ns) < std::tie(b.path, b.size, b.mtime_ns);
}

Result<std::unique_ptr<BackingSource>> BackingSource::Create(BackingDir* dir,
                                                             const BackingSourceOptions& options) {
  if (dir == nullptr) return Invalid("backing source: no backing directory");
  if (options.max_open_files == 0) return Invalid("backing source: max_open_files must be >= 1");
  return std::unique_ptr<BackingSource>(new BackingSource(dir, options));
}

BackingSource::~BackingSource() = default;

BackingSource::File& BackingSource::BindLocked(const BlockId& id, File file) {
  auto it = files_.find(id);
  if (it != files_.end()) {
    lru_.erase(it->second.lru_pos);
    it->second = std::move(file);
  } else {
    it = files_.emplace(id, std::move(file)).first;
  }
  SweepLocked();
  lru_.push_front(id);
  it->second.lru_pos = lru_.begin();
  if (it->second.fd) CloseUnlinkedLocked(id);
  while (files_.size() > opts_.max_open_files) EraseLocked(files_.find(lru_.back()));
  return it->second;
}

void BackingSource::SweepLocked() {
  for (auto it = files_.begin(); it != files_.end();) {
    if (!it->second.fd && it->second.borrowed.expired()) {
      lru_.erase(it->second.lru_pos);
      it = files_.erase(it);
    } else {
      ++it;
    }
  }
}

void BackingSource::CloseUnlinkedLocked(const BlockId& keep) {
  // A descriptor opened here whose file has no name left: another node deleted it (this
  // node never sees that unlink), and the descriptor would keep the deleted file's space
  // allocated on the backing store until evicted (the two-node soak of stop 53: 508
  // descriptors of deleted shards on one node). A few bindings a bind, in turn, so that a
  // bind costs a bounded number of fstat() calls and every binding is looked at within
  // max_open_files / kChecks binds of files opened here.
  constexpr size_t kChecks = 8;
  if (files_.empty()) return;
  unlink_next_ %= files_.size();
  auto it = std::next(files_.begin(), static_cast<std::ptrdiff_t>(unlink_next_));
  std::vector<std::map<BlockId, File, BlockIdLess>::iterator> gone;
  for (size_t n = 0; n < std::min(kChecks, files_.size()); ++n) {
    struct stat st;
    if (it->second.fd && it->first != keep && ::fstat(it->second.fd->get(), &st) == 0 &&
        st.st_nlink == 0) {
      gone.push_back(it);
    }
    if (++it == files_.end()) it = files_.begin();
  }
  unlink_next_ += kChecks;
  for (auto g : gone) EraseLocked(g);
}

void BackingSource::EraseLocked(std::map<BlockId, File, BlockIdLess>::iterator it) {
  lru_.erase(it->second.lru_pos);
  files_.erase(it);  // a read in flight keeps its own references to the descriptors
}

bool BackingSource::Adopt(const BlockId& id, std::shared_ptr<const UniqueFd> fd,
                          const struct stat& st,
                          const std::function<void(const std::string& path)>& drop_cached) {
  const uint64_t dev = static_cast<uint64_t>(st.st_dev);
  const uint64_t ino = static_cast<uint64_t>(st.st_ino);
  MutexLock lock(&mu_);
  bool replaced = false;
  // Other versions of the path go: the caller has just seen which one is current.
  for (auto it = files_.lower_bound(BlockId{id.path, 0, INT64_MIN});
       it != files_.end() && it->first.path == id.path;) {
    if (it->first == id) {
      if (it->second.dev == dev && it->second.ino == ino) {
        it->second.vouched = true;  // the same file: keep its O_DIRECT twin
        if (!it->second.fd) it->second.borrowed = fd;
        lru_.splice(lru_.begin(), lru_, it->second.lru_pos);
        return false;
      }
      replaced = true;
    }
    EraseLocked(it++);
  }
  // Readers of the new file wait on mu_ in Adopt until the old file's blocks are gone.
  if (replaced && drop_cached) drop_cached(id.path);
  File file;
  file.borrowed = fd;  // borrowed: closes with the caller's handle
  file.vouched = true;
  file.dev = dev;
  file.ino = ino;
  BindLocked(id, std::move(file));
  return replaced;
}

void BackingSource::Forget(const std::string& path) {
  MutexLock lock(&mu_);
  for (auto it = files_.lower_bound(BlockId{path, 0, INT64_MIN});
       it != files_.end() && it->first.path == path;) {
    EraseLocked(it++);
  }
}

Result<BackingSource::Use> BackingSource::Acquire(const BlockId& id) {
  {
    MutexLock lock(&mu_);
    if (auto it = files_.find(id); it != files_.end()) {
      const File& f = it->second;
      if (auto fd = FdOf(f)) {
        lru_.splice(lru_.begin(), lru_, it->second.lru_pos);
        return Use{fd, f.direct, f.vouched, f.direct_tried, f.dev};
      }
      EraseLocked(it);  // its owner closed the lent descriptor: open by path
    }
  }
  // Not open: by path, confined to the backing directory.
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, dir_->OpenFile(id.path, O_RDONLY));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return Status::FromErrno(errno, "fstat " + id.path);
  MutexLock lock(&mu_);
  ++stats_.opens;
  if (!SameVersion(id, st)) {
    ++stats_.stale;
    return Stale(id, st);
  }
  if (auto it = files_.find(id); it != files_.end()) {  // another reader got here first
    const File& f = it->second;
    if (auto bound = FdOf(f)) return Use{bound, f.direct, f.vouched, f.direct_tried, f.dev};
    EraseLocked(it);
  }
  File file;
  file.fd = std::make_shared<const UniqueFd>(std::move(fd));
  file.dev = static_cast<uint64_t>(st.st_dev);
  file.ino = static_cast<uint64_t>(st.st_ino);
  const File& f = BindLocked(id, std::move(file));
  return Use{f.fd, f.direct, f.vouched, f.direct_tried, f.dev};
}

bool BackingSource::NoDirectLocked(uint64_t dev) const {
  return std::find(no_direct_devs_.begin(), no_direct_devs_.end(), dev) != no_direct_devs_.end();
}

void BackingSource::NoDirectIo(uint64_t dev) {
  MutexLock lock(&mu_);
  if (!NoDirectLocked(dev)) no_direct_devs_.push_back(dev);
  for (auto& [id, file] : files_) {
    if (file.dev == dev) file.direct.reset();
  }
}

std::shared_ptr<const UniqueFd> BackingSource::DirectFd(const BlockId& id, const Use& use) {
  {
    MutexLock lock(&mu_);
    if (NoDirectLocked(use.dev)) return nullptr;
  }
  // Reopen the very inode `use.fd` refers to: no path is looked up, so confinement holds.
  const std::string self = "/proc/self/fd/" + std::to_string(use.fd->get());
  // /proc/self/fd entries are magic links; O_NOFOLLOW refuses them on some kernels (6.x:
  // ELOOP). Once refused it is not asked for again: a twin of a borrowed descriptor is
  // opened for every block read, and the refused open was a third of that cost.
  static std::atomic<bool> nofollow_refused{false};
  int direct = -1;
  if (!nofollow_refused.load(std::memory_order_relaxed)) {
    direct = ::open(self.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC | O_NOFOLLOW);
    if (direct < 0 && errno == ELOOP) nofollow_refused.store(true, std::memory_order_relaxed);
  }
  if (direct < 0 && nofollow_refused.load(std::memory_order_relaxed)) {
    direct = ::open(self.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  }
  const int open_errno = errno;
  std::shared_ptr<const UniqueFd> shared;
  if (direct >= 0) {
    struct stat st;
    if (::fstat(direct, &st) == 0 && static_cast<uint64_t>(st.st_dev) == use.dev) {
      shared = std::make_shared<const UniqueFd>(direct);
    } else {
      ::close(direct);
    }
  }
  MutexLock lock(&mu_);
  if (direct < 0 && open_errno == EINVAL && !NoDirectLocked(use.dev)) {
    no_direct_devs_.push_back(use.dev);  // no O_DIRECT on this device
  }
  // Only an owned descriptor keeps its twin: a borrowed one's twin would outlive the
  // owner's close, so it serves this read only.
  if (auto it = files_.find(id); it != files_.end() && it->second.fd && it->second.fd == use.fd) {
    it->second.direct_tried = true;
    if (!it->second.direct) it->second.direct = shared;
    return it->second.direct;
  }
  return shared;  // the binding went meanwhile: use it for this read only
}

Result<BlockRead> BackingSource::ReadBlock(const BlockId& id, uint64_t offset,
                                           std::span<char> out) {
  if (offset > id.size) {
    return Invalid("read at " + std::to_string(offset) + " past the end of " + id.path + " (" +
                   std::to_string(id.size) + " bytes)");
  }
  CKPT_ASSIGN_OR_RETURN(Use use, Acquire(id));
  if (!use.vouched) {
    // Opened by path: nobody vouches for it, so check it is still the version asked for.
    struct stat st;
    if (::fstat(use.fd->get(), &st) != 0) return Status::FromErrno(errno, "fstat " + id.path);
    if (!SameVersion(id, st)) {
      MutexLock lock(&mu_);
      ++stats_.stale;
      if (auto it = files_.find(id); it != files_.end() && it->second.fd == use.fd) {
        EraseLocked(it);
      }
      return Stale(id, st);
    }
  }
  const uint64_t want = std::min<uint64_t>(out.size(), id.size - offset);
  BlockRead read;
  if (want == 0) return read;

  Result<size_t> got = size_t{0};
  bool direct = false;
  const bool aligned = offset % kDirectIoAlign == 0 &&
                       reinterpret_cast<uintptr_t>(out.data()) % kDirectIoAlign == 0 &&
                       out.size() >= RoundUp(want, kDirectIoAlign);
  if (opts_.direct_io && aligned) {
    std::shared_ptr<const UniqueFd> dfd = use.direct;
    if (!dfd && !use.direct_tried) dfd = DirectFd(id, use);
    if (dfd) {
      // Aligned length into an aligned buffer; a file that grew in place may return more
      // than `want`, which is not this version's to serve.
      got = dir_->PRead(dfd->get(), out.data(), RoundUp(want, kDirectIoAlign),
                        static_cast<off_t>(offset));
      if (!got.ok() && got.status().code() == Code::kInvalid) {
        NoDirectIo(use.dev);  // the file system took the open but not the read
      } else {
        direct = true;
      }
    }
  }
  if (!direct) got = dir_->PRead(use.fd->get(), out.data(), want, static_cast<off_t>(offset));
  if (!got.ok()) return got.status();
  read.bytes = std::min<size_t>(*got, want);
  MutexLock lock(&mu_);
  ++stats_.reads;
  stats_.bytes_read += read.bytes;
  if (direct) stats_.direct_bytes_read += read.bytes;
  return read;
}

BackingSourceStats BackingSource::Stats() const {
  MutexLock lock(&mu_);
  BackingSourceStats s = stats_;
  for (const auto& [id, f] : files_) s.open_fds += (f.fd ? 1 : 0) + (f.direct ? 1 : 0);
  return s;
}

}  // namespace ckptfs::store
