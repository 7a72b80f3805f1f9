// The factory of Peers: the one place that knows whether the UCX transport is built
// (CKPTFS_HAVE_UCX is defined for this file only, by store/peer/CMakeLists.txt).
#include "store/peer/peers.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>

#include "common/unique_fd.h"
#include "store/peer/protocol.h"
#ifdef CKPTFS_HAVE_UCX
#include "store/peer/peer_node.h"
#endif

namespace ckptfs::store::peer {

Status PeerTransportAvailable() {
#ifdef CKPTFS_HAVE_UCX
  return Status::Ok();
#else
  return Unsupported(
      "this ckptfs was built without the UCX peer transport (libucx-dev, libssl-dev)");
#endif
}

Result<std::unique_ptr<Peers>> Peers::Create(const PeerNodeOptions& options, BackingDir* dir,
                                             BlockSource* fallback) {
#ifdef CKPTFS_HAVE_UCX
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<PeerNode> node, PeerNode::Create(options, dir, fallback));
  return std::unique_ptr<Peers>(std::move(node));
#else
  return PeerTransportAvailable();
#endif
}

Result<std::string> ReadSecretFile(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return Status::FromErrno(errno, "peer secret file " + path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return Status::FromErrno(errno, "peer secret file " + path);
  if (!S_ISREG(st.st_mode)) return Invalid("peer secret file " + path + " is not a regular file");
  if (st.st_mode & (S_IRWXG | S_IRWXO)) {
    spdlog::warn(
        "peer secret file {} is accessible to group or others (mode {:o}); "
        "chmod 600 it",
        path, st.st_mode & 07777);
  }
  std::string secret(kMaxSecretBytes + 1, '\0');
  size_t got = 0;
  while (got < secret.size()) {
    ssize_t n = ::read(fd.get(), secret.data() + got, secret.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::FromErrno(errno, "peer secret file " + path);
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  if (got > kMaxSecretBytes) {
    return Invalid("peer secret file " + path + " is longer than " +
                   std::to_string(kMaxSecretBytes) + " bytes");
  }
  secret.resize(got);
  while (!secret.empty() && std::isspace(static_cast<unsigned char>(secret.back()))) {
    secret.pop_back();
  }
  if (secret.size() < kMinSecretBytes) {
    return Invalid("peer secret file " + path + " holds fewer than " +
                   std::to_string(kMinSecretBytes) + " bytes of secret");
  }
  return secret;
}

}  // namespace ckptfs::store::peer
