"""Helpers of the POSIX e2e tests (test_posix.py, test_file_io.py): files, trees and
snapshots, and MountedTest, a fresh mount per test (harness.MountedTest) with the
reference-tree check."""
import os
import random
import stat

import harness
from harness import CONTROL, sha256_file

MiB = 1 << 20


# ---------------------------------------------------------------- helpers

def rand_bytes(seed, n):
    return random.Random(seed).randbytes(n)


def write_file(path, data, chunk=MiB):
    with open(path, "wb") as f:
        for i in range(0, len(data), chunk):
            f.write(data[i:i + chunk])


def read_file(path):
    with open(path, "rb") as f:
        return f.read()



def snapshot(root, skip_top=()):
    """relpath -> description of every entry under root: type, permission
    bits, size and sha256 (files) or target (symlinks)."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if dirpath == root:
            dirnames[:] = [d for d in dirnames if d not in skip_top]
            filenames = [f for f in filenames if f not in skip_top]
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                snap[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                snap[rel] = ("dir", oct(stat.S_IMODE(st.st_mode)))
            elif stat.S_ISREG(st.st_mode):
                snap[rel] = ("file", oct(stat.S_IMODE(st.st_mode)), st.st_size, sha256_file(p))
            else:
                snap[rel] = ("other", st.st_mode)
    return snap


def xattr(path, name):
    return os.getxattr(path, name).decode()



def pid_alive(pid):
    """True while pid exists and is not a zombie (a daemonized ckptfs is not
    our child, and init in a container may be slow to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class MountedTest(harness.MountedTest):
    """A fresh mount per test (harness.MountedTest with MOUNT_IN_SETUP); self.m is the
    mount, p()/b() build paths in the mount and in the backing directory."""

    MOUNT_IN_SETUP = True
    PLAIN_OK = True

    def assertSameTree(self, expected_snap, root, what):
        got = snapshot(root, skip_top=(CONTROL,) if root == self.m.mnt else ())
        missing = sorted(set(expected_snap) - set(got))
        extra = sorted(set(got) - set(expected_snap))
        differ = sorted(k for k in set(got) & set(expected_snap) if got[k] != expected_snap[k])
        self.assertFalse(missing or extra or differ,
                         f"{what}: missing={missing} extra={extra} "
                         f"differ={[(k, expected_snap[k], got[k]) for k in differ]}")
