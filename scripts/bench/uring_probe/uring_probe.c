// ckptfs-uring-probe: how much FUSE over io_uring cuts a round trip on this kernel (bench only).
//
// The per-item DCP loads of issue 21 pay two blocking round trips per open (OPEN, and the
// GETATTR that a passthrough read's atime invalidation forces). ckptfs runs on Debian 12's
// libfuse 3.14, which only speaks /dev/fuse read/write. Linux 6.14+ can carry requests over
// io_uring instead (CONFIG_FUSE_IO_URING, module parameter fuse.enable_uring): each CPU gets
// its own queue, and a request is answered from the queue of the CPU that made it.
//
// This is a minimal FUSE server written against the kernel ABI directly (no libfuse): a root
// directory with 64 files f000..f063 of 1 MiB reading as zeros, served either the classic
// way (2 threads reading /dev/fuse) or over io_uring (INIT over /dev/fuse, then one ring per
// CPU, SQE128, FUSE_IO_URING_CMD_REGISTER of 4 entries per queue, each request answered by
// FUSE_IO_URING_CMD_COMMIT_AND_FETCH). scripts/bench/bench_uring_probe.py times open()
// against both. It is a measuring instrument, not a file system: no permissions, no state.
//
//   ckptfs-uring-probe classic|uring MOUNTPOINT      (root; SIGTERM prints the request
//                                                      counts per path and exits)
// uring needs /sys/module/fuse/parameters/enable_uring = Y before the mount.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#define NFILES 64
#define FSIZE (1 << 20)
#define PAYLOAD (1 << 20)
#define OVER_IO_URING (1u << 9) /* (1ULL << 41) >> 32 */
struct ent_in_out { uint64_t flags, commit_id; uint32_t payload_sz, padding; uint64_t reserved; };
struct req_header { char in_out[128]; char op_in[128]; struct ent_in_out ent; };
struct cmd_req { uint64_t flags, commit_id; uint16_t qid; uint8_t padding[6]; };
enum { CMD_REGISTER = 1, CMD_COMMIT_AND_FETCH = 2 };

static int fusefd, uring_mode;
static atomic_int init_done;
static atomic_long n_classic, n_uring;
#include <signal.h>
static void on_term(int sig) { (void)sig; fprintf(stderr, "requests: classic %ld uring %ld\n", atomic_load(&n_classic), atomic_load(&n_uring)); _exit(0); }

static void fill_attr(struct fuse_attr *a, uint64_t ino) {
  memset(a, 0, sizeof *a);
  a->ino = ino;
  if (ino == 1) { a->mode = 040755; a->nlink = 2; }
  else { a->mode = 0100644; a->nlink = 1; a->size = FSIZE; a->blocks = FSIZE / 512; }
  a->blksize = 4096;
}

// Handles one request; writes the reply body into `out` and returns its size, or -errno,
// or INT32_MIN for no reply.
static int handle(const struct fuse_in_header *in, const void *op, const void *rest, char *out) {
  switch (in->opcode) {
  case FUSE_INIT: {
    const struct fuse_init_in *ii = op;
    struct fuse_init_out *o = (void *)out; memset(o, 0, sizeof *o);
    o->major = 7; o->minor = ii->minor < 42 ? ii->minor : 42;
    o->max_readahead = ii->max_readahead; o->max_write = 128 * 1024; o->max_pages = 32;
    o->flags = FUSE_INIT_EXT | FUSE_MAX_PAGES | FUSE_ASYNC_READ;
    if (uring_mode) o->flags2 = OVER_IO_URING;
    o->max_background = 16; o->congestion_threshold = 12;
    fprintf(stderr, "INIT kernel %u.%u flags2 in %#x\n", ii->major, ii->minor, ii->flags2);
    return sizeof *o;
  }
  case FUSE_LOOKUP: {
    const char *name = rest;
    int i;
    if (in->nodeid != 1 || sscanf(name, "f%03d", &i) != 1 || i < 0 || i >= NFILES) return -ENOENT;
    struct fuse_entry_out *e = (void *)out; memset(e, 0, sizeof *e);
    e->nodeid = 2 + i; e->generation = 1; e->entry_valid = 3600; e->attr_valid = 3600;
    fill_attr(&e->attr, e->nodeid);
    return sizeof *e;
  }
  case FUSE_GETATTR: {
    struct fuse_attr_out *a = (void *)out; memset(a, 0, sizeof *a);
    a->attr_valid = 3600; fill_attr(&a->attr, in->nodeid);
    return sizeof *a;
  }
  case FUSE_OPEN: case FUSE_OPENDIR: {
    struct fuse_open_out *o = (void *)out; memset(o, 0, sizeof *o);
    o->open_flags = FOPEN_KEEP_CACHE;
    return sizeof *o;
  }
  case FUSE_READ: {
    const struct fuse_read_in *r = op;
    uint64_t end = r->offset + r->size; if (end > FSIZE) end = FSIZE;
    int n = r->offset >= FSIZE ? 0 : (int)(end - r->offset);
    memset(out, 0, n);
    return n;
  }
  case FUSE_FLUSH: case FUSE_RELEASE: case FUSE_RELEASEDIR: return 0;
  case FUSE_FORGET: case FUSE_BATCH_FORGET: case FUSE_INTERRUPT: return INT32_MIN;
  case FUSE_DESTROY: return 0;
  default: return -ENOSYS;
  }
}

static size_t op_size(uint32_t opcode) {
  switch (opcode) {
  case FUSE_INIT: return sizeof(struct fuse_init_in);
  case FUSE_GETATTR: return sizeof(struct fuse_getattr_in);
  case FUSE_OPEN: case FUSE_OPENDIR: return sizeof(struct fuse_open_in);
  case FUSE_READ: return sizeof(struct fuse_read_in);
  case FUSE_FLUSH: return sizeof(struct fuse_flush_in);
  case FUSE_RELEASE: case FUSE_RELEASEDIR: return sizeof(struct fuse_release_in);
  case FUSE_FORGET: return sizeof(struct fuse_forget_in);
  default: return 0;
  }
}

static void *classic(void *arg) {
  (void)arg;
  char *buf = malloc(PAYLOAD + 4096), *out = malloc(PAYLOAD);
  for (;;) {
    ssize_t n = read(fusefd, buf, PAYLOAD + 4096);
    if (n < 0) { if (errno == EINTR || errno == EAGAIN) continue; if (errno == ENODEV) exit(0); perror("read"); exit(1); }
    struct fuse_in_header *in = (void *)buf;
    atomic_fetch_add(&n_classic, 1);
    size_t os = op_size(in->opcode);
    int r = handle(in, buf + sizeof *in, buf + sizeof *in + os, out);
    if (r == INT32_MIN) continue;
    struct fuse_out_header oh = {.len = sizeof oh + (r > 0 ? r : 0), .error = r < 0 ? r : 0, .unique = in->unique};
    struct iovec iov[2] = {{&oh, sizeof oh}, {out, r > 0 ? r : 0}};
    if (writev(fusefd, iov, 2) < 0 && errno != ENOENT) perror("writev");
    if (in->opcode == FUSE_INIT) atomic_store(&init_done, 1);
  }
}

// ---- io_uring, raw
struct ring { int fd; unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
              struct io_uring_sqe *sqes; struct io_uring_cqe *cqes; };
static int ring_init(struct ring *r, unsigned entries) {
  struct io_uring_params p; memset(&p, 0, sizeof p); p.flags = IORING_SETUP_SQE128;
  r->fd = syscall(__NR_io_uring_setup, entries, &p);
  if (r->fd < 0) { perror("io_uring_setup"); return -1; }
  size_t sqsz = p.sq_off.array + p.sq_entries * sizeof(unsigned);
  size_t cqsz = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
  char *sq = mmap(0, sqsz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQ_RING);
  char *cq = mmap(0, cqsz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_CQ_RING);
  r->sqes = mmap(0, p.sq_entries * 128, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
  r->sq_head = (void *)(sq + p.sq_off.head); r->sq_tail = (void *)(sq + p.sq_off.tail);
  r->sq_mask = (void *)(sq + p.sq_off.ring_mask); r->sq_array = (void *)(sq + p.sq_off.array);
  r->cq_head = (void *)(cq + p.cq_off.head); r->cq_tail = (void *)(cq + p.cq_off.tail);
  r->cq_mask = (void *)(cq + p.cq_off.ring_mask); r->cqes = (void *)(cq + p.cq_off.cqes);
  return 0;
}
struct entry { struct req_header hdr; struct iovec iov[2]; char *payload; };
static void push_cmd(struct ring *r, struct entry *e, uint64_t idx, int qid, int cmd, uint64_t commit_id) {
  unsigned tail = *r->sq_tail, i = tail & *r->sq_mask;
  struct io_uring_sqe *s = (void *)((char *)r->sqes + i * 128);
  memset(s, 0, 128);
  s->opcode = IORING_OP_URING_CMD; s->fd = fusefd; s->cmd_op = cmd;
  s->addr = (uint64_t)(uintptr_t)e->iov; s->len = 2; s->user_data = idx;
  struct cmd_req *c = (void *)((char *)s + 48); c->qid = qid; c->commit_id = commit_id;
  r->sq_array[i] = i;
  atomic_thread_fence(memory_order_release);
  *r->sq_tail = tail + 1;
}
#define NENT 4
static void *queue_thread(void *arg) {
  int qid = (int)(intptr_t)arg;
  cpu_set_t set; CPU_ZERO(&set); CPU_SET(qid, &set); sched_setaffinity(0, sizeof set, &set);
  struct ring r; if (ring_init(&r, 16)) exit(1);
  struct entry *ents = calloc(NENT, sizeof *ents);
  char *out = malloc(PAYLOAD);
  for (int i = 0; i < NENT; i++) {
    ents[i].payload = aligned_alloc(4096, PAYLOAD);
    ents[i].iov[0] = (struct iovec){&ents[i].hdr, sizeof ents[i].hdr};
    ents[i].iov[1] = (struct iovec){ents[i].payload, PAYLOAD};
    push_cmd(&r, &ents[i], i, qid, CMD_REGISTER, 0);
  }
  unsigned submit = NENT;
  for (;;) {
    int rc = syscall(__NR_io_uring_enter, r.fd, submit, 1, IORING_ENTER_GETEVENTS, NULL, 0);
    if (rc < 0) { if (errno == EINTR) continue; perror("io_uring_enter"); exit(1); }
    submit = 0;
    unsigned head = *r.cq_head;
    atomic_thread_fence(memory_order_acquire);
    while (head != *r.cq_tail) {
      struct io_uring_cqe *cqe = &r.cqes[head & *r.cq_mask];
      struct entry *e = &ents[cqe->user_data];
      if (cqe->res < 0) { fprintf(stderr, "q%d: cqe res %d (%s)\n", qid, cqe->res, strerror(-cqe->res)); exit(cqe->res == -ENOTCONN ? 0 : 1); }
      struct fuse_in_header *in = (void *)e->hdr.in_out;
      atomic_fetch_add(&n_uring, 1);
      int res = handle(in, e->hdr.op_in, e->payload, out);
      struct fuse_out_header *oh = (void *)e->hdr.in_out;
      uint64_t unique = in->unique;
      memset(oh, 0, sizeof *oh);
      oh->unique = unique; oh->error = res < 0 && res != INT32_MIN ? res : 0;
      int n = res > 0 ? res : 0;
      memcpy(e->payload, out, n);
      oh->len = sizeof *oh + n;
      e->hdr.ent.payload_sz = n;
      push_cmd(&r, e, cqe->user_data, qid, CMD_COMMIT_AND_FETCH, e->hdr.ent.commit_id);
      submit++;
      head++;
    }
    atomic_thread_fence(memory_order_release);
    *r.cq_head = head;
  }
}

int main(int argc, char **argv) {
  if (argc < 3 || (strcmp(argv[1], "classic") && strcmp(argv[1], "uring"))) {
    fprintf(stderr, "usage: ckptfs-uring-probe classic|uring MOUNTPOINT\n");
    return 2;
  }
  uring_mode = !strcmp(argv[1], "uring");
  signal(SIGTERM, on_term);
  fusefd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
  if (fusefd < 0) { perror("/dev/fuse"); return 1; }
  char opts[256]; snprintf(opts, sizeof opts, "fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other", fusefd);
  if (mount("ckptfs-uring-probe", argv[2], "fuse.ckptfs-uring-probe", MS_NOSUID | MS_NODEV, opts)) { perror("mount"); return 1; }
  pthread_t t[4];
  for (int i = 0; i < 2; i++) pthread_create(&t[i], 0, classic, 0);
  if (uring_mode) {
    while (!atomic_load(&init_done)) usleep(1000);
    for (int q = 0; q < 2; q++) pthread_create(&t[2 + q], 0, queue_thread, (void *)(intptr_t)q);
  }
  fprintf(stderr, "serving %s (%s)\n", argv[2], argv[1]);
  pthread_join(t[0], 0);
  return 0;
}
