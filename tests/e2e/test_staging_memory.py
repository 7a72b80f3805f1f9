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
    both files read back byte-exact, their bytes never the zeroes a released page holds.
"""
import hashlib
import os
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
        self.assertIn("given back after 1 s", m.log_text())
        self.assertEqual(m.unmount(), 0)

    def test_release_after_idle_async(self):
        self.check_release_and_repin("async")

    def test_release_after_idle_strict(self):
        self.check_release_and_repin("strict")


if __name__ == "__main__":
    unittest.main()
