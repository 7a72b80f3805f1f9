"""Stress through a real mount with a deliberately small staging pool (G1, G3, G6, G8).

A ckptfs mount with --staging-mem 16M and --chunk-size 1M (so writers hit
backpressure all the time) is driven for CKPTFS_STRESS_SECONDS (default 45) by:
  * writer threads in this process and writer processes (forked before any thread),
    each owning a directory of "scratch" files with an exact model (a bytearray per
    file): create with a random size, pwrite at random offsets (overlapping rewrites,
    writes past EOF leaving holes), ftruncate, O_TRUNC rewrites, renames within and
    between its directories, unlinks. Every write is read back through the mount at
    once (read-your-writes) and a file is verified whole before it is renamed, closed
    for good or unlinked;
  * the same writers also publish self-describing files: written under a scratch name,
    then renamed over one of a few shared names (DCP-style rename-over, racing other
    writers for the same name);
  * reader threads and a reader process that open shared names at random and verify
    the whole file against its own header while writers keep replacing it.
At the end every file is verified through the mount, the mount is unmounted (the drain
must exit 0), and every file is verified again on the backing store against the models,
with no temp file and nothing else left there.

Daemon RSS: its VmHWM must stay within staging + cache + CKPTFS_STRESS_RSS_SLACK_MB (default
200 MiB). A watchdog fails the test, and kills exactly the daemon's PID, if no operation
completes for CKPTFS_STRESS_STALL_S (default 60) seconds. The test prints the bytes
written and verified, operations, the peak RSS and the duration.
"""
import collections
import errno
import faulthandler
import hashlib
import multiprocessing
import os
import random
import signal
import struct
import sys
import threading
import time
import traceback
import unittest

import harness

SECONDS = float(os.environ.get("CKPTFS_STRESS_SECONDS", "45"))
STALL_S = float(os.environ.get("CKPTFS_STRESS_STALL_S", "60"))
RSS_SLACK_MB = int(os.environ.get("CKPTFS_STRESS_RSS_SLACK_MB", "200"))
CACHE_MB = 32  # the read block cache is a budget of its own (--cache-mem)
SEED = int(os.environ.get("CKPTFS_STRESS_SEED", str(random.randrange(1 << 30))))
STAGING_MB = 16
CHUNK = "1M"
WRITER_THREADS = 3
WRITER_PROCS = 2
READER_THREADS = 2
READER_PROCS = 1
SHARED_NAMES = 6
MAX_FILE = 6 << 20
MiB = 1 << 20

# A fixed pool of random bytes every worker derives its data from, so no worker spends
# its time generating randomness and a reader can recompute any self-describing file.
POOL_LEN = (4 << 20) + 7
POOL = random.Random(0x5eed).randbytes(POOL_LEN)
POOL2 = POOL + POOL
MAGIC = b"CKPTSTRS"
HDR = struct.Struct("<8sQQ")   # magic, seed, total size


def pool_bytes(start, n):
    """n bytes of the pool from `start` (wrapping)."""
    out = bytearray()
    start %= POOL_LEN
    while len(out) < n:
        take = min(n - len(out), POOL_LEN)
        out += POOL2[start:start + take]
        start = (start + take) % POOL_LEN
    return bytes(out)


def self_describing(seed, size):
    size = max(size, HDR.size)
    return HDR.pack(MAGIC, seed, size) + pool_bytes(seed, size - HDR.size)


def check_self_describing(data, where):
    """Raises AssertionError unless data is a whole self-describing file."""
    if len(data) < HDR.size:
        raise AssertionError(f"{where}: {len(data)} bytes, shorter than the header")
    magic, seed, size = HDR.unpack_from(data)
    if magic != MAGIC or size != len(data):
        raise AssertionError(f"{where}: bad header magic={magic!r} size={size} "
                             f"len={len(data)}")
    if data[HDR.size:] != pool_bytes(seed, size - HDR.size):
        bad = next(i for i, (a, b) in enumerate(zip(data[HDR.size:],
                                                    pool_bytes(seed, size - HDR.size))) if a != b)
        raise AssertionError(f"{where}: body differs at byte {bad + HDR.size} of {size}")


def read_fd_all(fd):
    chunks = []
    off = 0
    while True:
        b = os.pread(fd, 4 * MiB, off)
        if not b:
            return b"".join(chunks)
        chunks.append(b)
        off += len(b)


def read_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_fd_all(fd)
    finally:
        os.close(fd)


def first_diff(a, b):
    n = min(len(a), len(b))
    for i in range(0, n, 4096):
        if a[i:i + 4096] != b[i:i + 4096]:
            return next(j for j in range(i, min(i + 4096, n)) if a[j] != b[j])
    return n


class Counters:
    """Shared between threads and forked processes."""

    def __init__(self, ctx):
        self.ops = ctx.Value("q", 0, lock=True)
        self.written = ctx.Value("q", 0, lock=True)
        self.verified = ctx.Value("q", 0, lock=True)
        self.stop = ctx.Event()

    def add(self, ops=0, written=0, verified=0):
        if ops:
            with self.ops.get_lock():
                self.ops.value += ops
        if written:
            with self.written.get_lock():
                self.written.value += written
        if verified:
            with self.verified.get_lock():
                self.verified.value += verified


class Writer:
    """Owns mnt/w<id>/{a,b}/ and an exact model of every file in them."""

    def __init__(self, wid, mnt, counters, seed):
        self.wid = wid
        self.mnt = mnt
        self.c = counters
        self.rng = random.Random(seed)
        self.dirs = [f"w{wid}/a", f"w{wid}/b"]
        self.model = {}          # relpath -> bytearray
        self.serial = 0
        self.ops = collections.Counter()

    def p(self, rel):
        return os.path.join(self.mnt, rel)

    def new_name(self):
        self.serial += 1
        return f"{self.rng.choice(self.dirs)}/f{self.serial}"

    def data(self, n):
        return pool_bytes(self.rng.randrange(POOL_LEN), n)

    def rand_size(self):
        r = self.rng.random()
        if r < 0.3:
            return self.rng.randrange(0, 64 << 10)
        if r < 0.8:
            return self.rng.randrange(64 << 10, 2 << 20)
        return self.rng.randrange(2 << 20, MAX_FILE)

    def verify_whole(self, rel, fd=None):
        data = read_fd_all(fd) if fd is not None else read_path(self.p(rel))
        want = self.model[rel]
        if data != want:
            raise AssertionError(f"writer {self.wid}: {rel} through the mount: {len(data)} "
                                 f"bytes, model {len(want)}; first difference at "
                                 f"{first_diff(data, want)}")
        self.c.add(verified=len(data))

    def run(self):
        for d in self.dirs:
            os.makedirs(self.p(d), exist_ok=True)
        while not self.c.stop.is_set():
            r = self.rng.random()
            if r < 0.35 or len(self.model) < 3:
                self.op_create()
            elif r < 0.65:
                self.op_rewrite()
            elif r < 0.72:
                self.op_truncate()
            elif r < 0.82:
                self.op_rename()
            elif r < 0.88:
                self.op_unlink()
            else:
                self.op_publish_shared()
            self.c.add(ops=1)
        return self.ops

    def op_create(self):
        rel = self.new_name()
        size = self.rand_size()
        buf = bytearray(self.data(size))
        fd = os.open(self.p(rel), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        try:
            off = 0
            while off < size:
                n = min(size - off, self.rng.choice((4096, 65536, 1 << 20, 3 << 20)))
                os.pwrite(fd, buf[off:off + n], off)
                off += n
            self.c.add(written=size)
            self.model[rel] = buf
            self.verify_whole(rel, fd)
        finally:
            os.close(fd)
        self.ops["create"] += 1

    def op_rewrite(self):
        rel = self.rng.choice(sorted(self.model))
        m = self.model[rel]
        flags = os.O_RDWR | (os.O_TRUNC if self.rng.random() < 0.1 else 0)
        fd = os.open(self.p(rel), flags)
        try:
            if flags & os.O_TRUNC:
                del m[:]
            for _ in range(self.rng.randrange(1, 8)):
                n = self.rng.choice((1, 17, 4096, 70000, 1 << 20, 2 << 20))
                off = self.rng.randrange(0, max(1, len(m) + (256 << 10)))
                if off + n > MAX_FILE:
                    off = max(0, MAX_FILE - n)
                data = self.data(n)
                if os.pwrite(fd, data, off) != n:
                    raise AssertionError(f"{rel}: short pwrite")
                if off > len(m):
                    m.extend(b"\0" * (off - len(m)))
                m[off:off + n] = data
                self.c.add(written=n)
                back = os.pread(fd, n, off)      # read-your-writes, before any flush
                if back != data:
                    raise AssertionError(f"writer {self.wid}: {rel} pread right after pwrite "
                                         f"at {off}+{n} differs at {first_diff(back, data)}")
                self.c.add(verified=n)
            if self.rng.random() < 0.3:
                os.fsync(fd)
            if self.rng.random() < 0.3:
                self.verify_whole(rel, fd)
        finally:
            os.close(fd)
        self.ops["rewrite"] += 1

    def op_truncate(self):
        rel = self.rng.choice(sorted(self.model))
        m = self.model[rel]
        size = self.rng.randrange(0, min(MAX_FILE, len(m) + (1 << 20)) + 1)
        os.truncate(self.p(rel), size)
        if size < len(m):
            del m[size:]
        else:
            m.extend(b"\0" * (size - len(m)))
        if os.stat(self.p(rel)).st_size != size:
            raise AssertionError(f"{rel}: size after truncate")
        self.ops["truncate"] += 1

    def op_rename(self):
        rel = self.rng.choice(sorted(self.model))
        self.verify_whole(rel)
        if self.rng.random() < 0.3 and len(self.model) > 1:
            dst = self.rng.choice([k for k in self.model if k != rel])   # rename over
        else:
            dst = self.new_name()
        os.rename(self.p(rel), self.p(dst))
        self.model[dst] = self.model.pop(rel)
        if os.path.exists(self.p(rel)):
            raise AssertionError(f"{rel} still exists after rename to {dst}")
        self.verify_whole(dst)
        self.ops["rename"] += 1

    def op_unlink(self):
        rel = self.rng.choice(sorted(self.model))
        self.verify_whole(rel)
        os.unlink(self.p(rel))
        del self.model[rel]
        self.ops["unlink"] += 1

    def op_publish_shared(self):
        seed = self.rng.randrange(1 << 40)
        data = self_describing(seed, self.rand_size())
        self.serial += 1
        tmp = self.p(f"{self.dirs[0]}/publish-{self.serial}")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            for off in range(0, len(data), 1 << 20):
                os.write(fd, data[off:off + (1 << 20)])
        finally:
            os.close(fd)
        self.c.add(written=len(data))
        os.rename(tmp, self.p(f"shared/s{self.rng.randrange(SHARED_NAMES)}"))
        self.ops["publish"] += 1

    def final_digests(self):
        return {rel: (len(m), hashlib.sha256(m).hexdigest()) for rel, m in self.model.items()}


def reader_loop(mnt, counters, seed, errors_out):
    rng = random.Random(seed)
    n = 0
    while not counters.stop.is_set():
        path = os.path.join(mnt, "shared", f"s{rng.randrange(SHARED_NAMES)}")
        try:
            data = read_path(path)
        except FileNotFoundError:
            time.sleep(0.01)
            continue
        check_self_describing(data, path)
        counters.add(ops=1, verified=len(data))
        n += 1
    return n


def proc_main(kind, idx, mnt, counters, seed, conn):
    """A forked worker process: runs a writer or a reader, sends back its result."""
    try:
        if kind == "writer":
            w = Writer(idx, mnt, counters, seed)
            ops = w.run()
            conn.send(("ok", dict(ops), w.final_digests()))
        else:
            n = reader_loop(mnt, counters, seed, None)
            conn.send(("ok", {"reads": n}, {}))
    except BaseException:
        counters.stop.set()
        conn.send(("error", traceback.format_exc(), {}))
    finally:
        conn.close()


def vm_hwm_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


class Stress(harness.MountedTest):
    # The mount's watchdog only catches a hang: longer than any run.
    WATCHDOG_S = 1800 + 4 * SECONDS
    def test_concurrent_writers_and_readers_with_small_staging(self):
        print(f"\nCKPTFS_STRESS_SEED={SEED} CKPTFS_STRESS_SECONDS={SECONDS}", file=sys.stderr)
        extra = os.environ.get("CKPTFS_STRESS_DAEMON_ARGS", "").split()
        m = self.mount(["--durability", "async", "--chunk-size", CHUNK,
                        "--cache-mem", f"{CACHE_MB}M"] + extra,
                       staging=f"{STAGING_MB}M")
        pid = m.proc.pid
        os.makedirs(os.path.join(m.mnt, "shared"))
        rng = random.Random(SEED)
        ctx = multiprocessing.get_context("fork")
        c = Counters(ctx)
        stalled = []
        failures = []
        t_start = time.time()

        # Processes first, while this process has no other thread to fork.
        procs = []
        n_writers = 0
        for kind, count in (("writer", WRITER_PROCS), ("reader", READER_PROCS)):
            for _ in range(count):
                idx = n_writers if kind == "writer" else -1
                n_writers += kind == "writer"
                parent, child = ctx.Pipe(duplex=False)
                pr = ctx.Process(target=proc_main,
                                 args=(kind, idx, m.mnt, c, rng.randrange(1 << 30), child))
                pr.start()
                child.close()
                procs.append((kind, pr, parent))

        writers = [Writer(n_writers + i, m.mnt, c, rng.randrange(1 << 30))
                   for i in range(WRITER_THREADS)]
        results = {}

        def run_thread(name, fn):
            try:
                results[name] = fn()
            except BaseException:
                failures.append(f"{name}:\n{traceback.format_exc()}")
                c.stop.set()

        threads = [threading.Thread(target=run_thread, args=(f"writer-thread-{w.wid}", w.run))
                   for w in writers]
        threads += [threading.Thread(target=run_thread,
                                     args=(f"reader-thread-{i}",
                                           lambda s=rng.randrange(1 << 30):
                                           reader_loop(m.mnt, c, s, None)))
                    for i in range(READER_THREADS)]
        for t in threads:
            t.start()

        # Watchdog and RSS sampler.
        peak_kib = [0]
        watchdog_done = threading.Event()

        def watchdog():
            last_ops, last_change = -1, time.time()
            while not watchdog_done.wait(0.5):
                try:
                    peak_kib[0] = max(peak_kib[0], vm_hwm_kib(pid))
                except OSError:
                    pass
                ops = c.ops.value
                if ops != last_ops:
                    last_ops, last_change = ops, time.time()
                elif time.time() - last_change > STALL_S:
                    stalled.append(f"no operation completed for {STALL_S:.0f}s at {ops} ops")
                    sys.stderr.write(f"\nwatchdog: {stalled[-1]}; killing ckptfs pid {pid}\n")
                    faulthandler.dump_traceback(all_threads=True)
                    c.stop.set()
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    harness.unmount(m.mnt)
                    return

        wd = threading.Thread(target=watchdog, daemon=True)
        wd.start()
        deadline = t_start + SECONDS
        while time.time() < deadline and not c.stop.is_set():
            time.sleep(0.2)
        c.stop.set()
        for t in threads:
            t.join(timeout=STALL_S + 30)
            if t.is_alive():
                failures.append(f"{t.name} did not finish")
        digests = {}
        for kind, pr, conn in procs:
            if conn.poll(STALL_S + 30):
                status, info, dig = conn.recv()
                if status != "ok":
                    failures.append(f"{kind} process:\n{info}")
                digests.update(dig)
            else:
                failures.append(f"{kind} process {pr.pid} sent no result")
            pr.join(timeout=30)
            if pr.is_alive():
                pr.kill()
                pr.join()
        run_s = time.time() - t_start
        watchdog_done.set()
        wd.join(timeout=5)
        self.assertEqual(stalled, [], "watchdog: the mount stalled\n" + m.log_text()[-4000:])
        self.assertEqual(failures, [], "\n".join(failures) + "\n--- ckptfs log tail ---\n" +
                         m.log_text()[-4000:])
        for w in writers:
            digests.update(w.final_digests())
        self.assertIsNone(m.proc.poll(), "the daemon exited")

        # Everything, once more through the mount.
        verified_end = 0
        for rel, (size, h) in sorted(digests.items()):
            data = read_path(os.path.join(m.mnt, rel))
            self.assertEqual((len(data), hashlib.sha256(data).hexdigest()), (size, h),
                             f"{rel} through the mount at the end")
            verified_end += len(data)
        shared = sorted(os.listdir(os.path.join(m.mnt, "shared")))
        for name in shared:
            data = read_path(os.path.join(m.mnt, "shared", name))
            check_self_describing(data, "mount:shared/" + name)
            verified_end += len(data)
        peak_kib[0] = max(peak_kib[0], vm_hwm_kib(pid))
        stats = m.stats()

        t_drain = time.time()
        rc = m.unmount(timeout=300)
        drain_s = time.time() - t_drain
        self.assertEqual(rc, 0, "drain after the stress run\n" + m.log_text()[-4000:])

        # The backing store alone, against the models.
        verified_backing = 0
        on_backing = set()
        for d, dirs, files in os.walk(m.backing):
            for n in files:
                on_backing.add(os.path.relpath(os.path.join(d, n), m.backing))
        expected = set(digests) | {f"shared/{n}" for n in shared}
        self.assertEqual(sorted(on_backing - expected), [], "unexpected files on the backing "
                         "store (temps or stale names)")
        self.assertEqual(sorted(expected - on_backing), [], "files missing on the backing store")
        for rel, (size, h) in sorted(digests.items()):
            with open(os.path.join(m.backing, rel), "rb") as f:
                data = f.read()
            self.assertEqual((len(data), hashlib.sha256(data).hexdigest()), (size, h),
                             f"{rel} on the backing store")
            verified_backing += len(data)
        for name in shared:
            with open(os.path.join(m.backing, "shared", name), "rb") as f:
                data = f.read()
            check_self_describing(data, "backing:shared/" + name)
            verified_backing += len(data)

        budget_kib = (STAGING_MB + CACHE_MB + RSS_SLACK_MB) * 1024
        ops = collections.Counter()
        for w in writers:
            ops.update(w.ops)
        print(f"stress: {run_s:.1f}s of load, {c.ops.value} operations, "
              f"{c.written.value / MiB:.1f} MiB written, "
              f"{(c.verified.value + verified_end) / MiB:.1f} MiB verified through the mount, "
              f"{verified_backing / MiB:.1f} MiB verified on the backing store, "
              f"{len(digests)} files + {len(shared)} shared; drain {drain_s:.1f}s; "
              f"daemon VmHWM {peak_kib[0] / 1024:.0f} MiB (budget {budget_kib / 1024:.0f}); "
              f"thread-writer ops {dict(ops)}; staging stats "
              f"{ {k: v for k, v in stats.items() if 'staging' in k} }", file=sys.stderr)
        self.assertGreater(c.ops.value, 50, "the stress run made almost no progress")
        self.assertLessEqual(peak_kib[0], budget_kib,
                             f"daemon peak RSS {peak_kib[0] / 1024:.0f} MiB over staging "
                             f"{STAGING_MB} MiB + {RSS_SLACK_MB} MiB")


if __name__ == "__main__":
    unittest.main()
