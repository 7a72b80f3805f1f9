// TensorView: /.ckptfs/tensors/<checkpoint path>/<fqn>/ — every indexed checkpoint as a
// browsable directory of tensors.
//
// Each fqn directory holds one file per chunk with its raw bytes (exact size; the dtype
// and shape in meta.json turn it into the tensor), `meta.json`, and bytes items as
// files. Directories above a checkpoint mirror the backing store's directories; a
// directory holding a commit file (`.metadata`, `__{rank}.metadata`, a safetensors index or
// model.safetensors: store/dcp/checkpoint_source.h) is a checkpoint, indexed on first look.
//
// Thread-safe. Inode numbers are allocated from kFirstIno upwards and stay stable for the
// life of the daemon.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "store/dcp/key_index.h"
#include "store/primitives/backing_dir.h"

namespace ckptfs::fs {

class TensorView {
 public:
  static constexpr uint64_t kRootIno = 6;             // /.ckptfs/tensors
  static constexpr uint64_t kFirstIno = 1ull << 48;   // the view's other inodes

  TensorView(store::BackingDir* backing, store::KeyIndex* index)  // both must outlive
      : backing_(backing), index_(index) {}

  static bool Owns(uint64_t ino) { return ino == kRootIno || ino >= kFirstIno; }

  struct Entry {
    uint64_t ino;
    struct stat attr;
  };
  struct DirEnt {
    std::string name;
    uint64_t ino;
    mode_t type;
  };

  Result<Entry> Lookup(uint64_t parent, const std::string& name);
  Result<struct stat> GetAttr(uint64_t ino);
  Result<std::vector<DirEnt>> List(uint64_t ino);
  // Opens a chunk or meta.json; `content` gets meta.json's text, `fd` the backing file.
  Status Open(uint64_t ino, std::string* content, std::shared_ptr<UniqueFd>* fd,
              uint64_t* base, uint64_t* size);

 private:
  enum class Kind { kDir, kCheckpoint, kFqn, kChunk, kMeta };
  struct VNode {
    uint64_t ino;
    Kind kind;
    std::string path;  // backing path of the (checkpoint) directory
    std::string fqn;
    std::optional<store::IndexedItem> item;  // chunks
  };

  std::shared_ptr<VNode> Get(uint64_t ino);
  std::shared_ptr<VNode> Intern(Kind kind, const std::string& path, const std::string& fqn,
                                const std::string& leaf,
                                std::optional<store::IndexedItem> item = std::nullopt);
  struct stat AttrOf(const VNode& v);
  // The chunks of one fqn (no copy of the whole index).
  Result<std::vector<store::IndexedItem>> ItemsOf(const std::string& ckpt, const std::string& fqn);
  bool IsCheckpoint(const std::string& path);
  static std::string MetaJson(const std::vector<store::IndexedItem>& items);

  store::BackingDir* const backing_;
  store::KeyIndex* const index_;
  Mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<VNode>> nodes_ GUARDED_BY(mu_);
  std::map<std::string, uint64_t> by_key_ GUARDED_BY(mu_);
  uint64_t next_ino_ GUARDED_BY(mu_) = kFirstIno;
};

}  // namespace ckptfs::fs
