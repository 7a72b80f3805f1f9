#include "fs/control/tensor_view.h"
#include "common/json_text.h"
#include "common/path.h"

#include <fcntl.h>

#include <cstdio>
#include <nlohmann/json.hpp>

namespace ckptfs::fs {
namespace {

constexpr auto Join = &path::Join;  // common/path.h

bool IsTensor(const store::IndexedItem& item) { return item.kind == store::ItemKind::kTensor; }

const char* KindName(store::ItemKind k) {
  switch (k) {
    case store::ItemKind::kTensor: return "tensor";
    case store::ItemKind::kBytes: return "bytes";
    case store::ItemKind::kOpaque: return "opaque";
  }
  return "opaque";
}

}  // namespace

std::shared_ptr<TensorView::VNode> TensorView::Get(uint64_t ino) {
  MutexLock lock(&mu_);
  if (ino == kRootIno && !nodes_.count(kRootIno)) {
    auto root = std::make_shared<VNode>();
    root->ino = kRootIno;
    root->kind = Kind::kDir;
    nodes_[kRootIno] = root;
  }
  auto it = nodes_.find(ino);
  return it == nodes_.end() ? nullptr : it->second;
}

std::shared_ptr<TensorView::VNode> TensorView::Intern(Kind kind, const std::string& path,
                                                      const std::string& fqn,
                                                      const std::string& leaf,
                                                      std::optional<store::IndexedItem> item) {
  std::string key;
  key.push_back(static_cast<char>('0' + static_cast<int>(kind)));
  key += path + '\0' + fqn + '\0' + leaf;
  MutexLock lock(&mu_);
  auto it = by_key_.find(key);
  if (it != by_key_.end()) {
    auto& node = nodes_[it->second];
    if (item) node->item = std::move(item);  // a rebuilt index may move the bytes
    return node;
  }
  auto node = std::make_shared<VNode>();
  node->ino = next_ino_++;
  node->kind = kind;
  node->path = path;
  node->fqn = fqn;
  node->item = std::move(item);
  nodes_[node->ino] = node;
  by_key_[key] = node->ino;
  return node;
}

bool TensorView::IsCheckpoint(const std::string& path) {
  // `.metadata`, per-rank metadata or safetensors (store/dcp/checkpoint_source.h).
  return store::FindCheckpointSource(backing_, path).ok();
}

Result<std::vector<store::IndexedItem>> TensorView::ItemsOf(const std::string& ckpt,
                                                              const std::string& fqn) {
  return index_->ItemsOf(ckpt, fqn);
}

std::string TensorView::MetaJson(const std::vector<store::IndexedItem>& items) {
  nlohmann::json j;
  nlohmann::json chunks = nlohmann::json::array();
  for (const auto& item : items) {
    if (j.empty()) {
      j["fqn"] = item.fqn;
      j["kind"] = KindName(item.kind);
      j["dtype"] = item.dtype;
      j["global_shape"] = item.global_size;
      j["checksum_algorithm"] = store::kChecksumAlgorithm;  // of each chunk's whole item
    }
    char sum[20];
    std::snprintf(sum, sizeof(sum), "%08llx", static_cast<unsigned long long>(item.checksum));
    chunks.push_back({{"file", store::ChunkFileName(item)},
                      {"offsets", item.chunk_offsets},
                      {"sizes", item.chunk_sizes},
                      {"stride", item.stride},
                      {"storage_offset", item.storage_offset},
                      {"source_file", item.file},
                      {"item_offset", item.offset},
                      {"item_length", item.length},
                      {"raw_offset", item.raw_offset},
                      {"raw_nbytes", item.raw_nbytes},
                      {"transforms", item.transforms},
                      {"checksum", item.has_checksum ? nlohmann::json(sum) : nlohmann::json()}});
  }
  j["chunks"] = chunks;
  return JsonText(j, 1) + "\n";
}

struct stat TensorView::AttrOf(const VNode& v) {
  static const struct timespec kBorn = [] {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts;
  }();
  struct stat st {};
  st.st_ino = v.ino;
  st.st_blksize = 1 << 20;
  st.st_atim = st.st_mtim = st.st_ctim = kBorn;
  switch (v.kind) {
    case Kind::kDir:
    case Kind::kCheckpoint:
    case Kind::kFqn:
      st.st_mode = S_IFDIR | 0555;
      st.st_nlink = 2;
      break;
    case Kind::kChunk:
      st.st_mode = S_IFREG | 0444;
      st.st_nlink = 1;
      st.st_size = static_cast<off_t>(IsTensor(*v.item) ? v.item->raw_nbytes : v.item->length);
      break;
    case Kind::kMeta: {
      st.st_mode = S_IFREG | 0444;
      st.st_nlink = 1;
      auto items = ItemsOf(v.path, v.fqn);
      if (items.ok()) st.st_size = static_cast<off_t>(MetaJson(*items).size());
      break;
    }
  }
  st.st_blocks = (st.st_size + 511) / 512;
  return st;
}

Result<TensorView::Entry> TensorView::Lookup(uint64_t parent, const std::string& name) {
  auto dir = Get(parent);
  if (!dir) return NotFound("stale tensor-view inode");
  std::shared_ptr<VNode> child;
  if (dir->kind == Kind::kDir) {
    const std::string path = Join(dir->path, name);
    auto st = backing_->Stat(path);
    if (!st.ok() || !S_ISDIR(st->st_mode) || name.rfind(".ckptfs", 0) == 0) return NotFound(name);
    child = Intern(IsCheckpoint(path) ? Kind::kCheckpoint : Kind::kDir, path, "", "");
  } else if (dir->kind == Kind::kCheckpoint) {
    CKPT_ASSIGN_OR_RETURN(auto fqns, index_->Fqns(dir->path));
    if (auto fqn = store::FindFqnByEscapedName(fqns, name)) {
      child = Intern(Kind::kFqn, dir->path, *fqn, "");
    }
  } else if (dir->kind == Kind::kFqn) {
    if (name == "meta.json") {
      child = Intern(Kind::kMeta, dir->path, dir->fqn, name);
    } else {
      CKPT_ASSIGN_OR_RETURN(auto items, ItemsOf(dir->path, dir->fqn));
      for (auto& item : items) {
        if (store::ChunkFileName(item) == name) {
          child = Intern(Kind::kChunk, dir->path, dir->fqn, name, item);
          break;
        }
      }
    }
  } else {
    return Status(Code::kNotDir, name);
  }
  if (!child) return NotFound(name);
  return Entry{child->ino, AttrOf(*child)};
}

Result<struct stat> TensorView::GetAttr(uint64_t ino) {
  auto v = Get(ino);
  if (!v) return NotFound("stale tensor-view inode");
  return AttrOf(*v);
}

Result<std::vector<TensorView::DirEnt>> TensorView::List(uint64_t ino) {
  auto dir = Get(ino);
  if (!dir) return NotFound("stale tensor-view inode");
  std::vector<DirEnt> out;
  if (dir->kind == Kind::kDir) {
    CKPT_ASSIGN_OR_RETURN(auto entries, backing_->List(dir->path));
    for (const auto& e : entries) {
      if (e.name.rfind(".ckptfs", 0) == 0) continue;
      const std::string path = Join(dir->path, e.name);
      auto st = backing_->Stat(path);
      if (!st.ok() || !S_ISDIR(st->st_mode)) continue;
      auto child = Intern(IsCheckpoint(path) ? Kind::kCheckpoint : Kind::kDir, path, "", "");
      out.push_back({e.name, child->ino, S_IFDIR});
    }
  } else if (dir->kind == Kind::kCheckpoint) {
    CKPT_ASSIGN_OR_RETURN(auto all, index_->Fqns(dir->path));
    std::map<std::string, std::string> fqns;
    for (auto& fqn : all) fqns.emplace(store::EscapeFqn(fqn), std::move(fqn));
    for (const auto& [escaped, fqn] : fqns) {
      out.push_back({escaped, Intern(Kind::kFqn, dir->path, fqn, "")->ino, S_IFDIR});
    }
  } else if (dir->kind == Kind::kFqn) {
    CKPT_ASSIGN_OR_RETURN(auto items, ItemsOf(dir->path, dir->fqn));
    out.push_back({"meta.json", Intern(Kind::kMeta, dir->path, dir->fqn, "meta.json")->ino,
                   S_IFREG});
    for (auto& item : items) {
      std::string name = store::ChunkFileName(item);
      out.push_back({name, Intern(Kind::kChunk, dir->path, dir->fqn, name, item)->ino, S_IFREG});
    }
  } else {
    return Status(Code::kNotDir, "not a directory");
  }
  return out;
}

Status TensorView::Open(uint64_t ino, std::string* content, std::shared_ptr<UniqueFd>* fd,
                        uint64_t* base, uint64_t* size) {
  auto v = Get(ino);
  if (!v) return NotFound("stale tensor-view inode");
  if (v->kind == Kind::kMeta) {
    CKPT_ASSIGN_OR_RETURN(auto items, ItemsOf(v->path, v->fqn));
    *content = MetaJson(items);
    return Status::Ok();
  }
  if (v->kind != Kind::kChunk) return Status(Code::kIsDir, "open of a tensor-view directory");
  const store::IndexedItem& item = *v->item;
  CKPT_ASSIGN_OR_RETURN(UniqueFd opened, backing_->OpenFile(Join(v->path, item.file), O_RDONLY));
  *fd = std::make_shared<UniqueFd>(std::move(opened));
  *base = IsTensor(item) ? item.raw_offset : item.offset;
  *size = IsTensor(item) ? item.raw_nbytes : item.length;
  return Status::Ok();
}

}  // namespace ckptfs::fs
