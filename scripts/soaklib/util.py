"""The soak's constants, helpers and the Job class (scripts/soak.py, issue 41)."""
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
E2E = os.path.join(HERE, "..", "..", "tests", "e2e")
sys.path.insert(0, E2E)

import dcp_tool  # noqa: E402
import harness  # noqa: E402
import netns  # noqa: E402
import reaper  # noqa: E402

import reaper  # noqa: E402

KEEP = 3                  # the rotator keeps the newest KEEP checkpoints
TRAIN_RANKS = 2
SIDE_RANKS = 2
HANG_S = 300              # a job with no progress this long is a hang
HALT_S = 120              # a journal halt this long is a failure (no fault is injected)
SAMPLE_S = 2.0
TRACKER = dcp_tool.TRACKER
TMP_MARK = harness.TMP_PREFIX
PLANS = [("float32", "int64", "bool"), ("bfloat16",), ("float32", "float16", "int8", "bool"),
         ("int64", "int8")]
TORN_SEED0 = 20_000_000
DONE_OPS = ("saved", "resave_done", "torn_done")   # the application is done with the dir
BEGIN_OPS = ("save_begin", "resave_begin", "torn_begin")
RESAVE_SEED0 = 10_000_000

# Runs one dcp_tool function in a child: SIGTERM unwinds through dcp_tool's finally, which
# kills its ranks by PID; the soak also kills the child's whole process group.
RUNNER = r"""
import json, signal, sys
sys.path.insert(0, sys.argv[1])
import dcp_tool
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
fn, kw = json.loads(sys.argv[2])
try:
    out = getattr(dcp_tool, fn)(**kw)
except dcp_tool.DcpToolError as e:
    print(str(e)[-3000:], file=sys.stderr)
    sys.exit(1)
print(json.dumps(out))
"""


def now():
    return time.monotonic()


def read_text(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def read_bytes(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def tracker_value(parent):
    """int, '' (between the tracker's O_TRUNC and its write) or None (absent / unreadable)."""
    t = read_text(os.path.join(parent, TRACKER))
    if t is None:
        return None
    t = t.strip()
    return int(t) if t.isdigit() else ""


def iter_name(n):
    return f"iter_{n:07d}"


def file_stats(d):
    """{name: (ino, mtime_ns, size)} of the files directly in d; None when d is gone."""
    try:
        out = {}
        for e in os.scandir(d):
            if e.is_file(follow_symlinks=False) and TMP_MARK not in e.name:
                st = e.stat(follow_symlinks=False)
                out[e.name] = (st.st_ino, st.st_mtime_ns, st.st_size)
        return out
    except OSError:
        return None


def dir_bytes(d):
    total = 0
    for root, _, files in os.walk(d):
        for n in files:
            try:
                total += os.lstat(os.path.join(root, n)).st_size
            except OSError:
                pass
    return total


def fd_kinds(pid, root):
    """{kind: count} of a process's open fds: pipe, socket, anon_inode, backing (files
    under the work dir, "deleted" when unlinked), state, other."""
    kinds = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            t = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if t.startswith(root):
            k = t[len(root):].lstrip("/").split("/")[0]
            k = k + (" deleted" if t.endswith("(deleted)") else "")
        else:
            k = t.split(":")[0] if ":" in t else "other"
        kinds[k] = kinds.get(k, 0) + 1
    return kinds


def held_bytes(stats):
    """Memory the daemon fills on purpose up to a budget of its own: resident staging
    chunks, the retained tier, the block cache (its buffers and its index), the state db's memtables and block cache
    (a memtable fills with every record until it is flushed at 2 MiB: up to 4 MiB of
    swing between two samples, 10 % of the rest; the 60-minute soak of stop 53, async,
    heap in use 10.8 -> 13.3 MiB over 1,833 quiet saves)."""
    return sum(stats.get(k, 0) or 0 for k in ("staging_resident", "retained_used",
                                               "cache_used", "cache_index",
                                               "state_db_memory"))


def tree(d):
    """{relative path: sha256} of files and the set of directories under d, /.ckptfs aside."""
    files, dirs = {}, set()
    for root, ds, fs in os.walk(d):
        if root == d and ".ckptfs" in ds:
            ds.remove(".ckptfs")
        for x in ds:
            dirs.add(os.path.relpath(os.path.join(root, x), d))
        for x in fs:
            p = os.path.join(root, x)
            files[os.path.relpath(p, d)] = harness.sha256_file(p)
    return files, dirs


def small_file_bytes(name, rng):
    payload = rng.randbytes(rng.randrange(0, 64 << 10))
    head = f"SOAK {name} {len(payload)} {hashlib.sha256(payload).hexdigest()}\n".encode()
    return head + payload


def small_file_ok(data):
    """A small file is whole: its header's length and sha256 match the payload."""
    nl = data.find(b"\n")
    if nl < 0:
        return False
    parts = data[:nl].split()
    if len(parts) != 4 or parts[0] != b"SOAK":
        return False
    payload = data[nl + 1:]
    return len(payload) == int(parts[2]) and hashlib.sha256(payload).hexdigest() == \
        parts[3].decode()


def log_line(seq):
    return f"{seq:08d} {hashlib.sha256(str(seq).encode()).hexdigest()[:16]}\n"


class Job:
    """A child process in its own process group (a dcp_tool run and its ranks)."""

    def __init__(self, run, fn, kw, tag):
        self.run = run
        self.out = os.path.join(run.root, f"job-{tag}.out")
        self.err = os.path.join(run.root, f"job-{tag}.err")
        with open(self.out, "wb") as fo, open(self.err, "wb") as fe:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", RUNNER, E2E, json.dumps([fn, kw])],
                stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, start_new_session=True,
                env=dcp_tool.child_env())
        reaper.register_pid(self.proc.pid)
        run.jobs.add(self)

    def wait(self, timeout=None, stop=None):
        """Exit code, or None when `stop` was set or `timeout` passed first."""
        deadline = None if timeout is None else now() + timeout
        while self.proc.poll() is None:
            if (stop is not None and stop.is_set()) or (deadline and now() > deadline):
                return None
            time.sleep(0.1)
        return self.proc.returncode

    def children(self):
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                return [int(x) for x in f.read().split()]
        except OSError:
            return []

    def kill(self):
        """SIGTERM (dcp_tool kills its ranks), then SIGKILL to the whole process group."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=15)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # its ranks, if any remain
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.run.jobs.discard(self)

    def tail(self, n=2500):
        return (read_text(self.err) or "")[-n:]


def daemon_options(binary, names):
    """Which of `names` (e.g. "--journal-trace") the daemon at `binary` takes: its option
    table's strings are in the binary, hidden options too. So the soak can run an older
    daemon (issue 41: it must find the regression on 3759c3f, which predates the fault layer
    and the journal trace) and say what it could not check, instead of failing to start it."""
    try:
        with open(binary, "rb") as f:
            data = f.read()
    except OSError:
        return set()
    return {n for n in names if n.encode() + b"\0" in data}


def journal_trace_check(path):
    """Reads a daemon's --journal-trace (store/publish/journal_trace.h) over all its runs:
    ({"runs", "done", "resumed", "discarded"}, [violations]). A run's lines follow its
    `start`; the recovery lines of a run come before its `start` and are judged against
    the run before: an entry resumed or discarded there must not have been done (its record
    was removed first), and no entry is applied twice in one run."""
    counts = {"runs": 0, "done": 0, "resumed": 0, "discarded": 0}
    bad = []
    try:
        with open(path, errors="replace") as f:
            lines = f.read().split("\n")
    except OSError:
        return counts, bad
    if lines and lines[-1] != "":
        lines = lines[:-1]   # a line cut by a SIGKILL
    done = {}       # seq -> line, the current run
    before = {}     # the run before, for the recovery lines of the next one
    epoch = None
    for line in lines:
        parts = line.split(" ", 4)
        if not parts or not parts[0]:
            continue
        kind = parts[0]
        if kind == "start" and len(parts) >= 2:
            before, done, epoch = done, {}, parts[1]
            counts["runs"] += 1
        elif kind in ("resume", "discard") and len(parts) >= 3:
            counts["resumed" if kind == "resume" else "discarded"] += 1
            seq = int(parts[1])
            if seq in done:   # judged against the last run (the one that left it)
                bad.append(f"run {epoch}: #{seq} was done ({done[seq]}), then {line!r} at "
                           "the next start")
        elif kind == "done" and len(parts) >= 4:
            counts["done"] += 1
            seq = int(parts[1])
            # Applied twice is publishing twice. An entry an abort dropped, whose place
            # and number the withdrawal of its save's `.metadata` took (journal_halt.cc:
            # `publish 0`, then `unlink 1` of the `.metadata`; the short soak, seed 4101),
            # is not.
            if seq in done and parts[3] == "1" and done[seq].split(" ")[3] == "1":
                bad.append(f"run {epoch}: #{seq} applied twice: {done[seq]!r}, {line!r}")
            elif seq in done:
                counts["renumbered"] = counts.get("renumbered", 0) + 1
            if seq not in done or parts[3] == "1":
                done[seq] = line
    return counts, bad
