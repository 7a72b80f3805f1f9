// Fuzzes the torch.save item reader through both entry points, and through a data.pkl cache.
// Whatever it reports as a tensor must describe a byte range inside the item.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "store/dcp/torch_zip.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view item(reinterpret_cast<const char*>(data), size);
  auto t = ckptfs::store::ParseTorchSaveItem(item);
  if (t.ok() && t->is_tensor && (t->data_offset > size || size - t->data_offset < t->data_nbytes)) {
    __builtin_trap();
  }
  ckptfs::store::ReadAtFn read = [item](uint64_t offset, std::span<char> dst) -> ckptfs::Status {
    if (offset > item.size() || item.size() - offset < dst.size()) {
      return ckptfs::Corrupt("short read");
    }
    std::copy_n(item.data() + offset, dst.size(), dst.data());
    return ckptfs::Status::Ok();
  };
  auto t2 = ckptfs::store::ParseTorchSaveItem(read, size);
  if (t.ok() != t2.ok()) __builtin_trap();
  // Through a data.pkl cache kept across inputs: exactly the uncached result.
  static ckptfs::store::TorchPickleCache cache;
  auto t3 = ckptfs::store::ParseTorchSaveItem(item, &cache);
  if (t.ok() != t3.ok()) __builtin_trap();
  if (!t.ok() && t.status().message() != t3.status().message()) __builtin_trap();
  if (t.ok() && (t->is_tensor != t3->is_tensor || t->opaque_reason != t3->opaque_reason ||
                 t->shape != t3->shape || t->stride != t3->stride || t->dtype != t3->dtype ||
                 t->data_offset != t3->data_offset || t->data_nbytes != t3->data_nbytes)) {
    __builtin_trap();
  }
  return 0;
}
