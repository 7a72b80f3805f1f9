// The parts of the kernel's FUSE ABI (linux/fuse.h, protocol 7.45) that Debian 12's
// linux-libc-dev (6.1) and libfuse 3.14 lack, spelled here: passthrough (7.40) and FUSE over
// io_uring (7.42). Plain layouts, checked by size; no behaviour.
#pragma once

#include <cstdint>

namespace ckptfs::fs::fuse_uapi {

constexpr uint32_t kOpInit = 26;
constexpr uint32_t kFlagMaxPages = 1u << 22;      // FUSE_MAX_PAGES: max_pages is valid
constexpr uint32_t kInitExt = 1u << 30;           // FUSE_INIT_EXT: flags2 is valid
constexpr uint32_t kFlags2Passthrough = 1u << 5;  // FUSE_PASSTHROUGH (1ULL << 37) >> 32
constexpr uint32_t kFlags2OverIoUring = 1u << 9;  // FUSE_OVER_IO_URING (1ULL << 41) >> 32
constexpr uint32_t kFopenKeepCache = 1u << 1;
constexpr uint32_t kFopenNoFlush = 1u << 5;
constexpr uint32_t kFopenPassthrough = 1u << 7;

struct InHeader {
  uint32_t len, opcode;
  uint64_t unique, nodeid;
  uint32_t uid, gid, pid;
  uint16_t total_extlen, padding;
};
struct InitIn {
  uint32_t major, minor, max_readahead, flags, flags2, unused[11];
};
struct OutHeader {
  uint32_t len;
  int32_t error;
  uint64_t unique;
};
struct InitOut {
  uint32_t major, minor, max_readahead, flags;
  uint16_t max_background, congestion_threshold;
  uint32_t max_write, time_gran;
  uint16_t max_pages, map_alignment;
  uint32_t flags2, max_stack_depth;
  uint16_t request_timeout, unused[11];
};
struct OpenOut {
  uint64_t fh;
  uint32_t open_flags;
  int32_t backing_id;
};
struct BackingMap {
  int32_t fd;
  uint32_t flags;
  uint64_t padding;
};

// FUSE over io_uring (Linux 6.14+, CONFIG_FUSE_IO_URING, module parameter fuse.enable_uring).
// An entry is two buffers the daemon registers with an IORING_OP_URING_CMD on /dev/fuse: a
// RingHeader and a payload. The kernel writes a request's fuse_in_header into in_out, its
// first argument (the op's own struct, possibly empty) into op_in, and the rest into the
// payload; the daemon answers with fuse_out_header in in_out and the reply in the payload.
constexpr uint32_t kUringCmdRegister = 1;
constexpr uint32_t kUringCmdCommitAndFetch = 2;
constexpr uint32_t kUringOpInSize = 128;
struct RingEntInOut {
  uint64_t flags;
  uint64_t commit_id;  // the kernel's: given back with the commit
  uint32_t payload_sz;  // bytes in the payload, both ways
  uint32_t padding;
  uint64_t reserved;
};
struct RingHeader {
  char in_out[128];
  char op_in[kUringOpInSize];
  RingEntInOut ent;
};
// The command's own bytes, in the 80 bytes an SQE128 has after its first 48.
struct UringCmdReq {
  uint64_t flags;
  uint64_t commit_id;
  uint16_t qid;
  uint8_t padding[6];
};

static_assert(sizeof(InHeader) == 40 && sizeof(InitIn) == 64 && sizeof(OutHeader) == 16);
static_assert(sizeof(InitOut) == 64 && sizeof(OpenOut) == 16 && sizeof(BackingMap) == 16);
static_assert(sizeof(RingEntInOut) == 32 && sizeof(RingHeader) == 288 &&
              sizeof(UringCmdReq) == 24);

}  // namespace ckptfs::fs::fuse_uapi
