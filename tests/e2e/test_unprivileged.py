"""A user without root runs their own ckptfs (as in a Slurm job on nodes they are not root on).

The daemon runs as `nobody` (setpriv; Debian's passwd has it, and fusermount3 needs a user
name), mounts through the setuid fusermount3, and must:
  * take a 64 MiB file written by that user through the mount (cp), serve it back
    byte-exact, and publish it to the backing store owned by that user;
  * keep everyone else out, root included (no allow_other): the kernel answers EACCES;
  * unmount through `fusermount3 -u` run by that user and exit 0 after a clean drain.
Whatever an unprivileged process cannot have (pinned staging past RLIMIT_MEMLOCK, the
backing disk's read-ahead setting) may only cost a warning, never the mount.

The user runs copies of ckptfs and ckptfs-admin in a directory everyone can read
(harness.copy_for_others): the build tree may sit under a 0700 directory such as /root.

This sandbox's /dev/fuse is 0600; the test opens it to others for its duration (as udev
does on a stock Debian, 0666) and puts the mode back.
"""
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import unittest

from harness import ADMIN, CKPTFS, copy_for_others, is_mounted

USER = "nobody"


def have_user():
    try:
        pwd.getpwnam(USER)
        return True
    except KeyError:
        return False


def setuid_fusermount():
    path = shutil.which("fusermount3")
    return path is not None and bool(os.stat(path).st_mode & stat.S_ISUID)


@unittest.skipUnless(os.geteuid() == 0, "needs root to make the user's directories")
@unittest.skipUnless(have_user(), f"no '{USER}' user")
@unittest.skipUnless(setuid_fusermount() and shutil.which("setpriv"),
                     "needs a setuid fusermount3 and setpriv")
class Unprivileged(unittest.TestCase):
    def as_user(self, *cmd, **kw):
        pw = pwd.getpwnam(USER)
        return ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups",
                "--"] + list(cmd)

    def run_as_user(self, *cmd, timeout=120):
        return subprocess.run(self.as_user(*cmd), stdout=subprocess.PIPE, cwd="/",
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)

    def open_dev_fuse(self):
        mode = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
        if mode & 0o006 != 0o006:
            os.chmod("/dev/fuse", mode | 0o006)
            self.addCleanup(os.chmod, "/dev/fuse", mode)

    def user_tree(self):
        """The user's backing, mount, state and work directories, owned by the user."""
        pw = pwd.getpwnam(USER)
        root = tempfile.mkdtemp(prefix="ckptfs-unpriv-")
        self.addCleanup(shutil.rmtree, root, True)
        os.chmod(root, 0o755)  # mkdtemp's 0700 would keep the user out of its own dirs
        paths = {k: os.path.join(root, k) for k in ("backing", "mnt", "state", "work")}
        for p in paths.values():
            os.mkdir(p)
            os.chown(p, pw.pw_uid, pw.pw_gid)
        self.open_dev_fuse()
        progs = copy_for_others(self, CKPTFS, ADMIN)
        return paths, progs[os.path.basename(CKPTFS)], progs[os.path.basename(ADMIN)]

    def log_text(self, paths):
        try:
            with open(os.path.join(paths["work"], "ckptfs.log"), errors="replace") as f:
                return f.read()[-6000:]
        except OSError:
            return ""

    def start_daemon(self, paths, ckptfs):
        """ckptfs as the user, in the foreground; returns once it has mounted."""
        mnt = paths["mnt"]
        proc = subprocess.Popen(self.as_user(ckptfs, "-f", "--staging-mem", "64M",
                                             "--state-dir", paths["state"], "--log-file",
                                             os.path.join(paths["work"], "ckptfs.log"),
                                             paths["backing"], mnt),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd="/")

        def stop():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
            if is_mounted(mnt):
                subprocess.run(["fusermount3", "-u", "-z", mnt], check=False)
            proc.stdout.close()
        self.addCleanup(stop)

        deadline = time.monotonic() + 30
        while not self.live_mount(mnt):
            if proc.poll() is not None:
                self.fail(f"ckptfs as {USER} exited {proc.returncode}: "
                          f"{proc.stdout.read().decode(errors='replace')}\n"
                          f"{self.log_text(paths)}")
            self.assertLess(time.monotonic(), deadline,
                            "no mount in 30 s\n" + self.log_text(paths))
            time.sleep(0.05)
        return proc

    def live_mount(self, mnt):
        """Mounted and answering the user (a killed daemon's mount is listed, dead). A
        listing, not a stat: the kernel answers a stat of the root from its cache."""
        if not is_mounted(mnt):
            return False
        return self.run_as_user("ls", "-a", mnt, timeout=30).returncode == 0

    def test_a_user_mounts_writes_reads_and_unmounts(self):
        pw = pwd.getpwnam(USER)
        paths, ckptfs, admin = self.user_tree()
        mnt = paths["mnt"]
        proc = self.start_daemon(paths, ckptfs)

        def log_text():
            return self.log_text(paths)

        # The user's own data, through the mount and back.
        src = os.path.join(paths["work"], "src.bin")
        script = (f"set -e; dd if=/dev/urandom of={src} bs=1M count=64 status=none; "
                  f"cp {src} {mnt}/f; cmp {src} {mnt}/f; "
                  f"{admin} wait {mnt}/f --timeout 60")
        r = self.run_as_user("sh", "-c", script)
        self.assertEqual(r.returncode, 0, r.stdout + "\n" + log_text())
        r = self.run_as_user("cat", os.path.join(mnt, ".ckptfs", "stats"))
        self.assertEqual(r.returncode, 0, r.stdout)
        stats = json.loads(r.stdout)
        self.assertEqual(stats["bytes_published"], 64 << 20, stats)
        self.assertGreaterEqual(stats["bytes_served"], 64 << 20, stats)

        published = os.path.join(paths["backing"], "f")
        st = os.stat(published)
        self.assertEqual((st.st_uid, st.st_gid), (pw.pw_uid, pw.pw_gid))
        with open(src, "rb") as a, open(published, "rb") as b:
            self.assertTrue(a.read() == b.read(), "the backing copy differs from the source")

        # Nobody else gets in, root included: the mount has no allow_other.
        with self.assertRaises(PermissionError):
            os.listdir(mnt)

        r = self.run_as_user("fusermount3", "-u", mnt)
        self.assertEqual(r.returncode, 0, r.stdout)
        self.assertEqual(proc.wait(timeout=60), 0, log_text())
        text = log_text()
        self.assertIn("ckptfs exits: clean", text)
        self.assertNotIn("[error]", text)
        self.assertNotIn("[critical]", text)

    def test_a_user_restarts_over_the_dead_mount_of_a_killed_daemon(self):
        """The daemon SIGKILLed (OOM killer, a crash): its mount stays, dead (ENOTCONN). A
        new daemon started by the same user (a job's retry, `systemctl --user restart`)
        detaches it itself: umount2 is not allowed to a user, so through fusermount3 -u -z
        (mount/options.cc, DetachDeadMount); then it mounts, resumes its journal and
        serves what the killed one had taken."""
        paths, ckptfs, admin = self.user_tree()
        mnt = paths["mnt"]
        proc = self.start_daemon(paths, ckptfs)
        src = os.path.join(paths["work"], "src.bin")
        script = (f"set -e; dd if=/dev/urandom of={src} bs=1M count=8 status=none; "
                  f"cp {src} {mnt}/f; {admin} wait {mnt}/f --timeout 60")
        r = self.run_as_user("sh", "-c", script)
        self.assertEqual(r.returncode, 0, r.stdout + "\n" + self.log_text(paths))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        self.assertTrue(is_mounted(mnt), "a killed daemon's mount stays until detached")
        self.assertFalse(self.live_mount(mnt), "the killed daemon's mount still answered")

        again = self.start_daemon(paths, ckptfs)
        r = self.run_as_user("cmp", src, os.path.join(mnt, "f"))
        self.assertEqual(r.returncode, 0, r.stdout + "\n" + self.log_text(paths))
        text = self.log_text(paths)
        self.assertIn("held the mount of a ckptfs that was killed", text)
        r = self.run_as_user("fusermount3", "-u", mnt)
        self.assertEqual(r.returncode, 0, r.stdout)
        self.assertEqual(again.wait(timeout=60), 0, self.log_text(paths))
        self.assertFalse(is_mounted(mnt))


if __name__ == "__main__":
    unittest.main()
