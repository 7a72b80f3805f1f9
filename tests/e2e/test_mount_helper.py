"""Operating ckptfs like any other file system: mount(8) with the mount.fuse.ckptfs helper,
an fstab line with systemd/_netdev options and `mount -a`, failed mounts that say why and
leave nothing behind, SIGHUP reopening the log instead of unmounting, --version.

mount(8) runs /sbin/mount.fuse.ckptfs, so the test links the built ckptfs there for its
duration (a file already there, e.g. from an installed .deb, is put back afterwards).
Daemons started through mount(8) run in the background: each test finds the daemon's pid
in .ckptfs/stats and kills exactly that pid at cleanup if it is still alive.
"""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

import harness
from harness import ADMIN, CKPTFS, is_mounted, unmount

HELPER = "/usr/sbin/mount.fuse.ckptfs"


def mount_source_and_type(path):
    """(source, fstype) of the mount on `path`, from /proc/self/mountinfo."""
    path = os.path.realpath(path)
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == path:
                rest = fields[fields.index("-") + 1:]
                found = (rest[1].replace("\\040", " "), rest[0])
    return found


def pid_alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class MountHelperTest(unittest.TestCase):
    def setUp(self):
        if os.geteuid() != 0:
            self.skipTest("mount(8) needs root")
        self.root = tempfile.mkdtemp(prefix="ckptfs-e2e-helper-")
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)
        self.backing = os.path.join(self.root, "backing")
        self.mnt = os.path.join(self.root, "mnt")
        self.state = os.path.join(self.root, "state")
        self.log = os.path.join(self.root, "ckptfs.log")
        os.makedirs(self.backing)
        os.makedirs(self.mnt)
        self._install_helper()
        self.pids = []
        self.addCleanup(self._stop_daemons)

    def _install_helper(self):
        backup = None
        if os.path.lexists(HELPER):
            backup = HELPER + ".ckptfs-e2e-backup"
            os.rename(HELPER, backup)
        os.symlink(os.path.realpath(CKPTFS), HELPER)

        def restore():
            if os.path.lexists(HELPER):
                os.unlink(HELPER)
            if backup is not None:
                os.rename(backup, HELPER)
        self.addCleanup(restore)

    def _stop_daemons(self):
        for pid in self.pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        unmount(self.mnt)

    def daemon_pid(self):
        with open(os.path.join(self.mnt, ".ckptfs", "stats")) as f:
            stats = json.load(f)
        self.pids.append(stats["pid"])
        return stats

    def wait_exit(self, pid, timeout=60):
        deadline = time.time() + timeout
        while pid_alive(pid) and time.time() < deadline:
            time.sleep(0.05)
        self.assertFalse(pid_alive(pid), f"daemon {pid} did not exit")

    def test_mount_t_with_ckptfs_options_then_umount_drains(self):
        opts = ("durability=strict,staging_mem=64M,chunk_size=1M,state_dir=" + self.state +
                ",log_file=" + self.log + ",_netdev,nofail,x-systemd.requires=foo.mount,"
                "x-systemd.mount-timeout=30,noatime")
        r = subprocess.run(["mount", "-t", "fuse.ckptfs", self.backing, self.mnt, "-o", opts],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(is_mounted(self.mnt))
        # df and /proc/mounts show the backing dir as the source, fuse.ckptfs as the type.
        self.assertEqual(mount_source_and_type(self.mnt), (self.backing, "fuse.ckptfs"))
        df = subprocess.run(["df", "--output=source,fstype", self.mnt], capture_output=True,
                            text=True).stdout
        self.assertIn(self.backing, df)
        stats = self.daemon_pid()
        self.assertEqual(stats["durability"], "strict")
        self.assertEqual(stats["staging_limit"], 64 << 20)
        self.assertEqual(stats["state_dir"], self.state)
        data = os.urandom(3 << 20)
        with open(os.path.join(self.mnt, "shard.bin"), "wb") as f:
            f.write(data)
        r = subprocess.run(["umount", self.mnt], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.wait_exit(stats["pid"])
        with open(os.path.join(self.state, "exit.json")) as f:
            report = json.load(f)
        self.assertTrue(report["clean"], report)
        with open(os.path.join(self.backing, "shard.bin"), "rb") as f:
            self.assertEqual(f.read(), data)

    def test_fstab_line_mounts_with_mount_a(self):
        fstab = os.path.join(self.root, "fstab")
        with open(fstab, "w") as f:
            f.write("# test fstab\n")
            f.write(f"{self.backing} {self.mnt} fuse.ckptfs "
                    f"_netdev,x-systemd.requires=lustre.mount,x-systemd.automount,"
                    f"staging_mem=32M,state_dir={self.state},log_file={self.log},"
                    f"commit_timeout=30 0 0\n")
        r = subprocess.run(["mount", "-a", "-T", fstab], capture_output=True, text=True,
                           timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(is_mounted(self.mnt))
        stats = self.daemon_pid()
        self.assertEqual(stats["staging_limit"], 32 << 20)
        with open(os.path.join(self.mnt, "f"), "w") as f:
            f.write("hello")
        r = subprocess.run([ADMIN, "unmount", self.mnt, "--timeout", "60", "--json"],
                           capture_output=True, text=True, timeout=90)
        self.assertEqual(r.returncode, 0, r.stderr)
        report = json.loads(r.stdout)
        self.assertEqual((report["clean"], report["exit_code"], report["pid"]),
                         (True, 0, stats["pid"]))
        self.assertFalse(is_mounted(self.mnt))
        with open(os.path.join(self.backing, "f")) as f:
            self.assertEqual(f.read(), "hello")

    def check_failed_mount(self, opts, reason):
        r = subprocess.run(["mount", "-t", "fuse.ckptfs", self.backing, self.mnt, "-o", opts],
                           capture_output=True, text=True, timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn(reason, r.stderr)
        self.assertFalse(is_mounted(self.mnt))
        # No state dir, daemon or log of a mount that never happened.
        self.assertFalse(os.path.exists(self.state), os.listdir(self.root))
        out = subprocess.run(["pgrep", "-f", self.mnt], capture_output=True, text=True).stdout
        self.assertEqual(out.strip(), "", "a daemon outlived its failed mount")
        return r.stderr

    def test_bad_options_fail_with_the_reason_and_leave_nothing(self):
        st = f"state_dir={self.state}"
        self.check_failed_mount(f"durability=bogus,{st}", "durability")
        self.check_failed_mount(f"staging_mem=12X,{st}", "bad size unit")
        # libfuse's own words for an option it does not know.
        self.check_failed_mount(f"no_such_fuse_option,{st}", "unknown option")
        self.check_failed_mount(f"staging_mem=64M,{st},metrics_listen=127.0.0.1:99999",
                                "bad port")

    def test_fake_mount_does_nothing(self):
        r = subprocess.run(["mount", "-f", "-t", "fuse.ckptfs", self.backing, self.mnt, "-o",
                            f"state_dir={self.state}"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertFalse(is_mounted(self.mnt))

    def test_version(self):
        for prog in (CKPTFS, ADMIN):
            r = subprocess.run([prog, "--version"], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertRegex(r.stdout, r"^ckptfs(-admin)? \d+\.\d+\.\d+ \(git \w+\)\n$")


class SdNotifyTest(unittest.TestCase):
    def test_foreground_daemon_reports_ready_and_stopping_to_systemd(self):
        """Type=notify: READY=1 (with MAINPID) once the mount answers, STOPPING=1 on drain."""
        import socket
        root = tempfile.mkdtemp(prefix="ckptfs-e2e-notify-")
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        backing, mnt = os.path.join(root, "b"), os.path.join(root, "m")
        os.makedirs(backing)
        os.makedirs(mnt)
        sock_path = os.path.join(root, "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.addCleanup(sock.close)
        sock.bind(sock_path)
        sock.settimeout(30)
        env = dict(os.environ, NOTIFY_SOCKET=sock_path)
        proc = subprocess.Popen([CKPTFS, "-f", "--staging-mem", "64M", "--state-dir",
                                 os.path.join(root, "s"), "--log-file",
                                 os.path.join(root, "log"), backing, mnt], env=env)

        def stop():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            unmount(mnt)
        self.addCleanup(stop)
        ready = sock.recv(4096).decode()
        self.assertIn("READY=1", ready)
        self.assertIn(f"MAINPID={proc.pid}", ready)
        self.assertTrue(is_mounted(mnt), "READY=1 before the mount answered")
        self.assertTrue(os.path.exists(os.path.join(mnt, ".ckptfs", "stats")))
        subprocess.run(["fusermount3", "-u", mnt], check=True)
        self.assertIn("STOPPING=1", sock.recv(4096).decode())
        self.assertEqual(proc.wait(timeout=60), 0)


class SighupTest(harness.MountedTest):
    def test_sighup_reopens_the_log_and_keeps_the_mount(self):
        m = self.mount()
        with open(os.path.join(m.mnt, "before"), "w") as f:
            f.write("x")
        rotated = m.log + ".1-rotated"
        os.rename(m.log, rotated)  # what logrotate does
        os.kill(m.proc.pid, signal.SIGHUP)
        deadline = time.time() + 10
        while not os.path.exists(m.log) and time.time() < deadline:
            time.sleep(0.05)
        self.assertTrue(os.path.exists(m.log), "SIGHUP did not reopen the log")
        time.sleep(0.3)
        self.assertIsNone(m.proc.poll(), "SIGHUP ended the daemon")
        self.assertTrue(is_mounted(m.mnt))
        with open(os.path.join(m.mnt, "after"), "w") as f:
            f.write("y")
        self.assertEqual(m.wait(os.path.join(m.mnt, "after"), timeout=30), 0)
        deadline = time.time() + 5
        while "reopened" not in m.log_text() and time.time() < deadline:
            time.sleep(0.1)
        self.assertIn("log file reopened", m.log_text())
        self.assertEqual(m.unmount(), 0)
        with open(os.path.join(m.backing, "after")) as f:
            self.assertEqual(f.read(), "y")


class LogRotationTest(harness.MountedTest):
    def test_log_rotates_by_size_and_keeps_max_files(self):
        m = self.mount(args=["--log-max-size", "64K", "--log-max-files", "2"])
        base, ext = os.path.splitext(m.log)  # spdlog names them ckptfs.1.log, ...
        rotated = [f"{base}.{n}{ext}" for n in (1, 2, 3)]
        deadline = time.time() + 60
        i = 0
        # Each SIGHUP logs one info line ("log file reopened"): ~1000 fill 64 KiB.
        while not os.path.exists(rotated[1]) and time.time() < deadline:
            os.kill(m.proc.pid, signal.SIGHUP)
            i += 1
            time.sleep(0.002)
        self.assertTrue(os.path.exists(rotated[0]), f"no rotation after {i} SIGHUPs")
        self.assertTrue(os.path.exists(rotated[1]), f"one rotation only after {i} SIGHUPs")
        self.assertFalse(os.path.exists(rotated[2]), "more files kept than --log-max-files")
        # A line may cross the limit when a reopen races with the size check: one line
        # of slack, never a whole extra file's worth.
        for path in (m.log, rotated[0], rotated[1]):
            self.assertLessEqual(os.path.getsize(path), 64 * 1024 + 200, path)
        self.assertIsNone(m.proc.poll(), "the daemon died")
        self.assertEqual(m.unmount(), 0)


if __name__ == "__main__":
    unittest.main()
