"""FUSE over io_uring (issue 21), over real mounts: requests come over the kernel's rings, a
queue per CPU, and everything works as over /dev/fuse.

  * test_requests_come_over_the_ring: a --fuse-uring on mount serves over io_uring (stats
    fuse_transport, fuse_uring_requests) and leaves the kernel's switch
    (fuse.enable_uring) as it found it. Files written in 1 MiB and odd-sized writes,
    read back staged (daemon) and published (passthrough), renames, directories,
    symlinks, xattrs (a request with a payload whose reply also carries bytes), error
    replies, truncation; a 4-rank torch DCP save and verified loads in both layouts. No request
    was answered EIO by the ring code (fuse_uring_errors 0), the daemon exits 0.
  * test_off_and_auto: --fuse-uring off serves over /dev/fuse, and auto (also given by no
    flag, the default) does so while the switch is off, saying why; the same files read
    back exact.
  * test_waiting_handler_leaves_its_cpu_served: three writers on CPU 0 wait in their
    handlers (a write open of a file a passthrough reader holds waits up to 1 s, then
    EBUSY). Meanwhile a reader on CPU 0 stats, opens and reads other files: each takes
    milliseconds, not the writers' second, because a queue whose idle threads are all
    taken starts another (fuse_uring_threads grows).
  * test_kill_and_start_again: SIGKILL of the daemon while four processes read and write
    through the rings; a new daemon started at once on the same directories serves over
    io_uring again (the start lock died with the killed daemon), the switch is as before,
    and what was published before the kill reads back exact.
  * test_daemons_starting_together: four daemons started at the same moment all come up
    over io_uring (they take the start lock in turn) and the switch ends as it began.
Skips when this kernel has no FUSE over io_uring or the test is not root.
"""
import errno
import hashlib
import os
import subprocess
import threading
import time
import unittest

import dcp_tool
from harness import Mount

MiB = 1 << 20
SWITCH = "/sys/module/fuse/parameters/enable_uring"


def switch():
    with open(SWITCH) as f:
        return f.read().strip()


def possible_cpus():
    """The kernel's queue count: 1 + the highest CPU in /sys/devices/system/cpu/possible."""
    with open("/sys/devices/system/cpu/possible") as f:
        return 1 + max(int(r.split("-")[-1]) for r in f.read().strip().split(","))


def sha_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            h.update(block)
    return h.hexdigest()


def pinned(cpu, fn, *args):
    """Runs fn in a thread pinned to `cpu` (the kernel picks the ring queue by CPU)."""
    out = {}

    def body():
        os.sched_setaffinity(0, {cpu})
        try:
            out["value"] = fn(*args)
        except Exception as e:  # reported by the caller
            out["error"] = e

    t = threading.Thread(target=body)
    t.start()
    return t, out


class FuseUringTest(unittest.TestCase):
    def setUp(self):
        if os.geteuid() != 0:
            self.skipTest("the daemon turns the kernel's io_uring switch on as root only")
        if not os.path.exists(SWITCH):
            self.skipTest("this kernel has no FUSE over io_uring (CONFIG_FUSE_IO_URING)")
        self.switch_before = switch()
        self.addCleanup(self.check_switch)

    def check_switch(self):
        self.assertEqual(switch(), self.switch_before, "fuse.enable_uring was left changed")

    def start(self, args=("--fuse-uring", "on"), **kw):
        m = Mount(args=args, **kw)
        m.start()
        self.addCleanup(m.cleanup)
        return m

    def assert_uring(self, m):
        s = m.stats()
        self.assertTrue(s["fuse_transport"].startswith("io_uring"), s["fuse_transport"])
        self.assertGreater(s["fuse_uring_requests"], 0)
        return s

    def test_requests_come_over_the_ring(self):
        m = self.start()
        s0 = self.assert_uring(m)
        p = lambda *n: os.path.join(m.mnt, *n)  # noqa: E731
        data = os.urandom(8 * MiB + 4097)
        with open(p("big.bin"), "wb") as f:
            for off in range(0, len(data), MiB):
                f.write(data[off:off + MiB])
        with open(p("odd.bin"), "wb") as f:
            for off in range(0, 300000, 7777):
                f.write(data[off:off + 7777])
        with open(p("big.bin"), "rb") as f:  # staged: the daemon serves it
            self.assertEqual(f.read(), data)
        self.assertEqual(m.wait(p("big.bin")), 0)
        self.assertEqual(sha_file(p("big.bin")), hashlib.sha256(data).hexdigest())
        self.assertEqual(sha_file(os.path.join(m.backing, "big.bin")),
                         hashlib.sha256(data).hexdigest())
        with open(p("odd.bin"), "rb") as f:
            self.assertEqual(f.read(), b"".join(data[o:o + 7777]
                                                 for o in range(0, 300000, 7777)))
        os.makedirs(p("d", "e"))
        os.rename(p("odd.bin"), p("d", "e", "moved.bin"))
        self.assertEqual(sorted(os.listdir(p("d", "e"))), ["moved.bin"])
        os.symlink("e/moved.bin", p("d", "link"))
        self.assertEqual(os.readlink(p("d", "link")), "e/moved.bin")
        # A request with a payload (the name) whose reply carries bytes, and error replies.
        self.assertEqual(os.getxattr(p("big.bin"), "user.ckptfs.state"), b"published")
        self.assertIn("user.ckptfs.state", os.listxattr(p("big.bin")))
        with self.assertRaises(OSError) as e:
            os.setxattr(p("big.bin"), "user.other", os.urandom(3000))
        self.assertEqual(e.exception.errno, errno.EOPNOTSUPP)
        with self.assertRaises(FileNotFoundError):
            os.stat(p("no", "such"))
        os.truncate(p("d", "e", "moved.bin"), 1000)
        self.assertEqual(os.stat(p("d", "e", "moved.bin")).st_size, 1000)
        self.assertEqual(
            subprocess.run(["ls", "-lR", m.mnt], capture_output=True).returncode, 0)
        ckpt = p("ckpt")
        dcp_tool.save(ckpt, 4, 32, False, 11)
        self.assertEqual(m.wait(os.path.join(ckpt, ".metadata")), 0)
        dcp_tool.load(ckpt, 4, "own", 11)
        dcp_tool.load(ckpt, 4, "reshard", 11)
        s1 = m.stats()
        self.assertGreater(s1["fuse_uring_requests"] - s0["fuse_uring_requests"], 200)
        self.assertEqual(s1["fuse_uring_errors"], 0)
        self.assertEqual(s1["errors"], 0, s1.get("last_error"))
        self.assertEqual(s1["fuse_uring_queues"], possible_cpus())
        self.assertIn("requests now come over io_uring",
                      m.wait_log("requests now come over io_uring"))
        self.assertEqual(m.unmount(), 0)
        self.assertEqual(sha_file(os.path.join(m.backing, "d", "e", "moved.bin")),
                         hashlib.sha256(b"".join(data[o:o + 7777] for o in
                                                 range(0, 300000, 7777))[:1000]).hexdigest())

    def test_off_and_auto(self):
        # None: no --fuse-uring flag at all, which must behave as auto (the default).
        for mode in ("off", "auto", None):
            m = self.start(["--fuse-uring", mode] if mode else [])  # the switch is off here,
            s = m.stats()                                           # as by default
            if mode != "off" and switch() == "Y":
                self.assertTrue(s["fuse_transport"].startswith("io_uring"), s["fuse_transport"])
                continue
            self.assertTrue(s["fuse_transport"].startswith("/dev/fuse"), s["fuse_transport"])
            if mode != "off":
                self.assertIn("does not offer io_uring", s["fuse_transport"])
            data = os.urandom(3 * MiB + 5)
            with open(os.path.join(m.mnt, "f"), "wb") as f:
                f.write(data)
            with open(os.path.join(m.mnt, "f"), "rb") as f:
                self.assertEqual(f.read(), data)
            s = m.stats()
            self.assertEqual(s["fuse_uring_requests"], 0)
            self.assertEqual(s["fuse_uring_threads"], 0)
            self.assertEqual(m.unmount(), 0)

    def test_waiting_handler_leaves_its_cpu_served(self):
        if 0 not in os.sched_getaffinity(0):
            self.skipTest("this test runs its clients on CPU 0")
        m = self.start()
        self.assert_uring(m)
        names = [f"held{i}.bin" for i in range(3)] + [f"free{i}.bin" for i in range(16)]
        for n in names:
            with open(os.path.join(m.backing, n), "wb") as f:
                f.write(os.urandom(2 * MiB))
        readers = [open(os.path.join(m.mnt, f"held{i}.bin"), "rb") for i in range(3)]
        for r in readers:
            r.read(4096)  # passthrough opens: a write open of these waits (then EBUSY)
        if m.stats()["passthrough_open_now"] < 3:
            for r in readers:
                r.close()
            self.skipTest("passthrough is off: no handler here waits")
        threads0 = m.stats()["fuse_uring_threads"]

        def write_open(i):
            t0 = time.monotonic()
            try:
                fd = os.open(os.path.join(m.mnt, f"held{i}.bin"), os.O_WRONLY)
                os.close(fd)
                return ("opened", time.monotonic() - t0)
            except OSError as e:
                return (errno.errorcode.get(e.errno, e.errno), time.monotonic() - t0)

        def read_others():
            times = []
            for n in names[3:]:
                t0 = time.monotonic()
                os.stat(os.path.join(m.mnt, n))
                with open(os.path.join(m.mnt, n), "rb") as f:
                    f.read(65536)
                times.append(time.monotonic() - t0)
            return times

        writers = [pinned(0, write_open, i) for i in range(3)]
        time.sleep(0.2)  # the writers are in their handlers now, waiting
        reader, got = pinned(0, read_others)
        reader.join(30)
        for t, _ in writers:
            t.join(30)
        for r in readers:
            r.close()
        self.assertNotIn("error", got, got.get("error"))
        results = [out.get("value") for _, out in writers]
        for res in results:
            self.assertIsNotNone(res)
            self.assertGreater(res[1], 0.5, f"the writer did not wait: {results}")
        self.assertLess(max(got["value"]), 0.4,
                        f"CPU 0's requests waited behind the waiting handlers: {got['value']}")
        # CPU 0's queue had a thread for each waiting handler and at least one more (each
        # other queue keeps its two), however many were started before the writers came.
        s = m.stats()
        self.assertGreaterEqual(s["fuse_uring_threads"],
                                max(threads0, 3 + 1 + 2 * (s["fuse_uring_queues"] - 1)), s)
        self.assertEqual(m.unmount(), 0)

    def test_kill_and_start_again(self):
        m = self.start()
        self.assert_uring(m)
        data = os.urandom(4 * MiB)
        with open(os.path.join(m.mnt, "kept.bin"), "wb") as f:
            f.write(data)
        self.assertEqual(m.wait(os.path.join(m.mnt, "kept.bin")), 0)
        stop = threading.Event()

        def churn(i):
            while not stop.is_set():
                try:
                    with open(os.path.join(m.mnt, f"churn{i}"), "wb") as f:
                        f.write(os.urandom(256 * 1024))
                    with open(os.path.join(m.mnt, "kept.bin"), "rb") as f:
                        f.read(MiB)
                except OSError:
                    return

        workers = [threading.Thread(target=churn, args=(i,)) for i in range(4)]
        for w in workers:
            w.start()
        time.sleep(1.0)
        m.kill()
        stop.set()
        for w in workers:
            w.join(30)
            self.assertFalse(w.is_alive(), "a client hung after the daemon was killed")
        m2 = self.start(backing=m.backing, root=m.root, state=m.state)
        self.assert_uring(m2)
        self.assertEqual(sha_file(os.path.join(m2.mnt, "kept.bin")),
                         hashlib.sha256(data).hexdigest())
        self.assertEqual(m2.unmount(), 0)

    def test_daemons_starting_together(self):
        mounts = [Mount(args=["--fuse-uring", "on"]) for _ in range(4)]
        for mo in mounts:
            self.addCleanup(mo.cleanup)
        starters = [threading.Thread(target=mo.start) for mo in mounts]
        for t in starters:
            t.start()
        for t in starters:
            t.join(60)
        for mo in mounts:
            with open(os.path.join(mo.mnt, "x"), "wb") as f:
                f.write(b"x" * 100)
            s = self.assert_uring(mo)
            self.assertEqual(s["fuse_uring_errors"], 0)
        self.assertEqual(switch(), self.switch_before)
        for mo in mounts:
            self.assertEqual(mo.unmount(), 0)


if __name__ == "__main__":
    unittest.main()
