"""A test process killed before its cleanup (ctest's TIMEOUT sends SIGKILL) leaves no mount,
daemon, namespace or link behind: the guardian harness.run_e2e_file starts (reaper.py)
undoes what it registered. Each case runs a real test-like child process that mounts a
real ckptfs (and sets up a network namespace), kills it, and looks at what is left."""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import unittest

import harness
import reaper

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {here!r})
    import harness, reaper
    reaper.start_guardian()
    m = harness.Mount()
    m.start()
    extra = []
    if {netns!r}:
        import netns
        c = netns.Cluster(1, root=os.path.join(m.root, "cluster")).setup()
        extra = [c.bridge, c.nodes[0].ns]
    print(m.mnt, m.proc.pid, m.root, os.environ[reaper.ENV], *extra, flush=True)
    if {clean!r}:
        m.cleanup()
        sys.exit(0)
    time.sleep(600)
""")


def wait_until(pred, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


class ReaperTest(unittest.TestCase):
    def setUp(self):
        if os.geteuid() != 0:
            self.skipTest("mounts and namespaces of a killed test: needs root")

    def run_child(self, clean=False, netns=False):
        env = dict(os.environ)
        env.pop(reaper.ENV, None)  # the child is a test process of its own
        p = subprocess.Popen([sys.executable, "-c",
                              CHILD.format(here=HERE, clean=clean, netns=netns)],
                             env=env, stdout=subprocess.PIPE, text=True)
        self.addCleanup(lambda: p.poll() is None and (p.kill(), p.wait()))
        fields = p.stdout.readline().split()
        self.assertGreaterEqual(len(fields), 4, "the child did not mount")
        mnt, pid, root, registry = fields[0], int(fields[1]), fields[2], fields[3]
        started = reaper.start_time(pid)
        # Whatever happens below, nothing of the child's stays.
        self.addCleanup(shutil.rmtree, root, True)
        self.addCleanup(harness.unmount, mnt)
        self.addCleanup(lambda: reaper.start_time(pid) == started and os.kill(pid, signal.SIGKILL))
        if not clean:  # a clean child unmounts right after it printed the line
            self.assertTrue(harness.is_mounted(mnt))
        return p, mnt, pid, started, registry, fields[4:]

    def assert_reaped(self, mnt, pid, started, registry):
        self.assertTrue(wait_until(lambda: not harness.is_mounted(mnt)),
                        f"{mnt} is still mounted after its test process died")
        self.assertNotEqual(reaper.start_time(pid), started, "the daemon still runs")
        self.assertTrue(wait_until(lambda: not os.path.exists(registry)),
                        "the guardian did not finish")

    def test_daemon_left_running(self):
        """Only the test process is killed: the guardian kills its daemon by PID and
        unmounts."""
        p, mnt, pid, started, registry, _ = self.run_child()
        p.kill()
        p.wait()
        self.assertEqual(reaper.start_time(pid), started)  # an orphan, still serving
        self.assert_reaped(mnt, pid, started, registry)

    def test_whole_tree_killed(self):
        """The test process and its daemon are killed, as ctest kills a test's tree: the
        mount is left dead (ENOTCONN) and the guardian removes it."""
        p, mnt, pid, started, registry, _ = self.run_child()
        os.kill(pid, signal.SIGKILL)
        p.kill()
        p.wait()
        self.assert_reaped(mnt, pid, started, registry)

    def test_namespace_and_bridge(self):
        if shutil.which("ip") is None:
            self.skipTest("no ip(8) (scripts/setup.sh installs iproute2)")
        p, mnt, pid, started, registry, (bridge, ns) = self.run_child(netns=True)
        self.assertTrue(os.path.exists(f"/run/netns/{ns}"))
        self.addCleanup(subprocess.run, ["ip", "link", "del", bridge], capture_output=True)
        self.addCleanup(subprocess.run, ["ip", "netns", "del", ns], capture_output=True)
        p.kill()
        p.wait()
        self.assert_reaped(mnt, pid, started, registry)
        self.assertFalse(os.path.exists(f"/run/netns/{ns}"), f"netns {ns} left behind")
        self.assertFalse(os.path.exists(f"/sys/class/net/{bridge}"), f"bridge {bridge} left")

    def test_clean_exit_leaves_nothing_to_do(self):
        """A test process that cleaned up after itself: the guardian finds nothing."""
        p, mnt, pid, started, registry, _ = self.run_child(clean=True)
        self.assertEqual(p.wait(timeout=120), 0)
        self.assertTrue(wait_until(lambda: not os.path.exists(registry)))
        self.assertFalse(harness.is_mounted(mnt))
        log = ""
        if os.path.exists(reaper.LOG):
            with open(reaper.LOG) as f:
                log = f.read()
        self.assertNotIn(f"test process {p.pid} ", log)


if __name__ == "__main__":
    unittest.main()
