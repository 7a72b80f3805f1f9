#include "fs/namespace/posix_access.h"

#include <unistd.h>

#include <algorithm>

namespace ckptfs::fs {

bool Caller::InGroup(gid_t g) const {
  return g == gid || std::find(groups.begin(), groups.end(), g) != groups.end();
}

bool MayAccess(const Caller& caller, const struct stat& attr, int want) {
  if (caller.root()) {
    // Root reads and writes anything; it executes only what someone may execute.
    if ((want & X_OK) && !S_ISDIR(attr.st_mode) && (attr.st_mode & 0111) == 0) return false;
    return true;
  }
  mode_t bits;
  if (caller.uid == attr.st_uid) {
    bits = (attr.st_mode >> 6) & 7;
  } else if (caller.InGroup(attr.st_gid)) {
    bits = (attr.st_mode >> 3) & 7;
  } else {
    bits = attr.st_mode & 7;
  }
  return (bits & static_cast<mode_t>(want)) == static_cast<mode_t>(want);
}

Status CheckChown(const Caller& caller, const struct stat& attr, uid_t uid, gid_t gid) {
  if (caller.root()) return Status::Ok();
  const bool uid_change = uid != static_cast<uid_t>(-1) && uid != attr.st_uid;
  if (uid_change) return Status(Code::kNotPermitted, "only root changes a file's owner");
  const bool gid_change = gid != static_cast<gid_t>(-1) && gid != attr.st_gid;
  if (!gid_change) {
    // chown to the same ids: allowed to the owner only (Linux chown_ok()).
    if (caller.uid != attr.st_uid) return Status(Code::kNotPermitted, "not the owner");
    return Status::Ok();
  }
  if (caller.uid != attr.st_uid) return Status(Code::kNotPermitted, "not the owner");
  if (!caller.InGroup(gid)) {
    return Status(Code::kNotPermitted, "group " + std::to_string(gid) + " is not the caller's");
  }
  return Status::Ok();
}

mode_t ModeAfterChown(const struct stat& attr) {
  mode_t mode = attr.st_mode;
  if (S_ISDIR(mode)) return mode;
  mode &= ~static_cast<mode_t>(S_ISUID);
  if ((mode & (S_ISGID | S_IXGRP)) == (S_ISGID | S_IXGRP)) mode &= ~static_cast<mode_t>(S_ISGID);
  return mode;
}

Result<mode_t> CheckChmod(const Caller& caller, const struct stat& attr, mode_t mode) {
  mode &= 07777;
  const mode_t old = attr.st_mode & 07777;
  const mode_t suid_bits = S_ISUID | S_ISGID;
  if (caller.root()) return mode;
  if (caller.uid != attr.st_uid) {
    // Only clearing setuid/setgid (the kernel's kill-priv on a non-owner's write).
    if ((mode & ~suid_bits) == (old & ~suid_bits) && (mode & suid_bits & ~old) == 0) return mode;
    return Status(Code::kNotPermitted, "only the owner changes the mode");
  }
  if ((mode & S_ISGID) && !caller.InGroup(attr.st_gid)) mode &= ~static_cast<mode_t>(S_ISGID);
  return mode;
}

Status CheckUtimes(const Caller& caller, const struct stat& attr, bool explicit_times) {
  if (caller.root() || caller.uid == attr.st_uid) return Status::Ok();
  if (explicit_times) return Status(Code::kNotPermitted, "only the owner sets explicit times");
  if (!MayAccess(caller, attr, W_OK)) return Status(Code::kPermission, "no write permission");
  return Status::Ok();
}

Status CheckSticky(const Caller& caller, const struct stat& dir, const struct stat& victim) {
  if (!(dir.st_mode & S_ISVTX) || caller.root()) return Status::Ok();
  if (caller.uid == victim.st_uid || caller.uid == dir.st_uid) return Status::Ok();
  return Status(Code::kNotPermitted, "sticky directory: not the owner");
}

NewOwner OwnerOfNew(const Caller& caller, const struct stat& dir, mode_t type, mode_t mode) {
  NewOwner out{caller.uid, caller.gid, mode & 07777};
  if (dir.st_mode & S_ISGID) {
    out.gid = dir.st_gid;
    if (S_ISDIR(type)) out.mode |= S_ISGID;
  }
  // Linux inode_init_owner(): setgid on a group-executable non-directory is kept only
  // for a member of that group (or root).
  if (!S_ISDIR(type) && (out.mode & (S_ISGID | S_IXGRP)) == (S_ISGID | S_IXGRP) &&
      !caller.root() && !caller.InGroup(out.gid)) {
    out.mode &= ~static_cast<mode_t>(S_ISGID);
  }
  return out;
}

}  // namespace ckptfs::fs
