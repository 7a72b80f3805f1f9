"""The staging pool's memory through a real mount (issue 21).

A daemon that only reads holds no staging memory: host staging is reserved at mount and
each chunk is pinned the first time a write needs it. `--staging-release-after N` gives
the pinned chunks back once nothing has been staged for N seconds; the next write pins
them again. Checked from outside the daemon as well as by its stats: /proc/PID/status
VmLck (root: every pinned chunk is locked).

  * a fresh mount, then a published file read back: staging_resident 0, the daemon's
    locked memory grows by less than one chunk;
  * a file larger than staging written and published: the chunks it needed are resident
    and locked (returned chunks go out again first, so usually not all of them), and stay
    so (no release by default);
  * with --staging-release-after 1, strict and async: after publication, resident and
    VmLck fall back; a second save into the same path works on the re-pinned memory and
    both files read back byte-exact, their bytes never the zeroes a released page holds;
  * in a memory cgroup (v1) limited to 160 MiB: a 256 MiB pool is refused at mount with an
    error that names the cgroup (pinning it later would get the daemon OOM-killed
    mid-save), and a 32 MiB pool mounts and saves a file larger than itself.
"""
import hashlib
import os
import subprocess
import tempfile
import time
import unittest

import harness

MiB = 1 << 20
STAGING = 32 * MiB


def vm_locked(pid):
    return harness.proc_status_bytes(pid, "VmLck")


write_file = harness.write_file
read_file = harness.read_file


def wait_until(pred, timeout=30):
    return harness.wait_for(pred, timeout, step=0.1)


class StagingMemoryTest(unittest.TestCase):
    def mount(self, *args, durability="async"):
        m = harness.Mount(args=["--durability", durability, "--chunk-size", "1M", *args],
                          staging="32M").start()
        self.addCleanup(m.cleanup)
        return m

    def test_reading_holds_no_staging_and_writing_pins_it(self):
        # A file published by an earlier daemon, read by a fresh one.
        data = os.urandom(48 * MiB)
        first = self.mount()
        write_file(os.path.join(first.mnt, "model.bin"), data)
        self.assertEqual(first.wait(os.path.join(first.mnt, "model.bin")), 0)
        self.assertEqual(first.unmount(), 0)

        m = harness.Mount(args=["--chunk-size", "1M"], staging="32M",
                          backing=first.backing, root=first.root).start()
        self.addCleanup(m.cleanup)
        locked_at_mount = vm_locked(m.proc.pid)
        s = m.stats()
        self.assertEqual(s["staging_resident"], 0, s)
        self.assertEqual(s["staging_limit"], STAGING, s)
        self.assertEqual(s["staging_backend"], "host-locked", s)
        self.assertEqual(hashlib.sha256(read_file(os.path.join(m.mnt, "model.bin"))).digest(),
                         hashlib.sha256(data).digest())
        s = m.stats()
        self.assertEqual(s["staging_resident"], 0, f"a read pinned staging: {s}")
        self.assertEqual(s["staging_pins"], 0, s)
        self.assertLess(vm_locked(m.proc.pid) - locked_at_mount, MiB,
                        "the daemon locked memory for a read")

        # A write larger than staging: what it needed is pinned, locked and kept.
        write_file(os.path.join(m.mnt, "next.bin"), data)
        self.assertEqual(m.wait(os.path.join(m.mnt, "next.bin")), 0)
        s = m.stats()
        resident = s["staging_resident"]
        self.assertGreaterEqual(resident, MiB, s)
        self.assertLessEqual(resident, STAGING, s)
        self.assertEqual(resident, s["staging_pins"] * MiB, s)
        self.assertGreaterEqual(vm_locked(m.proc.pid) - locked_at_mount, resident - MiB)
        time.sleep(1.5)
        self.assertEqual(m.stats()["staging_resident"], resident, "released without the option")
        self.assertEqual(m.stats()["staging_releases"], 0)
        self.assertEqual(read_file(os.path.join(m.backing, "next.bin")), data)

    def check_release_and_repin(self, durability):
        m = self.mount("--staging-release-after", "1", durability=durability)
        locked_at_mount = vm_locked(m.proc.pid)
        path = os.path.join(m.mnt, "ckpt", "shard.bin")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pins = 0
        for round_ in range(2):
            data = os.urandom(40 * MiB + 12345)
            write_file(path, data, fsync=durability == "strict")
            self.assertEqual(m.wait(path), 0)
            s = m.stats()
            self.assertGreater(s["staging_pins"], pins, f"round {round_} pinned nothing: {s}")
            pins = s["staging_pins"]
            self.assertTrue(wait_until(lambda: m.stats()["staging_resident"] == 0, timeout=20),
                            f"round {round_}: staging never given back: {m.stats()}")
            self.assertTrue(
                wait_until(lambda: vm_locked(m.proc.pid) - locked_at_mount < MiB, timeout=5),
                f"round {round_}: VmLck {vm_locked(m.proc.pid)} against {locked_at_mount} "
                "at mount")
            self.assertEqual(m.stats()["staging_used"], 0)
            # The released memory is zero pages now: the published bytes must not be.
            self.assertEqual(read_file(path), data, f"round {round_}: read through the mount")
            self.assertEqual(read_file(os.path.join(m.backing, "ckpt", "shard.bin")), data)
        s = m.stats()
        self.assertEqual(s["staging_pins"], s["staging_releases"], s)
        self.assertIn("given back after 1 s", m.wait_log("given back after 1 s"))
        self.assertEqual(m.unmount(), 0)

    def test_release_after_idle_async(self):
        self.check_release_and_repin("async")

    def test_release_after_idle_strict(self):
        self.check_release_and_repin("strict")

MEMCG_V1 = "/sys/fs/cgroup/memory"


class MemoryCgroupTest(unittest.TestCase):
    """The daemon started inside a fresh v1 memory cgroup with a 160 MiB limit."""

    def setUp(self):
        if not os.path.exists(os.path.join(MEMCG_V1, "memory.limit_in_bytes")):
            self.skipTest("no cgroup v1 memory hierarchy at " + MEMCG_V1)
        self.cgroup = os.path.join(MEMCG_V1, f"ckptfs-e2e-{os.getpid()}")
        os.mkdir(self.cgroup)
        self.addCleanup(self.remove_cgroup)
        with open(os.path.join(self.cgroup, "memory.limit_in_bytes"), "w") as f:
            f.write(str(160 * MiB))
        self.root = tempfile.mkdtemp(prefix="ckptfs-e2e-memcg-")

    def remove_cgroup(self):
        # Every process that ran in it has exited (the daemon is waited for or killed).
        for _ in range(50):
            try:
                os.rmdir(self.cgroup)
                return
            except OSError:
                time.sleep(0.1)
        os.rmdir(self.cgroup)

    def start_in_cgroup(self, staging):
        """Starts the daemon as the cgroup's member from its first instruction on."""
        mount = harness.Mount(args=["--chunk-size", "1M"], staging=staging, root=self.root)
        procs = os.path.join(self.cgroup, "cgroup.procs")
        cmd = [harness.CKPTFS, "-f", "--staging-mem", staging, "--chunk-size", "1M",
               "--state-dir", mount.state, "--log-file", mount.log, mount.backing, mount.mnt]
        proc = subprocess.Popen(["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh"] + cmd,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        harness.reaper.register_pid(proc.pid)
        mount.proc = proc
        self.addCleanup(mount.cleanup)
        return mount

    def test_a_pool_past_the_limit_is_refused_at_mount_and_one_within_it_saves(self):
        m = self.start_in_cgroup("256M")
        try:
            rc = m.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.fail("a 256 MiB pool in a 160 MiB memory cgroup was not refused")
        out = m.proc.stdout.read().decode(errors="replace") + m.log_text()
        self.assertNotEqual(rc, 0, out)
        self.assertIn("memory cgroup", out)
        self.assertIn("--staging-mem", out)
        self.assertFalse(harness.is_mounted(m.mnt))
        m.proc.stdout.close()
        m.proc = None

        m = self.start_in_cgroup("32M")
        self.assertTrue(wait_until(lambda: harness.is_mounted(m.mnt) and os.path.exists(
            os.path.join(m.mnt, ".ckptfs", "stats")), timeout=30), m.log_text())
        harness.reaper.register_mount(m.mnt)
        data = os.urandom(80 * MiB)
        write_file(os.path.join(m.mnt, "big.bin"), data, fsync=True)
        self.assertEqual(m.wait(os.path.join(m.mnt, "big.bin")), 0)
        self.assertEqual(read_file(os.path.join(m.backing, "big.bin")), data)
        with open(os.path.join(self.cgroup, "memory.failcnt")) as f:
            failcnt = int(f.read())
        self.assertEqual(m.unmount(), 0, f"{m.log_text()}\nmemory.failcnt {failcnt}")


if __name__ == "__main__":
    unittest.main()
