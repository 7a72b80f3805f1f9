// Caller and the POSIX permission rules the daemon applies itself.
//
// The mount is made with the kernel's `default_permissions` (fs/transport/fuse_server.cc says
// why), so the kernel checks the mode bits of every lookup, open, create, unlink and
// rename, and the sticky bit, against the attributes ckptfs reports. The rules here are
// the ones that concern ownership, which the daemon must get right on its own: who may
// chown/chgrp, chmod and set times, what a chown does to setuid/setgid, who may remove
// a name from a sticky directory, and the owner and group a new name gets. They follow
// Linux (fs/attr.c, fs/namei.c, fs/inode.c) and hold with or without the kernel's
// checks, so the daemon never does more than a local file system would allow.
//
// Pure functions of their arguments; thread-safe.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <vector>

#include "common/status.h"

namespace ckptfs::fs {

// Who sent a request (FUSE's fuse_req_ctx). The default is the daemon itself.
struct Caller {
  uid_t uid = ::geteuid();
  gid_t gid = ::getegid();
  // Supplementary groups; filled only where a rule needs them (a chgrp by a non-root
  // caller), since reading them costs a /proc read per request.
  std::vector<gid_t> groups;
  bool groups_known = false;

  bool root() const { return uid == 0; }
  bool InGroup(gid_t g) const;
};

// Access bits for MayAccess, as access(2): R_OK 4, W_OK 2, X_OK 1.
bool MayAccess(const Caller& caller, const struct stat& attr, int want);

// chown(path, uid, gid) with (uid_t)-1 / (gid_t)-1 for "unchanged": only root changes
// the owner; the owner may change the group to one of its groups. kNotPermitted else.
Status CheckChown(const Caller& caller, const struct stat& attr, uid_t uid, gid_t gid);
// The mode a chown leaves: Linux clears setuid, and setgid when group-executable, of
// anything but a directory, even when root changes the owner.
mode_t ModeAfterChown(const struct stat& attr);

// chmod: only the owner or root (kNotPermitted). A change that only clears setuid and
// setgid is allowed to anyone: the kernel sends it when a non-owner writes to or
// truncates such a file. Returns the mode to store: setgid is dropped when a non-root
// caller is not in the file's group.
Result<mode_t> CheckChmod(const Caller& caller, const struct stat& attr, mode_t mode);

// utimensat: explicit times need the owner or root (kNotPermitted); "now" for both
// also allows anyone with write permission (kPermission else).
Status CheckUtimes(const Caller& caller, const struct stat& attr, bool explicit_times);

// Removing or replacing `victim` in `dir`: with the sticky bit set only root, the
// victim's owner or the directory's owner may (kNotPermitted).
Status CheckSticky(const Caller& caller, const struct stat& dir, const struct stat& victim);

// The owner, group and mode of a new name of type `type` (S_IF*) created by `caller`
// in `dir`: a setgid directory hands on its group, and to directories its setgid bit;
// a non-directory asking for setgid in a group its creator is not in loses the bit.
struct NewOwner {
  uid_t uid;
  gid_t gid;
  mode_t mode;  // permission bits only (07777)
};
NewOwner OwnerOfNew(const Caller& caller, const struct stat& dir, mode_t type, mode_t mode);

}  // namespace ckptfs::fs
