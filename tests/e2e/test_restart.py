"""G11 end to end: a daemon can be started again at once after any stop or kill, on the
same mountpoint, state dir and peer port (issue 19).

* Unmount, then start at once: the new daemon mounts and shows what the last one wrote.
* SIGKILL, then start at once: the same, after a lazy unmount of the dead mount.
* SIGKILL, then start at once with the dead mount still there (systemd's restart): the
  new daemon detaches it right before it mounts; meanwhile calls fail with ENOTCONN.
* SIGKILL while flush threads are in direct writes to a slow disk (a blkio cgroup
  throttles the daemon's writes to the backing disk): the killed process lives on, holding
  the state dir's RocksDB lock, until those writes end. The new daemon, started at once,
  waits for it with a log line naming its pid instead of failing with exit 2.
* Two peer daemons (network namespaces, netns.Cluster) load blocks from each other, both
  unmount cleanly and start again at once on the same --peer-listen ports, where the last
  connections sit in TIME_WAIT: both listen, connect and serve a load through peers.
"""
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

from harness import CKPTFS, Mount, unmount

MiB = 1 << 20


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            h.update(block)
    return h.hexdigest()


def write_file(path, mib, seed):
    data = hashlib.sha256(str(seed).encode()).digest() * (MiB // 32)
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_text(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


class RestartTest(unittest.TestCase):
    def mount(self, root=None, log=None, **kw):
        m = Mount(root=root, **kw)
        if log:
            m.log = log
        # Cleanups run last-registered first: the directory goes after the stop, so that
        # a mount still up is not left holding an empty mnt/ behind.
        if root is None:
            self.addCleanup(shutil.rmtree, m.root, True)
        self.addCleanup(m.stop)
        return m

    def restart(self, old, log_name):
        """A new daemon on `old`'s backing dir, mountpoint and state dir, with its own log."""
        m = self.mount(root=old.root, log=os.path.join(old.root, log_name),
                       staging=old.staging)
        t0 = time.monotonic()
        m.start(timeout=60)
        return m, time.monotonic() - t0

    def test_unmount_then_start_at_once(self):
        m = self.mount().start()
        write_file(os.path.join(m.mnt, "a.bin"), 8, seed=1)
        want = sha256_of(os.path.join(m.mnt, "a.bin"))
        self.assertEqual(m.unmount(), 0, m.log_text())
        m2, took = self.restart(m, "ckptfs2.log")
        print(f"\nunmount, then start: up in {took:.2f} s", file=sys.stderr)
        self.assertEqual(sha256_of(os.path.join(m2.mnt, "a.bin")), want)
        self.assertEqual(m2.unmount(), 0, m2.log_text())

    def test_sigkill_then_start_at_once(self):
        m = self.mount().start()
        write_file(os.path.join(m.mnt, "a.bin"), 8, seed=2)
        self.assertEqual(m.wait(os.path.join(m.mnt, "a.bin"), timeout=60), 0)  # published
        want = sha256_of(os.path.join(m.backing, "a.bin"))
        m.kill(signal.SIGKILL)  # waits for the process, then fusermount3 -u -z
        m2, took = self.restart(m, "ckptfs2.log")
        print(f"\nSIGKILL, then start: up in {took:.2f} s", file=sys.stderr)
        self.assertEqual(sha256_of(os.path.join(m2.mnt, "a.bin")), want)

    def test_sigkill_then_start_over_the_dead_mount(self):
        """As systemd restarts it (Restart=on-failure): nobody unmounts the killed daemon's
        mount. Until the new daemon mounts, the application's calls fail with ENOTCONN and
        never reach the directory underneath; the new daemon detaches the dead mount and
        mounts. Before, it exited 2 ("mountpoint ... is not a directory") on every try."""
        import errno
        m = self.mount().start()
        write_file(os.path.join(m.mnt, "a.bin"), 4, seed=3)
        self.assertEqual(m.wait(os.path.join(m.mnt, "a.bin"), timeout=60), 0)
        want = sha256_of(os.path.join(m.backing, "a.bin"))
        m.proc.stdout.close()
        os.kill(m.proc.pid, signal.SIGKILL)
        m.proc.wait(timeout=30)
        m.proc = None
        with self.assertRaises(OSError) as e:
            with open(os.path.join(m.mnt, "lost.txt"), "w") as f:
                f.write("written while no daemon serves")
        self.assertEqual(e.exception.errno, errno.ENOTCONN)
        m2, took = self.restart(m, "ckptfs2.log")
        print(f"\nSIGKILL, then start over the dead mount: up in {took:.2f} s", file=sys.stderr)
        self.assertIn("detached, mounting again", m2.wait_log("detached, mounting again"))
        self.assertEqual(sha256_of(os.path.join(m2.mnt, "a.bin")), want)
        self.assertFalse(os.path.exists(os.path.join(m2.mnt, "lost.txt")))
        self.assertEqual(m2.unmount(), 0, m2.log_text())
        # Nothing reached the directory underneath, and no mount is left behind.
        self.assertEqual(os.listdir(m.mnt), [])
        with open("/proc/self/mountinfo") as f:
            self.assertNotIn(" " + m.mnt + " ", f.read())

    @unittest.skipUnless(os.geteuid() == 0 and os.path.isdir("/sys/fs/cgroup/blkio"),
                         "needs root and the cgroup v1 blkio controller")
    def test_sigkill_during_direct_flushes_then_start_at_once(self):
        from netns import throttle_writes
        m = self.mount(staging="64M", args=["--flush-direct-io", "on"]).start()
        throttle_writes(self, m.proc.pid, m.backing, 2 * MiB, "ckptfs-restart")
        dd = subprocess.Popen(["dd", "if=/dev/zero", f"of={os.path.join(m.mnt, 'big')}",
                               "bs=4M", "count=64"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.addCleanup(self.reap, dd)
        time.sleep(2)  # staging is full; flush threads are in throttled direct writes
        old = m.proc
        m.proc = None  # this test reaps it
        self.addCleanup(self.reap, old)
        old.stdout.close()
        os.kill(old.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        # Detach the dead daemon's mount without a lookup through it: fusermount3 -u -z
        # run right after the kill was seen to wait until the dying process was gone.
        subprocess.run(["umount", "-l", "-c", m.mnt], check=True)
        lingering = old.poll() is None
        m2, took = self.restart(m, "ckptfs2.log")
        old.wait(timeout=60)
        gone_after = time.monotonic() - t_kill
        log = read_text(m2.log)
        print(f"\nSIGKILL mid-flush, then start: killed process gone after {gone_after:.2f} s, "
              f"new daemon up in {took:.2f} s", file=sys.stderr)
        self.assertTrue(lingering, "the killed daemon exited at once: the throttle did not "
                        "hold its writes, so the test checked nothing")
        self.assertIn(f"still held by pid {old.pid}, which is exiting", log)
        self.assertIn(f"pid {old.pid} released it after", log)
        with open(os.path.join(m2.mnt, ".ckptfs", "stats")) as f:
            self.assertTrue(f.read())

    @staticmethod
    def reap(proc):
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)

    def test_a_live_holder_of_the_state_dir_fails_at_once(self):
        m = self.mount().start()
        other = os.path.join(m.root, "mnt2")
        os.makedirs(other)
        t0 = time.monotonic()
        r = subprocess.run([CKPTFS, "-f", "--state-dir", m.state, m.backing, other],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=60)
        took = time.monotonic() - t0
        self.assertEqual(r.returncode, 2, r.stdout)
        self.assertIn(f"held by pid {m.proc.pid}", r.stdout)
        self.assertIn("is another ckptfs using this --state-dir?", r.stdout)
        self.assertLess(took, 10)


def built_with_ucx():
    r = subprocess.run(["ldd", CKPTFS], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                       text=True)
    return "libucp" in r.stdout


@unittest.skipUnless(os.geteuid() == 0 and shutil.which("nsenter") and shutil.which("ip")
                     and shutil.which("ss"), "needs root, ip, nsenter and ss")
@unittest.skipUnless(built_with_ucx(), "ckptfs was built without the UCX peer transport")
class PeerRestartTest(unittest.TestCase):
    def setUp(self):
        import dcp_tool
        self.dcp_tool = dcp_tool
        self.root = tempfile.mkdtemp(prefix="ckptfs-restart-")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.backing = os.path.join(self.root, "backing")
        self.ckpt = os.path.join("run", "iter_0000001")
        os.makedirs(os.path.join(self.backing, self.ckpt))
        dcp_tool.save(os.path.join(self.backing, self.ckpt), ranks=1, mb=8, seed=5,
                      timeout=120)

    def load(self, node):
        return self.dcp_tool.load(os.path.join(node.mnt, self.ckpt), ranks=1,
                                  mode="replicated", seed=5, timeout=120)

    def time_wait_on(self, node, port):
        r = subprocess.run(["nsenter", f"--net=/run/netns/{node.ns}", "ss", "-Htan",
                            "state", "time-wait"], stdout=subprocess.PIPE, text=True)
        return [line for line in r.stdout.splitlines() if f":{port} " in line + " "]

    def test_peers_start_again_at_once_on_the_same_ports(self):
        from netns import PORT, Cluster
        c = Cluster(2, root=os.path.join(self.root, "c"), backing=self.backing)
        self.addCleanup(c.cleanup)
        c.setup()
        c.start()
        self.assertTrue(c.wait_connected(), [n.log_text(2000) for n in c.nodes])
        self.load(c.nodes[0])
        self.assertGreater(c.nodes[0].stats()["peer_bytes_read"], 0, c.nodes[0].log_text())
        # Both unmount cleanly, node 0 first (as a job's epilog would, in some order).
        for n in c.nodes:
            subprocess.run(["fusermount3", "-u", n.mnt], check=True)
            rc = n.proc.wait(timeout=60)
            n.proc.stdout.close()
            n.proc = None
            self.assertEqual(rc, 0, n.log_text())
        waiting = [self.time_wait_on(n, PORT) for n in c.nodes]
        print(f"\nTIME_WAIT on port {PORT} per node: {[len(w) for w in waiting]}",
              file=sys.stderr)
        self.assertTrue(any(waiting), "no connection in TIME_WAIT on the peer port: the "
                        "test checked nothing")
        t0 = time.monotonic()
        for n in c.nodes:
            os.rename(n.log, n.log + ".1")
        c.start()  # raises if a daemon exits (it did: "cannot listen ... Device is busy")
        took = time.monotonic() - t0
        self.assertTrue(c.wait_connected(), [n.log_text(2000) for n in c.nodes])
        print(f"both daemons up again in {took:.2f} s", file=sys.stderr)
        result = self.load(c.nodes[1])
        self.assertGreater(result["bytes_verified"], 0)
        s1, s0 = c.nodes[1].stats(), c.nodes[0].stats()
        self.assertGreater(s1["peer_bytes_read"], 0, s1.get("peers"))
        self.assertGreater(s0["peer_bytes_served"], 0, s0.get("peers"))


if __name__ == "__main__":
    unittest.main()
