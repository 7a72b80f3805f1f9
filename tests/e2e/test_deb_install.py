"""The .deb installs and mounts on a clean Debian 12.

A minimal Debian 12 root (debootstrap --variant=minbase, made once and cached under
/var/cache/ckptfs) is used through a throwaway overlay, so every run starts clean. The
package is built from this build tree with CPack, installed with apt (which pulls its
dependencies from the Debian archive; downloaded .debs and apt lists are cached next to
the root), and then, inside the chroot: both programs run, the mount helper, unit, man
pages and docs are in place, `mount -t fuse.ckptfs` mounts, a written file is published
to the backing dir, and `ckptfs-admin unmount` drains and reports a clean exit.

Bounded: debootstrap (first run only) 240 s, apt 180 s, the rest seconds. Skips, saying
why, when not root or when the Debian archive cannot be reached. Every mount made here
(overlay, proc, /dev/fuse, caches, the FUSE mount) is undone at cleanup, and a daemon
left running is killed by its pid.
"""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import unittest

from harness import BIN_DIR, is_mounted

CACHE = "/var/cache/ckptfs"
ROOT_CACHE = os.path.join(CACHE, "debroot-bookworm")
MIRROR = os.environ.get("CKPTFS_DEBIAN_MIRROR", "http://deb.debian.org/debian")


def run(cmd, timeout, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


class DebInstallTest(unittest.TestCase):
    def setUp(self):
        if os.geteuid() != 0:
            self.skipTest("chroot and mount need root")
        reach = run(["curl", "-sSfI", "--max-time", "15", f"{MIRROR}/dists/bookworm/Release"],
                    timeout=30)
        if reach.returncode != 0:
            self.skipTest(f"Debian archive {MIRROR} unreachable: {reach.stderr.strip()}")
        self.tmp = tempfile.mkdtemp(prefix="ckptfs-e2e-deb-")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.mounts = []  # undone in reverse order
        self.addCleanup(self._undo_mounts)

    def _mount(self, args, target):
        r = run(["mount", *args, target], timeout=30)
        self.assertEqual(r.returncode, 0, f"mount {args} {target}: {r.stderr}")
        self.mounts.append(target)

    def _undo_mounts(self):
        for target in reversed(self.mounts):
            if run(["umount", target], timeout=30).returncode != 0:
                run(["umount", "-l", target], timeout=30)

    def debian_root(self):
        if not os.path.isdir(ROOT_CACHE):
            if shutil.which("debootstrap") is None:
                self.skipTest("debootstrap is not installed (scripts/setup.sh)")
            os.makedirs(CACHE, exist_ok=True)
            part = tempfile.mkdtemp(prefix="debroot-", dir=CACHE)
            r = run(["debootstrap", "--variant=minbase", "bookworm", part, MIRROR], timeout=240)
            if r.returncode != 0:
                shutil.rmtree(part, ignore_errors=True)
                self.fail(f"debootstrap failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
            try:
                os.rename(part, ROOT_CACHE)
            except OSError:  # another worktree's run made it meanwhile
                shutil.rmtree(part, ignore_errors=True)
                if not os.path.isdir(ROOT_CACHE):
                    raise
        return ROOT_CACHE

    def build_deb(self):
        # CPack's DEB generator runs dpkg-shlibdeps, and `file` to find what to strip and scan;
        # without them it fails with a terse "file utility is not available".
        for tool in ("cpack", "dpkg-shlibdeps", "file"):
            self.assertIsNotNone(shutil.which(tool), f"{tool} is missing: run scripts/setup.sh")
        build = os.path.dirname(os.path.realpath(BIN_DIR))
        out = os.path.join(self.tmp, "dist")
        r = run(["cpack", "-G", "DEB", "--config", os.path.join(build, "CPackConfig.cmake"),
                 "-B", out], timeout=300, cwd=build)
        self.assertEqual(r.returncode, 0, r.stdout[-3000:] + r.stderr[-3000:])
        debs = [f for f in os.listdir(out) if f.endswith(".deb")]
        self.assertEqual(len(debs), 1, os.listdir(out))
        return os.path.join(out, debs[0])

    def chroot(self, root, *cmd, timeout=60, check=True):
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive",
               "LANG": "C.UTF-8"}
        r = run(["chroot", root, *cmd], timeout=timeout, env=env)
        if check:
            self.assertEqual(r.returncode, 0, f"{cmd}: {r.stdout[-3000:]}{r.stderr[-3000:]}")
        return r

    def test_deb_installs_and_mounts_in_a_clean_debian12_root(self):
        lower = self.debian_root()
        deb = self.build_deb()
        root = os.path.join(self.tmp, "root")
        upper, work = os.path.join(self.tmp, "upper"), os.path.join(self.tmp, "work")
        for d in (root, upper, work):
            os.makedirs(d)
        self._mount(["-t", "overlay", "overlay", "-o",
                     f"lowerdir={lower},upperdir={upper},workdir={work}"], root)
        self._mount(["-t", "proc", "proc"], os.path.join(root, "proc"))
        fuse = os.path.join(root, "dev", "fuse")
        if not os.path.exists(fuse):
            open(fuse, "w").close()
        self._mount(["--bind", "/dev/fuse"], fuse)
        for cached, inside in (("apt-archives", "var/cache/apt/archives"),
                               ("apt-lists", "var/lib/apt/lists")):
            src = os.path.join(CACHE, cached)
            os.makedirs(os.path.join(src, "partial"), exist_ok=True)
            self._mount(["--bind", src], os.path.join(root, inside))
        shutil.copy("/etc/resolv.conf", os.path.join(root, "etc", "resolv.conf"))
        shutil.copy(deb, os.path.join(root, "tmp", "ckptfs.deb"))

        self.chroot(root, "apt-get", "update", "-qq", timeout=180)
        self.chroot(root, "apt-get", "install", "-y", "-qq", "--no-install-recommends",
                    "/tmp/ckptfs.deb", timeout=180)

        for prog in ("ckptfs", "ckptfs-admin"):
            r = self.chroot(root, prog, "--version")
            self.assertRegex(r.stdout, rf"^{prog} \d+\.\d+\.\d+ ")
        for path in ("usr/sbin/mount.fuse.ckptfs", "usr/sbin/mount.ckptfs",
                     "usr/lib/systemd/system/ckptfs@.service",
                     "usr/lib/sysctl.d/90-ckptfs.conf",
                     "usr/share/man/man8/ckptfs.8.gz", "usr/share/man/man1/ckptfs-admin.1.gz",
                     "usr/share/doc/ckptfs/SEMANTICS.md", "usr/share/doc/ckptfs/integration.md",
                     "usr/share/doc/ckptfs/examples/slurm/prolog.sh"):
            self.assertTrue(os.path.lexists(os.path.join(root, path)), path)

        mnt = os.path.join(root, "mnt", "ckpt")
        os.makedirs(os.path.join(root, "srv", "backing"))
        os.makedirs(mnt)
        self.addCleanup(self._stop_daemon, mnt)
        self.chroot(root, "mount", "-t", "fuse.ckptfs", "/srv/backing", "/mnt/ckpt", "-o",
                    "staging_mem=64M,state_dir=/var/tmp/ckptfs-deb,_netdev", timeout=60)
        self.assertTrue(is_mounted(mnt))
        self.chroot(root, "sh", "-c", "head -c 3000000 /dev/zero | tr '\\0' 'k' > "
                    "/mnt/ckpt/shard && ckptfs-admin wait /mnt/ckpt/shard --timeout 60")
        r = self.chroot(root, "ckptfs-admin", "unmount", "/mnt/ckpt", "--timeout", "60",
                        "--json", timeout=90)
        report = json.loads(r.stdout)
        self.assertEqual((report["clean"], report["exit_code"]), (True, 0), report)
        self.assertFalse(is_mounted(mnt))
        with open(os.path.join(root, "srv", "backing", "shard"), "rb") as f:
            self.assertEqual(f.read(), b"k" * 3000000)

    def _stop_daemon(self, mnt):
        if not is_mounted(mnt):
            return
        try:
            with open(os.path.join(mnt, ".ckptfs", "stats")) as f:
                os.kill(json.load(f)["pid"], signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            pass
        run(["umount", "-l", mnt], timeout=30)


if __name__ == "__main__":
    unittest.main()
