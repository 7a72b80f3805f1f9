#define FUSE_USE_VERSION 312
#include "fs/transport/fuse_ops.h"

#include <fuse3/fuse_lowlevel.h>
#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <sys/uio.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common/thread_name.h"
#include "fs/op_metrics.h"
#include "fs/transport/fuse_server.h"

namespace ckptfs::fs {
namespace {

constexpr unsigned kMaxWrite = 1u << 20;

Filesystem* Fs(fuse_req_t req) {
  // Every request passes here: libfuse's worker threads get their name on their first one.
  thread_local const bool named = (NameThisThread("ckptfs-fuse"), true);
  (void)named;
  return static_cast<FuseServer::Context*>(fuse_req_userdata(req))->fs;
}
Handle* H(struct fuse_file_info* fi) { return reinterpret_cast<Handle*>(fi->fh); }
// The io mode of each inode under FUSE passthrough (FuseServer keeps it).
PassthroughTable* Table(fuse_req_t req) {
  return static_cast<FuseServer::Context*>(fuse_req_userdata(req))->passthrough;
}

void ReplyErr(fuse_req_t req, const Status& st) { fuse_reply_err(req, st.ToErrno()); }

// The sender of `req`. Its supplementary groups are read (from /proc, by libfuse) only
// when `with_groups`: the rules that need them are rare (chgrp, setgid bits).
Caller CallerOf(fuse_req_t req, bool with_groups) {
  const struct fuse_ctx* ctx = fuse_req_ctx(req);
  Caller caller;
  caller.uid = ctx->uid;
  caller.gid = ctx->gid;
  if (with_groups && ctx->uid != 0) {
    std::vector<gid_t> groups(64);
    int n = fuse_req_getgroups(req, static_cast<int>(groups.size()), groups.data());
    if (n > static_cast<int>(groups.size())) {
      groups.resize(static_cast<size_t>(n));
      n = fuse_req_getgroups(req, n, groups.data());
    }
    if (n >= 0) {
      groups.resize(std::min(groups.size(), static_cast<size_t>(n)));
      caller.groups = std::move(groups);
      caller.groups_known = true;
    } else {
      spdlog::debug("fuse: no supplementary groups of pid {}: {}", ctx->pid, std::strerror(-n));
    }
  }
  return caller;
}


void ReplyEntry(fuse_req_t req, const Entry& e) {
  struct fuse_entry_param p;
  std::memset(&p, 0, sizeof(p));
  p.ino = e.ino;
  p.generation = 1;
  p.attr = e.attr;
  p.attr_timeout = e.timeout;
  p.entry_timeout = e.timeout;
  fuse_reply_entry(req, &p);
}

// libfuse splices a request only into a pipe that holds all of it (max_write plus a
// 4 KiB header); growing a pipe past fs.pipe-max-size (1 MiB by default) takes
// CAP_SYS_RESOURCE. Where that fails libfuse falls back to read() thread by thread,
// silently: probe once and say so.
bool PipeHoldsRequest(size_t bytes) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return false;
  const int got = fcntl(fds[0], F_SETPIPE_SZ, static_cast<int>(bytes));
  close(fds[0]);
  close(fds[1]);
  return got >= static_cast<int>(bytes);
}

std::string PipeMaxSize() {
  char text[32] = {0};
  FILE* f = std::fopen("/proc/sys/fs/pipe-max-size", "r");
  if (f == nullptr) return "?";
  const bool got = std::fgets(text, sizeof(text), f) != nullptr;
  std::fclose(f);
  std::string v = got ? text : "?";
  while (!v.empty() && (v.back() == '\n' || v.back() == ' ')) v.pop_back();
  return v;
}

// This kernel's version as (major, minor), from uname; (0, 0) when it cannot be read.
std::pair<int, int> KernelVersion() {
  struct utsname u {};
  int major = 0, minor = 0;
  if (uname(&u) != 0 || std::sscanf(u.release, "%d.%d", &major, &minor) != 2) return {0, 0};
  return {major, minor};
}

// FuseTuning::direct_writes against this kernel: a direct write invalidates the range in the
// page cache of other descriptors only from Linux 6.6 ("fuse: invalidate page cache pages
// before direct write").
bool ResolveDirectWrites(FuseTuning::DirectWrites want, std::string* why) {
  const auto [major, minor] = KernelVersion();
  const std::string kernel = std::to_string(major) + "." + std::to_string(minor);
  switch (want) {
    case FuseTuning::DirectWrites::kOn:
      *why = "--fuse-direct-writes on";
      return true;
    case FuseTuning::DirectWrites::kOff:
      *why = "--fuse-direct-writes off";
      return false;
    case FuseTuning::DirectWrites::kAuto:
      break;
  }
  const bool recent = std::make_pair(major, minor) >= std::make_pair(6, 6);
  *why = "Linux " + kernel + (recent ? " keeps readers coherent" : " is older than 6.6");
  return recent;
}

// Whether the handle being opened may get FOPEN_DIRECT_IO: write-only, on a mount with
// direct writes (see FuseTuning::direct_writes).
bool DirectWriteOpen(fuse_req_t req, const struct fuse_file_info* fi) {
  const auto* context = static_cast<const FuseServer::Context*>(fuse_req_userdata(req));
  return context->direct_writes && (fi->flags & O_ACCMODE) == O_WRONLY;
}

// Whether a write changes this mode: it clears setuid, and setgid with group execute (the
// kernel's file_remove_privs), but on the cached path only. Such files do not get
// FOPEN_DIRECT_IO.
bool WriteKillsPrivs(mode_t mode) {
  return (mode & S_ISUID) || ((mode & S_ISGID) && (mode & S_IXGRP));
}

// The file's mode now; 0 when it cannot be had (then nothing marks it setuid or setgid).
// Asked only of write-only opens on a direct-writes mount (DirectWriteOpen), never of reads.
mode_t ModeOf(fuse_req_t req, fuse_ino_t ino) {
  auto st = Fs(req)->GetAttr(ino);
  return st.ok() ? st->st_mode : 0;
}

// Whether the kernel will pass reads through: the INIT request was read (InitPatcher saw
// it) and its reply is written right after this returns, patched.
void ResolvePassthrough(FuseServer::Context* context, struct fuse_conn_info* conn) {
  PassthroughTable* table = context->passthrough;
  std::string off;
  if (!context->fs->config().passthrough) {
    off = "--passthrough off";
  } else if (context->init == nullptr) {
    off = "libfuse custom I/O unavailable";
  } else if (!context->init->offered()) {
    off = "this kernel does not offer FUSE passthrough (Linux 6.9+, CONFIG_FUSE_PASSTHROUGH)";
  } else if (conn->want & FUSE_CAP_WRITEBACK_CACHE) {
    off = "the writeback cache is on";
  }
  if (off.empty()) {
    table->Enable(MakeFuseBackingDevice(fuse_session_fd(context->session)), "");
  } else {
    table->Enable(nullptr, off);
  }
  context->fs->OnInit({off.empty(), context->invalidate});
  spdlog::info("fuse: passthrough {} (kernel protocol 7.{})", off.empty() ? "on" : "off: " + off,
               context->init ? context->init->kernel_minor() : 0);
}

void OpInit(void* userdata, struct fuse_conn_info* conn) {
  FuseServer::Context* context = static_cast<FuseServer::Context*>(userdata);
  const uint64_t read_ahead = context->tuning.read_ahead_bytes;
  conn->max_write = kMaxWrite;
  // The kernel takes min(the bdi's read-ahead, this): SetReadAhead raised the former.
  conn->max_readahead = static_cast<unsigned>(std::max<uint64_t>(read_ahead, kMaxWrite));
  // The kernel must not cache writes behind our back (read-your-writes is ours to keep).
  // Replies are written from our buffers or pinned cache blocks (no splice to /dev/fuse).
  conn->want &= ~(FUSE_CAP_WRITEBACK_CACHE | FUSE_CAP_SPLICE_WRITE | FUSE_CAP_SPLICE_MOVE);
  // Requests spliced off /dev/fuse into a pipe: a write's payload pages are referenced,
  // not copied, and OpWriteBuf reads them once, into staging (bench_write: staged dd).
  // Every other request costs a second syscall (the pipe's read).
  const size_t request = size_t{conn->max_write} + 4096;
  bool splice = context->tuning.splice_writes && (conn->capable & FUSE_CAP_SPLICE_READ);
  if (splice && !PipeHoldsRequest(request)) {
    splice = false;
    spdlog::warn("fuse: splice off: a pipe cannot grow to {} bytes (fs.pipe-max-size is {} and "
                 "this process lacks CAP_SYS_RESOURCE); write payloads are copied twice. "
                 "`sysctl fs.pipe-max-size=2097152` turns it on for the next mount",
                 request, PipeMaxSize());
  }
  if (splice) {
    conn->want |= FUSE_CAP_SPLICE_READ;
  } else {
    conn->want &= ~FUSE_CAP_SPLICE_READ;
  }
  if (conn->capable & FUSE_CAP_PARALLEL_DIROPS) conn->want |= FUSE_CAP_PARALLEL_DIROPS;
  if (conn->capable & FUSE_CAP_ASYNC_READ) conn->want |= FUSE_CAP_ASYNC_READ;
  conn->max_background = 64;
  conn->congestion_threshold = 48;
  std::string why;
  context->direct_writes = ResolveDirectWrites(context->tuning.direct_writes, &why);
  ResolvePassthrough(context, conn);
  spdlog::info("fuse: protocol {}.{}, max_write {}, splice {}, direct writes {} ({})",
               conn->proto_major, conn->proto_minor, conn->max_write,
               (conn->want & FUSE_CAP_SPLICE_READ) ? "on" : "off",
               context->direct_writes ? "on" : "off", why);
}

void OpLookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  OpTimer timer(FuseOp::kLookup);
  auto r = Fs(req)->Lookup(parent, name);
  if (!r.ok()) return ReplyErr(req, r.status());
  ReplyEntry(req, *r);
}

void OpForget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup) {
  Fs(req)->Forget(ino, nlookup);
  fuse_reply_none(req);
}

void OpForgetMulti(fuse_req_t req, size_t count, struct fuse_forget_data* forgets) {
  for (size_t i = 0; i < count; ++i) Fs(req)->Forget(forgets[i].ino, forgets[i].nlookup);
  fuse_reply_none(req);
}

void OpGetattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info*) {
  OpTimer timer(FuseOp::kGetattr);
  auto r = Fs(req)->GetAttr(ino);
  if (!r.ok()) return ReplyErr(req, r.status());
  fuse_reply_attr(req, &*r, Fs(req)->AttrTimeout(ino));
}

void OpSetattr(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int to_set,
               struct fuse_file_info* fi) {
  OpTimer timer(FuseOp::kSetattr);
  // Every ownership rule of a setattr may turn on group membership (chgrp, setgid,
  // write permission through a supplementary group); setattr is rare next to I/O.
  // A truncate changes bytes that passthrough readers would not see: it waits for them
  // like a writer's open (a writable handle's own truncate never finds any).
  const bool truncates = (to_set & FUSE_SET_ATTR_SIZE) != 0;
  if (truncates) {
    Status st = Table(req)->AcquireOther(ino, /*changes=*/true);
    if (!st.ok()) return ReplyErr(req, st);
  }
  auto r = Fs(req)->SetAttr(ino, *attr, to_set, fi ? H(fi) : nullptr, CallerOf(req, true));
  if (truncates) Table(req)->Release(ino, /*passthrough=*/false);
  if (!r.ok()) return ReplyErr(req, r.status());
  fuse_reply_attr(req, &*r, Fs(req)->AttrTimeout(ino));
}

void OpReadlink(fuse_req_t req, fuse_ino_t ino) {
  OpTimer timer(FuseOp::kReadlink);
  auto r = Fs(req)->Readlink(ino);
  if (!r.ok()) return ReplyErr(req, r.status());
  fuse_reply_readlink(req, r->c_str());
}

void OpMkdir(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode) {
  OpTimer timer(FuseOp::kMkdir);
  auto r = Fs(req)->Mkdir(parent, name, mode, CallerOf(req, false));
  if (!r.ok()) return ReplyErr(req, r.status());
  ReplyEntry(req, *r);
}

void OpSymlink(fuse_req_t req, const char* link, fuse_ino_t parent, const char* name) {
  OpTimer timer(FuseOp::kSymlink);
  auto r = Fs(req)->Symlink(link, parent, name, CallerOf(req, false));
  if (!r.ok()) return ReplyErr(req, r.status());
  ReplyEntry(req, *r);
}

void OpMknod(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode, dev_t rdev) {
  OpTimer timer(FuseOp::kMknod);
  auto r = Fs(req)->Mknod(parent, name, mode, rdev, CallerOf(req, (mode & S_ISGID) != 0));
  if (!r.ok()) return ReplyErr(req, r.status());
  ReplyEntry(req, *r);
}

void OpLink(fuse_req_t req, fuse_ino_t ino, fuse_ino_t newparent, const char* newname) {
  OpTimer timer(FuseOp::kLink);
  auto r = Fs(req)->Link(ino, newparent, newname, CallerOf(req, false));
  if (!r.ok()) return ReplyErr(req, r.status());
  struct fuse_session* session =
      static_cast<FuseServer::Context*>(fuse_req_userdata(req))->session;
  ReplyEntry(req, *r);
  // The new name is a FUSE inode of its own; the source's cached attributes (st_nlink 1,
  // kept for their timeout) must go. Attributes only (negative offset).
  int rc = fuse_lowlevel_notify_inval_inode(session, ino, -1, 0);
  if (rc != 0 && rc != -ENOENT) {
    spdlog::debug("fuse: cannot invalidate attributes of inode {}: {}", ino, std::strerror(-rc));
  }
}

void OpFallocate(fuse_req_t req, fuse_ino_t, int mode, off_t offset, off_t length,
                 struct fuse_file_info* fi) {
  OpTimer timer(FuseOp::kFallocate);
  if (offset < 0 || length <= 0) {
    fuse_reply_err(req, EINVAL);
    return;
  }
  fuse_reply_err(req, Fs(req)->Fallocate(H(fi), mode, static_cast<uint64_t>(offset),
                                         static_cast<uint64_t>(length)).ToErrno());
}

void OpUnlink(fuse_req_t req, fuse_ino_t parent, const char* name) {
  OpTimer timer(FuseOp::kUnlink);
  fuse_reply_err(req, Fs(req)->Unlink(parent, name, CallerOf(req, false)).ToErrno());
}

void OpRmdir(fuse_req_t req, fuse_ino_t parent, const char* name) {
  OpTimer timer(FuseOp::kRmdir);
  fuse_reply_err(req, Fs(req)->Rmdir(parent, name, CallerOf(req, false)).ToErrno());
}

void OpRename(fuse_req_t req, fuse_ino_t parent, const char* name, fuse_ino_t newparent,
              const char* newname, unsigned int flags) {
  OpTimer timer(FuseOp::kRename);
  fuse_reply_err(req, Fs(req)->Rename(parent, name, newparent, newname, flags,
                                      CallerOf(req, false)).ToErrno());
}

// Ends a handle: its io mode in the passthrough table, then the handle itself.
void ReleaseHandle(fuse_req_t req, Handle* h) {
  if (FileHandle* f = h->file(); f != nullptr && f->io_counted) {
    Table(req)->Release(f->io_ino, f->passthrough);
  }
  Fs(req)->Release(h);
}

void OpCreate(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode,
              struct fuse_file_info* fi) {
  OpTimer timer(FuseOp::kCreate);
  auto r = Fs(req)->Create(parent, name, mode, fi->flags,
                           CallerOf(req, (mode & S_ISGID) != 0));
  if (!r.ok()) return ReplyErr(req, r.status());
  auto [entry, handle] = *r;
  // A new file, or an existing one opened for writing: no passthrough reader may hold it.
  if (FileHandle* f = handle->file()) {
    Status st = Table(req)->AcquireOther(entry.ino, /*changes=*/true);
    if (!st.ok()) {
      Fs(req)->Release(handle);
      return ReplyErr(req, st);
    }
    f->io_counted = true;
    f->io_ino = entry.ino;
  }
  fi->fh = reinterpret_cast<uint64_t>(handle);
  if (DirectWriteOpen(req, fi) && !WriteKillsPrivs(entry.attr.st_mode)) fi->direct_io = 1;
  struct fuse_entry_param p;
  std::memset(&p, 0, sizeof(p));
  p.ino = entry.ino;
  p.generation = 1;
  p.attr = entry.attr;
  p.attr_timeout = p.entry_timeout = entry.timeout;
  if (fuse_reply_create(req, &p, fi) != 0) ReleaseHandle(req, handle);
}

// Opens that change the bytes a passthrough reader would not see.
bool ChangesBytes(int flags) { return (flags & O_ACCMODE) != O_RDONLY || (flags & O_TRUNC); }

// Replies to a read-only open with FOPEN_PASSTHROUGH and `backing_id`: libfuse 3.14's
// fuse_reply_open cannot say either, so the fuse_open_out is written here. KEEP_CACHE and
// the other cache flags are refused with passthrough; NOFLUSH spares close() a round trip
// (a read-only handle has nothing to flush).
int ReplyPassthroughOpen(fuse_req_t req, const struct fuse_file_info* fi, int32_t backing_id) {
  fuse_uapi::OpenOut out{};
  out.fh = fi->fh;
  out.open_flags = fuse_uapi::kFopenPassthrough | fuse_uapi::kFopenNoFlush;
  out.backing_id = backing_id;
  return fuse_reply_buf(req, reinterpret_cast<const char*>(&out), sizeof(out));
}

// Takes a read-only open's io mode: passthrough where it can (the backing id), else a
// daemon-served open (-1); kBusy when neither can be had.
Result<int32_t> TakeReadMode(fuse_req_t req, fuse_ino_t ino, Handle* h) {
  Filesystem* fs = Fs(req);
  PassthroughTable* table = Table(req);
  FileHandle* f = h->file();
  if (table->enabled()) {
    if (auto src = fs->PassthroughSourceOf(h)) {
      CKPT_ASSIGN_OR_RETURN(int32_t id,
                            table->AcquireRead(ino, src->fd, src->dev, src->ino, src->size));
      if (id >= 0) {
        f->io_counted = f->passthrough = true;
        f->io_ino = ino;
        // A write may have begun between the check and the count; the count now keeps new
        // ones out, so a second look settles it.
        if (fs->PassthroughSourceOf(h)) return id;
        table->Release(ino, /*passthrough=*/true);
        f->io_counted = f->passthrough = false;
      }
    }
  }
  CKPT_RETURN_IF_ERROR(table->AcquireOther(ino, /*changes=*/false));
  f->io_counted = true;
  f->io_ino = ino;
  return -1;
}

void OpOpen(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info* fi) {
  OpTimer timer(FuseOp::kOpen);
  const bool changes = ChangesBytes(fi->flags) && !ControlTree::IsControl(ino) &&
                       !TensorView::Owns(ino);
  // A writer (or O_TRUNC) waits for passthrough readers before anything changes.
  if (changes) {
    Status st = Table(req)->AcquireOther(ino, /*changes=*/true);
    if (!st.ok()) return ReplyErr(req, st);
  }
  auto r = Fs(req)->Open(ino, fi->flags);
  if (!r.ok()) {
    if (changes) Table(req)->Release(ino, /*passthrough=*/false);
    return ReplyErr(req, r.status());
  }
  Handle* h = *r;
  fi->fh = reinterpret_cast<uint64_t>(h);
  FileHandle* f = h->file();
  if (f != nullptr && changes) {
    f->io_counted = true;
    f->io_ino = ino;
  } else if (f != nullptr) {
    Result<int32_t> mode = TakeReadMode(req, ino, h);
    if (!mode.ok()) {
      Fs(req)->Release(h);
      return ReplyErr(req, mode.status());
    }
    if (*mode >= 0) {
      if (ReplyPassthroughOpen(req, fi, *mode) != 0) ReleaseHandle(req, h);
      return;
    }
  } else if (changes) {
    Table(req)->Release(ino, /*passthrough=*/false);  // not a namespace file
  }
  if (f == nullptr) {
    fi->direct_io = 1;  // control files: generated content, size unknown to the kernel
  } else if (DirectWriteOpen(req, fi) && !WriteKillsPrivs(ModeOf(req, ino))) {
    fi->direct_io = 1;  // a writer: its payload reaches staging with one copy
  } else if (f->keep_cache) {
    fi->keep_cache = 1;  // a committed checkpoint's file: share the page cache
  }
  // A read-only handle has nothing to flush (Filesystem::Flush answers at once), and the
  // kernel keeps POSIX locks itself (no lock ops): close() skips the FLUSH round trip, as
  // a passthrough open does (ReplyPassthroughOpen).
  if (f != nullptr && !f->writable) fi->noflush = 1;
  if (fuse_reply_open(req, fi) != 0) ReleaseHandle(req, h);
}

void OpRead(fuse_req_t req, fuse_ino_t, size_t size, off_t off, struct fuse_file_info* fi) {
  OpTimer timer(FuseOp::kRead);
  // A backing file's bytes go to the kernel straight from the block cache's blocks
  // (pinned until the reply is written): no copy into a reply buffer.
  auto in_place = Fs(req)->ReadInPlace(H(fi), size, static_cast<uint64_t>(off),
                                       [req](std::span<const struct iovec> iov) {
                                         fuse_reply_iov(req, iov.data(),
                                                        static_cast<int>(iov.size()));
                                       });
  if (!in_place.ok()) return ReplyErr(req, in_place.status());
  if (*in_place) return;  // replied
  thread_local std::vector<char> buf;
  if (buf.size() < size) buf.resize(size);
  auto r = Fs(req)->Read(H(fi), buf.data(), size, static_cast<uint64_t>(off));
  if (!r.ok()) return ReplyErr(req, r.status());
  fuse_reply_buf(req, buf.data(), *r);
}

// Every write arrives here (libfuse calls write_buf, never write, when both are set).
// Its payload as libfuse hands it over: one memory buffer, or (with
// FUSE_CAP_SPLICE_READ) the per-thread pipe the request was spliced into, which
// CopyTo reads straight into the staging chunk. libfuse empties the pipe if a write
// fails before consuming it all.
class FuseBufSource final : public store::ByteSource {
 public:
  explicit FuseBufSource(struct fuse_bufvec* bufv) : bufv_(bufv), left_(fuse_buf_size(bufv)) {}
  size_t size() const override { return left_; }
  Status CopyTo(char* out, size_t n) override {
    struct fuse_bufvec dst = FUSE_BUFVEC_INIT(n);
    dst.buf[0].mem = out;
    const ssize_t got = fuse_buf_copy(&dst, bufv_, static_cast<enum fuse_buf_copy_flags>(0));
    if (got < 0) {
      return Status(Code::kIo, std::string("reading the write payload: ") +
                                   std::strerror(static_cast<int>(-got)));
    }
    if (static_cast<size_t>(got) != n) {
      return Status(Code::kIo, "short write payload from /dev/fuse");
    }
    left_ -= n;
    return Status::Ok();
  }

 private:
  struct fuse_bufvec* bufv_;
  size_t left_;
};

void OpWriteBuf(fuse_req_t req, fuse_ino_t, struct fuse_bufvec* bufv, off_t off,
                struct fuse_file_info* fi) {
  OpTimer timer(FuseOp::kWrite);
  FuseBufSource src(bufv);
  const size_t size = src.size();
  Status st = Fs(req)->Write(H(fi), src, static_cast<uint64_t>(off));
  if (!st.ok()) return ReplyErr(req, st);
  fuse_reply_write(req, size);
}

void OpFlush(fuse_req_t req, fuse_ino_t, struct fuse_file_info* fi) {
  OpTimer timer(FuseOp::kFlush);
  fuse_reply_err(req, Fs(req)->Flush(H(fi)).ToErrno());
}

// Test hook: CKPTFS_TEST_RELEASE_DELAY_MS delays every RELEASE, as a loaded kernel or a
// slow daemon thread does (close() returns after FLUSH; RELEASE is asynchronous), so tests
// can make a `.metadata` rename overtake the shards' releases deterministically.
int ReleaseDelayMs() {
  static const int delay = [] {
    const char* v = std::getenv("CKPTFS_TEST_RELEASE_DELAY_MS");
    return v == nullptr ? 0 : std::max(0, std::min(60000, std::atoi(v)));
  }();
  return delay;
}

void OpRelease(fuse_req_t req, fuse_ino_t, struct fuse_file_info* fi) {
  OpTimer timer(FuseOp::kRelease);
  if (ReleaseDelayMs() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ReleaseDelayMs()));
  ReleaseHandle(req, H(fi));
  fuse_reply_err(req, 0);
}

void OpFsync(fuse_req_t req, fuse_ino_t, int, struct fuse_file_info* fi) {
  OpTimer timer(FuseOp::kFsync);
  fuse_reply_err(req, Fs(req)->Flush(H(fi)).ToErrno());
}

void OpOpendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info* fi) {
  OpTimer timer(FuseOp::kOpendir);
  auto r = Fs(req)->OpenDir(ino);
  if (!r.ok()) return ReplyErr(req, r.status());
  fi->fh = reinterpret_cast<uint64_t>(*r);
  if (fuse_reply_open(req, fi) != 0) Fs(req)->ReleaseDir(*r);
}

void OpReaddir(fuse_req_t req, fuse_ino_t, size_t size, off_t off, struct fuse_file_info* fi) {
  OpTimer timer(FuseOp::kReaddir);
  const DirHandle* d = H(fi)->dir();
  if (d == nullptr) return (void)fuse_reply_err(req, ENOTDIR);
  // The reply is as large as the entries that fit, not the kernel's `size` (up to 1 MiB):
  // a buffer that large per readdir was freed on whichever worker thread took it, and the
  // heap kept it (common/heap.h). With no buffer, fuse_add_direntry returns an entry's size.
  const size_t first = static_cast<size_t>(off);
  size_t end = first, used = 0;
  auto stat_of = [](const DirHandle::Ent& e) {
    struct stat st;
    std::memset(&st, 0, sizeof(st));
    st.st_ino = e.ino;
    st.st_mode = e.type;
    return st;
  };
  for (; end < d->entries.size(); ++end) {
    const struct stat st = stat_of(d->entries[end]);
    const size_t n = fuse_add_direntry(req, nullptr, 0, d->entries[end].name.c_str(), &st, 0);
    if (n > size - used) break;
    used += n;
  }
  std::vector<char> buf(used);
  used = 0;
  for (size_t i = first; i < end; ++i) {
    const struct stat st = stat_of(d->entries[i]);
    used += fuse_add_direntry(req, buf.data() + used, buf.size() - used,
                              d->entries[i].name.c_str(), &st, static_cast<off_t>(i + 1));
  }
  fuse_reply_buf(req, buf.data(), used);
}

void OpReleasedir(fuse_req_t req, fuse_ino_t, struct fuse_file_info* fi) {
  OpTimer timer(FuseOp::kReleasedir);
  Fs(req)->ReleaseDir(H(fi));
  fuse_reply_err(req, 0);
}

void OpStatfs(fuse_req_t req, fuse_ino_t) {
  OpTimer timer(FuseOp::kStatfs);
  auto r = Fs(req)->StatFs();
  if (!r.ok()) return ReplyErr(req, r.status());
  fuse_reply_statfs(req, &*r);
}

void OpGetxattr(fuse_req_t req, fuse_ino_t ino, const char* name, size_t size) {
  OpTimer timer(FuseOp::kGetxattr);
  auto r = Fs(req)->GetXattr(ino, name);
  if (!r.ok()) {
    fuse_reply_err(req, r.status().code() == Code::kNotFound ? ENODATA : r.status().ToErrno());
  } else if (size == 0) {
    fuse_reply_xattr(req, r->size());
  } else if (size < r->size()) {
    fuse_reply_err(req, ERANGE);
  } else {
    fuse_reply_buf(req, r->data(), r->size());
  }
}

void OpListxattr(fuse_req_t req, fuse_ino_t ino, size_t size) {
  OpTimer timer(FuseOp::kListxattr);
  std::string names = Fs(req)->ListXattr(ino);
  if (size == 0) {
    fuse_reply_xattr(req, names.size());
  } else if (size < names.size()) {
    fuse_reply_err(req, ERANGE);
  } else {
    fuse_reply_buf(req, names.data(), names.size());
  }
}

void OpSetxattr(fuse_req_t req, fuse_ino_t ino, const char* name, const char* value, size_t size,
                int) {
  OpTimer timer(FuseOp::kSetxattr);
  Status st = Fs(req)->SetXattr(ino, name, std::string(value, size));
  ReplyErr(req, st);
}

void OpRemovexattr(fuse_req_t req, fuse_ino_t, const char*) { fuse_reply_err(req, ENOTSUP); }

// Every FUSE op runs behind this: nothing a client sends can end the daemon. An exception
// that escapes an op (a bug: the code reports errors with Status) is logged and answered
// with EIO. Ops that take no reply (forget) only log.
template <auto Op>
struct Guarded;
template <typename... Args, void (*Op)(fuse_req_t, Args...)>
struct Guarded<Op> {
  static void Call(fuse_req_t req, Args... args) {
    try {
      Op(req, args...);
    } catch (const std::exception& e) {
      spdlog::error("fuse: an operation threw ({}); answered EIO", e.what());
      fuse_reply_err(req, EIO);
    } catch (...) {
      spdlog::error("fuse: an operation threw; answered EIO");
      fuse_reply_err(req, EIO);
    }
  }
  static void CallNoReply(fuse_req_t req, Args... args) {
    try {
      Op(req, args...);
    } catch (...) {
      spdlog::error("fuse: forget threw; ignored");
      fuse_reply_none(req);
    }
  }
};

const struct fuse_lowlevel_ops kOps = [] {
  struct fuse_lowlevel_ops ops;
  std::memset(&ops, 0, sizeof(ops));
  ops.init = OpInit;
  ops.lookup = Guarded<OpLookup>::Call;
  ops.forget = Guarded<OpForget>::CallNoReply;
  ops.forget_multi = Guarded<OpForgetMulti>::CallNoReply;
  ops.getattr = Guarded<OpGetattr>::Call;
  ops.setattr = Guarded<OpSetattr>::Call;
  ops.readlink = Guarded<OpReadlink>::Call;
  ops.mkdir = Guarded<OpMkdir>::Call;
  ops.symlink = Guarded<OpSymlink>::Call;
  ops.mknod = Guarded<OpMknod>::Call;
  ops.link = Guarded<OpLink>::Call;
  ops.fallocate = Guarded<OpFallocate>::Call;
  ops.unlink = Guarded<OpUnlink>::Call;
  ops.rmdir = Guarded<OpRmdir>::Call;
  ops.rename = Guarded<OpRename>::Call;
  ops.create = Guarded<OpCreate>::Call;
  ops.open = Guarded<OpOpen>::Call;
  ops.read = Guarded<OpRead>::Call;
  ops.write_buf = Guarded<OpWriteBuf>::Call;
  ops.flush = Guarded<OpFlush>::Call;
  ops.release = Guarded<OpRelease>::Call;
  ops.fsync = Guarded<OpFsync>::Call;
  ops.opendir = Guarded<OpOpendir>::Call;
  ops.readdir = Guarded<OpReaddir>::Call;
  ops.releasedir = Guarded<OpReleasedir>::Call;
  ops.statfs = Guarded<OpStatfs>::Call;
  ops.getxattr = Guarded<OpGetxattr>::Call;
  ops.listxattr = Guarded<OpListxattr>::Call;
  ops.setxattr = Guarded<OpSetxattr>::Call;
  ops.removexattr = Guarded<OpRemovexattr>::Call;
  return ops;
}();

}  // namespace

const struct fuse_lowlevel_ops& FuseOps() { return kOps; }

}  // namespace ckptfs::fs
