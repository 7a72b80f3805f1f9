"""Reads through the kernel's FUSE passthrough (issue 21), over a real mount.

  * test_reads_pass_through: a plain file and a DCP checkpoint saved directly into the
    backing dir read back byte-exact through the mount by read() and mmap, with the
    kernel serving them (stats: passthrough "on", passthrough_opens counted, the daemon
    served no byte of them), and a 4-rank DCP load verifies every tensor.
  * test_read_your_writes_after_rewrite: a file rewritten through the mount (O_TRUNC)
    reads back its new bytes at once (the daemon serves staged bytes), and after its
    publication through passthrough again; a writer that opens the file while a
    passthrough reader holds it fails with EBUSY after the bounded wait (no hang), and
    succeeds once the reader closed.
  * test_fallback_when_disabled: --passthrough off: every read is the daemon's, bytes
    are the same, stats say why it is off; closing a read-only open sends no FLUSH
    (FOPEN_NOFLUSH, as passthrough opens), closing a writable one does.
  * test_prefetch_fills_only_the_setup_gap: the page-cache prefetch that opening
    `.metadata` starts asks for nothing when a rank opens a data file right away (torch
    2.x), and for some of the checkpoint, never more than it, when the ranks take their
    time first (torch 1.13 plans and allocates); both read back byte-exact.
Skips when this kernel or this process cannot pass through (stats say "off: ...").
"""
import errno
import hashlib
import mmap
import os
import time
import unittest
import urllib.request

import dcp_tool
from harness import Mount

MiB = 1 << 20


def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            h.update(block)
    return h.hexdigest()


def op_count(m, op):
    """`op` requests the daemon answered so far (its op histogram in /.ckptfs/metrics)."""
    with open(os.path.join(m.mnt, ".ckptfs", "metrics")) as f:
        for line in f:
            if line.startswith("ckptfs_fuse_op_duration_seconds_count") and f'op="{op}"' in line:
                return int(float(line.split()[-1]))
    raise AssertionError(f"no {op} histogram in /.ckptfs/metrics")


def http_op_count(port, op):
    """`op` requests the daemon answered so far, from its --metrics-listen endpoint: reading
    it costs the mount no request, unlike /.ckptfs/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("ckptfs_fuse_op_duration_seconds_count") and f'op="{op}"' in line:
                return int(float(line.split()[-1]))
    raise AssertionError(f"no {op} histogram at :{port}/metrics")


def flush_ops(m):
    return op_count(m, "flush")


def mmap_sha(path):
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
            return hashlib.sha256(m[:]).hexdigest()


class PassthroughTest(unittest.TestCase):
    def setUp(self):
        if os.geteuid() != 0:
            self.skipTest("FUSE passthrough needs CAP_SYS_ADMIN")

    def start(self, args=()):
        m = Mount(args=args)
        m.start()
        self.addCleanup(m.cleanup)
        return m

    def require_on(self, m):
        state = m.stats().get("passthrough", "")
        if state != "on":
            self.skipTest(f"passthrough is {state!r} on this kernel")

    def test_reads_pass_through(self):
        m = self.start(["--passthrough-min-size", "0"])  # .metadata passes through too
        self.require_on(m)
        data = os.urandom(8 * MiB + 123)
        with open(os.path.join(m.backing, "plain.bin"), "wb") as f:
            f.write(data)
        want = hashlib.sha256(data).hexdigest()
        dcp_tool.save(os.path.join(m.backing, "ckpt"), 4, 32, True, 7)
        s0 = m.stats()
        path = os.path.join(m.mnt, "plain.bin")
        self.assertEqual(sha(path), want)
        self.assertEqual(mmap_sha(path), want)
        ckpt_files = sorted(f for f in os.listdir(os.path.join(m.backing, "ckpt")))
        for name in ckpt_files:
            self.assertEqual(sha(os.path.join(m.mnt, "ckpt", name)),
                             sha(os.path.join(m.backing, "ckpt", name)), name)
        s1 = m.stats()
        self.assertGreaterEqual(s1["passthrough_opens"] - s0["passthrough_opens"],
                                2 + len(ckpt_files))
        self.assertEqual(s1["bytes_served"] - s0["bytes_served"], 0,
                         "the daemon served bytes the kernel should have passed through")
        self.assertEqual(s1["passthrough_refused"], 0)
        dcp_tool.load(os.path.join(m.mnt, "ckpt"), 4, "own", 7)
        dcp_tool.load(os.path.join(m.mnt, "ckpt"), 4, "replicated", 7)
        s2 = m.stats()
        self.assertEqual(s2["passthrough_open_now"], 0)
        self.assertEqual(s2["errors"], 0)
        self.assertEqual(m.unmount(), 0, "the daemon exits cleanly with backing ids registered")

    def test_prefetch_fills_only_the_setup_gap(self):
        m = self.start()
        self.require_on(m)
        for name in ("at_once", "after_setup"):
            dcp_tool.save(os.path.join(m.backing, name), 4, 64, True, 7)

        def prefetched():
            return m.stats()["passthrough_page_cache_prefetched"]

        def data_bytes(name):
            d = os.path.join(m.backing, name)
            return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)
                       if f.endswith(".distcp"))

        # A rank that reads right after `.metadata`: no prefetch at all.
        p0 = prefetched()
        with open(os.path.join(m.mnt, "at_once", ".metadata"), "rb") as md, \
                open(os.path.join(m.mnt, "at_once", "__0_0.distcp"), "rb") as f:
            md.read()
            f.read(1)
        time.sleep(1.0)
        self.assertEqual(prefetched(), p0, "prefetched beside ranks that read at once")
        # Ranks that plan for a while first: the prefetch fills that time.
        with open(os.path.join(m.mnt, "after_setup", ".metadata"), "rb") as md:
            md.read()
        deadline = time.monotonic() + 10
        while prefetched() == p0 and time.monotonic() < deadline:
            time.sleep(0.05)
        got = prefetched() - p0
        self.assertGreater(got, 0, "nothing prefetched in the setup gap")
        self.assertLessEqual(got, data_bytes("after_setup"))
        for name in ("at_once", "after_setup"):
            for f in sorted(os.listdir(os.path.join(m.backing, name))):
                self.assertEqual(sha(os.path.join(m.mnt, name, f)),
                                 sha(os.path.join(m.backing, name, f)), f)
        self.assertEqual(m.stats()["errors"], 0)

    def test_read_your_writes_after_rewrite(self):
        m = self.start(["--passthrough-min-size", "0"])  # this small file passes through too
        self.require_on(m)
        path = os.path.join(m.mnt, "tracker.txt")
        with open(os.path.join(m.backing, "tracker.txt"), "w") as f:
            f.write("100\n")
        with open(path) as f:
            self.assertEqual(f.read(), "100\n")
        # A reader holds it through passthrough: a writer may not change it under the reader
        # (the kernel would keep serving the old backing file): bounded wait, then EBUSY.
        reader = os.open(path, os.O_RDONLY)
        opens = m.stats()["passthrough_open_now"]
        self.assertGreaterEqual(opens, 1)
        t0 = time.monotonic()
        with self.assertRaises(OSError) as cm:
            open(path, "w")
        self.assertEqual(cm.exception.errno, errno.EBUSY)
        self.assertLess(time.monotonic() - t0, 10)
        self.assertEqual(os.pread(reader, 16, 0), b"100\n")
        os.close(reader)
        # Closed: the rewrite goes through, and its bytes read back at once (staged).
        with open(path, "w") as f:
            f.write("200\n")
        with open(path) as f:
            self.assertEqual(f.read(), "200\n")
        m.wait(path)
        before = m.stats()["passthrough_opens"]
        for _ in range(50):  # the write state goes once its last handle is released
            with open(path) as f:
                self.assertEqual(f.read(), "200\n")
            if m.stats()["passthrough_opens"] > before:
                break
            time.sleep(0.1)
        self.assertGreater(m.stats()["passthrough_opens"], before,
                           "a published file is passed through again")
        with open(os.path.join(m.backing, "tracker.txt")) as f:
            self.assertEqual(f.read(), "200\n")
        # Truncate by path waits for readers too, and is seen by the next open.
        with open(path) as f:
            self.assertEqual(f.read(), "200\n")
        os.truncate(path, 1)
        with open(path) as f:
            self.assertEqual(f.read(), "2")
        self.assertEqual(m.stats()["errors"], 0)

    def test_committed_checkpoint_attributes_stay_cached(self):
        """A passthrough read invalidates the file's atime in the kernel, so the next stat
        is a GETATTR. For a committed checkpoint's file (attributes kept 3600 s) the
        daemon answers it from what it holds; a plain file is refreshed from the backing
        store, so a change made there shows at once."""
        port = dcp_tool.free_port()
        m = self.start(["--passthrough-min-size", "0", "--metrics-listen", f"127.0.0.1:{port}"])
        self.require_on(m)
        ck = os.path.join(m.backing, "ck")
        os.makedirs(ck)
        for name, size in ((".metadata", 4096), ("__0_0.distcp", MiB)):
            with open(os.path.join(ck, name), "wb") as f:
                f.write(os.urandom(size))
        with open(os.path.join(m.backing, "plain.bin"), "wb") as f:
            f.write(os.urandom(MiB))
        shard, plain = os.path.join(m.mnt, "ck", "__0_0.distcp"), os.path.join(m.mnt, "plain.bin")
        with open(os.path.join(m.mnt, "ck", ".metadata"), "rb") as f:
            f.read()  # a load starts here: the checkpoint is committed
        modes = {p: os.stat(p).st_mode & 0o7777 for p in (shard, plain)}
        self.assertEqual(modes[shard], 0o644)
        for p in (shard, plain):
            os.chmod(os.path.join(m.backing, os.path.relpath(p, m.mnt)), 0o600)
        opens = m.stats()["passthrough_opens"]
        for p in (shard, plain):
            with open(p, "rb") as f:
                f.read(4096)  # through the kernel: the atime is invalidated
        self.assertEqual(m.stats()["passthrough_opens"], opens + 2)
        # Counted over HTTP: reading /.ckptfs/metrics through the mount costs GETATTRs of its
        # own, as many as the control files' attribute timeouts leave (1 to 3 here).
        g0 = http_op_count(port, "getattr")
        self.assertEqual(os.stat(plain).st_mode & 0o7777, 0o600)
        self.assertEqual(os.stat(shard).st_mode & 0o7777, modes[shard])
        # The kernel did ask: both stats were GETATTRs. A request is counted when its
        # handler returns, after its reply woke the caller: wait for the count to settle.
        deadline = time.monotonic() + 5
        while http_op_count(port, "getattr") - g0 < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        self.assertEqual(http_op_count(port, "getattr") - g0, 2)
        self.assertEqual(m.stats()["errors"], 0)
        self.assertEqual(m.unmount(), 0)

    def test_fallback_when_disabled(self):
        m = self.start(["--passthrough", "off"])
        data = os.urandom(3 * MiB + 5)
        with open(os.path.join(m.backing, "plain.bin"), "wb") as f:
            f.write(data)
        path = os.path.join(m.mnt, "plain.bin")
        self.assertEqual(sha(path), hashlib.sha256(data).hexdigest())
        self.assertEqual(mmap_sha(path), hashlib.sha256(data).hexdigest())
        s = m.stats()
        self.assertEqual(s["passthrough"], "off: --passthrough off")
        self.assertEqual(s["passthrough_opens"], 0)
        self.assertGreaterEqual(s["bytes_served"], 2 * len(data))
        # A writer next to a reader is no conflict on the daemon's path.
        reader = os.open(path, os.O_RDONLY)
        with open(path, "r+b") as f:
            f.write(b"x")
        self.assertEqual(os.pread(reader, 1, 0), b"x")
        os.close(reader)
        # Read-only closes skip the FLUSH round trip; writable ones keep it (G7: a flush
        # error reaches close()). The metrics read's own close adds one FLUSH.
        before = flush_ops(m)
        for _ in range(10):
            with open(path, "rb") as f:
                f.read(1)
        self.assertLessEqual(flush_ops(m) - before, 1, "read-only closes sent FLUSH")
        before = flush_ops(m)
        for _ in range(10):
            with open(path, "r+b") as f:
                f.write(b"y")
        self.assertGreaterEqual(flush_ops(m) - before, 10, "writable closes skipped FLUSH")


if __name__ == "__main__":
    unittest.main()
