"""The soak's torch 2.x side (issue 41): `dcp.async_save` trainers run in a cached Debian
root with torch 2.x (scripts/torch_root.sh sid) over the soak's own mounts.

The soak's work dir is made inside the root (its var/tmp) when a root is used, so every
mount point, the backing dir and the op logs are at the same path in the root as on the host
less the root's prefix, and a daemon restarted after a kill mounts again where the programs
in the root look (a bind mount of a mount point would keep the killed daemon's connection).
proc, sys and dev are mounted in the root for each job only, under the root's use lock that
the e2e tests take too (tests/e2e/torch_roots.py).
"""
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import time

from soaklib.util import (E2E, HANG_S, Job, harness, iter_name, now, read_text, reaper,
                          tracker_value)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
from torch_dcp_suite import RootMounts  # noqa: E402

REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
PROGRAMS = (os.path.join(HERE, "async_trainer.py"), os.path.join(E2E, "torch2_clients.py"))
PARENT = "async2"     # the torch 2.x trainer's directory in the mount (its own tracker)
KEEP = 2              # the trainer keeps its newest KEEP checkpoints


def find_root(choice):
    """(path of the root, why not): choice "off"; "auto" (the sid root when it is already
    built, never built here: minutes); "sid"/"trixie" (built if missing)."""
    if choice == "off":
        return None, "--torch2 off"
    cache = os.environ.get("CKPTFS_CACHE", "/var/cache/ckptfs")
    suite = "sid" if choice == "auto" else choice
    root = os.path.join(cache, f"torchroot-{suite}")
    if os.path.exists(os.path.join(root, ".ckptfs-torch-ready")):
        return root, None
    if choice == "auto":
        return None, (f"no torch 2.x root at {root} (scripts/torch_root.sh sid builds it, or "
                      f"--torch2 sid)")
    r = subprocess.run([os.path.join(REPO, "scripts", "torch_root.sh"), suite],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"torch_root.sh {suite} failed: {r.stderr.strip()[-300:]}"
    return r.stdout.strip().splitlines()[-1], None


class RootBusy(Exception):
    """Another user (an e2e test beside CI's soak) holds the root's mounts."""


class RootJob:
    """A program run in the root (chroot, its own process group), with Job's interface
    (soaklib/util.py): wait, kill, tail. Holds the root's mounts until killed. Raises
    RootBusy instead of waiting for the root's lock: a side job blocked there for the
    minutes a torch 2.x e2e test holds it would hold up the soak's pauses and its end."""

    def __init__(self, run, argv, tag):
        self.run = run
        self.root = run.torch2_root
        self.out = os.path.join(run.root, f"job-{tag}.out")
        self.lock = open(self.root + ".use.lock", "w")
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.lock.close()
            raise RootBusy(self.root) from None
        self.mounts = None
        self.tmp = None
        try:
            self.mounts = RootMounts(self.root).__enter__()
            self.tmp = tempfile.mkdtemp(prefix="ckptfs-soak-run-",
                                        dir=os.path.join(self.root, "tmp"))
            cmd = ["chroot", self.root, "env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
                   "HOME=/root", "LANG=C.UTF-8", "PYTHONWARNINGS=ignore",
                   "GLOO_SOCKET_IFNAME=lo",
                   f"TMPDIR={self.inside(self.tmp)}", f"PYTHONPATH={self.inside(run.progs)}",
                   "python3", os.path.join(self.inside(run.progs), "async_trainer.py"), *argv]
            with open(self.out, "wb") as fo:
                self.proc = subprocess.Popen(cmd, stdout=fo, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            self.release()
            raise
        reaper.register_pid(self.proc.pid)
        run.jobs.add(self)

    def inside(self, host_path):
        return "/" + os.path.relpath(host_path, self.root)

    wait = Job.wait

    def kill(self):
        """The whole group (the ranks and the checkpointer's helpers), then the mounts."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.run.jobs.discard(self)
        self.release()

    def release(self):
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        if self.mounts is not None:
            self.mounts.undo()
            self.mounts = None
        if self.lock is not None:
            self.lock.close()
            self.lock = None

    def tail(self, n=2500):
        return (read_text(self.out) or "")[-n:]


class Torch2:
    """Mixin of ModeRun: the torch 2.x async trainer as one of the side jobs, its checks
    at kills and at the end."""

    def torch2_setup(self):
        """Called by ModeRun before the work dir is made; the work dir goes in the root."""
        self.torch2_root, self.torch2_why = find_root(self.args.torch2)
        self.async2_ops = []           # the trainer's ops, in order, with the incarnation
        self.async2_off = 0
        self.async2_max_tracker = 0
        self.async2_verified = None    # the last checkpoint checked from the backing store
        return os.path.join(self.torch2_root, "var", "tmp") if self.torch2_root else None

    def torch2_ready(self):
        """Copies the programs into the work dir (in the root); says what is skipped."""
        if self.torch2_root is None:
            self.event("torch2 skipped", why=self.torch2_why)
            print(f"soak: the torch 2.x async_save trainer is skipped: {self.torch2_why}",
                  flush=True)
            return
        self.progs = os.path.join(self.root, "progs")
        os.makedirs(self.progs)
        for p in PROGRAMS:
            shutil.copy(p, self.progs)
        self.async2_oplog = os.path.join(self.root, "async2-ops.jsonl")

    def poll_async2(self):
        try:
            with open(self.async2_oplog) as f:
                f.seek(self.async2_off)
                data = f.read()
        except (FileNotFoundError, AttributeError):
            return
        end = data.rfind("\n")
        if end < 0:
            return
        self.async2_off += len(data[:end + 1].encode())
        with self.lock:
            for line in data[:end + 1].splitlines():
                o = json.loads(line)
                o["inc"] = self.inc
                self.async2_ops.append(o)
                if o["op"] == "saved":
                    self.counts["saves_async2"] += 1

    def async2_job(self, argv, tag):
        """The job, or None while another user holds the root (counted)."""
        try:
            return RootJob(self, argv, tag)
        except RootBusy:
            self.counts["async2_root_busy"] += 1
            return None

    def side_async2(self, n):
        if self.torch2_root is None:
            return
        d = os.path.join(self.mnt, PARENT)
        try:
            os.makedirs(d, exist_ok=True)
        except OSError:
            return
        t = tracker_value(d)
        if t == "" or (t is None and os.path.exists(os.path.join(d, "latest_checkpointed_"
                                                                    "iteration.txt"))):
            return   # a dead mount or the tracker mid-write: the next round
        start = (t if isinstance(t, int) else 0) + 1
        iters = self.rng.randint(2, 5)
        parents = self.mounts(PARENT) or [d]
        inside = lambda p: "/" + os.path.relpath(p, self.torch2_root)  # noqa: E731
        inc, faults = self.inc, self.faults_seen()
        self.counts["async2_jobs"] += 1
        argv = ["train", *[x for p in parents for x in ("--parent", inside(p))],
                "--start", str(start), "--iters", str(iters), "--keep", str(KEEP),
                "--oplog", inside(self.async2_oplog)]
        job = self.async2_job(argv, f"async2-{n}")
        if job is None:
            return
        rc = job.wait(timeout=HANG_S, stop=self.stop_ev)
        job.kill()
        self.poll_async2()
        if rc is None or self.stop_ev.is_set():
            if rc is None and not self.stop_ev.is_set():
                self.fail("hang: the torch 2.x async_save trainer", f"{HANG_S} s\n" + job.tail())
            return
        if rc != 0:
            if self.up.is_set() and not self.excused(inc, faults):
                self.fail("the torch 2.x async_save trainer failed with no daemon kill and "
                          "no fault injected", job.tail())
            else:
                self.counts["async2_failed_by_kill"] += 1
            return
        with self.lock:
            trackers = [o["iter"] for o in self.async2_ops if o["op"] == "tracker"]
        last = trackers[-1] if trackers else None
        if last is None:
            self.fail("the torch 2.x async_save trainer exited 0 with no tracker", job.tail())
            return
        # Once publication of async2/ caught up, the backing store's tracker names `last`:
        # in strict mode always (every write returned after it was published), in async
        # mode unless a kill or a fault since the trainer began may have lost its last
        # entries (a prefix of the application's history, G4). The checkpoint it names
        # loads exactly through the mounts (every rank its node's) and from the backing
        # store. Judged against the kills after the trainer ended (`inc2`): a trainer that
        # went on through a restarted daemon is checked too.
        inc2, faults2 = self.inc, self.faults_seen()
        r = subprocess.run([harness.ADMIN, "wait", d, "--timeout", "180"],
                           capture_output=True, text=True)
        if self.killed_since(inc2):
            return
        if r.returncode != 0:
            if self.up.is_set() and not self.excused(inc2, faults2):
                self.fail(f"ckptfs-admin wait {PARENT} -> {r.returncode} with no fault "
                          "injected", r.stdout + r.stderr)
            return
        backing_t = tracker_value(os.path.join(self.backing, PARENT))
        may_lag = self.mode == "async" and (self.inc != inc or self.faults_seen() > faults)
        if backing_t != last and not may_lag and not self.excused(inc2, faults2):
            self.fail("the torch 2.x trainer's tracker is not on the backing store after "
                      "ckptfs-admin wait", f"wrote {last}, backing {backing_t!r}")
            return
        if not isinstance(backing_t, int):
            return
        ck = iter_name(backing_t)
        if not self.async2_check([os.path.join(p, ck) for p in parents], backing_t, inc2,
                                 faults2, "through the mounts", f"async2-load{n}"):
            return
        if self.async2_check([os.path.join(self.backing, PARENT, ck)], backing_t, inc2,
                             faults2, "on the backing store", f"async2-verify{n}"):
            self.async2_verified = ck
            self.counts["async2_verified"] += 1

    def async2_check(self, dirs, seed, inc, faults, where, tag):
        inside = lambda p: "/" + os.path.relpath(p, self.torch2_root)  # noqa: E731
        argv = ["check", *[x for p in dirs for x in ("--dir", inside(p))], "--seed", str(seed)]
        job = self.async2_job(argv, tag)
        deadline = now() + 300
        while job is None and inc is None and now() < deadline:   # the final check waits
            time.sleep(1)
            job = self.async2_job(argv, tag)
        if job is None:
            if inc is None:
                self.event("torch2 final check skipped: the root stayed busy for 300 s")
            return False
        rc = job.wait(timeout=HANG_S, stop=None if inc is None else self.stop_ev)
        job.kill()
        if rc == 0:
            return True
        final = inc is None   # at the end, the daemons stopped: nothing excuses it
        if not final and (rc is None or self.stop_ev.is_set() or self.excused(inc, faults)):
            return False
        self.fail(f"the torch 2.x trainer's {iter_name(seed)} does not load exactly {where}",
                  job.tail())
        return False

    def async2_cheap_checks(self, context, strict):
        """At every kill and at the end, from the backing store alone: its tracker never goes
        back and names a checkpoint with its `.metadata`; strict: what returned is there."""
        if self.torch2_root is None:
            return
        parent = os.path.join(self.backing, PARENT)
        t = tracker_value(parent)
        if isinstance(t, int):
            if t < self.async2_max_tracker:
                self.fail("the torch 2.x trainer's tracker went backwards on the backing "
                          "store", f"{context}: {t} < {self.async2_max_tracker}")
            self.async2_max_tracker = max(self.async2_max_tracker, t)
            if not os.path.exists(os.path.join(parent, iter_name(t), ".metadata")) and \
                    tracker_value(parent) == t:
                self.fail("the torch 2.x trainer's tracker names a checkpoint with no "
                          ".metadata", f"{context}: tracker {t}")
        if not strict:
            return
        self.poll_async2()
        with self.lock:
            ops = list(self.async2_ops)
        trackers = [o["iter"] for o in ops if o["op"] == "tracker"]
        if trackers and t != "" and (not isinstance(t, int) or t < trackers[-1]):
            self.fail("strict: the torch 2.x trainer's tracker write returned and is not on "
                      "the backing store", f"{context}: returned {trackers[-1]}, backing {t!r}")
        # Per checkpoint, the application's last step that returned: a save (its future's
        # result) must be committed, an `rm -r` gone, unless held behind a given-up
        # checkpoint as the main trainer's (Checks.deletions_held).
        last = {}
        for o in ops:
            if o["op"] in ("save_begin", "saved", "rmtree_done"):
                last[o["iter"]] = o["op"]
        held = None
        for k, op in sorted(last.items()):
            where = os.path.join(parent, iter_name(k))
            if op == "saved" and not os.path.exists(os.path.join(where, ".metadata")):
                self.fail("strict: a torch 2.x async_save that returned (its future's "
                          "result) is not committed on the backing store",
                          f"{context}: {PARENT}/{iter_name(k)}")
            elif op == "rmtree_done" and os.path.exists(where):
                if held is None:
                    held = self.deletions_held()
                if held:
                    self.counts["rmtree_held_at_check"] += 1
                    continue
                self.fail("strict: the torch 2.x trainer's rm -r returned and is not on the "
                          "backing store", f"{context}: {PARENT}/{iter_name(k)} still there")

    def async2_final(self):
        """At the end (publication caught up, daemons stopped): the tracker's checkpoint loads
        exactly from the backing store."""
        if self.torch2_root is None:
            return
        t = tracker_value(os.path.join(self.backing, PARENT))
        if not isinstance(t, int):
            return
        if iter_name(t) != self.async2_verified:
            if self.async2_check([os.path.join(self.backing, PARENT, iter_name(t))], t, None,
                                 None, "on the backing store at the end", "async2-final"):
                self.counts["async2_verified"] += 1
