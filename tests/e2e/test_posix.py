"""POSIX surface of a real ckptfs mount, driven by real programs and syscalls.

Every test mounts a fresh daemon (tests/e2e/harness.py), works through the
mount, checks what the mount shows, then unmounts cleanly (which drains, G8)
and checks the backing directory holds exactly the same plain files (G1, G2).
Where it helps, the same operations run on a plain directory first and that
directory is the reference.

CKPTFS_E2E_PLAIN=1 runs the file-system tests against a plain directory
instead of a mount (the daemon-only tests skip). It only checks the tests'
own logic.
"""
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import harness
from harness import (ADMIN, CKPTFS, CONTROL, PLAIN, TMP_PREFIX, errno_of, is_mounted, sha256_file,
                     tmp_names)
from posix_common import (MiB, MountedTest, pid_alive, rand_bytes, read_file, snapshot, write_file,
                          xattr)


# ---------------------------------------------------------------- namespace

class NamespaceTest(MountedTest):
    """mkdir/rmdir, rename, unlink, symlink, readdir; mixed with files that
    already exist on the backing store."""

    def populate_backing(self, backing):
        os.makedirs(os.path.join(backing, "pre", "sub"))
        write_file(os.path.join(backing, "pre", "a.bin"), rand_bytes(1, 300_000))
        write_file(os.path.join(backing, "pre", "sub", "b.bin"), rand_bytes(2, 5000))

    def test_mkdir_rmdir(self):
        os.makedirs(self.p("a", "b", "c"))
        r = subprocess.run(["mkdir", "-p", self.p("x", "y", "z")])
        self.assertEqual(r.returncode, 0)
        os.mkdir(self.p("private"), 0o700)
        self.assertEqual(stat.S_IMODE(os.stat(self.p("private")).st_mode), 0o700)
        self.assertEqual(errno_of(os.mkdir, self.p("a")), errno.EEXIST)
        self.assertEqual(errno_of(os.mkdir, self.p("pre")), errno.EEXIST)
        self.assertEqual(errno_of(os.rmdir, self.p("a")), errno.ENOTEMPTY)
        self.assertEqual(errno_of(os.rmdir, self.p("pre")), errno.ENOTEMPTY)
        self.assertEqual(errno_of(os.rmdir, self.p("nope")), errno.ENOENT)
        os.rmdir(self.p("a", "b", "c"))
        write_file(self.p("a", "b", "f"), b"hello")
        self.assertEqual(errno_of(os.rmdir, self.p("a", "b")), errno.ENOTEMPTY)
        self.assertEqual(errno_of(os.rmdir, self.p("a", "b", "f")), errno.ENOTDIR)
        self.assertEqual(errno_of(os.mkdir, self.p("a", "b", "f", "g")), errno.ENOTDIR)
        r = subprocess.run(["rmdir", "-p", "x/y/z"], cwd=self.m.mnt, capture_output=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertFalse(os.path.exists(self.p("x")))
        # A directory that exists only on the backing store can be emptied and removed.
        os.unlink(self.p("pre", "sub", "b.bin"))
        os.rmdir(self.p("pre", "sub"))
        self.assertEqual(sorted(os.listdir(self.p("a"))), ["b"])
        self.assertEqual(sorted(os.listdir(self.p("pre"))), ["a.bin"])
        self.drain()
        self.assertTrue(os.path.isdir(self.b("a", "b")))
        self.assertEqual(read_file(self.b("a", "b", "f")), b"hello")
        self.assertFalse(os.path.exists(self.b("a", "b", "c")))
        self.assertFalse(os.path.exists(self.b("x")))
        self.assertFalse(os.path.exists(self.b("pre", "sub")))
        self.assertEqual(stat.S_IMODE(os.stat(self.b("private")).st_mode), 0o700)

    def test_rmdir_after_unlinking_published_and_staged_files(self):
        os.mkdir(self.p("d"))
        write_file(self.p("d", "published"), rand_bytes(3, 2 * MiB))
        self.wait(self.p("d", "published"))
        write_file(self.p("d", "staged"), rand_bytes(4, 2 * MiB))
        os.unlink(self.p("d", "published"))
        os.unlink(self.p("d", "staged"))
        self.assertEqual(os.listdir(self.p("d")), [])
        os.rmdir(self.p("d"))
        self.assertFalse(os.path.exists(self.p("d")))
        os.mkdir(self.p("d"))  # the name is free again
        write_file(self.p("d", "new"), b"new")
        self.drain()
        self.assertEqual(os.listdir(self.b("d")), ["new"])
        self.assertEqual(read_file(self.b("d", "new")), b"new")

    def test_rename_over_existing_file(self):
        for published in (False, True):
            with self.subTest(target_published=published):
                d = "pub" if published else "stg"
                os.mkdir(self.p(d))
                old, new = rand_bytes(5, 3 * MiB + 11), rand_bytes(6, MiB + 7)
                write_file(self.p(d, "target"), old)
                if published:
                    self.wait(self.p(d, "target"))
                reader = os.open(self.p(d, "target"), os.O_RDONLY)
                try:
                    write_file(self.p(d, "src"), new)
                    os.rename(self.p(d, "src"), self.p(d, "target"))
                    self.assertFalse(os.path.exists(self.p(d, "src")))
                    self.assertEqual(read_file(self.p(d, "target")), new)
                    # An fd opened before the rename still reads the old file.
                    self.assertEqual(os.pread(reader, len(old) + 10, 0), old)
                finally:
                    os.close(reader)
        # Rename over a file that exists only on the backing store, and the mv program.
        write_file(self.p("over-pre"), b"replacement")
        os.rename(self.p("over-pre"), self.p("pre", "a.bin"))
        r = subprocess.run(["mv", "-f", self.p("pre", "sub", "b.bin"), self.p("pre", "moved.bin")])
        self.assertEqual(r.returncode, 0)
        expected = snapshot(self.m.mnt, skip_top=(CONTROL,))
        self.drain()
        self.assertSameTree(expected, self.m.backing, "backing after drain")
        self.assertEqual(read_file(self.b("pub", "target")), rand_bytes(6, MiB + 7))
        self.assertEqual(read_file(self.b("stg", "target")), rand_bytes(6, MiB + 7))
        self.assertEqual(read_file(self.b("pre", "a.bin")), b"replacement")
        self.assertEqual(read_file(self.b("pre", "moved.bin")), rand_bytes(2, 5000))

    def test_files_written_then_directory_renamed(self):
        """The DCP pattern: write a checkpoint into a staging dir, rename the dir."""
        os.mkdir(self.p("ckpt.tmp"))
        files = {f"__{r}_0.distcp": rand_bytes(10 + r, 4 * MiB + r) for r in range(4)}
        for name, data in files.items():
            write_file(self.p("ckpt.tmp", name), data)
        os.mkdir(self.p("ckpt.tmp", "nested"))
        write_file(self.p("ckpt.tmp", "nested", "x"), b"x" * 1234)
        os.rename(self.p("ckpt.tmp"), self.p("ckpt"))
        # Rename a directory that exists only on the backing store, too.
        os.rename(self.p("pre"), self.p("pre-renamed"))
        self.assertFalse(os.path.exists(self.p("ckpt.tmp")))
        for name, data in files.items():
            self.assertEqual(read_file(self.p("ckpt", name)), data)
        self.assertEqual(read_file(self.p("pre-renamed", "sub", "b.bin")), rand_bytes(2, 5000))
        expected = snapshot(self.m.mnt, skip_top=(CONTROL,))
        self.drain()
        self.assertSameTree(expected, self.m.backing, "backing after drain")
        self.assertFalse(os.path.exists(self.b("ckpt.tmp")))
        self.assertFalse(os.path.exists(self.b("pre")))

    def test_rename_directory_with_files_still_being_written(self):
        os.makedirs(self.p("d1", "inner"))
        part1, part2 = rand_bytes(20, 8 * MiB + 3), rand_bytes(21, 8 * MiB + 5)
        fds = [os.open(self.p("d1", "f"), os.O_CREAT | os.O_WRONLY, 0o644),
               os.open(self.p("d1", "inner", "g"), os.O_CREAT | os.O_WRONLY, 0o644)]
        try:
            for fd in fds:
                os.write(fd, part1)
            os.rename(self.p("d1"), self.p("d2"))
            self.assertFalse(os.path.exists(self.p("d1")))
            for fd in fds:
                os.write(fd, part2)
            # Read-your-writes under the new name while the writer is still open.
            self.assertEqual(read_file(self.p("d2", "f")), part1 + part2)
            os.rename(self.p("d2", "inner"), self.p("d2", "inner2"))
        finally:
            for fd in fds:
                os.close(fd)
        self.assertEqual(read_file(self.p("d2", "inner2", "g")), part1 + part2)
        self.drain()
        self.assertFalse(os.path.exists(self.b("d1")))
        self.assertEqual(sorted(os.listdir(self.b("d2"))), ["f", "inner2"])
        self.assertEqual(read_file(self.b("d2", "f")), part1 + part2)
        self.assertEqual(read_file(self.b("d2", "inner2", "g")), part1 + part2)

    def test_rename_file_while_being_written(self):
        a, c = rand_bytes(30, 5 * MiB), rand_bytes(31, 3 * MiB)
        write_file(self.p("victim"), b"old victim")
        fd = os.open(self.p("w"), os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.write(fd, a)
            os.rename(self.p("w"), self.p("victim"))
            os.write(fd, c)
        finally:
            os.close(fd)
        self.assertFalse(os.path.exists(self.p("w")))
        self.assertEqual(read_file(self.p("victim")), a + c)
        self.drain()
        self.assertFalse(os.path.exists(self.b("w")))
        self.assertEqual(read_file(self.b("victim")), a + c)

    def test_unlink_of_open_files(self):
        os.mkdir(self.p("d"))
        x, y = rand_bytes(40, 4 * MiB + 1), rand_bytes(41, MiB + 2)
        fd = os.open(self.p("d", "f"), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            os.write(fd, x)
            os.unlink(self.p("d", "f"))
            self.assertFalse(os.path.exists(self.p("d", "f")))
            self.assertEqual(os.listdir(self.p("d")), [])
            os.write(fd, y)
            self.assertEqual(os.fstat(fd).st_size, len(x) + len(y))
            self.assertEqual(os.pread(fd, len(x) + len(y) + 1, 0), x + y)
        finally:
            os.close(fd)
        os.rmdir(self.p("d"))

        # A published file unlinked while open for reading stays readable.
        data = rand_bytes(42, 3 * MiB)
        write_file(self.p("pub"), data)
        self.wait(self.p("pub"))
        rfd = os.open(self.p("pub"), os.O_RDONLY)
        try:
            os.unlink(self.p("pub"))
            self.assertEqual(errno_of(os.stat, self.p("pub")), errno.ENOENT)
            self.assertEqual(os.pread(rfd, len(data) + 1, 0), data)
        finally:
            os.close(rfd)
        # A file that only exists on the backing store, unlinked while open.
        rfd = os.open(self.p("pre", "a.bin"), os.O_RDONLY)
        try:
            os.unlink(self.p("pre", "a.bin"))
            self.assertEqual(os.pread(rfd, 400_000, 0), rand_bytes(1, 300_000))
        finally:
            os.close(rfd)
        self.drain()
        self.assertFalse(os.path.exists(self.b("d")))
        self.assertFalse(os.path.exists(self.b("pub")))
        self.assertFalse(os.path.exists(self.b("pre", "a.bin")))

    def test_symlink_readlink(self):
        write_file(self.p("target.txt"), b"through the link")
        r = subprocess.run(["ln", "-s", "target.txt", self.p("l1")])
        self.assertEqual(r.returncode, 0)
        os.mkdir(self.p("sub"))
        os.symlink("../pre/a.bin", self.p("sub", "l2"))
        os.symlink("/nonexistent/absolute/target", self.p("dangling"))
        self.assertEqual(os.readlink(self.p("l1")), "target.txt")
        out = subprocess.run(["readlink", self.p("sub", "l2")], capture_output=True, text=True)
        self.assertEqual(out.stdout.strip(), "../pre/a.bin")
        self.assertTrue(stat.S_ISLNK(os.lstat(self.p("l1")).st_mode))
        self.assertEqual(read_file(self.p("l1")), b"through the link")
        self.assertEqual(read_file(self.p("sub", "l2")), rand_bytes(1, 300_000))
        self.assertEqual(os.readlink(self.p("dangling")), "/nonexistent/absolute/target")
        self.assertFalse(os.path.exists(self.p("dangling")))
        self.assertEqual(errno_of(os.symlink, "x", self.p("l1")), errno.EEXIST)
        os.rename(self.p("l1"), self.p("l1-renamed"))
        self.assertEqual(os.readlink(self.p("l1-renamed")), "target.txt")
        os.symlink("sub", self.p("dirlink"))
        os.unlink(self.p("dirlink"))
        self.assertTrue(os.path.isdir(self.p("sub")))
        self.drain()
        self.assertEqual(os.readlink(self.b("l1-renamed")), "target.txt")
        self.assertEqual(os.readlink(self.b("sub", "l2")), "../pre/a.bin")
        self.assertEqual(os.readlink(self.b("dangling")), "/nonexistent/absolute/target")
        self.assertFalse(os.path.lexists(self.b("l1")))
        self.assertFalse(os.path.lexists(self.b("dirlink")))
        self.assertEqual(read_file(self.b("target.txt")), b"through the link")

    def test_unusual_file_names(self):
        names = ["with space", "uni-\u00fc-\u65e5\u672c", "new\nline", "tab\there", "x" * 255,
                 "quote'\"", "back\\slash", "-dash", ".hidden", "..dots", "%s%n", "\x01ctl",
                 "ckptfs-tmp.not-hidden", ".ckptfs"]
        os.mkdir(self.p("n"))
        for n in names:
            write_file(self.p("n", n), n.encode() * 3)
        self.assertEqual(sorted(os.listdir(self.p("n"))), sorted(names))
        os.rename(self.p("n"), self.p("renamed \u00e9\n"))
        for n in names:
            self.assertEqual(read_file(self.p("renamed \u00e9\n", n)), n.encode() * 3, repr(n))
        self.drain()
        self.assertEqual(sorted(os.listdir(self.b("renamed \u00e9\n"))), sorted(names))
        for n in names:
            self.assertEqual(read_file(self.b("renamed \u00e9\n", n)), n.encode() * 3, repr(n))

    def test_overlong_names_are_refused(self):
        """A name longer than the backing store allows (255 bytes on ext4)
        must fail with ENAMETOOLONG when the application makes it, not be
        accepted and then fail to publish in the background."""
        too_long, longest = "y" * 256, "z" * 255
        self.assertEqual(errno_of(write_file, self.p(too_long), b"data"), errno.ENAMETOOLONG)
        self.assertEqual(errno_of(os.mkdir, self.p("d" + too_long)), errno.ENAMETOOLONG)
        self.assertEqual(errno_of(os.symlink, "target", self.p("l" + too_long)),
                         errno.ENAMETOOLONG)
        write_file(self.p("short"), b"short")
        self.assertEqual(errno_of(os.rename, self.p("short"), self.p("r" + too_long)),
                         errno.ENAMETOOLONG)
        self.assertEqual(sorted(n for n in os.listdir(self.m.mnt) if n != CONTROL),
                         ["pre", "short"])
        write_file(self.p(longest), b"longest")  # 255 bytes is fine
        self.wait(self.p(longest))
        self.drain()
        self.assertEqual(sorted(os.listdir(self.m.backing)), sorted(["pre", "short", longest]))
        self.assertEqual(read_file(self.b(longest)), b"longest")

    def test_replace_by_rename_loop(self):
        """The tracker pattern: write a temp file, rename it over the real
        one, many times; the last version wins, nothing stale remains."""
        for i in range(200):
            write_file(self.p("tracker.tmp"), f"iter {i}\n".encode())
            os.rename(self.p("tracker.tmp"), self.p("tracker"))
            if i % 50 == 0:
                self.wait(self.p("tracker"))
        self.assertEqual(read_file(self.p("tracker")), b"iter 199\n")
        self.drain()
        self.assertEqual(read_file(self.b("tracker")), b"iter 199\n")
        self.assertFalse(os.path.exists(self.b("tracker.tmp")))

    def test_random_namespace_ops_match_a_plain_directory(self):
        """A seeded sequence of creates, writes, appends, truncates, renames,
        unlinks, mkdirs, rmdirs, symlinks and chmods, run on a plain directory
        and on the mount: the same errno for every op, the same tree after,
        and the same tree on the backing store after drain."""
        ref_root = tempfile.mkdtemp(prefix="ckptfs-ref-")
        self.addCleanup(shutil.rmtree, ref_root, True)
        shutil.copytree(os.path.join(self.m.backing, "pre"), os.path.join(ref_root, "pre"),
                        symlinks=True)
        ops = random_namespace_ops(seed=1234, n=460)
        mismatches = []
        for i, op in enumerate(ops):
            e_ref = apply_op(ref_root, op)
            e_mnt = apply_op(self.m.mnt, op)
            if e_ref != e_mnt:
                mismatches.append((i, op, errno.errorcode.get(e_ref, e_ref),
                                   errno.errorcode.get(e_mnt, e_mnt)))
            target = os.path.join(self.m.mnt, op[1])
            if (op[0] == "write" and i % 40 == 0 and e_mnt == 0 and not os.path.islink(target)
                    and os.path.isfile(target)):
                self.wait(target)  # mix published and staged files
        self.assertEqual(mismatches, [], "errno differs (index, op, plain, mount)")
        expected = snapshot(ref_root)
        self.assertSameTree(expected, self.m.mnt, "mount vs plain directory")
        owners = ownership(ref_root)
        self.assertEqual(ownership(self.m.mnt, skip_top=(CONTROL,)), owners,
                         "owners: mount vs plain directory")
        self.drain()
        self.assertSameTree(expected, self.m.backing, "backing after drain vs plain directory")
        self.assertEqual(ownership(self.m.backing), owners,
                         "owners: backing after drain vs plain directory")


def ownership(root, skip_top=()):
    """relpath -> (uid, gid, link count unless a directory) of every name under root."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if dirpath == root:
            dirnames[:] = [d for d in dirnames if d not in skip_top]
        for n in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, n))
            nlink = None if stat.S_ISDIR(st.st_mode) else st.st_nlink
            out[os.path.relpath(os.path.join(dirpath, n), root)] = (st.st_uid, st.st_gid, nlink)
    return out


def random_namespace_ops(seed, n):
    rng = random.Random(seed)
    dirs = ["", "d0", "d1", "d0/e", "pre", "pre/sub"]
    names = ["f0", "f1", "f2", "f3", "a.bin", "b.bin"]
    ops = []
    for i in range(n):
        d = rng.choice(dirs)
        path = os.path.join(d, rng.choice(names))
        kind = rng.choices(
            ["write", "append", "otrunc", "truncate", "rename", "unlink", "mkdir", "rmdir",
             "rename_dir", "symlink", "chmod", "link_move", "mkfifo", "mknod", "chown"],
            weights=[20, 6, 4, 5, 10, 6, 6, 3, 3, 3, 3, 4, 2, 2, 3])[0]
        if kind == "write":
            ops.append(("write", path, rng.randrange(0, 300_000), rng.randrange(0, 200_000),
                        rng.randrange(1 << 30)))
        elif kind == "append":
            ops.append(("append", path, rng.randrange(1, 70_000), rng.randrange(1 << 30)))
        elif kind == "otrunc":
            ops.append(("otrunc", path, rng.randrange(0, 50_000), rng.randrange(1 << 30)))
        elif kind == "truncate":
            ops.append(("truncate", path, rng.randrange(0, 400_000)))
        elif kind == "rename":
            ops.append(("rename", path, os.path.join(rng.choice(dirs), rng.choice(names))))
        elif kind == "unlink":
            ops.append(("unlink", path))
        elif kind == "mkdir":
            ops.append(("mkdir", rng.choice(dirs[1:4] + ["d2", "d1/g"])))
        elif kind == "rmdir":
            ops.append(("rmdir", rng.choice(dirs[1:4] + ["d2", "d1/g"])))
        elif kind == "rename_dir":
            a, b = rng.sample(["d0", "d1", "d2", "d1/g", "d0/e"], 2)
            ops.append(("rename", a, b))
        elif kind == "symlink":
            # Targets stay inside the tree (or nowhere): writes through
            # a link must not leave the directory under test.
            ops.append(("symlink", rng.choice(["f0", "sub/f1", "/nonexistent-ckptfs/x"]), path))
        elif kind == "link_move":
            # A hard link under a name no write op uses, then the old name goes: no file
            # keeps two links for a later write (EMLINK, docs/SEMANTICS.md), yet the link
            # of a still staged file and the unlink after it must publish in order.
            ops.append(("link_move", path, os.path.join(rng.choice(dirs), f"h{i}")))
        elif kind == "mkfifo":
            ops.append(("mkfifo", os.path.join(d, rng.choice(["p0", "p1"]))))
        elif kind == "mknod":
            ops.append(("mknod", path))
        elif kind == "chown":
            ops.append(("chown", path, rng.choice([0, 4242, 4343]), rng.choice([-1, 0, 4343])))
        else:
            ops.append(("chmod", path, rng.choice([0o600, 0o640, 0o644, 0o755])))
    return ops


def write_through(path, flags, data, off=None):
    """One open(O_CREAT | O_WRONLY | flags), one write (a pwrite at `off`), one close."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | flags, 0o644)
    try:
        if off is None:
            os.write(fd, data)
        else:
            os.pwrite(fd, data, off)
    finally:
        os.close(fd)


def apply_op(root, op):
    """Applies one op under root; returns 0 or the errno."""
    P = lambda rel: os.path.join(root, rel)  # noqa: E731
    try:
        kind = op[0]
        if kind == "write":
            _, path, off, length, seed = op
            write_through(P(path), 0, rand_bytes(seed, length), off)
        elif kind == "append":
            _, path, length, seed = op
            write_through(P(path), os.O_APPEND, rand_bytes(seed, length))
        elif kind == "otrunc":
            _, path, length, seed = op
            write_through(P(path), os.O_TRUNC, rand_bytes(seed, length))
        elif kind == "truncate":
            os.truncate(P(op[1]), op[2])
        elif kind == "rename":
            os.rename(P(op[1]), P(op[2]))
        elif kind == "unlink":
            os.unlink(P(op[1]))
        elif kind == "mkdir":
            os.mkdir(P(op[1]), 0o755)
        elif kind == "rmdir":
            os.rmdir(P(op[1]))
        elif kind == "symlink":
            os.symlink(op[1], P(op[2]))
        elif kind == "link_move":
            os.link(P(op[1]), P(op[2]), follow_symlinks=False)
            if os.path.isfile(P(op[2])) and not os.path.islink(P(op[2])):
                with open(P(op[1]), "rb") as a, open(P(op[2]), "rb") as b:
                    if a.read() != b.read():
                        return -1  # the two names of one inode show different bytes
            os.unlink(P(op[1]))
        elif kind == "mkfifo":
            os.mkfifo(P(op[1]), 0o640)
        elif kind == "mknod":
            os.mknod(P(op[1]), stat.S_IFREG | 0o600)
        elif kind == "chown":
            os.lchown(P(op[1]), op[2], op[3])
        elif kind == "chmod":
            # chmod follows symlinks; only chmod real files so a dangling
            # /abs/x link never reaches outside the tree.
            if os.path.islink(P(op[1])):
                return errno.ELOOP
            os.chmod(P(op[1]), op[2])
        return 0
    except OSError as e:
        return e.errno


class StrictNamespaceTest(NamespaceTest):
    """The same namespace tests with --durability strict."""
    MOUNT_ARGS = ("--durability", "strict")


class HiddenTmpTest(MountedTest):
    STAGING = "512M"

    def populate_backing(self, backing):
        os.makedirs(os.path.join(backing, "d"))
        write_file(os.path.join(backing, "d", TMP_PREFIX + "stray-from-test"), b"stray")

    def test_readdir_hides_temporary_files(self):
        self.skip_if_plain()
        data = rand_bytes(60, 96 * MiB)
        fd = os.open(self.p("d", "big"), os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.write(fd, data[:64 * MiB])
            # The file is being written: its bytes go to a hidden temp file at the
            # backing root (a root temp never depends on a pending mkdir or rename).
            deadline = time.time() + 20
            live = []
            while time.time() < deadline:
                live = [n for n in os.listdir(self.m.backing)
                        if n.startswith(TMP_PREFIX) and n != TMP_PREFIX + "stray-from-test"]
                if live:
                    break
                time.sleep(0.05)
            self.assertTrue(live, f"no {TMP_PREFIX}* on the backing store while writing 64 MiB; "
                                  f"backing root has {os.listdir(self.m.backing)}")
            self.assertEqual(os.listdir(self.p("d")), ["big"])
            r = subprocess.run(["ls", "-a", self.p("d")], capture_output=True, text=True)
            self.assertNotIn(TMP_PREFIX, r.stdout)
            for name in live:
                self.assertEqual(errno_of(os.stat, self.p(name)), errno.ENOENT, name)
            self.assertEqual(errno_of(os.stat, self.p("d", TMP_PREFIX + "stray-from-test")),
                             errno.ENOENT)
            # Nothing torn under the real name (G4): absent, or the empty file just created.
            if os.path.exists(self.b("d", "big")):
                self.assertEqual(os.path.getsize(self.b("d", "big")), 0)
            os.write(fd, data[64 * MiB:])
        finally:
            os.close(fd)
        self.assertEqual(os.listdir(self.p("d")), ["big"])
        self.assertEqual(sha256_file(self.p("d", "big")), hashlib.sha256(data).hexdigest())
        rc = self.m.unmount(timeout=180)
        self.assertEqual(rc, 0)
        self.assertEqual(read_file(self.b("d", "big")), data)
        leftover = [n for n in tmp_names(self.m.backing) if not n.endswith("stray-from-test")]
        self.assertEqual(leftover, [])


class StrictModeTest(MountedTest):
    """--durability strict: namespace ops and close reach the backing store
    before they return."""
    MOUNT_ARGS = ("--durability", "strict")

    def test_operations_reach_backing_before_returning(self):
        self.skip_if_plain()
        os.mkdir(self.p("d"))
        self.assertTrue(os.path.isdir(self.b("d")))
        data = rand_bytes(70, 9 * MiB + 1)
        write_file(self.p("d", "f"), data)  # close returns once published
        self.assertEqual(read_file(self.b("d", "f")), data)
        self.assertEqual(xattr(self.p("d", "f"), "user.ckptfs.state"), "published")
        fd = os.open(self.p("d", "g"), os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
            self.assertEqual(read_file(self.b("d", "g")), data)
        finally:
            os.close(fd)
        os.rename(self.p("d", "f"), self.p("d", "f2"))
        self.assertTrue(os.path.exists(self.b("d", "f2")))
        self.assertFalse(os.path.exists(self.b("d", "f")))
        os.symlink("f2", self.p("d", "l"))
        self.assertEqual(os.readlink(self.b("d", "l")), "f2")
        os.unlink(self.p("d", "g"))
        self.assertFalse(os.path.exists(self.b("d", "g")))
        os.rename(self.p("d"), self.p("e"))
        self.assertTrue(os.path.isdir(self.b("e")))
        self.assertFalse(os.path.exists(self.b("d")))
        os.unlink(self.p("e", "l"))
        os.unlink(self.p("e", "f2"))
        os.rmdir(self.p("e"))
        self.assertFalse(os.path.exists(self.b("e")))
        self.drain()


# ---------------------------------------------------------------- shutdown

class ShutdownTest(MountedTest):
    STAGING = "1G"

    def setUp(self):
        if PLAIN:
            self.skipTest("needs a real ckptfs daemon")
        super().setUp()

    def write_workload(self, total_mb):
        """Writes files totalling total_mb, a rename and a directory; returns
        {relpath: sha256} of what the backing store must hold."""
        expected = {}
        os.mkdir(self.p("ckpt.tmp"))
        n = max(1, total_mb // 128)
        for i in range(n):
            data = rand_bytes(80 + i, (total_mb // n) * MiB + i)
            write_file(self.p("ckpt.tmp", f"__{i}_0.distcp"), data)
            expected[os.path.join("ckpt", f"__{i}_0.distcp")] = hashlib.sha256(data).hexdigest()
        os.rename(self.p("ckpt.tmp"), self.p("ckpt"))
        write_file(self.p("latest.txt"), b"ckpt\n")
        expected["latest.txt"] = hashlib.sha256(b"ckpt\n").hexdigest()
        # Many small files: each needs its own fsync and rename on the backing
        # store, so the journal still has a backlog when the signal arrives.
        os.mkdir(self.p("small"))
        for i in range(1500):
            data = rand_bytes(100_000 + i, 4096 + i)
            write_file(self.p("small", f"s{i}"), data)
            expected[os.path.join("small", f"s{i}")] = hashlib.sha256(data).hexdigest()
        return expected

    def check_backing(self, expected):
        got = {}
        for dirpath, _, filenames in os.walk(self.m.backing):
            for f in filenames:
                p = os.path.join(dirpath, f)
                got[os.path.relpath(p, self.m.backing)] = sha256_file(p)
        self.assertEqual(got, expected, "backing store after shutdown")
        self.assertFalse(os.path.exists(self.b("ckpt.tmp")))

    def signal_drains(self, sig, total_mb):
        expected = self.write_workload(total_mb)
        # A file still open for writing when the signal arrives: its staged
        # bytes are published too (G8: everything staged).
        data = rand_bytes(99, 32 * MiB + 5)
        fd = os.open(self.p("open.bin"), os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, data)
        expected["open.bin"] = hashlib.sha256(data).hexdigest()
        before = self.m.stats()
        proc = self.m.proc
        os.kill(proc.pid, sig)
        try:
            rc = proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            self.fail(f"daemon did not exit within 180 s of {sig.name}")
        finally:
            try:
                os.close(fd)
            except OSError:
                pass  # ENOTCONN: the mount is gone
        self.m.proc = None
        self.assertEqual(rc, 0, f"exit code after {sig.name}; stats before: {before}\n"
                                f"{self.m.log_text()[-3000:]}")
        self.assertFalse(is_mounted(self.m.mnt), f"still mounted after {sig.name}")
        self.check_backing(expected)
        return before

    def test_sigterm_drains_everything_staged(self):
        before = self.signal_drains(signal.SIGTERM, 768)
        sys.stderr.write(f"\n  at SIGTERM: journal_pending={before.get('journal_pending')} "
                         f"bytes_written={before.get('bytes_written')} "
                         f"bytes_flushed={before.get('bytes_flushed')}\n")

    def test_sigint_drains_everything_staged(self):
        self.signal_drains(signal.SIGINT, 256)

    def test_admin_unmount_exits_zero_and_drains(self):
        expected = self.write_workload(384)
        r = subprocess.run([ADMIN, "unmount", self.m.mnt], capture_output=True, text=True,
                           timeout=300)
        self.assertEqual(r.returncode, 0, f"ckptfs-admin unmount: {r.stdout}{r.stderr}")
        self.assertFalse(is_mounted(self.m.mnt))
        try:
            rc = self.m.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.fail("daemon still running 120 s after ckptfs-admin unmount returned")
        self.m.proc = None
        self.assertEqual(rc, 0)
        self.check_backing(expected)


# ---------------------------------------------------------------- daemon CLI

class DaemonCliTest(harness.MountedTest):
    """Bad invocations exit 2 with exactly one line on stderr and mount nothing."""

    def setUp(self):
        if PLAIN:
            self.skipTest("needs a real ckptfs daemon")
        self.root = tempfile.mkdtemp(prefix="ckptfs-cli-")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.backing = os.path.join(self.root, "backing")
        self.mnt = os.path.join(self.root, "mnt")
        self.state = os.path.join(self.root, "state")
        os.makedirs(self.backing)
        os.makedirs(self.mnt)

    def run_daemon(self, args, foreground=True, timeout=20, mnt=None):
        """Runs ckptfs; if it wrongly keeps running or mounts, kills it by PID."""
        cmd = [CKPTFS] + (["-f"] if foreground else []) + list(args)
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            harness.unmount(mnt or self.mnt)
            self.fail(f"{cmd} still running after {timeout} s (expected an error exit)")
        return p.returncode, out, err

    def expect_usage_error(self, args, mention=None, foreground=True):
        rc, out, err = self.run_daemon(args, foreground=foreground)
        mounted = is_mounted(self.mnt)
        if mounted:
            harness.unmount(self.mnt)
        self.assertFalse(mounted, f"{args} mounted something")
        self.assertEqual(rc, 2, f"{args}: exit {rc}\nstdout: {out}\nstderr: {err}")
        lines = err.strip().splitlines()
        self.assertEqual(len(lines), 1, f"{args}: expected one line on stderr, got {err!r}")
        self.assertGreater(len(lines[0].strip()), 10, f"{args}: message too terse: {err!r}")
        if mention:
            self.assertIn(mention, lines[0], f"{args}: message does not name {mention}")

    def test_missing_backing_dir(self):
        missing = os.path.join(self.root, "no-such-backing")
        self.expect_usage_error(["--state-dir", self.state, missing, self.mnt], mention=missing)
        self.expect_usage_error(["--state-dir", self.state, missing, self.mnt], mention=missing,
                                foreground=False)
        self.assertFalse(os.path.exists(missing), "the daemon created the missing backing dir")

    def test_backing_dir_is_a_file(self):
        f = os.path.join(self.root, "file")
        write_file(f, b"x")
        self.expect_usage_error(["--state-dir", self.state, f, self.mnt], mention=f)

    def test_missing_mountpoint(self):
        missing = os.path.join(self.root, "no-such-mnt")
        self.expect_usage_error(["--state-dir", self.state, self.backing, missing], mention=missing)
        self.expect_usage_error(["--state-dir", self.state, self.backing, missing], mention=missing,
                                foreground=False)

    def test_busy_mountpoint(self):
        m = self.mount()
        other_backing = os.path.join(self.root, "other")
        os.makedirs(other_backing)
        rc, out, err = self.run_daemon(["--state-dir", self.state, other_backing, m.mnt],
                                       mnt=m.mnt)
        self.assertEqual(rc, 2, f"second mount on a busy mountpoint: exit {rc}\n{out}{err}")
        self.assertEqual(len(err.strip().splitlines()), 1, repr(err))
        # The first mount is undisturbed.
        self.assertIsInstance(m.stats(), dict)
        write_file(os.path.join(m.mnt, "still-works"), b"ok")
        self.assertEqual(m.unmount(), 0)
        self.assertEqual(read_file(os.path.join(m.backing, "still-works")), b"ok")
        self.assertEqual(os.listdir(other_backing), [])

    def test_bad_options(self):
        base = ["--state-dir", self.state]
        pos = [self.backing, self.mnt]
        cases = [
            ["--durability", "sometimes"] + base + pos,
            ["--no-such-option"] + base + pos,
            ["--staging-mem", "lots"] + base + pos,
            ["--staging-mem", "-5G"] + base + pos,
            ["--flush-threads", "many"] + base + pos,
            ["--log-level", "shouty"] + base + pos,
            base + [self.backing],
            base + pos + ["extra-positional"],
        ]
        for args in cases:
            with self.subTest(args=args):
                self.expect_usage_error(args)

    def test_state_dir_inside_the_mount(self):
        for state in (os.path.join(self.mnt, "state"), self.mnt):
            with self.subTest(state=state):
                self.expect_usage_error(["--state-dir", state, self.backing, self.mnt])
        self.assertEqual(os.listdir(self.mnt), [])

    def test_state_dir_in_use_by_another_daemon(self):
        m = self.mount()
        other_backing = os.path.join(self.root, "other")
        os.makedirs(other_backing)
        self.expect_usage_error(["--state-dir", m.state, other_backing, self.mnt])
        self.expect_usage_error(["--state-dir", m.state, other_backing, self.mnt],
                                foreground=False)
        self.assertIsInstance(m.stats(), dict)
        self.assertEqual(m.unmount(), 0)

    def test_daemonizes_returns_once_mounted_and_admin_unmount(self):
        log = os.path.join(self.root, "daemon.log")
        cmd = [CKPTFS, "--state-dir", self.state, "--log-file", log, self.backing, self.mnt]
        pid = None
        try:
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                rc = p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                self.fail("ckptfs (daemonizing) did not return within 60 s")
            # The daemon must not hold the caller's stdout/stderr open, or
            # `out=$(ckptfs ...)` would hang.
            outputs = {}
            readers = [threading.Thread(target=lambda k, f: outputs.__setitem__(k, f.read()),
                                        args=(k, f), daemon=True)
                       for k, f in (("out", p.stdout), ("err", p.stderr))]
            for t in readers:
                t.start()
            for t in readers:
                t.join(timeout=10)
            p.stdout.close()
            p.stderr.close()
            self.assertEqual(rc, 0, f"{outputs}")
            self.assertEqual(len(outputs), 2, "the daemon keeps the caller's stdout/stderr open")
            # Returned once mounted: the control files answer right away.
            self.assertTrue(is_mounted(self.mnt))
            with open(os.path.join(self.mnt, CONTROL, "stats")) as f:
                pid = json.load(f)["pid"]
            self.assertTrue(pid_alive(pid))
            st = subprocess.run([ADMIN, "stats", self.mnt, "--json"], capture_output=True,
                                text=True, timeout=30)
            self.assertEqual(st.returncode, 0, st.stderr)
            self.assertEqual(json.loads(st.stdout)["pid"], pid)
            data = rand_bytes(90, 40 * MiB)
            write_file(os.path.join(self.mnt, "f"), data)
            u = subprocess.run([ADMIN, "unmount", self.mnt], capture_output=True, text=True,
                               timeout=300)
            self.assertEqual(u.returncode, 0, f"{u.stdout}{u.stderr}")
            self.assertFalse(is_mounted(self.mnt))
            deadline = time.time() + 60
            while pid_alive(pid) and time.time() < deadline:
                time.sleep(0.1)
            self.assertFalse(pid_alive(pid), "daemon still alive 60 s after admin unmount")
            self.assertEqual(read_file(os.path.join(self.backing, "f")), data)
            self.assertEqual(tmp_names(self.backing), [])
        finally:
            if pid is not None and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
            harness.unmount(self.mnt)


if __name__ == "__main__":
    unittest.main()
