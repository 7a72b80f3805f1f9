#include "store/dcp/item_reader.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include "store/primitives/crc32c.h"

namespace ckptfs::store::keyidx {

Result<std::string_view> WindowReader::View(uint64_t off, size_t len) {
  if (off > size_ || size_ - off < len) return Corrupt("read past the end of the file");
  for (Slot& w : slots_) {
    if (w.len > 0 && off >= w.off && off + len <= w.off + w.len) {
      w.used = ++clock_;
      return std::string_view(w.buf.get() + (off - w.off), len);
    }
  }
  uint64_t start = off;
  if (off >= tail_start_ && off < tail_end_) start = tail_start_;
  Slot& w = slots_[0].used <= slots_[1].used ? slots_[0] : slots_[1];
  if (!w.buf) w.buf.reset(new char[kWindowCapacity]);  // not zeroed: read into at once
  uint64_t need = off + len - start;  // <= kWindowCapacity: the tail is at most 64 KiB
  if (need > kWindowCapacity) {
    start = off;
    need = len;
  }
  size_t want = static_cast<size_t>(std::min<uint64_t>(
      std::max<uint64_t>(need, kReadAhead), std::min<uint64_t>(kWindowCapacity, size_ - start)));
  w.len = 0;
  size_t got = 0;
  if (held_ != nullptr && held_->Read(path_, key_, start, std::span<char>(w.buf.get(), want))) {
    got = want;
    from_memory_ += got;
  } else {
    CKPT_ASSIGN_OR_RETURN(got, dir_->PRead(fd_, w.buf.get(), want, static_cast<off_t>(start)));
    from_backing_ += got;
  }
  if (got < need) return Corrupt("short read (file shrank?)");
  w.off = start;
  w.len = got;
  w.used = ++clock_;
  return std::string_view(w.buf.get() + (off - start), len);
}

Status WindowReader::ReadInto(uint64_t off, std::span<char> dst) {
  size_t done = 0;
  while (done < dst.size()) {
    size_t n = std::min(dst.size() - done, kWindowCapacity);
    CKPT_ASSIGN_OR_RETURN(std::string_view v, View(off + done, n));
    std::memcpy(dst.data() + done, v.data(), n);
    done += n;
  }
  return Status::Ok();
}

Result<uint32_t> WindowReader::Crc(uint64_t off, uint64_t len) {
  uint32_t crc = 0;
  for (uint64_t done = 0; done < len;) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(len - done, kWindowCapacity));
    CKPT_ASSIGN_OR_RETURN(std::string_view v, View(off + done, n));
    crc = Crc32cExtend(crc, v.data(), v.size());
    done += n;
  }
  return crc;
}

ReadAtFn WindowReader::ItemReader(uint64_t item_offset, uint64_t item_length) {
  tail_end_ = item_offset + item_length;
  tail_start_ = tail_end_ - std::min(item_length, kTailWindow);
  return [this, item_offset, item_length](uint64_t rel, std::span<char> dst) -> Status {
    if (rel > item_length || item_length - rel < dst.size()) {
      return Corrupt("read past the end of the item");
    }
    return ReadInto(item_offset + rel, dst);
  };
}

Result<TorchSaveTensor> WindowReader::ParseItem(uint64_t offset, uint64_t length,
                                                TorchPickleCache* cache) {
  if (length <= kWholeItemMax) {
    Result<std::string_view> whole = View(offset, static_cast<size_t>(length));
    if (!whole.ok()) return whole.status();
    return ParseTorchSaveItem(*whole, cache);
  }
  return ParseTorchSaveItem(ItemReader(offset, length), length, cache);
}

Result<OpenedFile> OpenShard(BackingDir* dir, const std::string& path) {
  OpenedFile f;
  CKPT_ASSIGN_OR_RETURN(f.fd, dir->OpenFile(path, O_RDONLY | O_CLOEXEC));
  struct stat st;
  if (::fstat(f.fd.get(), &st) != 0) return Status::FromErrno(errno, "fstat " + path);
  if (!S_ISREG(st.st_mode)) return Invalid(path + " is not a regular file");
  f.size = static_cast<uint64_t>(st.st_size);
  f.key = FileKeyFromStat(st);
  return f;
}

Result<std::optional<uint32_t>> CrcFromBlocks(WindowReader* reader, const BlockCrcMap& blocks,
                                              uint64_t off, uint64_t len, uint64_t file_size) {
  const uint64_t bs = blocks.block_bytes(), end = off + len;
  const uint64_t mid_begin = std::min(end, (off + bs - 1) / bs * bs);
  const uint64_t mid_end = std::max(mid_begin, end == file_size ? end : end / bs * bs);
  std::optional<uint32_t> mid = blocks.RangeCrc(mid_begin, mid_end);
  if (!mid) return std::optional<uint32_t>();
  CKPT_ASSIGN_OR_RETURN(uint32_t head, reader->Crc(off, mid_begin - off));
  CKPT_ASSIGN_OR_RETURN(uint32_t tail, reader->Crc(mid_end, end - mid_end));
  uint32_t crc = Crc32cCombine(head, *mid, mid_end - mid_begin);
  return std::optional<uint32_t>(Crc32cCombine(crc, tail, end - mid_end));
}

void ResolveTensor(WindowReader* reader, IndexedItem* item, std::string* error,
                   TorchPickleCache* cache) {
  Result<TorchSaveTensor> t = reader->ParseItem(item->offset, item->length, cache);
  Status st = t.ok() ? Status::Ok() : t.status();
  if (st.ok() && !t->is_tensor) {
    item->kind = ItemKind::kOpaque;
    return;
  }
  if (st.ok()) {
    st = CheckItemData(
        *t, ItemFacts{item->fqn, item->file, item->dtype, item->chunk_sizes, item->length});
  }
  if (!st.ok()) {
    item->kind = ItemKind::kOpaque;
    *error = st.ToString();
    return;
  }
  item->raw_offset = item->offset + t->data_offset;
  item->raw_nbytes = t->data_nbytes;
  item->stride = std::move(t->stride);
  item->storage_offset = t->storage_offset;
}

std::vector<FileGroup> GroupByFile(const std::vector<IndexedItem>& items) {
  std::unordered_map<std::string_view, uint32_t> ids;
  std::vector<FileGroup> groups;
  std::string_view last;
  uint32_t last_id = 0;
  for (uint32_t i = 0; i < items.size(); ++i) {
    std::string_view f = items[i].file;
    if (groups.empty() || f != last) {
      auto [it, added] = ids.try_emplace(f, static_cast<uint32_t>(groups.size()));
      if (added) groups.push_back({f, {}});
      last = f;
      last_id = it->second;
    }
    groups[last_id].idx.push_back(i);
  }
  auto by_offset = [&](uint32_t a, uint32_t b) {
    return items[a].offset != items[b].offset ? items[a].offset < items[b].offset : a < b;
  };
  for (FileGroup& g : groups) {
    if (!std::is_sorted(g.idx.begin(), g.idx.end(), by_offset)) {
      std::sort(g.idx.begin(), g.idx.end(), by_offset);
    }
  }
  std::sort(groups.begin(), groups.end(),
            [](const FileGroup& a, const FileGroup& b) { return a.name < b.name; });
  return groups;
}

}  // namespace ckptfs::store::keyidx
