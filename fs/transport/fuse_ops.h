// The FUSE op table: one short function per low-level op, each calling the Filesystem
// (fs/filesystem.h) that the session's userdata (a FuseServer::Context) names and mapping
// its Status to an errno reply (the only place that does). Every op runs behind a guard:
// nothing a client sends can end the daemon, an exception that escapes an op is logged and
// answered EIO. The session itself (mount, custom I/O, the loop) is fs/transport/fuse_server.cc.
#pragma once

struct fuse_lowlevel_ops;

namespace ckptfs::fs {

// The table FuseServer::Mount gives fuse_session_new. Constant; read by every FUSE thread.
const struct fuse_lowlevel_ops& FuseOps();

}  // namespace ckptfs::fs
