// Reading the items of a checkpoint's shard files for the key index: windowed reads, item
// resolution against each item's torch.save archive, CRCs from write-path block CRCs, and
// the grouping of items by file (each file opened once, read forward).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"
#include "store/dcp/dcp_metadata.h"
#include "store/dcp/indexed_item.h"
#include "store/dcp/torch_zip.h"
#include "store/flush/block_crc_map.h"
#include "store/primitives/backing_dir.h"
#include "store/primitives/file_key.h"

namespace ckptfs::store::keyidx {

inline constexpr size_t kWindowCapacity = 4u << 20;
// A miss reads at least this much: enough for a run of small items, or one large item's
// head (its zip entries and the unaligned edge of its data) and no more. Issue 39: with the
// data's checksums from block CRCs, these windows are what an index build reads of each
// shard; 256 KiB made it 2-3 % of a checkpoint of 10 MiB items.
inline constexpr size_t kReadAhead = 64u << 10;
// Items up to this size are parsed from one view of the whole item (they are read anyway,
// since windows are bigger than they are); larger ones only through their head and tail.
inline constexpr uint64_t kWholeItemMax = 64u << 10;
// A large item's zip directory is read with this much before the item's end.
inline constexpr uint64_t kTailWindow = 64u << 10;

// Bytes of one version of a backing file that memory still holds, so that an index build
// reads none of them back from the backing store: the retained tier keeps the checkpoint
// that was just committed (store/cache/retained_bytes.h), and the build after that commit
// reads its zip headers and the unaligned edges of its items (per item, 8-20 % of a
// checkpoint of 4 MiB items). Thread-safe.
class HeldBytes {
 public:
  virtual ~HeldBytes() = default;
  // Copies [off, off + out.size()) of `path` (relative to the backing root) at version
  // `key` into `out` when memory holds all of it, checked; false otherwise (`out` is then
  // unspecified, and the caller reads the backing store).
  virtual bool Read(const std::string& path, const FileKey& key, uint64_t off,
                    std::span<char> out) = 0;
};

// Serves reads of one open shard file from two read-ahead windows, so that the small reads
// of the zip reader over many back-to-back items cost few syscalls. Two, because the zip
// reader of a large item reads its tail (directory) before its head (data.pkl): the window
// read for one item's tail runs on into the next item's head, and stays while the next
// item's tail is read into the other. Not thread-safe (one per build or verify pass).
class WindowReader {
 public:
  WindowReader(BackingDir* dir, int fd, uint64_t file_size)
      : dir_(dir), fd_(fd), size_(file_size) {}

  // [off, off+len) of the file; len <= kWindowCapacity. Valid until the second-next call.
  // On a miss, the window read starts at `off`, or at `tail_start_` when `off` lies in the
  // tail of the item being read (see ItemReader).
  Result<std::string_view> View(uint64_t off, size_t len);
  Status ReadInto(uint64_t off, std::span<char> dst);
  // CRC32C of [off, off+len).
  Result<uint32_t> Crc(uint64_t off, uint64_t len);
  // Reads of the item [item_offset, item_offset+item_length), for the zip reader. Also makes
  // a miss in the item's last kTailWindow bytes read that whole tail at once.
  ReadAtFn ItemReader(uint64_t item_offset, uint64_t item_length);
  // Parses the torch.save archive of the item [offset, offset+length): a small item from
  // one view of it, a large one through reads of its head and tail only.
  Result<TorchSaveTensor> ParseItem(uint64_t offset, uint64_t length, TorchPickleCache* cache);
  // Windows are filled from `held` (may be null) where it holds them: the file is `path` at
  // version `key` (the one `fd` reads).
  void ServeFrom(HeldBytes* held, std::string path, const FileKey& key) {
    held_ = held;
    path_ = std::move(path);
    key_ = key;
  }
  uint64_t bytes_from_memory() const { return from_memory_; }
  uint64_t bytes_from_backing() const { return from_backing_; }

 private:
  struct Slot {
    std::unique_ptr<char[]> buf;
    uint64_t off = 0;
    size_t len = 0;
    uint64_t used = 0;  // clock_ at the last hit: the older slot is refilled
  };
  BackingDir* dir_;
  int fd_;
  uint64_t size_;
  Slot slots_[2];
  uint64_t clock_ = 0;
  uint64_t tail_start_ = 0, tail_end_ = 0;
  HeldBytes* held_ = nullptr;
  std::string path_;
  FileKey key_;
  uint64_t from_memory_ = 0, from_backing_ = 0;
};

struct OpenedFile {
  UniqueFd fd;
  uint64_t size = 0;
  FileKey key;  // the version opened
};

Result<OpenedFile> OpenShard(BackingDir* dir, const std::string& path);

// CRC32C of the item [off, off+len) of a file of `file_size` bytes from its block CRCs: the
// whole blocks inside the item come from `blocks`, the unaligned edges (under one block
// each, usually in the window the zip parse just read) from `reader`. nullopt when a block
// is unknown.
Result<std::optional<uint32_t>> CrcFromBlocks(WindowReader* reader, const BlockCrcMap& blocks,
                                              uint64_t off, uint64_t len, uint64_t file_size);

// Takes the fields of `d` (moved from when the caller passes an rvalue).
template <typename D>
IndexedItem FromDcp(D&& d, uint32_t ordinal) {
  IndexedItem it;
  it.kind = d.kind;
  it.fqn = std::forward<D>(d).fqn;
  it.chunk_offsets = std::forward<D>(d).chunk_offsets;
  it.chunk_sizes = std::forward<D>(d).chunk_sizes;
  it.global_size = std::forward<D>(d).global_size;
  it.stride = std::forward<D>(d).stride;
  it.dtype = std::forward<D>(d).dtype;
  it.file = std::forward<D>(d).file;
  it.offset = d.offset;
  it.length = d.length;
  it.raw_offset = d.raw_offset;
  it.raw_nbytes = d.raw_nbytes;
  it.storage_offset = d.storage_offset;
  it.transforms = std::forward<D>(d).transforms;
  it.is_bytes = d.is_bytes;
  it.ordinal = ordinal;
  return it;
}

// Resolves a kTensor item from its archive; turns it kOpaque (with `*error`) when the
// archive is broken or contradicts the metadata. Opaque-by-design archives (compressed,
// big-endian, ...) turn kOpaque without an error. The same as ResolveItemData() on the item.
void ResolveTensor(WindowReader* reader, IndexedItem* item, std::string* error,
                   TorchPickleCache* cache);

// The items of one shard file, by (offset, ordinal).
struct FileGroup {
  std::string_view name;  // borrowed from the items
  std::vector<uint32_t> idx;
};

// Groups items by file, files by name, so that each shard file is opened once and read
// forward. Items usually come in offset order within a file already (DCP writes them so);
// only a group that is not gets sorted.
std::vector<FileGroup> GroupByFile(const std::vector<IndexedItem>& items);

}  // namespace ckptfs::store::keyidx
