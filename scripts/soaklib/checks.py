"""The soak's invariants, checked from the backing store alone."""
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


def abort_target(path):
    """What an operator aborts for a publication halted at `path`: its checkpoint
    directory (iter_N, torn/t_N, resave, recreate), else the file itself."""
    parts = path.split("/")
    if parts[0] == "torn" and len(parts) > 2:
        return "/".join(parts[:2])
    if len(parts) > 1 and (parts[0].startswith("iter_") or parts[0] in ("resave", "recreate")):
        return parts[0]
    return path


class Checks:
    """Mixin of ModeRun (soaklib/run.py): the checks and the verifiers."""

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

    def check_halt(self, act=True):
        """Every node's journal halt: one needs a reason; one that retries by itself must
        clear within HALT_S; one halted for good (an fsync failed: the bytes may be lost) is
        what an operator aborts (docs/USAGE.md), 0.5 to 3 s after it is seen, when `act`."""
        for d in self.daemons:
            st = self.stats(d.index) if d.alive() else None
            h = (st or {}).get("journal_halted")
            key = d.index
            if not h:
                self.halt_since.pop(key, None)
                continue
            first = key not in self.halt_since or self.halt_since[key][1] != h.get("seq")
            if first:
                self.halt_since[key] = (now(), h.get("seq"), self.rng.uniform(0.5, 3.0))
                self.counts["halts_seen"] += 1
                self.counts["halts_permanent"] += not h.get("retrying")
                self.event("halt", node=d.index, **h)
            since, _, delay = self.halt_since[key]
            if not str(h.get("error", "")).strip():
                self.fail("journal halted without a reason", json.dumps(h))
            elif h.get("retrying"):
                if now() - since > HALT_S:
                    self.fail(f"node {d.index}: a transient halt lasted over {HALT_S} s",
                              json.dumps(h))
                    self.halt_since[key] = (now() + 10 ** 6, h.get("seq"), delay)   # once
            elif act and now() - since >= delay:
                self.abort(d, abort_target(h.get("path", "")), h, since)

    def abort(self, d, target, halt, since):
        # The application may have renamed or removed the halted name since (a small file
        # written as .tmp and renamed): `ckptfs-admin abort` needs a path the mount shows,
        # so the operator aborts the nearest directory above it that is still there.
        while "/" in target and not os.path.lexists(os.path.join(d.mnt, target)):
            target = target.rsplit("/", 1)[0]
        if not os.path.lexists(os.path.join(d.mnt, target)):
            # Gone from the mount altogether (the rotation's rm -r of the halted checkpoint):
            # there is nothing left to abort, and the application's delete drops the halted
            # entries. Only a halt that outlives that by HALT_S is a failure.
            self.event("operator abort skipped: the halted name is gone", node=d.index,
                       path=target, error=halt.get("error"))
            if now() - since > HALT_S:
                self.fail(f"node {d.index}: halted at {target}, which is gone, for over "
                          f"{HALT_S} s", json.dumps(halt))
                self.halt_since[d.index] = (now() + 10 ** 6, halt.get("seq"), 0)  # once
            return
        # Recorded before the command runs: the daemon acts on it (drops the entries, goes
        # on publishing) before `ckptfs-admin` returns, and the checks on other threads must
        # judge what they see then by it.
        with self.lock:
            self.aborted[target] = self.t()
        r = subprocess.run([harness.ADMIN, "abort", os.path.join(d.mnt, target)],
                           capture_output=True, text=True)
        self.counts["operator_aborts"] += 1
        self.event("operator abort", node=d.index, path=target, rc=r.returncode,
                   error=halt.get("error"), out=(r.stdout + r.stderr)[-300:])
        if r.returncode != 0 and d.alive():
            self.fail(f"ckptfs-admin abort {target} -> {r.returncode}", r.stdout + r.stderr)

    def operator(self):
        while not self.stop_ev.is_set():
            if self.sleep(0.5):
                return
            self.check_halt(act=True)
            if self.faults_on:
                self.counts["faults_injected"] = self.faults_seen()

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
                # A tracker between naming a checkpoint the operator aborted is withheld (it
                # never commits): the backing tracker stays behind the application's.
                lo = t2 + 1 if isinstance(t2, int) else 1
                withheld = any(self.was_aborted(iter_name(j)) for j in range(lo, k + KEEP + 1))
                if still and not withheld:
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
        self.async2_cheap_checks(context, strict=strict_ops is not None)

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
        # A deletion of a committed checkpoint behind a given-up one (a save that failed
        # across nodes) returns in strict mode and waits for a later commit
        # (store/publish/deletion_hold.h); held on the killed node or on one still running,
        # an `rm -r` that returned may rightly still be there.
        # A deletion found held at one check and lost with a later kill stays excused
        # until the application touches its directory again (app_op clears the mark).
        held = self.deletions_held()
        for name in done:
            if os.path.exists(os.path.join(self.backing, name)):
                with self.lock:
                    d = self.dirs.get(name, {})
                    excused = bool(held) or d.get("held_seen", False)
                    if excused:
                        d["held_seen"] = True
                if excused:
                    self.counts["rmtree_held_at_check"] += 1
                    continue
                self.fail("strict: an rm -r that returned is not on the backing store",
                          f"{context}: {name} still there")

    def deletions_held(self):
        """Deletions held behind a given-up checkpoint, on the node last killed (just before)
        and on the running ones."""
        return self.held_at_kill + sum(
            (self.stats(j) or {}).get("journal_held", 0) for j in range(len(self.daemons)))

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
                # Nor is an equal .metadata enough: a re-save of the same iteration after a
                # kill (same seed, same layout) writes the same bytes, and before its shards
                # are published the backing store can hold the first save's .metadata with
                # the shards a killed rank left (a state the application passed through).
                # So the daemon must also call the directory committed, before and after.
                want = read_bytes(os.path.join(self.mnt, name, ".metadata"))
                if want is None or read_bytes(os.path.join(src, ".metadata")) != want or \
                        not self.committed_in_mount(name):
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
                        or read_bytes(os.path.join(snap, ".metadata")) != want \
                        or not self.committed_in_mount(name):
                    shutil.rmtree(snap, ignore_errors=True)
                    continue
                with self.lock:
                    self.seen_complete[name] = ev0
                    self.snap_queue.append((name, snap, next(iter(seeds)), ev0, stats))

    def committed_in_mount(self, name):
        """The daemon's own word: the directory's state (user.ckptfs.state) is committed."""
        try:
            return os.getxattr(os.path.join(self.mnt, name), "user.ckptfs.state") == b"committed"
        except OSError:
            return False

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

    def check_journal_trace(self, context):
        """Nothing published twice, by the journal's sequence numbers (every node's
        --journal-trace, soaklib.util.journal_trace_check): no entry done twice in one run,
        and no entry a restart resumed or discarded that the run before had done. A daemon
        without --journal-trace (an older build) is not judged here: the report says so."""
        if "--journal-trace" not in self.args.daemon_options:
            self.counts["journal_trace_unsupported"] = 1
            return
        for d in self.daemons:
            counts, bad = journal_trace_check(d.trace)
            for k, v in counts.items():
                self.counts[f"journal_{k}"] = self.counts.get(f"journal_{k}", 0) + v
            for what in bad[:5]:
                self.fail("the journal handled an entry twice (its trace)",
                          f"{context}: node {d.index}: {what}")

    def checker(self):
        while not self.stop_ev.is_set():
            if self.sleep(self.rng.uniform(5, 12)):
                return
            if not self.up.is_set():
                continue
            self.poll_oplog()
            self.poll_reported()
            self.cheap_checks("periodic")
            self.verify_snaps()
            self.check_double_publish("periodic")
