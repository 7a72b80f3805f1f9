"""Attributes through a real mount move only with the user's operations (issue 10, item 5).

* open(O_RDWR) then close with no write changes nothing: not the times through the mount,
  not the backing file (no copy, no republication).
* A file's and a directory's stat (mtime, ctime, size, nlink) is the same before and
  after the journal publishes them on the backing store (the kernel's attribute cache is
  waited out, so the second stat reaches the daemon).
* `tar -c` of a tree just extracted with `tar -x` through the mount does not say "file
  changed as we read it".
* A one-byte rewrite of a 64 MiB file on an XFS backing store with reflink shares the
  file's extents instead of copying them (skipped where XFS cannot be mounted); on the
  default backing store the time of the same rewrite is printed.

Both durability modes.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import harness

MiB = 1 << 20
ATTR_TIMEOUT = 1.2  # the mount's attribute timeout is 1 s


def key(st, nlink=True):
    k = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_mode, st.st_ino)
    return k + (st.st_nlink,) if nlink else k


def published(path, timeout=60):
    deadline = time.time() + timeout
    while os.getxattr(path, "user.ckptfs.state") != b"published":
        if time.time() > deadline:
            raise AssertionError(f"{path} not published")
        time.sleep(0.01)


class AttrStability(harness.MountedTest):
    durability = "async"

    def setUp(self):
        self.m = self.mount(["--durability", self.durability])

    def p(self, *parts):
        return os.path.join(self.m.mnt, *parts)

    def test_open_for_writing_without_a_write_changes_nothing(self):
        with open(self.p("f"), "wb") as f:
            f.write(b"x" * 100000)
        published(self.p("f"))
        time.sleep(ATTR_TIMEOUT)
        before = os.stat(self.p("f"))
        backing = os.stat(os.path.join(self.m.backing, "f"))
        for flags in (os.O_RDWR, os.O_WRONLY, os.O_RDWR | os.O_APPEND, os.O_RDWR | os.O_CREAT):
            os.close(os.open(self.p("f"), flags))
        published(self.p("f"))
        time.sleep(ATTR_TIMEOUT)
        self.assertEqual(key(os.stat(self.p("f"))), key(before))
        self.assertEqual(key(os.stat(os.path.join(self.m.backing, "f"))), key(backing),
                         "the backing file was copied or republished")
        self.assertEqual(self.m.stats()["files_published"], 1)

    def test_file_and_directory_stat_same_before_and_after_publication(self):
        os.mkdir(self.p("d"))
        os.mkdir(self.p("d", "sub"))
        for i in range(20):
            with open(self.p("d", f"f{i}"), "wb") as f:
                f.write(os.urandom(1000 * i))
        os.rename(self.p("d", "f0"), self.p("d", "sub", "moved"))
        os.unlink(self.p("d", "f1"))
        os.symlink("f2", self.p("d", "link"))
        names = ["d", "d/sub", "d/f5", "d/f19", "d/sub/moved"]
        before = {n: os.lstat(self.p(n)) for n in names + ["d/link"]}
        for n in names:
            if os.path.isfile(self.p(n)):
                published(self.p(n))
        self.assertEqual(self.m.wait(self.p("d")), 0)
        time.sleep(ATTR_TIMEOUT)
        for n, st in before.items():
            self.assertEqual(key(os.lstat(self.p(n))), key(st), n)
        self.assertEqual(before["d"].st_nlink, 3)

    def test_tar_of_a_just_extracted_tree_reads_without_changes(self):
        src = tempfile.mkdtemp(prefix="ckptfs-tar-src-")
        self.addCleanup(shutil.rmtree, src, True)
        for d in range(8):
            os.makedirs(os.path.join(src, "tree", f"dir{d}", "inner"))
            for i in range(25):
                size = 3000 * i if i != 24 else MiB + 7
                with open(os.path.join(src, "tree", f"dir{d}", f"file{i}"), "wb") as f:
                    f.write(os.urandom(size))
            os.symlink("../file1", os.path.join(src, "tree", f"dir{d}", "inner", "link"))
        tarball = os.path.join(src, "tree.tar")
        subprocess.run(["tar", "-C", src, "-cf", tarball, "tree"], check=True)
        for round_ in range(3):
            dest = self.p(f"x{round_}")
            os.mkdir(dest)
            subprocess.run(["tar", "-C", dest, "-xf", tarball], check=True)
            out = os.path.join(src, f"out{round_}.tar")
            r = subprocess.run(["tar", "-C", dest, "-cf", out, "tree"], capture_output=True,
                               text=True)
            self.assertEqual(r.returncode, 0, f"round {round_}: {r.stderr}")
            self.assertNotIn("changed as we read it", r.stderr)
            d = subprocess.run(["diff", "-r", os.path.join(src, "tree"),
                                os.path.join(dest, "tree")], capture_output=True, text=True)
            self.assertEqual(d.returncode, 0, d.stdout + d.stderr)

    def test_one_byte_rewrite_of_a_large_file(self):
        rewrite_one_byte(self, self.m, f"default backing store ({self.durability})")


def rewrite_one_byte(test, m, where):
    path = os.path.join(m.mnt, "big.bin")
    data = bytearray(os.urandom(64 * MiB))
    with open(path, "wb") as f:
        f.write(data)
    published(path)
    os.sync()
    used = shutil.disk_usage(m.backing).used
    t0 = time.time()
    with open(path, "r+b") as f:
        f.seek(12345)
        f.write(b"\xff")
    closed = time.time() - t0
    published(path)
    total = time.time() - t0
    os.sync()
    grew = shutil.disk_usage(m.backing).used - used
    data[12345] = 0xff
    with open(os.path.join(m.backing, "big.bin"), "rb") as f:
        test.assertTrue(f.read() == bytes(data), "backing file differs")
    with open(path, "rb") as f:
        test.assertTrue(f.read() == bytes(data), "file through the mount differs")
    sys.stderr.write(f"\n  {where}: 1-byte rewrite of 64 MiB: close after {closed * 1e3:.1f} ms, "
                     f"published after {total * 1e3:.1f} ms, backing store grew "
                     f"{grew / MiB:.2f} MiB\n")
    return grew


class AttrStabilityStrict(AttrStability):
    durability = "strict"


class ReflinkRewrite(harness.MountedTest):
    """The backing store on a small XFS image with reflink: a one-byte rewrite of a 64 MiB
    file shares its extents (copy_file_range reflinks) and the store grows by a block or
    so, not by 64 MiB."""

    def setUp(self):
        if shutil.which("mkfs.xfs") is None:
            self.skipTest("mkfs.xfs not installed (xfsprogs)")
        self.dir = tempfile.mkdtemp(prefix="ckptfs-xfs-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        img = os.path.join(self.dir, "img")
        with open(img, "wb") as f:
            f.truncate(512 * MiB)
        subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", img], check=True)
        self.backing = os.path.join(self.dir, "xfs")
        os.mkdir(self.backing)
        r = subprocess.run(["mount", "-o", "loop", img, self.backing], capture_output=True,
                           text=True)
        if r.returncode != 0:
            self.skipTest(f"cannot mount an XFS image: {r.stderr.strip()}")
        self.addCleanup(harness.remove_tmpfs, self.backing)  # umount (lazy if busy), rm

    def run_mode(self, durability):
        back = os.path.join(self.backing, durability)
        os.mkdir(back)
        m = self.mount(["--durability", durability], backing=back)
        grew = rewrite_one_byte(self, m, f"XFS reflink ({durability})")
        self.assertLess(grew, 8 * MiB, "the rewrite copied the file instead of sharing it")
        self.assertEqual(m.unmount(), 0, m.log_text())

    def test_async(self):
        self.run_mode("async")

    def test_strict(self):
        self.run_mode("strict")


if __name__ == "__main__":
    unittest.main()
