#include "store/dcp/metadata_file.h"

#include <fcntl.h>
#include <sys/stat.h>

namespace ckptfs::store {

Result<std::string> ReadMetadataBytes(BackingDir* dir, const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, dir->OpenFile(path, O_RDONLY));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return Status::FromErrno(errno, "stat " + path);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > kMaxMetadataBytes) {
    return Corrupt(path + " is " + std::to_string(size) + " bytes, over the " +
                   std::to_string(kMaxMetadataBytes) + "-byte limit of a .metadata");
  }
  std::string out(size, '\0');
  CKPT_ASSIGN_OR_RETURN(size_t got, dir->PRead(fd.get(), out.data(), out.size(), 0));
  out.resize(got);
  return out;
}

}  // namespace ckptfs::store
