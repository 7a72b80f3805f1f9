// Reads one DCP item, a torch.save zip archive, far enough to locate a tensor's raw bytes.
//
// Every DCP item (see DCP_FORMAT.md) is a complete torch.save archive. For a plain tensor,
// `<archive>/data.pkl` (protocol 2) is a `_rebuild_tensor_v2`/`_v3` call on a persistent-id
// storage, and the storage bytes are the STORED record `<archive>/data/<key>`. This reader
// parses the zip central directory (zip64 included), the data.pkl pickle (never executing
// it, see pickle.h), and the record's LOCAL header, and reports dtype, shape, stride,
// storage offset and the item-relative byte range of the storage.
//
// It never misreads: anything it cannot vouch for is reported as opaque (is_tensor=false
// with a reason) rather than guessed: compressed or encrypted records, big-endian or unknown
// byte order, pickles that are not a single plain tensor (bytes items, quantized or sparse
// tensors, tensor subclasses, unknown dtypes). A structurally broken archive (truncated,
// offsets past the end, inconsistent sizes) is a Corrupt error. Hostile input never crashes
// and never makes the reader allocate more than ZipLimits allows.
//
// The tensor data itself is never read; only the directory, the local headers, data.pkl and
// the byteorder record are. Pure functions, thread-safe if `read` is.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "store/dcp/dcp_metadata.h"

namespace ckptfs::store {

// Fills `dst` with the item's bytes at item-relative `offset`. A short read is an error.
using ReadAtFn = std::function<Status(uint64_t offset, std::span<char> dst)>;

struct ZipLimits {
  uint32_t max_entries = 1u << 16;
  uint64_t max_central_directory_bytes = 16ull << 20;
  // data.pkl of a tensor is a few hundred bytes; a larger one is treated as opaque.
  uint64_t max_pickle_bytes = 1ull << 20;
};

struct ZipEntry {
  std::string name;
  uint16_t flags = 0;
  uint16_t method = 0;  // 0 = STORED
  uint32_t crc32 = 0;
  uint64_t compressed_size = 0, uncompressed_size = 0;
  uint64_t local_header_offset = 0;
  bool encrypted() const { return (flags & 1) != 0; }
};

struct ZipDirectory {
  std::vector<ZipEntry> entries;
  uint64_t central_directory_offset = 0;  // record data must end at or before this
  const ZipEntry* Find(std::string_view name) const;
};

// Parses the end-of-central-directory records (zip64 when present) and the central
// directory of an archive of `size` bytes. Names must be unique.
Result<ZipDirectory> ReadZipDirectory(const ReadAtFn& read, uint64_t size,
                                      const ZipLimits& limits = {});

// Item-relative offset of `entry`'s data: local_header_offset + 30 + name_len + extra_len,
// read from the LOCAL header, whose extra field (alignment padding) differs from the
// central one. Checks that the data lies before the central directory.
Result<uint64_t> ZipDataOffset(const ReadAtFn& read, const ZipDirectory& dir,
                               const ZipEntry& entry);

struct TorchSaveTensor {
  bool is_tensor = false;
  std::string opaque_reason;  // set when !is_tensor
  std::string dtype;          // "float32", ...
  std::vector<int64_t> shape, stride;
  int64_t storage_offset = 0;  // in elements
  std::string storage_key;     // persistent-id key, e.g. "0"
  std::string record_name;     // e.g. "archive/data/0"
  uint64_t data_offset = 0;    // item-relative offset of the storage bytes
  uint64_t data_nbytes = 0;    // size of the storage record
};

Result<TorchSaveTensor> ParseTorchSaveItem(const ReadAtFn& read, uint64_t size,
                                           const ZipLimits& limits = {});
Result<TorchSaveTensor> ParseTorchSaveItem(std::string_view item, const ZipLimits& limits = {});

// Remembers how data.pkl records were interpreted, by their exact bytes. Chunks of one
// checkpoint with the same dtype, shape, stride and storage size have byte-identical data.pkl
// records (torch.save puts no per-item id, checksum or path in them; those live in the zip
// headers, which are still parsed per item), so a build over many chunks interprets each
// distinct record once. Results are exactly those without a cache. Bounded in entries and
// key size. Not thread-safe: one per thread.
class TorchPickleCache {
 public:
  TorchPickleCache();
  ~TorchPickleCache();
  TorchPickleCache(const TorchPickleCache&) = delete;
  TorchPickleCache& operator=(const TorchPickleCache&) = delete;
  uint64_t hits() const;
  uint64_t misses() const;

  struct Impl;

 private:
  friend Result<TorchSaveTensor> ParseTorchSaveItem(const ReadAtFn&, uint64_t, TorchPickleCache*,
                                                    const ZipLimits&);
  friend Result<TorchSaveTensor> ParseTorchSaveItem(std::string_view, TorchPickleCache*,
                                                    const ZipLimits&);
  std::unique_ptr<Impl> impl_;
};

// The same, with a cache (`cache` may be null).
Result<TorchSaveTensor> ParseTorchSaveItem(const ReadAtFn& read, uint64_t size,
                                           TorchPickleCache* cache, const ZipLimits& limits = {});
Result<TorchSaveTensor> ParseTorchSaveItem(std::string_view item, TorchPickleCache* cache,
                                           const ZipLimits& limits = {});

// Completes a kTensor `item` with what its archive says (`t`, parsed from the item's bytes):
// sets data_resolved, raw_offset (file-absolute), raw_nbytes, stride and storage_offset.
// An opaque archive turns the item kOpaque, since its bytes cannot be served as raw tensor
// data. An archive that contradicts the metadata (dtype, shape, a data range outside the
// item) is Corrupt. Other item kinds are left unchanged.
Status ResolveItemData(const TorchSaveTensor& t, DcpItem* item);

// What ResolveItemData() checks of a kTensor item, borrowed (fqn and file only name it in
// errors), for callers that keep items in another type.
struct ItemFacts {
  std::string_view fqn, file, dtype;
  std::span<const int64_t> chunk_sizes;
  uint64_t length = 0;
};
// The checks of ResolveItemData() for an archive that is a tensor (t.is_tensor): OK, or the
// same Corrupt error. The item's raw bytes are then [offset + t.data_offset, +t.data_nbytes).
Status CheckItemData(const TorchSaveTensor& t, const ItemFacts& item);

// Bytes per element of a torch dtype name ("bfloat16" -> 2); 0 if unknown or sub-byte.
int DtypeItemSize(std::string_view dtype);

}  // namespace ckptfs::store
