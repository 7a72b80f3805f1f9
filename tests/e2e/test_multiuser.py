"""Multi-user POSIX on a root mount with -o allow_other, driven as other uids.

The same sequence of operations (creates, mkdir, chmod, chown/chgrp, sticky-directory
unlinks and renames by a non-owner, opens without permission, utimensat both ways,
hard links, FIFOs and sockets, fallocate, rmdir of a non-empty directory...) runs as
root, as user A (uid 4242, also in group 4243) and as user B (uid 4343) against a plain
directory and against the mount. Every errno must match, and so must the owner, group,
mode, type, link count and contents of every name: on the mount at once (before
publication in async mode), on the backing store after the drain, and on the mount
after a remount. The few documented differences (docs/SEMANTICS.md, "Multi-user
POSIX") are listed in KNOWN_DIFFERENCES; any other difference fails.

No user is created: setpriv switches to bare uids and gids, which need no passwd entry.
The other uids run a copy of multiuser_ops.py in a directory everyone can read
(harness.copy_for_others): the checkout may sit under a 0700 directory such as /root.
"""
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import unittest

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "multiuser_ops.py")
PY = "/usr/bin/python3"

ROOT = None
A = (4242, 4242, [4243])  # owner of work/, member of group 4243
B = (4343, 4343, [])      # a stranger
S_IFSOCK = stat.S_IFSOCK
FALLOC_FL_KEEP_SIZE = 1
T1, T2 = 1_000_000_000_123_456_789, 1_100_000_000_987_654_321  # explicit times (ns)

# (who, [ops]) in order. Comments give the POSIX outcome for the non-obvious ones.
SEQUENCE = [
    (ROOT, [
        ("mkdir", "work", 0o755),
        ("chown", "work", 4242, 4242, True),
        ("mkdir", "sticky", 0o777),
        ("chmod", "sticky", 0o1777),
        ("mkdir", "open", 0o777),
        ("chmod", "open", 0o777),
        ("mkdir", "sgid", 0o775),
        ("chown", "sgid", 4242, 4243, True),
        ("chmod", "sgid", 0o2775),
        ("chown", "", -1, 4243, True),              # the mount's root itself
        ("chmod", "", 0o775),
    ]),
    (A, [
        ("create", "work/a", 0o644, "alpha"),
        ("create", "work/pub", 0o666, "public"),
        ("create", "work/pub_b", 0o666, "for b"),
        ("chmod", "work/pub", 0o666),               # the runner's umask is 022
        ("chmod", "work/pub_b", 0o666),
        ("create", "work/secret", 0o600, "secret"),
        ("create", "work/none", 0o000, "none"),
        ("read", "work/none"),                      # EACCES: the owner has no read bit
        ("write", "work/none", "x"),                # EACCES
        ("mkdir", "work/d", 0o750),
        ("create", "work/d/inner", 0o644, "in"),
        ("rmdir", "work/d"),                        # ENOTEMPTY
        ("symlink", "a", "work/l"),
        ("chmod", "work/a", 0o640),
        ("chown", "work/a", -1, 4243, True),        # chgrp to a supplementary group
        ("chown", "work/a", -1, 9999, True),        # EPERM: not one of A's groups
        ("chown", "work/a", 4343, -1, True),        # EPERM: only root gives away
        ("chown", "work/a", 4242, -1, True),        # chown to oneself: allowed
        ("chown", "work/l", -1, 4243, False),       # lchown of one's own symlink
        ("utime", "work/secret", T1, T2),           # explicit times by the owner
        ("mkfifo", "work/fifo", 0o644),
        ("fifo_roundtrip", "work/fifo"),
        ("mknod", "work/sock", S_IFSOCK | 0o640),
        ("bind", "work/bound"),
        ("mknod", "work/regular", stat.S_IFREG | 0o640),
        ("mknod", "work/chr", stat.S_IFCHR | 0o644),  # EPERM: no CAP_MKNOD
        ("create", "work/f", 0o644, "fa"),
        ("fallocate", "work/f", 0, 0, 1 << 20),     # mode 0: size becomes 1 MiB
        ("fallocate", "work/f", 0, 4096, 100),      # inside: size unchanged
        ("fallocate", "work/f", FALLOC_FL_KEEP_SIZE, 0, 2 << 20),
        ("link", "work/d", "work/d_link"),          # EPERM: directory
        ("link", "work/l", "work/l2"),              # a hard link of a symlink
        ("link", "work/fifo", "work/fifo2"),
        ("link", "work/missing", "work/m2"),        # ENOENT
        ("link", "work/a", "work/pub"),             # EEXIST
        ("create", "sticky/a_file", 0o644, "A's"),
        ("mkdir", "sticky/a_dir", 0o755),
        ("create", "open/a_open", 0o644, "open"),
        ("create", "sgid/a_in_sgid", 0o2755, "g"),  # group 4243 inherited, setgid kept
        ("mkdir", "sgid/a_sub", 0o755),             # group and setgid bit inherited
        ("chmod", "work/secret", 0o4755),           # setuid by the owner
        ("truncate", "work/pub_b", 3),
        ("create", "work/suidw", 0o666, "s"),
        ("chmod", "work/suidw", 0o6777),
    ]),
    (B, [
        ("read", "work/secret"),                    # 04755: others may read
        ("write", "work/secret", "no"),             # EACCES
        ("read", "work/a"),                         # EACCES: 0640, B not in 4243
        ("write", "work/a", "b"),                   # EACCES
        ("access", "work/a", 4),                    # EACCES
        ("read", "work/pub"),
        ("write", "work/pub", "+b"),                # 0666: allowed
        ("truncate", "work/a", 0),                  # EACCES
        ("truncate", "work/pub", 4),
        ("utime_now", "work/pub"),                  # "now" with write permission
        ("utime", "work/pub", T1, T2),              # EPERM: explicit times need the owner
        ("utime_now", "work/a"),                    # EACCES
        ("chmod", "work/pub", 0o600),               # EPERM
        ("chown", "work/pub", 4343, -1, True),      # EPERM
        ("chown", "work/pub", -1, 4343, True),      # EPERM: not the owner
        ("unlink", "sticky/a_file"),                # EPERM: sticky
        ("rename", "sticky/a_file", "sticky/b_name"),  # EPERM
        ("rmdir", "sticky/a_dir"),                  # EPERM
        ("rename", "sticky/a_dir", "sticky/b_dir"),    # EPERM
        ("create", "sticky/b_file", 0o644, "B's"),
        ("rename", "sticky/b_file", "sticky/b_moved"),
        ("create", "sticky/b_victim", 0o644, "v"),
        ("rename", "sticky/b_moved", "sticky/a_file"),  # EPERM: would replace A's file
        ("unlink", "open/a_open"),                  # allowed: not sticky
        ("mkdir", "work/b_dir", 0o755),             # EACCES: work is A's, 0755
        ("create", "work/b_file", 0o644, ""),       # EACCES
        ("unlink", "work/pub"),                     # EACCES
        ("rename", "work/pub", "open/stolen"),      # EACCES
        ("link", "work/pub_b", "open/pub_by_b"),    # allowed: B may read and write it
        ("link", "work/secret", "open/secret_by_b"),  # EPERM: protected_hardlinks
        ("listdir", "work"),
        ("listdir", "work/d"),                      # EACCES: 0750, B not in group
        ("create", "open/b_sgid", 0o2755, "x"),     # setgid dropped: B not in group 0
        ("mkfifo", "open/b_fifo", 0o600),
        ("chmod", "open/b_fifo", 0o640),
        ("fallocate", "work/pub", 0, 0, 10),        # allowed: open for writing
        ("write", "work/suidw", "+b"),              # a stranger's write clears setuid/setgid
    ]),
    (A, [
        ("unlink", "sticky/b_moved"),               # EPERM: B's file, root's sticky dir
        ("unlink", "sticky/a_file"),
        ("create", "work/linked", 0o644, "one"),
        ("link", "work/linked", "work/linked2"),
        ("write", "work/linked", "+a"),             # KNOWN: EMLINK on the mount
        ("unlink", "work/linked"),
        ("write", "work/linked2", "+again"),        # one link again: allowed
        ("unlink", "work/linked2"),
        ("link", "work/pub", "work/pub2"),
        ("chmod", "work/pub2", 0o664),              # one inode: both names change
        ("unlink", "work/pub2"),
        ("write", "work/pub", "+again"),
        ("rename", "work/a", "work/a_renamed"),
        ("truncate", "work/f", 100),
        ("utime", "work/f", T2, T1),
        ("rmdir", "sticky/a_dir"),
        ("utime", "open/b_fifo", T1, T1),           # EPERM: B's fifo
    ]),
    (ROOT, [
        ("chown", "work/secret", 4343, -1, True),   # root gives away; setuid cleared
        ("chown", "work/l", 4343, 4343, False),
        ("chown", "work/d", 4343, 4343, True),
        ("chown", "work/fifo", -1, 4243, True),
        ("unlink", "sticky/b_moved"),               # root may
        ("chmod", "work/none", 0o644),
        ("read", "work/none"),
        ("utime", "open/b_fifo", T2, T2),
        ("chown", "work/regular", 4343, 4343, True),
        ("chmod", "work/regular", 0o6750),
        ("chown", "work/regular", -1, 4242, True),  # setuid cleared, setgid (g+x) cleared
    ]),
]

# Errno differences documented in docs/SEMANTICS.md: (op, plain, mount).
KNOWN_DIFFERENCES = {
    (("write", "work/linked", "+a"), "0", "EMLINK"),
    (("fallocate", "work/f", FALLOC_FL_KEEP_SIZE, 0, 2 << 20), "0", "ENOTSUP"),  # EOPNOTSUPP
}
# Names whose times the sequence set explicitly (compared to the nanosecond).
TIMED = {"work/secret", "work/f", "open/b_fifo"}


def who_name(who):
    return "root" if who is None else f"uid {who[0]}"


def run_ops(who, root, ops, runner=RUNNER):
    cmd = [PY, runner, root]
    if who is not None:
        uid, gid, groups = who
        grp = [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
        cmd = ["setpriv", f"--reuid={uid}", f"--regid={gid}"] + grp + ["--"] + cmd
    r = subprocess.run(cmd, input=json.dumps(ops), capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(runner))
    if r.returncode != 0:
        raise RuntimeError(f"runner as {who_name(who)} failed: {r.stderr}")
    return json.loads(r.stdout)


def describe(root, skip=(".ckptfs",)):
    """relpath -> (type, mode, uid, gid, nlink, size or target, sha256, mtime?) of every
    name under root, as root sees it with lstat, and which names share an inode.
    Directory sizes and link counts are left out (see docs/SEMANTICS.md)."""
    st = os.lstat(root)
    groups = {}
    out = {".": {"mode": oct(stat.S_IMODE(st.st_mode)), "uid": st.st_uid, "gid": st.st_gid}}
    for dirpath, dirnames, filenames in os.walk(root):
        if dirpath == root:
            dirnames[:] = [d for d in dirnames if d not in skip]
        for n in sorted(dirnames + filenames):
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            kind = stat.S_IFMT(st.st_mode)
            d = {"type": oct(kind), "mode": oct(stat.S_IMODE(st.st_mode)), "uid": st.st_uid,
                 "gid": st.st_gid}
            if stat.S_ISREG(kind):
                with open(p, "rb") as f:
                    d["sha"] = hashlib.sha256(f.read()).hexdigest()[:16]
                d["size"] = st.st_size
            if stat.S_ISLNK(kind):
                d["target"] = os.readlink(p)
            if not stat.S_ISDIR(kind):
                d["nlink"] = st.st_nlink
            if rel in TIMED:
                d["mtime_ns"] = st.st_mtime_ns
            out[rel] = d
            if not stat.S_ISDIR(kind):
                groups.setdefault((st.st_dev, st.st_ino), []).append(rel)
    # Which names are one inode (tar, cp -a and rsync -H tell hard links by st_ino).
    out["hard links"] = sorted(sorted(g) for g in groups.values() if len(g) > 1)
    return out


def diff_trees(expected, got):
    problems = []
    for k in sorted(set(expected) | set(got)):
        if k not in got:
            problems.append(f"{k}: missing")
        elif k not in expected:
            problems.append(f"{k}: extra {got[k]}")
        elif expected[k] != got[k]:
            fields = {f: (expected[k].get(f), got[k].get(f))
                      for f in set(expected[k]) | set(got[k]) if expected[k].get(f) != got[k].get(f)}
            problems.append(f"{k}: {fields}")
    return problems


class MultiUserTest(harness.MountedTest):
    MOUNT_ARGS = ("-o", "allow_other")

    def setUp(self):
        if os.geteuid() != 0:
            self.skipTest("needs root (allow_other mount, setpriv)")
        if shutil.which("setpriv") is None:
            self.skipTest("needs setpriv (util-linux)")
        self.runner = harness.copy_for_others(self, RUNNER)["multiuser_ops.py"]
        self.m = self.mount(self.MOUNT_ARGS, start=False)
        os.chmod(self.m.root, 0o755)
        os.chmod(self.m.backing, 0o755)
        self.plain = os.path.join(self.m.root, "plain")
        os.mkdir(self.plain, 0o755)
        self.start_mount(self.m)

    def run_sequence(self, root):
        results = []
        for who, ops in SEQUENCE:
            got = run_ops(who, root, ops, self.runner)
            results.extend(zip([who_name(who)] * len(ops), ops, got))
        return results

    def test_same_errnos_owners_and_modes_as_a_plain_directory(self):
        with open("/proc/self/mountinfo") as f:
            line = next(l for l in f if l.split()[4] == os.path.realpath(self.m.mnt))
        self.assertIn("default_permissions", line)
        self.assertIn("allow_other", line)

        plain = self.run_sequence(self.plain)
        mnt = self.run_sequence(self.m.mnt)
        matched, differences = 0, []
        for (who, op, e_plain), (_, _, e_mnt) in zip(plain, mnt):
            if e_plain == e_mnt:
                matched += 1
            else:
                differences.append((tuple(op), e_plain, e_mnt, who))
        unexpected = [d for d in differences if d[:3] not in KNOWN_DIFFERENCES]
        sys.stderr.write(f"\n{type(self).__name__}: {matched} of {len(plain)} operations "
                         f"matched a plain directory; differences: {differences}\n")
        self.assertEqual(unexpected, [], "errno differs (op, plain, mount, who)")
        # Not vacuous: the sequence did meet every refusal it was written for.
        for refusal in ("EPERM", "EACCES", "ENOTEMPTY", "EEXIST", "ENOENT"):
            self.assertIn(refusal, {e for _, _, e in plain})

        expected = describe(self.plain)
        self.assertEqual(diff_trees(expected, describe(self.m.mnt)), [],
                         "mount (before publication) vs plain directory")

        rc = self.m.unmount(timeout=180)
        self.assertEqual(rc, 0, self.m.log_text()[-3000:])
        self.assertEqual(diff_trees(expected, describe(self.m.backing)), [],
                         "backing store after publication vs plain directory")

        self.m.start()
        self.assertEqual(diff_trees(expected, describe(self.m.mnt)), [],
                         "mount after a remount vs plain directory")


class StrictMultiUserTest(MultiUserTest):
    MOUNT_ARGS = ("-o", "allow_other", "--durability", "strict")


if __name__ == "__main__":
    unittest.main()
