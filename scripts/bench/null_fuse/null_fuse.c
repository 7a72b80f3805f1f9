// ckptfs-null-fuse: the FUSE ceiling for the write and read benchmarks (bench only).
//
// A minimal low-level FUSE server with one regular file, /null, that accepts every
// write and discards it, configured as ckptfs configures its session (max_write 1 MiB,
// no writeback cache, no splice, multithreaded loop). `dd bs=1M` into it measures
// what the FUSE transport allows on this kernel on its cached write path (the
// kernel copies into the file's page cache, the server's read copies again). ckptfs
// opens writers with FOPEN_DIRECT_IO (one copy) and can beat it. Like libfuse's
// example/null.c, which Debian does not ship built.
//
// A second file, /zero (--zero-size bytes, 2 GiB by default), reads as zeros served from
// memory: `dd` or an mmap read of it measures the daemon-served FUSE read ceiling (the
// kernel's requests, one copy out of the daemon, no storage) for bench_reads.py.
//
//   ckptfs-null-fuse MOUNTPOINT [-f] [--threads N] [--zero-size BYTES]
//   (unmount: fusermount3 -u)
#define FUSE_USE_VERSION 312
#include <fuse3/fuse_lowlevel.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum { kRootIno = 1, kNullIno = 2, kZeroIno = 3 };
static long long g_zero_size = 2LL << 30;
static char g_zeros[4 << 20];  // the largest read the kernel sends with max_readahead 4 MiB

static void FillAttr(fuse_ino_t ino, struct stat* st) {
  memset(st, 0, sizeof(*st));
  st->st_ino = ino;
  st->st_uid = getuid();
  st->st_gid = getgid();
  if (ino == kRootIno) {
    st->st_mode = S_IFDIR | 0755;
    st->st_nlink = 2;
  } else {
    st->st_mode = S_IFREG | 0666;
    st->st_nlink = 1;
    if (ino == kZeroIno) st->st_size = g_zero_size;
  }
}

static void OpInit(void* userdata, struct fuse_conn_info* conn) {
  (void)userdata;
  conn->max_write = 1u << 20;
  conn->max_readahead = 4u << 20;
  conn->want &= ~(FUSE_CAP_WRITEBACK_CACHE | FUSE_CAP_SPLICE_READ | FUSE_CAP_SPLICE_WRITE |
                  FUSE_CAP_SPLICE_MOVE);
}

static void OpLookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  fuse_ino_t ino = 0;
  if (parent == kRootIno && strcmp(name, "null") == 0) ino = kNullIno;
  if (parent == kRootIno && strcmp(name, "zero") == 0) ino = kZeroIno;
  if (ino == 0) {
    fuse_reply_err(req, ENOENT);
    return;
  }
  struct fuse_entry_param e;
  memset(&e, 0, sizeof(e));
  e.ino = ino;
  e.attr_timeout = e.entry_timeout = 3600;
  FillAttr(ino, &e.attr);
  fuse_reply_entry(req, &e);
}

static void OpGetattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info* fi) {
  (void)fi;
  if (ino != kRootIno && ino != kNullIno && ino != kZeroIno) {
    fuse_reply_err(req, ENOENT);
    return;
  }
  struct stat st;
  FillAttr(ino, &st);
  fuse_reply_attr(req, &st, 3600);
}

static void OpSetattr(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int to_set,
                      struct fuse_file_info* fi) {
  (void)attr;
  (void)to_set;
  OpGetattr(req, ino, fi);  // O_TRUNC and friends: nothing to keep
}

static void OpOpen(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info* fi) {
  if (ino != kNullIno && ino != kZeroIno) {
    fuse_reply_err(req, EISDIR);
    return;
  }
  fuse_reply_open(req, fi);
}

static void OpRead(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                   struct fuse_file_info* fi) {
  (void)fi;
  if (ino != kZeroIno || off >= g_zero_size) {
    fuse_reply_buf(req, NULL, 0);
    return;
  }
  if ((long long)size > g_zero_size - off) size = (size_t)(g_zero_size - off);
  if (size > sizeof(g_zeros)) size = sizeof(g_zeros);
  fuse_reply_buf(req, g_zeros, size);
}

static void OpWrite(fuse_req_t req, fuse_ino_t ino, const char* buf, size_t size, off_t off,
                    struct fuse_file_info* fi) {
  (void)ino;
  (void)buf;
  (void)off;
  (void)fi;
  fuse_reply_write(req, size);
}

static void OpOk(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info* fi) {
  (void)ino;
  (void)fi;
  fuse_reply_err(req, 0);
}

static void OpFsync(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info* fi) {
  (void)datasync;
  OpOk(req, ino, fi);
}

int main(int argc, char** argv) {
  const char* mountpoint = NULL;
  int foreground = 0;
  unsigned threads = 32;
  for (int i = 1; i < argc; ++i) {
    if (strcmp(argv[i], "-f") == 0) {
      foreground = 1;
    } else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      threads = (unsigned)atoi(argv[++i]);
    } else if (strcmp(argv[i], "--zero-size") == 0 && i + 1 < argc) {
      g_zero_size = atoll(argv[++i]);
    } else if (mountpoint == NULL) {
      mountpoint = argv[i];
    } else {
      fprintf(stderr, "usage: %s MOUNTPOINT [-f] [--threads N] [--zero-size BYTES]\n", argv[0]);
      return 2;
    }
  }
  if (mountpoint == NULL) {
    fprintf(stderr, "usage: %s MOUNTPOINT [-f] [--threads N] [--zero-size BYTES]\n", argv[0]);
    return 2;
  }
  static const struct fuse_lowlevel_ops ops = {
      .init = OpInit,
      .lookup = OpLookup,
      .getattr = OpGetattr,
      .setattr = OpSetattr,
      .open = OpOpen,
      .read = OpRead,
      .write = OpWrite,
      .flush = OpOk,
      .release = OpOk,
      .fsync = OpFsync,
  };
  char* fargv[] = {argv[0], "-o", "fsname=ckptfs-null,subtype=null", NULL};
  struct fuse_args args = FUSE_ARGS_INIT(3, fargv);
  struct fuse_session* se = fuse_session_new(&args, &ops, sizeof(ops), NULL);
  if (se == NULL) return 1;
  if (fuse_set_signal_handlers(se) != 0 || fuse_session_mount(se, mountpoint) != 0) {
    fuse_session_destroy(se);
    return 1;
  }
  fuse_daemonize(foreground);
  struct fuse_loop_config* cfg = fuse_loop_cfg_create();
  fuse_loop_cfg_set_max_threads(cfg, threads);
  int rc = fuse_session_loop_mt(se, cfg);
  fuse_loop_cfg_destroy(cfg);
  fuse_session_unmount(se);
  fuse_remove_signal_handlers(se);
  fuse_session_destroy(se);
  return rc == 0 ? 0 : 1;
}
