"""Reads through the daemon's block cache, over a real mount (issue 4).

Checkpoints are saved with dcp_tool DIRECTLY into the backing directory (no
ckptfs involved), so every byte read through the mount comes from the backing
store through the block cache. Before each measured read the page cache is
dropped (`sync; echo 3 > /proc/sys/vm/drop_caches`, root).

  * test_concurrent_readers: 8 processes reading the same bytes and
    overlapping, unaligned ranges at once get byte-exact data; the backing
    bytes read (cache_backing_bytes_read and backing_bytes_read) for 8
    identical concurrent readers equal one reader's, i.e. the file size, both
    for a committed checkpoint's shard (keep_cache) and for a plain file.
  * test_dcp_loads: a 4-rank DCP load of each kind (own, replicated,
    reshard) through the mount verifies every tensor, for both
    single_file_per_rank settings; a replicated load (4x the bytes) on a cold
    daemon reads the checkpoint from the backing store at most 1.05x.
  * test_budget_holds: --cache-mem 64M while 512 MiB of files (and a DCP
    load) are read concurrently: cache_used never exceeds cache_limit (polled),
    cache_peak <= cache_limit, and the daemon's VmHWM <= staging + cache +
    150 MiB.
  * test_freshness_*: a file outside any checkpoint (1 s kernel timeouts)
    changed on the backing store by someone else (rewritten in place with a
    different size, rewritten in place with the same size, replaced by rename,
    replaced by rename with identical size and mtime) is never served stale
    once it is reopened after the attribute timeout; nor through a handle kept
    open across an in-place rewrite, once the attribute timeout has passed.
"""
import hashlib
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import unittest

import dcp_tool
import harness
from harness import Mount

MiB = 1 << 20
RANKS = 4
SEED = 77
BIG_MB = 64             # sfpr=1 checkpoint: 4 shard files of ~16 MiB
SMALL_MB = 32           # sfpr=0 checkpoint
PLAIN_FILE_MB = 64      # plain files outside any checkpoint
BUDGET_FILES = 8        # 8 x 64 MiB = 512 MiB read under a 64 MiB cache
READERS = 8
ATTR_WAIT = 1.6         # > the daemon's 1 s entry/attr timeout for non-checkpoint files


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def vm_hwm(pid):
    return harness.proc_status_bytes(pid, "VmHWM")


def pattern_bytes(tag, size):
    """Deterministic, position-dependent content: every 4 KiB block differs."""
    out = bytearray()
    block = 0
    while len(out) < size:
        out += hashlib.sha256(f"{tag}/{block}".encode()).digest() * 128
        block += 1
    return bytes(out[:size])


def write_file(path, data):
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_all(path, chunk=MiB):
    with open(path, "rb", buffering=0) as f:
        parts = []
        while True:
            b = f.read(chunk)
            if not b:
                break
            parts.append(b)
    return b"".join(parts)


# ------------------------------------------------------------------------------------------
# Reader processes (forked: `expected` is inherited, never re-read from the backing store).

def _reader(path, ranges, expected, barrier, results, idx):
    errors = []
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            barrier.wait(timeout=60)
            for off, length in ranges:
                got = b""
                while len(got) < length:
                    part = os.pread(fd, length - len(got), off + len(got))
                    if not part:
                        break
                    got += part
                want = expected[off:off + length]
                if got != want:
                    bad = next((i for i in range(min(len(got), len(want)))
                                if got[i] != want[i]), min(len(got), len(want)))
                    errors.append(f"range [{off}, +{length}): got {len(got)} bytes, want "
                                  f"{len(want)}, first difference at {off + bad}")
                    if len(errors) > 5:
                        break
        finally:
            os.close(fd)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        errors.append(f"{type(e).__name__}: {e}")
    results.put((idx, errors))


def run_readers(path, expected, range_lists, timeout=120):
    """One forked process per range list, all started at one barrier; returns errors."""
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(len(range_lists))
    results = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(path, r, expected, barrier, results, i))
             for i, r in enumerate(range_lists)]
    for p in procs:
        p.start()
    errors = {}
    try:
        for _ in procs:
            idx, errs = results.get(timeout=timeout)
            if errs:
                errors[idx] = errs
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    for i, p in enumerate(procs):
        if p.exitcode != 0:
            errors.setdefault(i, []).append(f"exit code {p.exitcode}")
    return errors


def sequential_ranges(size, chunk=MiB):
    return [(off, min(chunk, size - off)) for off in range(0, size, chunk)]


def overlapping_ranges(size, i):
    """Reader i: unaligned ranges of a length of its own, starting at a phase of its own,
    wrapping around so that together the readers cover every byte several times."""
    length = 3 * MiB + 4096 * (7 * i + 1) + 13 * i
    start = (i * 1_234_567) % size
    ranges, off, covered = [], start, 0
    while covered < size:
        n = min(length, size - off)
        ranges.append((off, n))
        covered += n
        off = (off + n) % size
    # plus a few short reads straddling 1 MiB block boundaries
    ranges += [(b * MiB - 100 - i, 200 + 3 * i) for b in range(1, size // MiB, 5)]
    return ranges


class ReadCache(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if os.geteuid() != 0:
            raise unittest.SkipTest("needs root (FUSE, drop_caches)")
        cls.root = tempfile.mkdtemp(prefix="ckptfs-readcache-")
        cls.backing = os.path.join(cls.root, "backing")
        os.makedirs(cls.backing)
        # Checkpoints saved directly into the backing dir: ckptfs only ever reads them.
        dcp_tool.save(os.path.join(cls.backing, "ckpt_sfpr1"), RANKS, BIG_MB, True, SEED,
                      timeout=300)
        dcp_tool.save(os.path.join(cls.backing, "ckpt_sfpr0"), RANKS, SMALL_MB, False, SEED,
                      timeout=300)
        data = os.path.join(cls.backing, "data")
        os.makedirs(data)
        for i in range(BUDGET_FILES):
            write_file(os.path.join(data, f"plain{i}.bin"),
                       pattern_bytes(f"plain{i}", PLAIN_FILE_MB * MiB + 4321 * i))

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.root, ignore_errors=True)

    def mount(self, args=(), staging="64M"):
        # The block cache is what these tests measure: the daemon serves every read.
        return Mount(args=list(args) + ["--passthrough", "off"], backing=self.backing,
                     root=tempfile.mkdtemp(prefix="m-", dir=self.root), staging=staging)

    def shard_files(self, ckpt):
        d = os.path.join(self.backing, ckpt)
        files = sorted((n for n in os.listdir(d) if n.endswith(".distcp")),
                       key=lambda n: -os.path.getsize(os.path.join(d, n)))
        return files

    def read_counters(self, m):
        s = m.stats()
        return s["cache_backing_bytes_read"], s["backing_bytes_read"]

    def assert_backing_bytes(self, what, got, size, slack):
        self.assertGreaterEqual(got, size, f"{what}: read {got} < file size {size}?")
        self.assertLessEqual(got, size + slack,
                             f"{what}: {got} bytes read from the backing store for a "
                             f"{size}-byte file (allowed {size + slack})")

    # -- (a) -------------------------------------------------------------------------------

    def measure(self, rel, nreaders):
        """Fresh daemon, cold page cache; nreaders identical whole-file readers of `rel`.
        Returns (cache_backing_bytes_read, backing_bytes_read) deltas."""
        expected = open(os.path.join(self.backing, rel), "rb").read()
        with self.mount() as m:
            path = os.path.join(m.mnt, rel)
            drop_caches()
            c0, b0 = self.read_counters(m)
            errors = run_readers(path, expected,
                                 [sequential_ranges(len(expected))] * nreaders)
            self.assertEqual(errors, {}, f"{nreaders} identical readers of {rel}")
            time.sleep(0.3)  # let a prefetch that raced the readers finish counting
            c1, b1 = self.read_counters(m)
            self.assertEqual(m.stats()["errors"], 0, m.log_text())
            return c1 - c0, b1 - b0, len(expected)

    def test_concurrent_readers(self):
        shard = os.path.join("ckpt_sfpr1", self.shard_files("ckpt_sfpr1")[0])
        plain = os.path.join("data", "plain0.bin")
        for rel in (shard, plain):
            with self.subTest(file=rel):
                c1, b1, size = self.measure(rel, 1)
                cn, bn, _ = self.measure(rel, READERS)
                slack = MiB + size // 100
                self.assert_backing_bytes(f"{rel}, 1 reader, cache", c1, size, slack)
                self.assert_backing_bytes(f"{rel}, {READERS} readers, cache", cn, size, slack)
                self.assert_backing_bytes(f"{rel}, 1 reader, total", b1, size, 2 * slack)
                self.assert_backing_bytes(f"{rel}, {READERS} readers, total", bn, size,
                                          2 * slack)
                self.assertLessEqual(abs(cn - c1), slack,
                                     f"{READERS} readers read {cn} bytes, one reader {c1}")
                self.assertLessEqual(abs(bn - b1), slack,
                                     f"{READERS} readers read {bn} bytes, one reader {b1}")

        # Overlapping, unaligned ranges at once, on a cold daemon and cold page cache.
        for rel in (os.path.join("ckpt_sfpr1", self.shard_files("ckpt_sfpr1")[1]),
                    os.path.join("data", "plain1.bin")):
            with self.subTest(overlapping=rel):
                expected = open(os.path.join(self.backing, rel), "rb").read()
                size = len(expected)
                with self.mount() as m:
                    drop_caches()
                    c0, _ = self.read_counters(m)
                    errors = run_readers(os.path.join(m.mnt, rel), expected,
                                         [overlapping_ranges(size, i) for i in range(READERS)])
                    self.assertEqual(errors, {}, f"overlapping readers of {rel}")
                    time.sleep(0.3)
                    c1, _ = self.read_counters(m)
                    self.assert_backing_bytes(f"{rel}, overlapping readers", c1 - c0, size,
                                              MiB + size // 100)
                    s = m.stats()
                    self.assertEqual(s["errors"], 0, m.log_text())
                    self.assertGreaterEqual(s["bytes_served"], size)

    # -- (b) -------------------------------------------------------------------------------

    def test_dcp_loads(self):
        for ckpt in ("ckpt_sfpr1", "ckpt_sfpr0"):
            ckpt_bytes = sum(os.path.getsize(os.path.join(self.backing, ckpt, n))
                             for n in os.listdir(os.path.join(self.backing, ckpt)))
            with self.mount() as m:
                # replicated first: a cold daemon, every rank loads every tensor
                for mode in ("replicated", "own", "reshard"):
                    with self.subTest(ckpt=ckpt, mode=mode):
                        _, b0 = self.read_counters(m)
                        try:
                            dcp_tool.load(os.path.join(m.mnt, ckpt), RANKS, mode, SEED,
                                          timeout=300)
                        except dcp_tool.DcpToolError as e:
                            self.fail(f"{ckpt} {mode} load through the mount: {e}\n"
                                      f"{m.log_text()}")
                        _, b1 = self.read_counters(m)
                        if mode == "replicated":
                            self.assertLessEqual(
                                b1 - b0, 1.05 * ckpt_bytes,
                                f"{ckpt}: replicated load read {b1 - b0} backing bytes for "
                                f"a {ckpt_bytes}-byte checkpoint")
                self.assertEqual(m.stats()["errors"], 0, m.log_text())

    # -- (c) -------------------------------------------------------------------------------

    def test_budget_holds(self):
        staging, cache = 64 * MiB, 64 * MiB
        data = os.path.join(self.backing, "data")
        names = sorted(os.listdir(data))
        total = sum(os.path.getsize(os.path.join(data, n)) for n in names)
        self.assertGreaterEqual(total, 512 * MiB)
        digests = {}
        for n in names:
            with open(os.path.join(data, n), "rb") as f:
                digests[n] = hashlib.sha256(f.read()).hexdigest()
        with self.mount(args=["--cache-mem", "64M"], staging="64M") as m:
            self.assertEqual(m.stats()["cache_limit"], cache)
            samples, stop = [], threading.Event()

            def poll():
                while not stop.is_set():
                    try:
                        s = m.stats()
                        samples.append((s["cache_used"], s["cache_limit"], s["cache_peak"]))
                    except (OSError, ValueError):
                        pass
                    stop.wait(0.02)

            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            got, errors = {}, []

            def reader(ns):
                for n in ns:
                    try:
                        h = hashlib.sha256()
                        with open(os.path.join(m.mnt, "data", n), "rb") as f:
                            for b in iter(lambda: f.read(MiB), b""):
                                h.update(b)
                        got[n] = h.hexdigest()
                    except OSError as e:
                        errors.append(f"{n}: {e}")

            threads = [threading.Thread(target=reader, args=(names[i::4],)) for i in range(4)]
            try:
                for t in threads:
                    t.start()
                # and a DCP load (its .metadata open prefetches the whole checkpoint)
                dcp_tool.load(os.path.join(m.mnt, "ckpt_sfpr1"), RANKS, "own", SEED, timeout=300)
                for t in threads:
                    t.join(timeout=300)
            finally:
                stop.set()
                poller.join()
            self.assertEqual(errors, [])
            self.assertEqual(got, digests, "contents read under a 64 MiB cache")
            s = m.stats()
            hwm = vm_hwm(m.proc.pid)
            self.assertGreater(len(samples), 5)
            over = [x for x in samples if x[0] > x[1]]
            self.assertEqual(over, [], "cache_used above cache_limit")
            self.assertLessEqual(s["cache_peak"], s["cache_limit"])
            self.assertGreater(s["cache_peak"], 0)
            self.assertGreaterEqual(s["cache_backing_bytes_read"], total)
            self.assertLessEqual(hwm, staging + cache + 150 * MiB,
                                 f"daemon VmHWM {hwm / MiB:.0f} MiB with {staging // MiB} MiB "
                                 f"staging and a {cache // MiB} MiB cache")
            self.assertEqual(s["errors"], 0, m.log_text())

    # -- (d) -------------------------------------------------------------------------------

    def freshness_mount(self, name):
        d = os.path.join(self.backing, "fresh")
        os.makedirs(d, exist_ok=True)
        return self.mount(), os.path.join(d, name), os.path.join("fresh", name)

    def assert_reads(self, m, rel, want, what):
        path = os.path.join(m.mnt, rel)
        self.assertEqual(os.stat(path).st_size, len(want), f"{what}: st_size")
        got = read_all(path)
        self.assertEqual(len(got), len(want), f"{what}: bytes read")
        self.assertTrue(got == want, f"{what}: stale or wrong content")
        # and a partial read of the middle, as a reader doing pread would
        with open(path, "rb", buffering=0) as f:
            mid = len(want) // 2
            self.assertTrue(os.pread(f.fileno(), 4096, mid) == want[mid:mid + 4096],
                            f"{what}: pread")

    def test_freshness_after_reopen(self):
        mnt_ctx, backing_path, rel = self.freshness_mount("f.bin")
        a = pattern_bytes("A", 3 * MiB + 17)
        write_file(backing_path, a)
        with mnt_ctx as m:
            self.assert_reads(m, rel, a, "initial")
            self.assert_reads(m, rel, a, "initial, again (cached)")

            # 1. rewritten in place with a different size and content
            b = pattern_bytes("B", 5 * MiB + 123)
            write_file(backing_path, b)
            time.sleep(ATTR_WAIT)
            self.assert_reads(m, rel, b, "in-place rewrite, larger")

            # 2. rewritten in place with the same size, different content (new mtime)
            c = pattern_bytes("C", len(b))
            write_file(backing_path, c)
            time.sleep(ATTR_WAIT)
            self.assert_reads(m, rel, c, "in-place rewrite, same size")

            # 3. shrunk in place
            d = pattern_bytes("D", MiB + 5)
            write_file(backing_path, d)
            time.sleep(ATTR_WAIT)
            self.assert_reads(m, rel, d, "in-place rewrite, smaller")

            # 4. replaced by rename (new inode), different size
            e = pattern_bytes("E", 4 * MiB + 999)
            tmp = backing_path + ".new"
            write_file(tmp, e)
            os.rename(tmp, backing_path)
            time.sleep(ATTR_WAIT)
            self.assert_reads(m, rel, e, "replaced by rename")

            # 5. replaced by rename with the same size and the same mtime: only the
            # inode tells the versions apart
            f_ = pattern_bytes("F", len(e))
            old = os.stat(backing_path)
            write_file(tmp, f_)
            os.utime(tmp, ns=(old.st_atime_ns, old.st_mtime_ns))
            os.rename(tmp, backing_path)
            self.assertEqual(os.stat(backing_path).st_mtime_ns, old.st_mtime_ns)
            time.sleep(ATTR_WAIT)
            self.assert_reads(m, rel, f_, "replaced by rename, same size and mtime")
            self.assertEqual(m.stats()["errors"], 0, m.log_text())

    def test_freshness_open_handle(self):
        """A handle kept open while someone rewrites the file in place (same inode): once
        the attribute timeout has passed, fstat shows the new size and reads return the
        new bytes, as on the backing file system itself."""
        mnt_ctx, backing_path, rel = self.freshness_mount("held.bin")
        a = pattern_bytes("hA", 2 * MiB + 7)
        write_file(backing_path, a)
        with mnt_ctx as m:
            fd = os.open(os.path.join(m.mnt, rel), os.O_RDONLY)
            try:
                self.assertTrue(os.pread(fd, len(a) + 10, 0) == a, "initial")
                b = pattern_bytes("hB", 3 * MiB + 70)
                write_file(backing_path, b)  # O_TRUNC + write: the same inode
                time.sleep(ATTR_WAIT)
                self.assertEqual(os.fstat(fd).st_size, len(b), "fstat after the timeout")
                got = os.pread(fd, len(b) + 10, 0)
                self.assertEqual(len(got), len(b), "bytes read through the held handle")
                self.assertTrue(got == b, "held handle served stale bytes after an in-place "
                                          "rewrite")
            finally:
                os.close(fd)


if __name__ == "__main__":
    unittest.main()
