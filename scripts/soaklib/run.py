"""One durability mode of the soak: its daemon(s), its threads, its checks, its report."""
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

from soaklib.util import *  # noqa: F401,F403
from soaklib.util import dcp_tool, harness, netns, reaper  # noqa: F401

from soaklib.checks import Checks
from soaklib.nodes import make_daemons
from soaklib.torch2 import Torch2
from soaklib.workloads import Workloads


def fuse_workers(pid):
    """The daemon's FUSE loop workers (threads named ckptfs-fuse)."""
    n = 0
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{t}/comm") as f:
                    n += f.read().strip() == "ckptfs-fuse"
            except OSError:
                pass
    except OSError:
        pass
    return n


class ModeRun(Workloads, Checks, Torch2):
    """One durability mode: one backing dir, its daemon(s) restarted after every kill."""

    def __init__(self, args, mode, seed, out_dir, nodes=1):
        self.args = args
        self.mode = mode
        self.nodes = nodes
        self.seed = seed
        self.out_dir = out_dir
        self.rng = random.Random(f"{seed}/{mode}" + (f"/{nodes}n" if nodes > 1 else ""))
        # With a torch 2.x root, the work dir is inside it (soaklib/torch2.py).
        self.counts = {}
        self.root = tempfile.mkdtemp(prefix=f"ckptfs-soak-{mode}-{nodes}n-",
                                     dir=self.torch2_setup())
        self.backing = os.path.join(self.root, "backing")
        self.oplog = os.path.join(self.root, "train-ops.jsonl")
        os.makedirs(self.backing)
        self.cluster = None
        self.faults_on = args.faults != "none"
        self.faults_before = 0     # injected by the incarnations that are gone
        self.aborted = {}          # path -> t: what the operator aborted
        self.daemons = make_daemons(self)
        # Node 0's mount is the application's: tracker, rotation, side jobs, traffic.
        self.mnt = self.daemons[0].mnt
        self.state = self.daemons[0].state
        self.lock = threading.RLock()
        self.stop_ev = threading.Event()
        self.up = threading.Event()
        self.jobs = set()
        self.inc = 0               # daemon incarnations of all nodes; +1 at every start
        self.restarting = False    # a node killed and not serving again yet (restart())
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
        self.rotating = set()                   # checkpoints the rotation is removing
        self.drained = {}                       # label -> resources once publication caught up
        self.rotated_unverified = set()
        self.max_backing_tracker = 0
        self.halt_since = {}           # node -> (first seen, seq, abort delay)
        self.counts.update({k: 0 for k in (
            "daemon_kills", "kills_after_step", "saves_train", "saves_resave", "saves_recreate",
            "torn_attempts", "torn_rank_kills", "torn_committed", "loads_mount",
            "loads_failed_by_kill", "loads_unpublished", "loads_rotated",
            "verify_loads", "verify_bytes", "verify_inconclusive", "rotations", "checks",
            "restart_checks", "files_checked", "small_files", "renames", "appends", "deletes",
            "halts_seen", "throttle_switches", "train_restarts", "double_publish_checked",
            "peer_kills", "faults_injected", "halts_permanent", "operator_aborts",
            "failed_by_fault", "rmtree_held_at_check", "saves_async2", "async2_jobs",
            "async2_failed_by_kill", "async2_verified", "async2_root_busy")})
        self.held_at_kill = 0           # journal_held of the node last killed, just before
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
        f = {"t": self.t(), "mode": self.mode, "nodes": self.nodes, "seed": self.seed,
             "inc": self.inc,
             "what": what, "detail": str(detail)[-4000:]}
        with self.lock:
            self.failures.append(f)
        print(f"[{self.mode} {f['t']:8.1f}] FAIL {what}\n{f['detail'][-1500:]}", flush=True)

    def app_op(self, name, op, seeds=None, mutates=True, history=None):
        """history: every seed this op saves into the directory (a re-save job's), kept as
        unconfirmed until confirm() (async: a kill may leave any of them, G4's prefix)."""
        with self.lock:
            self.ev += 1
            d = self.dirs.setdefault(name, {"op": None, "mut": 0, "done": 0, "begin": 0,
                                            "seeds": set(), "unconfirmed": set()})
            if history is not None:
                d["unconfirmed"].update(history)
            d["op"] = op
            d.pop("held_seen", None)
            if mutates:
                d["mut"] = self.ev
            if op in DONE_OPS:
                d["done"] = self.ev
            if op in BEGIN_OPS:
                d["begin"] = self.ev
            if seeds is not None:
                d["seeds"] = set(seeds)
            return self.ev

    def confirm(self, name, seed):
        """The daemon said `name`'s last save is published: no kill can take it back."""
        with self.lock:
            d = self.dirs.get(name)
            if d is not None:
                d["unconfirmed"] = {seed}

    def widen_after_kill(self):
        """Async: a SIGKILL leaves a prefix of the application's history on the backing
        store (G4), so a re-saved directory whose last save was not yet confirmed published
        may hold any save since the last confirmed one."""
        if self.mode != "async":
            return
        with self.lock:
            for d in self.dirs.values():
                if d.get("unconfirmed"):
                    d["seeds"] = d["seeds"] | d["unconfirmed"]

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
        return c["saves_train"] + c["saves_resave"] + c["saves_recreate"] + c["saves_async2"]

    # ------------------------------------------------------------------ the daemon
    @property
    def proc(self):
        return self.daemons[0].proc

    def start_daemon(self, i=None):
        """Starts node `i` (None: every node that is down); `up` once node 0 serves."""
        for d in self.daemons if i is None else [self.daemons[i]]:
            if d.alive():
                continue
            d.start()
            # Counted once it serves: a job started while its mount was still dead (the
            # trainer starts again at once after a peer's kill) failed with ENOTCONN under
            # the new count and was not excused (seed 6001, async, two nodes).
            self.inc += 1
        if self.daemons[0].alive():
            self.up.set()

    def kill_daemon(self, i=None, leave_mount=False):
        """SIGKILL of node `i` (None: every node). leave_mount: its dead mount stays, as
        after a crash under systemd; the next daemon detaches it right before it mounts
        (until then the application's calls fail with ENOTCONN). Unmounting it here left the
        bare mountpoint for that while, and the trainer wrote whole saves and trackers into
        it (seed 5501, strict: "a tracker write that returned is not on the backing store")."""
        for d in self.daemons if i is None else [self.daemons[i]]:
            if d.index == 0:
                self.up.clear()
            if d.alive():
                self.faults_before += d.faults_injected()
            d.kill(leave_mount=leave_mount)

    def faults_seen(self):
        """Faults injected so far, by every incarnation of every node."""
        return self.faults_before + sum(d.faults_injected() for d in self.daemons if d.alive())

    def killed_since(self, inc):
        """A daemon was killed since incarnation `inc` began, or is being killed now: between
        the SIGKILL and the new daemon's start (the checks of restart()) the incarnation is
        still `inc` while the mount answers ENOTCONN. (A load whose failure was judged there
        by the incarnation alone failed the kill-heavy strict two-node soak, seed 6104,
        t = 405 s: its rank read ENOTCONN from the node killed 0.6 s before.)"""
        return self.inc != inc or self.restarting or not all(d.alive() for d in self.daemons)

    def excused(self, inc, faults):
        """A job that failed since incarnation `inc` and fault count `faults` was broken by
        the soak itself: a daemon kill, or a fault injected meanwhile."""
        if self.killed_since(inc):
            return True
        if self.faults_seen() > faults or any(d.disk_full() for d in self.daemons if d.alive()):
            self.counts["failed_by_fault"] += 1
            return True
        return False

    def stats(self, i=0):
        try:
            with open(os.path.join(self.daemons[i].mnt, ".ckptfs", "stats")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def was_aborted(self, rel):
        """`rel` (backing-relative) is at or below what the operator aborted."""
        with self.lock:
            return any(rel == a or rel.startswith(a + "/") for a in self.aborted)

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

    # ------------------------------------------------------------------ the run
    def killer(self, until):
        while now() < until and not self.stop_ev.is_set():
            # Not past the kill phase's end: with --kill-min beyond the run (no kills, e.g.
            # an older daemon that cannot start over its killed predecessor's mount) the
            # quiet phase and the end still come.
            delay = self.rng.uniform(self.args.kill_min, self.args.kill_max)
            if self.sleep(min(delay, max(0.0, until - now()))):
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
            # Two nodes: the peer (node 1, one trainer rank's mount) 40 % of the time.
            victim = 1 if len(self.daemons) > 1 and self.rng.random() < 0.4 else 0
            self.counts["kills_after_step"] += after_step
            self.restart(victim, "kill")

    def restart(self, i, why):
        """SIGKILL of node `i` and a start at once, as systemd would; the checks a kill
        calls for. why: "kill", or "faults off" (the quiet phase begins)."""
        self.poll_oplog()
        self.poll_reported()
        with self.lock:
            ops = [o for o in self.ops_before_kill]
        # Deletions held behind a given-up checkpoint (a save that failed across nodes) are
        # lost with the daemon: the strict check of `rm -r`s cannot count those.
        before = self.stats(i) or {}
        self.held_at_kill = before.get("journal_held", 0)
        t_kill = now()
        # From the kill until the new daemon serves, a job's failure is the kill's (its mount
        # is dead, or not mounted yet: ENOTCONN), whenever the job began.
        self.restarting = True
        self.kill_daemon(i, leave_mount=True)
        self.widen_after_kill()
        if why == "kill":
            self.counts["daemon_kills"] += 1
            self.counts["peer_kills"] += i != 0
        kills = self.counts["daemon_kills"]
        # A traffic op in flight failed with the mount; the next one must see the restart.
        self.traffic_lock.acquire()
        try:
            # With one node the backing store stands still now: check it. (With two, the
            # other node goes on; the checks hold as well.)
            self.poll_oplog()
            self.cheap_checks(f"after kill {kills} (node {i})",
                              strict_ops=ops if self.mode == "strict" else None)
            t_start = now()
            self.start_daemon(i)
        finally:
            self.restarting = False
            self.traffic_lock.release()
        self.down_s.append(now() - t_kill)
        # The checks' part and the daemon's own start, apart: a 31.6 s time down (stop 59,
        # async, two nodes) could not be told one from the other afterwards.
        self.event("restart", node=i, why=why, kills=kills, down_s=round(self.down_s[-1], 2),
                   checks_s=round(t_start - t_kill, 2), start_s=round(now() - t_start, 2))
        # Recovery done (or 5 s): nothing of a verified checkpoint published again.
        deadline = now() + 5
        while now() < deadline:
            s = self.stats(i)
            if s is not None and s.get("journal_pending", 1) == 0:
                break
            time.sleep(0.2)
        self.counts["restart_checks"] += 1
        self.check_double_publish(f"after restart {kills} (node {i})")

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
        self.torch2_ready()
        self.start_daemon()
        threads = [threading.Thread(target=getattr(self, n), name=n, daemon=True)
                   for n in ("trainer", "rotator", "side", "traffic", "throttler", "sampler",
                             "capturer", "checker", "operator")]
        for th in threads:
            th.start()
        end = self.t0 + seconds
        quiet_at = end - seconds * self.args.quiet_frac
        self.quiet_inc = None
        try:
            self.killer(quiet_at)
            if self.faults_on and not self.stop_ev.is_set():
                # The quiet phase measures the leak bound and ends in a clean stop: no
                # faults either. One last restart of every node without them.
                self.faults_on = False
                for i in range(len(self.daemons)):
                    self.restart(i, "faults off")
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
            for d in self.daemons:
                if not d.alive():
                    continue
                r = subprocess.run([harness.ADMIN, "wait", d.mnt, "--timeout", "300"],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    self.fail(f"publication did not catch up at the end on node {d.index}",
                              r.stdout + r.stderr)
            self.poll_reported()
            self.resources("end")
            view = tree(self.mnt)
        # Every other node first: node 0's stop may wait for their shards.
        for d in reversed(self.daemons):
            if not d.alive():
                continue
            subprocess.run(["fusermount3", "-u", d.mnt], capture_output=True)
            try:
                rc = d.proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                rc = "timeout"
                self.kill_daemon(d.index)
            if rc != 0:
                # Its error lines say why (on 3759c3f: "journal: rmdir ... skipped:
                # NotEmpty"), its last lines what the stop reported.
                text = read_text(d.log) or ""
                errors = [ln for ln in text.splitlines() if "] [error] " in ln]
                self.fail(f"node {d.index}: the daemon did not exit 0 on a clean unmount",
                          f"rc {rc}\nerror lines ({len(errors)}):\n" +
                          "\n".join(errors[-10:]) + f"\nlast lines:\n{text[-1500:]}")
        self.up.clear()
        temps = harness.tmp_names(self.backing)
        if temps:
            self.fail("temp files left after a clean stop", temps[:20])
        if view is not None:
            backing = tree(self.backing)
            # What the operator aborted is in the application's view, never published.
            for part in (backing, view):
                for k in [k for k in part[0] if self.was_aborted(k)]:
                    del part[0][k]
                part[1].difference_update({k for k in part[1] if self.was_aborted(k)})
            if backing[1] != view[1] or backing[0] != view[0]:
                diff = sorted(k for k in set(backing[0]) | set(view[0])
                              if backing[0].get(k) != view[0].get(k))
                self.fail("after a clean stop the backing tree differs from the mount's view",
                          f"files {diff[:20]} dirs {sorted(backing[1] ^ view[1])[:20]}")
        self.cheap_checks("final")
        self.async2_final()
        self.check_double_publish("final")
        self.check_journal_trace("final")
        self.verify_snaps()
        self.verify_pending(final=True)
        t = tracker_value(self.backing)
        if isinstance(t, int) and iter_name(t) not in self.verified:
            self.fail("the final tracker's checkpoint was not verified", iter_name(t))
        self.leak_check()

    def resources(self, label):
        """Every node's resources now (publication caught up), under `label`: node 0's at
        the top, the other nodes' under "peers" (a node that writes shards only kept what
        it learned of every checkpoint: the heap of stop 59's heaptrack run)."""
        self.drained[label] = self.node_resources(0)
        self.drained[label]["peers"] = [self.node_resources(i)
                                        for i in range(1, len(self.daemons))]
        self.event("drained sample", label=label, **self.drained[label])

    def node_resources(self, i):
        d = self.daemons[i]
        pid = d.proc.pid
        st = {}
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                st[k] = v.split()
        stats = self.stats(i) or {}
        rss_mb = int(st["VmRSS"][0]) / 1024
        # Memory the daemon budgets and fills on purpose: staging chunks pinned on first use
        # and kept (--staging-mem), the retained tier (--retain-mem, half the staging by
        # default), the block cache and the state db's memtables and block cache. What is
        # left is what must not grow.
        held_mb = held_bytes(stats) / 2 ** 20
        return {"t": self.t(), "saves": self.saves_done(),
                "rss_mb": round(rss_mb, 1),
                "retained_mb": round(stats.get("retained_used", 0) / 2 ** 20, 1),
                "cache_mb": round(stats.get("cache_used", 0) / 2 ** 20, 1),
                "cache_index_mb": round(stats.get("cache_index", 0) / 2 ** 20, 2),
                "staging_mb": round(stats.get("staging_resident", 0) / 2 ** 20, 1),
                "state_db_mem_mb": round((stats.get("state_db_memory", 0) or 0) / 2 ** 20, 1),
                # The write path's block CRC maps kept for index builds (bounded by the key
                # index's max_block_crc_bytes; counted in rss_other_mb).
                "crc_maps_mb": round((stats.get("checksum_block_maps_bytes", 0) or 0) / 2 ** 20,
                                     2),
                # The peer transport's buffers kept for reuse (bounded per link; counted in
                # rss_other_mb): the lead of stop 63's two-node leak bound.
                "peer_pool_mb": round((stats.get("peers_buffer_pool_bytes", 0) or 0) / 2 ** 20,
                                      2),
                "rss_other_mb": round(rss_mb - held_mb, 1),
                # glibc's heap: live allocations, and free bytes it holds
                "heap_in_use_mb": round(stats.get("heap_in_use", 0) / 2 ** 20, 2),
                "heap_free_mb": round(stats.get("heap_free_held", 0) / 2 ** 20, 2),
                "inodes": stats.get("inodes"),
                "threads": int(st["Threads"][0]),
                # FUSE loop workers ("ckptfs-fuse", each with a splice pipe pair): libfuse
                # makes them under load and keeps up to 8 idle, so their number floats
                # (bounded); the thread and fd bounds leave them out.
                "fuse_workers": fuse_workers(pid),
                "fds": len(os.listdir(f"/proc/{pid}/fd")),
                # Backing files the block cache's source keeps open to serve reads (up to
                # 256, and their O_DIRECT twins; 0 from a daemon without the counter):
                # a node prefetching its share of another node's loads holds some until
                # the files go, so the fd bound leaves them out as the RSS bound leaves
                # out the cache's memory. (The async2 loads through both mounts left 4 on
                # node 1 at the end of a two-node run, seed 6203, over the +4 bound.)
                "cache_fds": stats.get("cache_source_open_fds", 0),
                "fd_kinds": fd_kinds(pid, self.root),
                "state_mb": round(dir_bytes(d.state) / 2 ** 20, 2)}

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
            for d in self.daemons:
                r = subprocess.run([harness.ADMIN, "wait", d.mnt, "--timeout", "120"],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    break
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
        block cache hold (bounded by their own budgets) within 10 %, fds +4, threads +2 (FUSE
        loop workers and their splice pipes left out: libfuse's pool floats, bounded),
        state dir at most twice plus 64 MiB; on every node."""
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
        nodes = [(0, base, end)] + [(i + 1, b, e) for i, (b, e) in
                                    enumerate(zip(base.get("peers", []), end.get("peers", [])))]
        for i, b, e in nodes:
            self.leak_check_node(i, b, e, between)

    def leak_check_node(self, i, base, end, between):
        who = f"node {i}: " if len(self.daemons) > 1 else ""
        detail = json.dumps({"node": i, "saves_between": between, "base": base, "end": end})
        if end["rss_other_mb"] > base["rss_other_mb"] * 1.10:
            what = (f"leak: {who}daemon RSS (less staging, retained tier, block cache and "
                    "state db memory) grew more than 10 %")
            self.leak["over_bound"] = True
            if getattr(self.args, "leak_report_only", False):
                print(f"[{self.mode}] LEAK (reported only): {what}: "
                      f"{base['rss_other_mb']} -> {end['rss_other_mb']} MiB over {between} saves",
                      flush=True)
            else:
                self.fail(what, detail)
        workers = end.get("fuse_workers", 0) - base.get("fuse_workers", 0)
        cache_fds = end.get("cache_fds", 0) - base.get("cache_fds", 0)
        if end["fds"] - 2 * workers - cache_fds > base["fds"] + 4:
            self.fail(f"leak: {who}open fds grew", detail)
        if end["threads"] - workers > base["threads"] + 2:
            self.fail(f"leak: {who}threads grew", detail)
        if end["state_mb"] > 2 * base["state_mb"] + 64:
            self.fail(f"leak: {who}the state dir grew", detail)

    def cleanup(self, keep):
        self.stop_ev.set()
        for job in list(self.jobs):
            job.kill()
        try:
            self.kill_daemon()
        except Exception:
            pass
        if self.cluster is not None:
            self.cluster.cleanup()       # namespaces, veths, the bridge
        if self.cgroup:
            netns.remove_cgroup(self.cgroup)
        if not keep:
            shutil.rmtree(self.root, ignore_errors=True)

    def report(self):
        kills_per_min = self.counts["daemon_kills"] / max(1e-9, self.t() / 60)
        return {"mode": self.mode, "nodes": self.nodes, "seed": self.seed, "seconds": self.t(),
                "root": self.root, "faults": self.args.faults,
                "counts": self.counts, "kills_per_min": round(kills_per_min, 2),
                "reported_committed": len(self.reported),
                "reported_committed_verified": len(self.reported_verified),
                "checkpoints_verified": len(self.verified_ever),
                "reported_committed_rotated_before_verify": len(self.rotated_unverified),
                "down_s_max": round(max(self.down_s), 2) if self.down_s else None,
                "down_s_mean": round(sum(self.down_s) / len(self.down_s), 2)
                if self.down_s else None,
                "aborted": self.aborted,
                "leak": getattr(self, "leak", None), "failures": self.failures,
                "samples": self.samples, "events": self.events}
