"""The soak's workloads: trainer, rotator, side jobs, traffic, throttle, sampler."""
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


class Workloads:
    """Mixin of ModeRun (soaklib/run.py): the threads that act as the application."""

    def mounts(self, name=None):
        """Each node's mount (of `name` in it), for jobs whose rank r works through
        mounts[r % nodes]; None with one node."""
        if len(self.daemons) == 1:
            return None
        return [d.mnt if name is None else os.path.join(d.mnt, name) for d in self.daemons]

    def state_of(self, name):
        for c in self.checkpoints() or []:
            if c.get("path") == name:
                return c.get("state")
        return None

    def trainer(self):
        while self.wait_up():
            inc, faults = self.inc, self.faults_seen()
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
                "single_file_per_rank": sfpr, "oplog": self.oplog, "timeout": 10 ** 7,
                "parents": self.mounts()},
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
            if rc not in (0, None) and self.up.is_set() and not self.excused(inc, faults):
                self.fail("trainer failed with no daemon kill and no fault injected", job.tail())
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
            # As the trainer itself rotates (Megatron: after its tracker write returned),
            # never past a tracker whose write has not returned: the mount shows a written
            # value while its publish runs, and a strict write that then fails (an EIO
            # injected) returns the error to the trainer, after this thread has read it.
            # (Stop 62, seed 6204, strict, one node: tracker 59's publish failed, the
            # rotation had read 59 and removed 56, under the backing store's tracker 58.)
            self.poll_oplog()
            t = min(t, self.app_tracker)
            try:
                old = sorted(int(d[5:]) for d in os.listdir(self.mnt)
                             if d.startswith("iter_") and d[5:].isdigit())
            except OSError:
                continue
            for k in old:
                if k > t - KEEP:
                    break
                name = iter_name(k)
                # Checked and claimed at once (side_load claims under the same lock): a
                # load that chose this checkpoint first keeps it; one that comes later
                # skips it.
                with self.lock:
                    if name in self.loading:
                        continue
                    self.rotating.add(name)
                self.app_op(name, "rmtree_begin")
                try:
                    shutil.rmtree(os.path.join(self.mnt, name))
                    self.app_op(name, "rmtree_done")
                    self.counts["rotations"] += 1
                except OSError as e:
                    self.event("rmtree_error", dir=name, error=str(e))
                    break
                finally:
                    with self.lock:
                        self.rotating.discard(name)

    def side(self):
        n = 0
        while self.wait_up():
            self.side_idle.set()
            while self.paused.is_set() and not self.stop_ev.is_set():
                self.sleep(0.2)
            self.side_idle.clear()
            n += 1
            what = self.rng.choices(["resave", "recreate", "torn", "load", "async2"],
                                    weights=[2, 2, 3, 4, 3 if self.torch2_root else 0])[0]
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
        inc, faults = self.inc, self.faults_seen()
        try:
            os.makedirs(d, exist_ok=True)
        except OSError:
            return
        self.app_op(name, "resave_begin", seeds=[seeds[-1]], history=seeds)
        job = Job(self, "resave", {"dir": d, "ranks": SIDE_RANKS, "seeds": seeds,
                                   "mbs": [1] * k, "single_file_per_rank": sfpr,
                                   "recreate": recreate, "dtypes_per_save": plans,
                                   "timeout": HANG_S}, f"{name}{n}")
        rc = job.wait(stop=self.stop_ev)
        job.kill()
        if rc is None or (rc != 0 and self.stop_ev.is_set()):   # the soak's own stop
            return
        if rc != 0:
            if self.up.is_set() and not self.excused(inc, faults):
                self.fail(f"{name} failed with no daemon kill and no fault injected", job.tail())
            else:
                self.app_op(name, "resave_torn_by_kill")
            return
        self.counts["saves_" + name] += k
        self.app_op(name, "resave_done", mutates=False)
        # The application is done with the directory: once publication caught up, the
        # backing store holds its last save, and the daemon must call it committed.
        r = subprocess.run([harness.ADMIN, "wait", d, "--timeout", "180"],
                           capture_output=True, text=True)
        if self.killed_since(inc):
            return
        if r.returncode != 0:
            # A fault failed the save after it returned (async), or the operator aborted it.
            if self.up.is_set() and not self.excused(inc, faults):
                self.fail(f"ckptfs-admin wait {name} -> {r.returncode} with no fault injected",
                          r.stdout + r.stderr)
            return
        self.confirm(name, seeds[-1])
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
                                 "timeout": HANG_S, "dirs": self.mounts(name)}, f"torn{n}")
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
        # The tracker may have moved on since it was read, and the rotation may be removing
        # (or have removed) the checkpoint it named: that is the application's race, not
        # the mount's, so such a load is skipped and counted. The claim and the rotation's
        # check share the lock, so no removal starts between them.
        with self.lock:
            if name in self.rotating:
                self.counts["loads_rotated"] += 1
                return
            self.loading.add(name)
        try:
            if not os.path.exists(os.path.join(self.mnt, name, ".metadata")):
                self.counts["loads_rotated"] += 1
                return
            self.load_one(n, t, name, inc)
        finally:
            with self.lock:
                self.loading.discard(name)

    def load_one(self, n, t, name, inc):
        with self.lock:
            ev = self.ev
        if self.mounts() is not None and self.mode == "async":
            # Async on several nodes: another node sees the checkpoint once it is on the
            # backing store. A job loading it there right after the save (an evaluation
            # job, ranks on every node) waits for that first, as docs/USAGE.md says
            # (`ckptfs-admin wait`); the 60-minute soak of stop 53 loaded at once, and the
            # ranks on the other node found no `.metadata` yet.
            r = subprocess.run([harness.ADMIN, "wait", os.path.join(self.mnt, name),
                                "--timeout", "120"], capture_output=True, text=True)
            if r.returncode != 0:
                self.counts["loads_unpublished"] += 1
                return
        mode = self.rng.choice(["own", "reshard", "replicated"])
        job = Job(self, "load", {"dir": os.path.join(self.mnt, name), "ranks": SIDE_RANKS,
                                 "mode": mode, "seed": t, "timeout": HANG_S,
                                 "dirs": self.mounts(name)}, f"load{n}")
        rc = job.wait(stop=self.stop_ev)
        job.kill()
        if rc is None or self.stop_ev.is_set():   # the soak's own stop killed it
            return
        if rc == 0:
            self.counts["loads_mount"] += 1
        elif self.killed_since(inc) or self.mutated_since(name, ev):
            self.counts["loads_failed_by_kill"] += 1
        elif self.was_aborted(name) or self.state_of(name) in ("failed", "aborted"):
            # A fault failed the save after it returned (async); the application's view
            # of it is gone or partial, as its failed state says.
            self.counts["failed_by_fault"] += 1
        else:
            self.fail(f"load of the tracker's {name} through the mount failed",
                      job.tail() + "\n" + self.sizes_seen(name))

    def sizes_seen(self, name):
        """Each file's size on the backing store and through every mount, and its
        backing mtime: a load that ran out of input reads a size one of them got wrong."""
        lines = []
        try:
            files = sorted(os.listdir(os.path.join(self.backing, name)))
        except OSError as e:
            return f"sizes: {e}"
        for f in files:
            row = []
            for where in [self.backing] + [d.mnt for d in self.daemons]:
                try:
                    st = os.stat(os.path.join(where, name, f))
                    row.append(f"{st.st_size}@{st.st_mtime:.3f}")
                except OSError as e:
                    row.append(type(e).__name__)
            lines.append(f"{f}: backing, mounts: {' '.join(row)}")
        return "sizes:\n" + "\n".join(lines)

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
                # What a failed step left is read back before the log goes on: an append
                # whose close failed may still be in the file (seed 5501, async: Python's
                # close flushes its buffer a second time, and the line landed twice).
                inc = None
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
            # One write(2) per line, no buffering: a write that fails wrote nothing.
            fd = os.open(os.path.join(logs, "app.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                         0o644)
            try:
                os.write(fd, log_line(seq).encode())
            finally:
                os.close(fd)
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
                "held_mb": held_bytes(st) / 2 ** 20,
                "heap_in_use_mb": st.get("heap_in_use", 0) / 2 ** 20,
                "heap_free_mb": st.get("heap_free_held", 0) / 2 ** 20,
                "crc_maps_mb": (st.get("checksum_block_maps_bytes", 0) or 0) / 2 ** 20,
                "peer_pool_mb": (st.get("peers_buffer_pool_bytes", 0) or 0) / 2 ** 20,
                "inodes": st.get("inodes")}
