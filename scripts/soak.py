#!/usr/bin/env python3
"""A long, mixed run of ckptfs that breaks many things at once and checks everything (issue 41).

    scripts/soak.py --minutes 20 --seed 7 --modes async,strict --out /tmp/soak

For each durability mode in turn (the time split evenly), one daemon mounts a fresh backing
directory (the daemon's flushes go to disk directly, so a blkio throttle reaches them) and
these run at once, each drawing its choices from one seeded generator:
  * trainer: `dcp_tool train` on 2 gloo ranks (torch 1.13, /usr/bin/python3): DCP save of
    iter_N (seed N), then the Megatron tracker latest_checkpointed_iteration.txt; after a
    failure (a daemon kill) it starts again from the tracker it reads through the mount, in
    a layout (single_file_per_rank) drawn again;
  * rotator: on every new save it reads the tracker through the mount and `rm -r`s each
    iter_K with K <= tracker - KEEP (but not one a load is reading), while that save is in
    flight;
  * side jobs, one at a time: saves again and again into one directory ("resave"), the same
    into a directory removed and made again before each save ("recreate", as torch's
    test_load_with_different_shard_plan), a save whose rank is SIGKILLed mid-save
    ("torn/t_N"), and loads of the newest checkpoint the tracker names, through the mount;
  * traffic: small files written in one write() each, renamed, deleted, and an append-only
    log, in logs/;
  * a blkio write throttle on the daemon switched on (2-8 MiB/s) and off;
  * SIGKILL of the daemon at random moments (half of them just after the trainer finished a
    step), restarted at once on the same mountpoint, state and backing dirs. The last
    --quiet-frac of each mode runs without kills, so that one daemon lives long enough for
    the leak bound.

Invariants, from the backing directory alone (never through the mount):
  * every checkpoint the daemon reported committed (/.ckptfs/checkpoints) loads exactly
    (every value against its seed's state) unless the application began removing it first,
    and one reported committed before a kill still has its .metadata after the kill;
  * the tracker names a checkpoint whose .metadata is there and which loads, and it never
    goes backwards; a rotated checkpoint is gone or incomplete only once a tracker at least
    KEEP ahead of it is there (G4);
  * a save whose rank was killed never commits incomplete: if its .metadata is there, it
    loads exactly;
  * every checkpoint whose .metadata appears on the backing store is copied at once (most
    are rotated away within a second) and the copy loads exactly, unless the application
    had begun to remove or rewrite it before the copy was made;
  * nothing torn under a real name: every non-empty file in logs/ carries its own checksum,
    and the append log is always whole lines 0..k-1;
  * strict: every save, tracker and rm -r that returned before a kill is on the backing
    store after it;
  * after every restart, nothing is published twice: the files of a verified checkpoint the
    application did not touch since keep their inode, mtime and size;
  * a journal halt has a reason; none lasts 120 s (nothing here fails the store);
  * a clean stop exits 0, leaves no .ckptfs-tmp.* file, and the backing tree equals the
    mount's view file for file and byte for byte;
  * no job hangs (a trainer step, or a side job, that makes no progress for 300 s).
Resources, sampled every 2 s: daemon RSS, open fds (by kind), threads, state dir and log size
and the journal's backlog, plotted against saves done (OUT/soak-<mode>.png). While the store
is slower than the saves, fds and RSS follow the backlog; so the leak bound compares two
points where publication had caught up (the application held still between two saves,
`ckptfs-admin wait` on the mount): after the quiet daemon's first 50 saves and after the
run. Bound: RSS less resident staging, the retained tier and the block cache (each filled
on purpose up to its own budget, which stats report) within 10 %, fds at most +4, threads
at most +2, the state dir at most twice plus 64 MiB. A quiet phase with fewer than 50 saves
leaves the bound unchecked (the report says so).

OUT/soak.json holds the figures, every failure with the seed, mode and time, and the
events; exit status 0 only when every invariant held. Every process the soak starts is
killed by PID (a job and its ranks by their own process group), every mount, cgroup and
temporary directory removed, on failure and on Ctrl-C as well; a guardian (reaper.py) does
it if the soak itself is killed. Needs root (FUSE, blkio cgroups).
"""
import argparse
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
E2E = os.path.join(HERE, "..", "tests", "e2e")
sys.path.insert(0, E2E)

import dcp_tool  # noqa: E402
import harness  # noqa: E402
import netns  # noqa: E402
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
    chunks, the retained tier, the block cache."""
    return sum(stats.get(k, 0) or 0 for k in ("staging_resident", "retained_used",
                                               "cache_used"))


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


class ModeRun:
    """One durability mode: one backing dir, one daemon restarted after every kill."""

    def __init__(self, args, mode, seed, out_dir):
        self.args = args
        self.mode = mode
        self.seed = seed
        self.out_dir = out_dir
        self.rng = random.Random(f"{seed}/{mode}")
        self.root = tempfile.mkdtemp(prefix=f"ckptfs-soak-{mode}-")
        self.backing = os.path.join(self.root, "backing")
        self.mnt = os.path.join(self.root, "mnt")
        self.state = os.path.join(self.root, "state")
        self.oplog = os.path.join(self.root, "train-ops.jsonl")
        for d in (self.backing, self.mnt):
            os.makedirs(d)
        self.lock = threading.RLock()
        self.stop_ev = threading.Event()
        self.up = threading.Event()
        self.jobs = set()
        self.proc = None
        self.inc = 0               # daemon incarnation; +1 at every start
        self.t0 = now()
        self.failures = []
        self.events = []
        self.samples = []
        self.cgroup = None
        self.throttle_bps = 0
        # The application's model: per directory, its last operation and when (an event
        # number, increasing); mutating operations also bump `mut`.
        self.ev = 0
        self.dirs = {}             # name -> {"op", "mut", "seeds"}
        self.oplog_off = 0
        self.app_tracker = 0
        self.ops_before_kill = []  # trainer ops (strict checks)
        self.verified = {}         # name -> (metadata identity, file stats, ev at snapshot)
        self.reported = {}         # name -> ev when first reported committed
        self.reported_verified = set()
        self.failed_seen = set()
        self.seen_complete = {}    # name -> ev when its .metadata was seen on the backing
        self.snap_queue = []       # copies of complete checkpoints to verify
        self.snap_n = 0
        self.verified_ever = set()
        self.snaps = os.path.join(self.root, "snaps")
        os.makedirs(self.snaps)
        self.traffic_lock = threading.Lock()   # held by one traffic op; a restart waits
        self.paused = threading.Event()         # set: side jobs, traffic, rotation hold still
        self.side_idle = threading.Event()
        self.train_job = None
        self.loading = set()                    # checkpoints a load job reads: not rotated
        self.drained = {}                       # label -> resources once publication caught up
        self.rotated_unverified = set()
        self.max_backing_tracker = 0
        self.halt_since = None
        self.counts = {k: 0 for k in (
            "daemon_kills", "kills_after_step", "saves_train", "saves_resave", "saves_recreate",
            "torn_attempts", "torn_rank_kills", "torn_committed", "loads_mount",
            "loads_failed_by_kill",
            "verify_loads", "verify_bytes", "verify_inconclusive", "rotations", "checks",
            "restart_checks", "files_checked", "small_files", "renames", "appends", "deletes",
            "halts_seen", "throttle_switches", "train_restarts", "double_publish_checked")}
        self.down_s = []

    # ------------------------------------------------------------------ bookkeeping
    def t(self):
        return round(now() - self.t0, 2)

    def event(self, what, **kw):
        e = {"t": self.t(), "inc": self.inc, "what": what, **kw}
        with self.lock:
            self.events.append(e)
        if self.args.verbose:
            print(f"[{self.mode} {e['t']:8.1f}] {what} {kw if kw else ''}", flush=True)

    def fail(self, what, detail=""):
        f = {"t": self.t(), "mode": self.mode, "seed": self.seed, "inc": self.inc,
             "what": what, "detail": str(detail)[-4000:]}
        with self.lock:
            self.failures.append(f)
        print(f"[{self.mode} {f['t']:8.1f}] FAIL {what}\n{f['detail'][-1500:]}", flush=True)

    def app_op(self, name, op, seeds=None, mutates=True):
        with self.lock:
            self.ev += 1
            d = self.dirs.setdefault(name, {"op": None, "mut": 0, "done": 0, "begin": 0,
                                            "seeds": set()})
            d["op"] = op
            if mutates:
                d["mut"] = self.ev
            if op in DONE_OPS:
                d["done"] = self.ev
            if op in BEGIN_OPS:
                d["begin"] = self.ev
            if seeds is not None:
                d["seeds"] = set(seeds)
            return self.ev

    def mutated_since(self, name, ev):
        with self.lock:
            d = self.dirs.get(name)
            return d is not None and d["mut"] > ev

    def poll_oplog(self):
        """Reads the trainer's new (complete) op lines into the model."""
        with self.lock:
            try:
                with open(self.oplog) as f:
                    f.seek(self.oplog_off)
                    data = f.read()
            except FileNotFoundError:
                return
            end = data.rfind("\n")
            if end < 0:
                return
            self.oplog_off += len(data[:end + 1].encode())
            for line in data[:end + 1].splitlines():
                o = json.loads(line)
                n = o["iter"]
                o["inc"] = self.inc
                self.ops_before_kill.append(o)
                if o["op"] == "save_begin":
                    self.app_op(iter_name(n), "save_begin", seeds=[n])
                elif o["op"] == "saved":
                    self.app_op(iter_name(n), "saved", mutates=False)
                    self.counts["saves_train"] += 1
                elif o["op"] == "tracker":
                    self.app_tracker = n

    def saves_done(self):
        c = self.counts
        return c["saves_train"] + c["saves_resave"] + c["saves_recreate"]

    # ------------------------------------------------------------------ the daemon
    def start_daemon(self):
        self.inc += 1
        log = os.path.join(self.root, f"ckptfs.{self.inc}.log")
        cmd = [harness.CKPTFS, "-f", "--staging-mem", "128M", "--state-dir", self.state,
               "--log-file", log, "--log-level", "info", "--durability", self.mode,
               "--flush-direct-io", "on", self.backing, self.mnt]
        with open(os.path.join(self.root, f"ckptfs.{self.inc}.out"), "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        reaper.register_pid(self.proc.pid)
        deadline = now() + 60
        while now() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ckptfs exited {self.proc.returncode} at start:\n"
                                   f"{(read_text(log) or '')[-3000:]}")
            if harness.is_mounted(self.mnt) and os.path.exists(
                    os.path.join(self.mnt, ".ckptfs", "stats")):
                reaper.register_mount(self.mnt)
                break
            time.sleep(0.02)
        else:
            raise RuntimeError("ckptfs did not mount in 60 s:\n" + (read_text(log) or "")[-3000:])
        if self.cgroup:
            with open(os.path.join(self.cgroup, "cgroup.procs"), "w") as f:
                f.write(str(self.proc.pid))
        self.up.set()

    def kill_daemon(self):
        self.up.clear()
        p = self.proc
        if p is not None and p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        harness.unmount(self.mnt)

    def stats(self):
        try:
            with open(os.path.join(self.mnt, ".ckptfs", "stats")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def checkpoints(self):
        try:
            with open(os.path.join(self.mnt, ".ckptfs", "checkpoints")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def wait_up(self):
        while not self.stop_ev.is_set():
            if self.up.wait(0.5):
                return True
        return False

    def sleep(self, s):
        return self.stop_ev.wait(s)

    # ------------------------------------------------------------------ the workloads
    def trainer(self):
        while self.wait_up():
            inc = self.inc
            t = tracker_value(self.mnt)
            if t is None and os.path.exists(os.path.join(self.mnt, TRACKER)):
                self.sleep(0.5)        # a dead mount, read before up was cleared
                continue
            # '' is the state between the tracker's O_TRUNC and its write: the application
            # goes on after the last value it wrote.
            start = (t if isinstance(t, int) else self.app_tracker if t == "" else 0) + 1
            sfpr = self.rng.random() < 0.5
            self.counts["train_restarts"] += 1
            job = Job(self, "train", {
                "parent": self.mnt, "ranks": TRAIN_RANKS, "mb": self.args.mb,
                "start": start, "iters": 10 ** 7, "keep": 10 ** 9,
                "single_file_per_rank": sfpr, "oplog": self.oplog, "timeout": 10 ** 7},
                f"train{self.counts['train_restarts']}")
            self.train_job = job
            self.event("train_start", start=start, single_file_per_rank=sfpr)
            last_progress, seen = now(), self.oplog_off
            while True:
                rc = job.wait(timeout=1.0, stop=self.stop_ev)
                self.poll_oplog()
                if self.oplog_off != seen or inc != self.inc:
                    last_progress, seen = now(), self.oplog_off
                if rc is not None or self.stop_ev.is_set():
                    break
                if now() - last_progress > HANG_S and self.up.is_set():
                    self.fail("hang: the trainer made no progress", f"{HANG_S} s without an "
                              f"op; stats={self.stats()}\n{job.tail()}")
                    break
            job.kill()
            if self.stop_ev.is_set():
                return
            if rc not in (0, None) and self.inc == inc and self.up.is_set():
                self.fail("trainer failed with no daemon kill", job.tail())
                self.sleep(5)

    def rotator(self):
        seen_begin = 0
        while not self.stop_ev.is_set():
            self.sleep(0.2)
            with self.lock:
                begins = [o for o in self.ops_before_kill if o["op"] == "save_begin"]
            if len(begins) == seen_begin or not self.up.is_set() or self.paused.is_set():
                continue
            seen_begin = len(begins)
            t = tracker_value(self.mnt)
            if not isinstance(t, int):
                continue
            try:
                old = sorted(int(d[5:]) for d in os.listdir(self.mnt)
                             if d.startswith("iter_") and d[5:].isdigit())
            except OSError:
                continue
            for k in old:
                if k > t - KEEP:
                    break
                name = iter_name(k)
                if name in self.loading:
                    continue
                self.app_op(name, "rmtree_begin")
                try:
                    shutil.rmtree(os.path.join(self.mnt, name))
                    self.app_op(name, "rmtree_done")
                    self.counts["rotations"] += 1
                except OSError as e:
                    self.event("rmtree_error", dir=name, error=str(e))
                    break

    def side(self):
        n = 0
        while self.wait_up():
            self.side_idle.set()
            while self.paused.is_set() and not self.stop_ev.is_set():
                self.sleep(0.2)
            self.side_idle.clear()
            n += 1
            what = self.rng.choices(["resave", "recreate", "torn", "load"],
                                    weights=[2, 2, 3, 4])[0]
            try:
                getattr(self, "side_" + what)(n)
            except Exception as e:   # a bug in the soak, not in the daemon
                self.fail(f"side job {what} raised", repr(e))
            self.sleep(self.rng.uniform(0.5, 3.0))

    def side_resave(self, n, recreate=False):
        name = "recreate" if recreate else "resave"
        k = self.rng.randint(2, 4)
        seeds = [RESAVE_SEED0 + n * 10 + i for i in range(k)]
        plans = [PLANS[self.rng.randrange(len(PLANS))] for _ in range(k)]
        sfpr = self.rng.random() < 0.5
        d = os.path.join(self.mnt, name)
        inc = self.inc
        try:
            os.makedirs(d, exist_ok=True)
        except OSError:
            return
        self.app_op(name, "resave_begin", seeds=[seeds[-1]])
        job = Job(self, "resave", {"dir": d, "ranks": SIDE_RANKS, "seeds": seeds,
                                   "mbs": [1] * k, "single_file_per_rank": sfpr,
                                   "recreate": recreate, "dtypes_per_save": plans,
                                   "timeout": HANG_S}, f"{name}{n}")
        rc = job.wait(stop=self.stop_ev)
        job.kill()
        if rc is None or (rc != 0 and self.stop_ev.is_set()):   # the soak's own stop
            return
        if rc != 0:
            if self.inc == inc and self.up.is_set():
                self.fail(f"{name} failed with no daemon kill", job.tail())
            else:
                self.app_op(name, "resave_torn_by_kill")
            return
        self.counts["saves_" + name] += k
        self.app_op(name, "resave_done", mutates=False)
        # The application is done with the directory: once publication caught up, the
        # backing store holds its last save, and the daemon must call it committed.
        r = subprocess.run([harness.ADMIN, "wait", d, "--timeout", "180"],
                           capture_output=True, text=True)
        if self.inc != inc:
            return
        if r.returncode != 0:
            if self.up.is_set():
                self.fail(f"ckptfs-admin wait {name} -> {r.returncode}", r.stdout + r.stderr)
            return
        self.verify_dirs([name], {name: seeds[-1]}, reason=f"{name} after wait")

    def side_recreate(self, n):
        self.side_resave(n, recreate=True)

    def side_torn(self, n):
        name = f"torn/t_{n:06d}"
        seed = TORN_SEED0 + n
        try:
            os.makedirs(os.path.join(self.mnt, "torn"), exist_ok=True)
        except OSError:
            return
        self.app_op(name, "torn_begin", seeds=[seed])
        self.counts["torn_attempts"] += 1
        job = Job(self, "save", {"dir": os.path.join(self.mnt, name), "ranks": SIDE_RANKS,
                                 "mb": self.args.mb, "seed": seed,
                                 "single_file_per_rank": self.rng.random() < 0.5,
                                 "timeout": HANG_S}, f"torn{n}")
        victim = self.rng.randrange(SIDE_RANKS)
        delay = self.rng.uniform(1.0, 8.0)       # torch start-up is most of the first seconds
        if job.wait(timeout=delay, stop=self.stop_ev) is None and not self.stop_ev.is_set():
            kids = job.children()
            if len(kids) > victim:
                try:
                    os.kill(kids[victim], signal.SIGKILL)
                    self.counts["torn_rank_kills"] += 1
                except ProcessLookupError:
                    pass
        rc = job.wait(timeout=HANG_S, stop=self.stop_ev)
        job.kill()
        self.app_op(name, "torn_done", mutates=False)
        if rc == 0:
            self.counts["torn_committed"] += 1   # the kill came after the save returned
        # Keep the last 3 torn directories.
        try:
            old = sorted(x for x in os.listdir(os.path.join(self.mnt, "torn")))[:-3]
        except OSError:
            return
        for x in old:
            nm = "torn/" + x
            self.app_op(nm, "rmtree_begin")
            try:
                shutil.rmtree(os.path.join(self.mnt, nm))
                self.app_op(nm, "rmtree_done")
            except OSError:
                break

    def side_load(self, n):
        t = tracker_value(self.mnt)
        if not isinstance(t, int) or t == 0:
            return
        inc, name = self.inc, iter_name(t)
        # As a job loading its newest checkpoint would, nothing rotates it during the load.
        self.loading.add(name)
        try:
            self.load_one(n, t, name, inc)
        finally:
            self.loading.discard(name)

    def load_one(self, n, t, name, inc):
        with self.lock:
            ev = self.ev
        mode = self.rng.choice(["own", "reshard", "replicated"])
        job = Job(self, "load", {"dir": os.path.join(self.mnt, name), "ranks": SIDE_RANKS,
                                 "mode": mode, "seed": t, "timeout": HANG_S}, f"load{n}")
        rc = job.wait(stop=self.stop_ev)
        job.kill()
        if rc is None or self.stop_ev.is_set():   # the soak's own stop killed it
            return
        if rc == 0:
            self.counts["loads_mount"] += 1
        elif self.inc != inc or self.mutated_since(name, ev):
            self.counts["loads_failed_by_kill"] += 1
        else:
            self.fail(f"load of the tracker's {name} through the mount failed", job.tail())

    def traffic(self):
        logs = os.path.join(self.mnt, "logs")
        seq, next_file, inc = 0, 0, None
        while self.wait_up():
            if self.paused.is_set():
                self.sleep(0.2)
                continue
            try:
                with self.traffic_lock:
                    seq, next_file, inc = self.traffic_op(logs, seq, next_file, inc)
            except OSError:
                self.sleep(0.5)
            except ValueError as e:
                self.fail("the append log through the mount is not whole lines", repr(e))
                self.sleep(5)
            self.sleep(self.rng.uniform(0.02, 0.3))

    def traffic_op(self, logs, seq, next_file, inc):
        """One step of unrelated traffic; after a restart it first resyncs with the log."""
        if inc != self.inc:
            # After a restart the application sees what survived: continue the log
            # after its last whole line.
            os.makedirs(logs, exist_ok=True)
            try:
                with open(os.path.join(logs, "app.log")) as f:
                    lines = f.read().splitlines()
            except FileNotFoundError:
                lines = []
            seq = int(lines[-1].split()[0]) + 1 if lines else 0
            inc = self.inc
        r = self.rng.random()
        if r < 0.45:
            with open(os.path.join(logs, "app.log"), "a") as f:
                f.write(log_line(seq))
            seq += 1
            self.counts["appends"] += 1
        elif r < 0.8:
            name = f"f_{next_file:06d}"
            next_file += 1
            tmp = os.path.join(logs, name + ".tmp")
            fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            try:
                os.write(fd, small_file_bytes(name, self.rng))
            finally:
                os.close(fd)
            os.rename(tmp, os.path.join(logs, name + ".dat"))
            self.counts["small_files"] += 1
            self.counts["renames"] += 1
        else:
            dats = sorted(x for x in os.listdir(logs) if x.endswith(".dat"))
            if len(dats) > 40:
                os.unlink(os.path.join(logs, dats[self.rng.randrange(len(dats) - 10)]))
                self.counts["deletes"] += 1
        return seq, next_file, inc

    def throttler(self):
        while not self.stop_ev.is_set():
            if self.sleep(self.rng.uniform(5, 25)):
                return
            bps = 0 if self.throttle_bps else self.rng.choice([2, 4, 8]) << 20
            self.set_throttle(bps)

    def set_throttle(self, bps):
        if not self.cgroup:
            return
        with open(os.path.join(self.cgroup, "blkio.throttle.write_bps_device"), "w") as f:
            f.write(f"{netns.backing_disk(self.backing)} {bps}\n")
        self.throttle_bps = bps
        self.counts["throttle_switches"] += 1
        self.event("throttle", bps=bps)

    def sampler(self):
        while not self.stop_ev.is_set():
            p = self.proc
            if p is not None and p.poll() is None and self.up.is_set():
                try:
                    pid = p.pid
                    st = {}
                    with open(f"/proc/{pid}/status") as f:
                        for line in f:
                            k, _, v = line.partition(":")
                            st[k] = v.split()
                    s = {"t": self.t(), "inc": self.inc, "saves": self.saves_done(),
                         "rss_mb": int(st["VmRSS"][0]) / 1024, "threads": int(st["Threads"][0]),
                         "fds": len(os.listdir(f"/proc/{pid}/fd")),
                         "fd_kinds": fd_kinds(pid, self.root),
                         **self.stats_sample(),
                         "state_mb": dir_bytes(self.state) / 2 ** 20,
                         "log_mb": sum(os.path.getsize(os.path.join(self.root, x))
                                       for x in os.listdir(self.root)
                                       if x.startswith("ckptfs.")) / 2 ** 20}
                    with self.lock:
                        self.samples.append(s)
                except (OSError, KeyError, ValueError):
                    pass
            self.sleep(SAMPLE_S)

    def stats_sample(self):
        st = self.stats() or {}
        return {"journal_pending": st.get("journal_pending"),
                "held_mb": held_bytes(st) / 2 ** 20}

    # ------------------------------------------------------------------ checks
    def poll_reported(self):
        """Notes every checkpoint the daemon now calls committed; checks failed states."""
        cks = self.checkpoints()
        if cks is None:
            return set()
        committed = set()
        with self.lock:
            for c in cks:
                name, state = c.get("path"), c.get("state")
                d = self.dirs.get(name)
                if state == "committed":
                    committed.add(name)
                    # Counted from now when the application finished a save there since it
                    # was last seen committed (and is not in the middle of another one).
                    if d and d["op"] in DONE_OPS and d["done"] > self.reported.get(name, -1):
                        self.reported[name] = self.ev
                elif state == "failed" and name not in self.failed_seen:
                    # A daemon kill can lose a shard a still running rank had closed before
                    # it; its .metadata then waits for it and fails with a reason.
                    self.failed_seen.add(name)
                    self.event("checkpoint failed", path=name, error=c.get("error"))
                    if not str(c.get("error") or "").strip():
                        self.fail("a checkpoint failed without a reason", json.dumps(c))
        return committed

    def check_halt(self):
        st = self.stats()
        if st is None:
            return
        h = st.get("journal_halted")
        if not h:
            self.halt_since = None
            return
        if self.halt_since is None:
            self.halt_since = now()
            self.counts["halts_seen"] += 1
            self.event("halt", **h)
        if not str(h.get("error", "")).strip():
            self.fail("journal halted without a reason", json.dumps(h))
        elif now() - self.halt_since > HALT_S:
            self.fail(f"journal halted for over {HALT_S} s", json.dumps(h))
            self.halt_since = now() + 10 ** 6     # once

    def cheap_checks(self, context, strict_ops=None):
        """Stat-only checks of the backing dir (no torch); strict_ops: the trainer ops that
        returned before a kill, whose effects strict mode must have published."""
        self.counts["checks"] += 1
        # Tracker first, then the .metadata it names (published before it; removed only once
        # a tracker KEEP ahead is there).
        t = tracker_value(self.backing)
        if isinstance(t, int):
            if t < self.max_backing_tracker:
                self.fail("the tracker went backwards on the backing store",
                          f"{context}: {t} < {self.max_backing_tracker}")
            self.max_backing_tracker = max(self.max_backing_tracker, t)
            md = os.path.join(self.backing, iter_name(t), ".metadata")
            if not os.path.exists(md) and tracker_value(self.backing) == t:
                self.fail("the tracker names a checkpoint with no .metadata",
                          f"{context}: tracker {t}; {os.listdir(self.backing)}")
        # Deletions: listing first, then the tracker (only ever larger later).
        with self.lock:
            rotated = {n for n, d in self.dirs.items()
                       if n.startswith("iter_") and d["op"] in ("rmtree_begin", "rmtree_done")}
            seen = {n for n in rotated
                    if self.seen_complete.get(n, -1) > self.dirs[n]["begin"]}
        # Only a deletion is checked here, not a save a kill lost before publishing it.
        incomplete = {n for n in seen
                      if not os.path.exists(os.path.join(self.backing, n, ".metadata"))}
        t2 = tracker_value(self.backing)
        for n in sorted(incomplete):
            k = int(n[5:])
            if t2 != "" and (not isinstance(t2, int) or t2 < k + KEEP):
                with self.lock:
                    still = self.dirs[n]["op"] in ("rmtree_begin", "rmtree_done")
                if still:
                    self.fail("a rotated checkpoint is gone before the tracker KEEP ahead",
                              f"{context}: {n} incomplete/gone, tracker {t2!r}")
        # Committed before: still has its .metadata unless removed since.
        with self.lock:
            reported = dict(self.reported)
        for name, ev in reported.items():
            if self.mutated_since(name, ev) or name not in self.dirs:
                continue
            if not os.path.exists(os.path.join(self.backing, name, ".metadata")):
                self.fail("a checkpoint the daemon reported committed lost its .metadata",
                          f"{context}: {name}")
        self.check_logs(context)
        if strict_ops:
            self.check_strict(strict_ops, context)

    def check_logs(self, context):
        logs = os.path.join(self.backing, "logs")
        try:
            names = os.listdir(logs)
        except FileNotFoundError:
            return
        for x in names:
            if TMP_MARK in x:
                continue
            p = os.path.join(logs, x)
            try:
                with open(p, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                continue
            self.counts["files_checked"] += 1
            if x == "app.log":
                lines = data.split(b"\n")
                if lines[-1] != b"":
                    self.fail("torn append log on the backing store", f"{context}: last "
                              f"line {lines[-1][:60]!r} has no newline")
                for i, line in enumerate(lines[:-1]):
                    if line + b"\n" != log_line(i).encode():
                        self.fail("append log on the backing store is not lines 0..k-1",
                                  f"{context}: line {i} is {line[:60]!r}")
                        break
            elif data and not small_file_ok(data):
                self.fail("a torn small file under its real name", f"{context}: logs/{x}, "
                          f"{len(data)} bytes, head {data[:80]!r}")

    def check_strict(self, ops, context):
        last = {}
        for o in ops:
            last[o["iter"]] = o
        trackers = [o["iter"] for o in ops if o["op"] == "tracker"]
        t = tracker_value(self.backing)
        if trackers and t != "" and (not isinstance(t, int) or t < trackers[-1]):
            self.fail("strict: a tracker write that returned is not on the backing store",
                      f"{context}: returned {trackers[-1]}, backing {t!r}")
        for n, o in last.items():
            name = iter_name(n)
            with self.lock:
                cur = self.dirs.get(name, {}).get("op")
            if o["op"] == "saved" and cur == "saved" and not os.path.exists(
                    os.path.join(self.backing, name, ".metadata")):
                self.fail("strict: a save that returned is not committed on the backing store",
                          f"{context}: {name}")
        with self.lock:
            done = [n for n, d in self.dirs.items() if d["op"] == "rmtree_done"]
        for name in done:
            if os.path.exists(os.path.join(self.backing, name)):
                self.fail("strict: an rm -r that returned is not on the backing store",
                          f"{context}: {name} still there")

    def verify_dirs(self, names, seeds, reason, final=False):
        """Loads each of `names` from the backing dir (one rank, every value) and snapshots
        its files; a failure counts unless the application touched the directory meanwhile
        (then it is inconclusive). seeds[name]: the seed it must hold (None: its manifest's,
        which must be among the directory's allowed seeds)."""
        with self.lock:
            ev0 = self.ev
        before = {n: file_stats(os.path.join(self.backing, n)) for n in names}
        try:
            results = dcp_tool.verify([os.path.join(self.backing, n) for n in names],
                                      [seeds.get(n) for n in names], timeout=HANG_S)
        except dcp_tool.DcpToolError as e:
            self.fail("the verifier itself failed", str(e))
            return
        self.poll_oplog()
        for n, r in zip(names, results):
            after = file_stats(os.path.join(self.backing, n))
            touched = self.mutated_since(n, ev0) or before[n] != after
            with self.lock:
                allowed = self.dirs.get(n, {}).get("seeds", set())
            good = r["ok"] and (seeds.get(n) is not None or r["seed"] in allowed)
            if good and not touched:
                self.counts["verify_loads"] += 1
                self.counts["verify_bytes"] += r["bytes"]
                with self.lock:
                    self.verified[n] = (after.get(".metadata"), after, ev0)
                    if n in self.reported:
                        self.reported_verified.add(n)
                    self.verified_ever.add(n)
            elif touched and not final:
                self.counts["verify_inconclusive"] += 1
            elif not good:
                self.fail(f"a checkpoint does not load exactly from the backing store ({reason})",
                          f"{n}: seed {r['seed']} allowed {sorted(allowed)}: {r['errors'][:5]}")

    def verify_pending(self, final=False):
        """Verifies what is complete on the backing store and not verified as it is now."""
        names, seeds = [], {}
        with self.lock:
            dirs = dict((n, dict(d)) for n, d in self.dirs.items())
        for n, d in sorted(dirs.items()):
            if d["op"] not in ("saved", "torn_done", "resave_done"):
                continue
            if not final and d["op"] == "resave_done":
                continue          # verified by its own job once publication caught up
            md = os.path.join(self.backing, n, ".metadata")
            try:
                st = os.stat(md)
            except OSError:
                continue
            ident = (st.st_ino, st.st_mtime_ns, st.st_size)
            v = self.verified.get(n)
            if v is not None and v[0] == ident and not self.mutated_since(n, v[2]):
                continue
            names.append(n)
            seeds[n] = next(iter(d["seeds"])) if len(d["seeds"]) == 1 else None
        for i in range(0, len(names), 8):
            self.verify_dirs(names[i:i + 8], seeds, "final" if final else "running",
                             final=final)
        with self.lock:
            for n in self.reported:
                d = self.dirs.get(n)
                if n not in self.reported_verified and d and d["op"] in (
                        "rmtree_begin", "rmtree_done"):
                    self.rotated_unverified.add(n)

    def capturer(self):
        """Copies every checkpoint as soon as its .metadata is on the backing store, so that
        it can be verified after the rotation removed it (most live under a second). A copy
        is kept only when the application did not begin to remove or rewrite the directory
        before the copy was done: then no deletion was published meanwhile. (Not hard links:
        the daemon refuses to rewrite a file with several links, EMLINK.)"""
        while not self.stop_ev.is_set():
            self.sleep(0.1)
            self.poll_oplog()
            names = []
            try:
                names = [x for x in os.listdir(self.backing) if x.startswith("iter_")]
                names += ["torn/" + x for x in os.listdir(os.path.join(self.backing, "torn"))]
            except OSError:
                pass
            for name in names:
                with self.lock:
                    d = self.dirs.get(name)
                    if d is None or d["op"] not in ("saved", "torn_done") or \
                            self.seen_complete.get(name, -1) > d["begin"]:
                        continue
                    ev0, seeds = self.ev, set(d["seeds"])
                src = os.path.join(self.backing, name)
                # In async mode the backing store lags: after a re-save of the directory
                # (a restarted trainer, another layout) it can still hold the last save's
                # .metadata with some of the new save's shards, a state the application
                # passed through. Only the .metadata the application sees now, published,
                # proves its save is all there (G5).
                want = read_bytes(os.path.join(self.mnt, name, ".metadata"))
                if want is None or read_bytes(os.path.join(src, ".metadata")) != want:
                    continue
                self.snap_n += 1
                snap = os.path.join(self.snaps, f"{self.snap_n:07d}")
                os.makedirs(snap)
                stats = {}
                try:
                    for e in os.scandir(src):
                        if e.is_file(follow_symlinks=False) and TMP_MARK not in e.name:
                            st = e.stat(follow_symlinks=False)
                            shutil.copyfile(e.path, os.path.join(snap, e.name))
                            stats[e.name] = (st.st_ino, st.st_mtime_ns, st.st_size)
                    if file_stats(src) != stats:
                        stats = None     # published again while copied: the app's doing
                except OSError:
                    stats = None
                self.poll_oplog()
                if stats is None or self.mutated_since(name, ev0) or ".metadata" not in stats \
                        or read_bytes(os.path.join(snap, ".metadata")) != want:
                    shutil.rmtree(snap, ignore_errors=True)
                    continue
                with self.lock:
                    self.seen_complete[name] = ev0
                    self.snap_queue.append((name, snap, next(iter(seeds)), ev0, stats))

    def verify_snaps(self):
        """Loads the copied checkpoints (one torch start for up to 64)."""
        with self.lock:
            queue, self.snap_queue = self.snap_queue, []
        for i in range(0, len(queue), 64):
            batch = queue[i:i + 64]
            try:
                results = dcp_tool.verify([b[1] for b in batch], [b[2] for b in batch],
                                          timeout=HANG_S)
            except dcp_tool.DcpToolError as e:
                self.fail("the verifier itself failed", str(e))
                return
            for (name, snap, seed, ev0, stats), r in zip(batch, results):
                if not r["ok"]:
                    self.fail("a checkpoint committed on the backing store does not load "
                              "exactly", f"{name} (seed {seed}, copy {snap}): {r['errors'][:5]}")
                    continue
                self.counts["verify_loads"] += 1
                self.counts["verify_bytes"] += r["bytes"]
                with self.lock:
                    self.verified[name] = (stats.get(".metadata"), stats, ev0)
                    if name in self.reported:
                        self.reported_verified.add(name)
                    self.verified_ever.add(name)
                shutil.rmtree(snap, ignore_errors=True)

    def check_double_publish(self, context):
        """Files of verified checkpoints the application has not touched since keep their
        inode, mtime and size: nothing was published again."""
        with self.lock:
            snaps = dict(self.verified)
        for n, (_, files, ev) in snaps.items():
            if self.mutated_since(n, ev):
                continue
            now_files = file_stats(os.path.join(self.backing, n))
            self.poll_oplog()     # a save_begin is logged before its first file is made
            if self.mutated_since(n, ev):
                continue
            self.counts["double_publish_checked"] += 1
            if now_files != files:
                changed = sorted(k for k in set(files) | set(now_files or {})
                                 if files.get(k) != (now_files or {}).get(k))
                self.fail("a file of a committed checkpoint was published again (or lost) "
                          "though the application never touched it",
                          f"{context}: {n}: {changed[:6]} before "
                          f"{[files.get(k) for k in changed[:3]]}"
                          f" now {[(now_files or {}).get(k) for k in changed[:3]]}")

    def checker(self):
        while not self.stop_ev.is_set():
            if self.sleep(self.rng.uniform(5, 12)):
                return
            if not self.up.is_set():
                continue
            self.poll_oplog()
            self.poll_reported()
            self.check_halt()
            self.cheap_checks("periodic")
            self.verify_snaps()
            self.check_double_publish("periodic")

    # ------------------------------------------------------------------ the run
    def killer(self, until):
        while now() < until and not self.stop_ev.is_set():
            if self.sleep(self.rng.uniform(self.args.kill_min, self.args.kill_max)):
                return
            if now() >= until:
                return
            after_step = self.rng.random() < 0.5
            if after_step:
                seen = self.oplog_off
                deadline = now() + 15
                while now() < deadline:
                    self.poll_oplog()
                    if self.oplog_off != seen:
                        break
                    time.sleep(0.005)
            self.poll_oplog()
            self.poll_reported()
            with self.lock:
                ops = [o for o in self.ops_before_kill]
            t_kill = now()
            self.kill_daemon()
            self.counts["daemon_kills"] += 1
            # A traffic op in flight failed with the mount; the next one must see the restart.
            self.traffic_lock.acquire()
            self.counts["kills_after_step"] += after_step
            # The backing store stands still while no daemon runs: check it now.
            self.poll_oplog()
            self.cheap_checks(f"after kill {self.counts['daemon_kills']}",
                              strict_ops=ops if self.mode == "strict" else None)
            try:
                self.start_daemon()
            finally:
                self.traffic_lock.release()
            self.down_s.append(now() - t_kill)
            self.event("restart", kills=self.counts["daemon_kills"],
                       down_s=round(self.down_s[-1], 2))
            # Recovery done (or 5 s): nothing of a verified checkpoint published again.
            deadline = now() + 5
            while now() < deadline:
                s = self.stats()
                if s is not None and s.get("journal_pending", 1) == 0:
                    break
                time.sleep(0.2)
            self.counts["restart_checks"] += 1
            self.check_double_publish(f"after restart {self.counts['daemon_kills']}")

    def setup_cgroup(self):
        if not os.path.isdir("/sys/fs/cgroup/blkio"):
            self.event("no blkio cgroup: no slow store")
            return
        self.cgroup = f"/sys/fs/cgroup/blkio/ckptfs-soak-{os.getpid()}-{self.mode}"
        reaper.register("cgroup", self.cgroup)
        os.makedirs(self.cgroup, exist_ok=True)

    def run(self, seconds):
        print(f"== soak {self.mode}: {seconds / 60:.1f} min, seed {self.seed}, root "
              f"{self.root}", flush=True)
        self.setup_cgroup()
        self.start_daemon()
        threads = [threading.Thread(target=getattr(self, n), name=n, daemon=True)
                   for n in ("trainer", "rotator", "side", "traffic", "throttler", "sampler",
                             "capturer", "checker")]
        for th in threads:
            th.start()
        end = self.t0 + seconds
        quiet_at = end - seconds * self.args.quiet_frac
        self.quiet_inc = None
        try:
            self.killer(quiet_at)
            self.quiet_inc = self.inc
            s0 = self.saves_done()
            self.event("quiet phase: no more kills", saves=s0)
            while now() < end and not self.stop_ev.is_set():
                time.sleep(0.5)
                if "base" not in self.drained and self.saves_done() - s0 >= 50:
                    self.drained_sample("base")
        finally:
            self.stop_ev.set()
            for job in list(self.jobs):
                job.kill()
            for th in threads:
                th.join(timeout=60)
        self.finish()

    def finish(self):
        """Clean stop and the final checks."""
        self.set_throttle(0)
        self.poll_oplog()
        self.poll_reported()
        self.check_halt()
        view = None
        if self.up.is_set():
            r = subprocess.run([harness.ADMIN, "wait", self.mnt, "--timeout", "300"],
                               capture_output=True, text=True)
            if r.returncode != 0:
                self.fail("publication did not catch up at the end", r.stdout + r.stderr)
            self.poll_reported()
            self.resources("end")
            view = tree(self.mnt)
        subprocess.run(["fusermount3", "-u", self.mnt], capture_output=True)
        try:
            rc = self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            rc = "timeout"
            self.kill_daemon()
        self.up.clear()
        log = read_text(os.path.join(self.root, f"ckptfs.{self.inc}.log")) or ""
        if rc != 0:
            self.fail("the daemon did not exit 0 on a clean unmount", f"rc {rc}\n{log[-3000:]}")
        temps = harness.tmp_names(self.backing)
        if temps:
            self.fail("temp files left after a clean stop", temps[:20])
        if view is not None:
            backing = tree(self.backing)
            if backing[1] != view[1] or backing[0] != view[0]:
                diff = sorted(k for k in set(backing[0]) | set(view[0])
                              if backing[0].get(k) != view[0].get(k))
                self.fail("after a clean stop the backing tree differs from the mount's view",
                          f"files {diff[:20]} dirs {sorted(backing[1] ^ view[1])[:20]}")
        self.cheap_checks("final")
        self.check_double_publish("final")
        self.verify_snaps()
        self.verify_pending(final=True)
        t = tracker_value(self.backing)
        if isinstance(t, int) and iter_name(t) not in self.verified:
            self.fail("the final tracker's checkpoint was not verified", iter_name(t))
        self.leak_check()

    def resources(self, label):
        """The daemon's resources now (publication caught up), under `label`."""
        pid = self.proc.pid
        st = {}
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                st[k] = v.split()
        stats = self.stats() or {}
        rss_mb = int(st["VmRSS"][0]) / 1024
        # Memory the daemon budgets and fills on purpose: staging chunks pinned on first use
        # and kept (--staging-mem), the retained tier (--retain-mem, half the staging by
        # default) and the block cache. What is left is what must not grow.
        held_mb = held_bytes(stats) / 2 ** 20
        self.drained[label] = {"t": self.t(), "saves": self.saves_done(),
                               "rss_mb": round(rss_mb, 1),
                               "retained_mb": round(stats.get("retained_used", 0) / 2 ** 20, 1),
                               "cache_mb": round(stats.get("cache_used", 0) / 2 ** 20, 1),
                               "staging_mb": round(stats.get("staging_resident", 0) / 2 ** 20,
                                                   1),
                               "rss_other_mb": round(rss_mb - held_mb, 1),
                               "threads": int(st["Threads"][0]),
                               "fds": len(os.listdir(f"/proc/{pid}/fd")),
                               "fd_kinds": fd_kinds(pid, self.root),
                               "state_mb": round(dir_bytes(self.state) / 2 ** 20, 2)}
        self.event("drained sample", label=label, **self.drained[label])

    def drained_sample(self, label):
        """Holds the application still between two saves, lets publication catch up, and
        records the daemon's resources: what a leak would raise from one such point to the
        next (samples taken while a backlog is being published measure the backlog)."""
        self.paused.set()
        stopped = None
        try:
            self.side_idle.wait(120)
            job = self.train_job
            if job is not None and job.proc.poll() is None:
                # Right after the tracker op the trainer holds no file open in the mount.
                seen = len([o for o in self.ops_before_kill if o["op"] == "tracker"])
                deadline = now() + 60
                while now() < deadline:
                    self.poll_oplog()
                    if len([o for o in self.ops_before_kill if o["op"] == "tracker"]) > seen:
                        break
                    time.sleep(0.002)
                os.killpg(job.proc.pid, signal.SIGSTOP)
                stopped = job
            r = subprocess.run([harness.ADMIN, "wait", self.mnt, "--timeout", "120"],
                               capture_output=True, text=True)
            if r.returncode == 0:
                self.resources(label)
            else:
                self.event("drain for a sample failed", label=label, out=r.stdout + r.stderr)
        finally:
            if stopped is not None:
                try:
                    os.killpg(stopped.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            self.paused.clear()

    def leak_check(self):
        """The quiet daemon's resources after its first 50 saves and after the run, both
        once publication caught up: RSS less what resident staging, the retained tier and the
        block cache hold (bounded by their own budgets) within 10 %, fds +4, threads +2,
        state dir at most twice plus 64 MiB."""
        self.leak = {"checked": False}
        base, end = self.drained.get("base"), self.drained.get("end")
        if base is None or end is None:
            self.leak["why"] = ("the quiet phase did not reach 50 saves" if base is None
                                else "no clean end")
            return
        between = end["saves"] - base["saves"]
        if between < 50:
            # Growth over a few dozen saves is the allocator's and the async backlog's
            # warm-up, not a leak (the 3-minute CI form often gets there): the bound is
            # judged over at least 50 saves, as issue 41 states it (after 50 vs after 1,000).
            self.leak.update(why=f"only {between} saves between the drained samples (< 50)",
                             base=base, end=end)
            return
        self.leak.update(checked=True, saves_between=between, base=base, end=end)
        if end["rss_other_mb"] > base["rss_other_mb"] * 1.10:
            self.fail("leak: daemon RSS (less staging, retained tier and block cache) grew "
                      "more than 10 %", json.dumps(self.leak))
        if end["fds"] > base["fds"] + 4:
            self.fail("leak: open fds grew", json.dumps(self.leak))
        if end["threads"] > base["threads"] + 2:
            self.fail("leak: threads grew", json.dumps(self.leak))
        if end["state_mb"] > 2 * base["state_mb"] + 64:
            self.fail("leak: the state dir grew", json.dumps(self.leak))

    def cleanup(self, keep):
        self.stop_ev.set()
        for job in list(self.jobs):
            job.kill()
        try:
            self.kill_daemon()
        except Exception:
            pass
        if self.cgroup:
            netns.remove_cgroup(self.cgroup)
        if not keep:
            shutil.rmtree(self.root, ignore_errors=True)

    def report(self):
        kills_per_min = self.counts["daemon_kills"] / max(1e-9, self.t() / 60)
        return {"mode": self.mode, "seed": self.seed, "seconds": self.t(), "root": self.root,
                "counts": self.counts, "kills_per_min": round(kills_per_min, 2),
                "reported_committed": len(self.reported),
                "reported_committed_verified": len(self.reported_verified),
                "checkpoints_verified": len(self.verified_ever),
                "reported_committed_rotated_before_verify": len(self.rotated_unverified),
                "down_s_max": round(max(self.down_s), 2) if self.down_s else None,
                "down_s_mean": round(sum(self.down_s) / len(self.down_s), 2)
                if self.down_s else None,
                "leak": getattr(self, "leak", None), "failures": self.failures,
                "samples": self.samples, "events": self.events}


def plot(rep, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ss = rep["samples"]
    if not ss:
        return False
    fig, axes = plt.subplots(5, 1, figsize=(10, 12), sharex=True)
    x = [s["saves"] for s in ss]
    for ax, key, label in zip(axes, ("rss_mb", "fds", "threads", "state_mb", "log_mb"),
                              ("daemon RSS (MiB)", "open fds", "threads", "state dir (MiB)",
                               "logs (MiB)")):
        ax.plot(x, [s[key] for s in ss], ".", markersize=2)
        if key == "rss_mb":
            ax.plot(x, [s["rss_mb"] - s.get("held_mb", 0) for s in ss], ".", markersize=2,
                    label="less staging, retained tier, block cache")
            ax.legend(loc="upper left", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    kills = [e for e in rep["events"] if e["what"] == "restart"]
    # Each restart, at the saves done then (the nearest sample).
    for e in kills:
        near = min(ss, key=lambda s: abs(s["t"] - e["t"]))
        for ax in axes:
            ax.axvline(near["saves"], color="red", alpha=0.15, linewidth=0.6)
    axes[-1].set_xlabel("saves done (red: a daemon SIGKILL and restart)")
    c = rep["counts"]
    fig.suptitle(f"ckptfs soak, {rep['mode']}, seed {rep['seed']}: {c['daemon_kills']} kills, "
                 f"{c['saves_train'] + c['saves_resave'] + c['saves_recreate']} saves, "
                 f"{len(rep['failures'])} failures")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10, help="total, split over the modes")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--modes", default="async,strict")
    ap.add_argument("--nodes", type=int, choices=(1, 2), default=1)
    ap.add_argument("--out", default=None, help="report dir (default: a new temp dir)")
    ap.add_argument("--mb", type=int, default=2, help="checkpoint size of the trainer (MiB)")
    ap.add_argument("--kill-min", type=float, default=5, help="seconds between kills, at least")
    ap.add_argument("--kill-max", type=float, default=30, help="seconds between kills, at most")
    ap.add_argument("--quiet-frac", type=float, default=0.3,
                    help="last fraction of each mode without kills (the leak bound)")
    ap.add_argument("--keep", action="store_true", help="keep the work dirs even on success")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    if a.nodes != 1:
        print("soak.py: --nodes 2 is not implemented yet (see docs/RELIABILITY.md)",
              file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("soak.py: needs root (FUSE mounts, blkio cgroups)", file=sys.stderr)
        return 2
    if not os.access(harness.CKPTFS, os.X_OK):
        print(f"soak.py: no daemon at {harness.CKPTFS} (CKPTFS_BIN_DIR)", file=sys.stderr)
        return 2
    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    modes = [m for m in a.modes.split(",") if m]
    out = a.out or tempfile.mkdtemp(prefix="ckptfs-soak-out-")
    os.makedirs(out, exist_ok=True)
    print(f"soak: seed {seed}, modes {modes}, {a.minutes} min, report in {out}", flush=True)
    reaper.start_guardian()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    reports, ok = [], True
    for mode in modes:
        run = ModeRun(a, mode, seed, out)
        try:
            run.run(a.minutes * 60 / len(modes))
        except BaseException as e:
            run.fail("the soak was interrupted or raised", repr(e))
            if not isinstance(e, Exception):
                run.cleanup(keep=True)
                reports.append(run.report())
                break
        finally:
            run.cleanup(keep=a.keep or bool(run.failures))
        rep = run.report()
        reports.append(rep)
        ok = ok and not rep["failures"]
        plot(rep, os.path.join(out, f"soak-{mode}.png"))
        c = rep["counts"]
        print(f"== {mode}: {c['daemon_kills']} daemon kills, "
              f"{c['saves_train']} train saves, {c['saves_resave']} + {c['saves_recreate']} "
              f"re-saves, {c['rotations']} rotations, {c['torn_rank_kills']} rank kills, "
              f"{c['loads_mount']} loads, {c['verify_loads']} verified loads, "
              f"{len(rep['failures'])} failures; leak {rep['leak']}", flush=True)
    ok = ok and all(not r["failures"] for r in reports) and len(reports) == len(modes)
    with open(os.path.join(out, "soak.json"), "w") as f:
        json.dump({"seed": seed, "minutes": a.minutes, "modes": modes, "ok": ok,
                   "argv": sys.argv, "runs": reports}, f, indent=1)
    print(f"soak: {'PASS' if ok else 'FAIL'}, seed {seed}; report {out}/soak.json", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
