#include "store/dcp/read_checksums.h"

#include <algorithm>

#include "store/primitives/crc32c.h"

namespace ckptfs::store {

void ReadChecksums::OnRead(const std::string& ckpt, const std::string& file,
                           const FileKey& version, uint64_t offset, const char* data, size_t n) {
  const uint64_t end = offset + n;
  for (uint64_t pos = offset; pos < end;) {
    std::optional<KeyIndex::Located> item = index_->Locate(ckpt, file, pos);
    if (!item || item->offset + item->length <= pos) return;  // a gap: nothing to learn
    const uint64_t item_end = item->offset + item->length;
    const uint64_t run_end = std::min(end, item_end);
    if (item->has_checksum) {
      pos = run_end;
      continue;
    }
    std::string key = ckpt;
    key.push_back('\0');
    key += file;
    key.push_back('\0');
    key += std::to_string(item->offset);
    // The parts of [pos, run_end) this item has not seen yet (relative to the item).
    const uint64_t rb = pos - item->offset, re = run_end - item->offset;
    std::vector<std::pair<uint64_t, uint64_t>> gaps;
    {
      MutexLock lock(&mu_);
      auto it = items_.find(key);
      uint64_t at = rb;
      if (it != items_.end() && it->second.version == version &&
          it->second.length == item->length) {
        for (const Piece& p : it->second.pieces) {
          if (p.end <= at) continue;
          if (p.begin >= re) break;
          if (p.begin > at) gaps.emplace_back(at, p.begin);
          at = std::max(at, p.end);
        }
      }
      if (at < re) gaps.emplace_back(at, re);
    }
    std::vector<Piece> pieces;
    for (auto [b, e] : gaps) {
      pieces.push_back({b, e, Crc32c(data + (item->offset + b - offset), e - b)});
    }
    uint32_t crc = 0;
    bool complete = false;
    if (!pieces.empty()) {
      MutexLock lock(&mu_);
      complete = AddLocked(key, version, item->length, pieces, &crc);
    }
    if (complete) {
      index_->RecordChecksums(ckpt, file, {RangeChecksum{item->offset, item->length, crc}});
    }
    pos = run_end;
  }
}

bool ReadChecksums::AddLocked(const std::string& key, const FileKey& version, uint64_t length,
                              const std::vector<Piece>& pieces, uint32_t* crc) {
  auto it = items_.find(key);
  if (it != items_.end() && (it->second.version != version || it->second.length != length)) {
    age_.erase(it->second.seq);
    items_.erase(it);
    it = items_.end();
  }
  if (it == items_.end()) {
    while (items_.size() >= max_items_ && !age_.empty()) {
      items_.erase(age_.begin()->second);
      age_.erase(age_.begin());
    }
    it = items_.emplace(key, Progress{version, length, ++seq_, {}}).first;
    age_[it->second.seq] = key;
  }
  std::vector<Piece>& v = it->second.pieces;
  for (const Piece& p : pieces) {
    auto pos = std::lower_bound(v.begin(), v.end(), p.begin,
                                [](const Piece& q, uint64_t b) { return q.end <= b; });
    if (pos != v.end() && pos->begin < p.end) continue;  // another reader got there first
    pos = v.insert(pos, p);
    if (auto next = pos + 1; next != v.end() && next->begin == pos->end) {
      pos->crc = Crc32cCombine(pos->crc, next->crc, next->end - next->begin);
      pos->end = next->end;
      pos = v.erase(next) - 1;
    }
    if (pos != v.begin() && (pos - 1)->end == pos->begin) {
      auto prev = pos - 1;
      prev->crc = Crc32cCombine(prev->crc, pos->crc, pos->end - pos->begin);
      prev->end = pos->end;
      v.erase(pos);
    }
  }
  if (v.size() != 1 || v[0].begin != 0 || v[0].end != length) return false;
  *crc = v[0].crc;
  age_.erase(it->second.seq);
  items_.erase(it);
  ++recorded_;
  return true;
}

uint64_t ReadChecksums::recorded() const {
  MutexLock lock(&mu_);
  return recorded_;
}

size_t ReadChecksums::items_in_progress() const {
  MutexLock lock(&mu_);
  return items_.size();
}

}  // namespace ckptfs::store
