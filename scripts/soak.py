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
    ("torn/t_N"), loads of the newest checkpoint the tracker names, through the mount, and
    (with a torch 2.x root, --torch2) a torch 2.x trainer of 2-5 `dcp.async_save`s into
    async2/ (each save finalized at the next step: the future's result, the tracker, the
    rotation to 2), in the cached Debian root (soaklib/torch2.py, async_trainer.py), whose
    last checkpoint is loaded exactly through the mounts and from the backing store;
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
    store after it (the torch 2.x trainer's too: an async_save whose future returned);
  * after every restart, nothing is published twice: the files of a verified checkpoint the
    application did not touch since keep their inode, mtime and size; and by sequence
    number, from every daemon's --journal-trace: no entry done twice in one run, none
    resumed or discarded at a start that the run before had done;
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
on purpose up to its own budget, which stats report) within 10 %, fds at most +4 (less the
backing files the block cache's source keeps open to serve reads, which stats report too),
threads at most +2, the state dir at most twice plus 64 MiB. A quiet phase with fewer than 50 saves
leaves the bound unchecked (the report says so).

OUT/soak.json holds the figures, every failure with the seed, mode and time, and the
events; exit status 0 only when every invariant held. Every process the soak starts is
killed by PID (a job and its ranks by their own process group), every mount, cgroup and
temporary directory removed, on failure and on Ctrl-C as well; a guardian (reaper.py) does
it if the soak itself is killed. Needs root (FUSE, blkio cgroups).
"""
import argparse
import json
import os
import random
import signal
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from soaklib.report import plot  # noqa: E402
from soaklib.run import ModeRun  # noqa: E402
from soaklib.nodes import DEFAULT_FAULTS  # noqa: E402
from soaklib.util import daemon_options, harness, reaper  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10, help="total, split over the modes")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--modes", default="async,strict")
    ap.add_argument("--nodes", default="1",
                    help="1, 2 (two daemons in network namespaces over one backing dir, the "
                         "second one killed too) or 1,2 (both, the time split)")
    ap.add_argument("--runs", default=None,
                    help="explicit MODE:NODES pairs instead of --modes x --nodes, e.g. "
                         "async:1,strict:2 (what CI runs)")
    ap.add_argument("--faults", default=DEFAULT_FAULTS,
                    help="the fault layer's rates for every daemon incarnation (seeded per "
                         "incarnation; docs/RELIABILITY.md), or none (default: %(default)s)")
    ap.add_argument("--commit-timeout", type=int, default=60,
                    help="two nodes: the daemons' --commit-timeout, s (a killed peer's shards "
                         "never come)")
    ap.add_argument("--out", default=None, help="report dir (default: a new temp dir)")
    ap.add_argument("--mb", type=int, default=2, help="checkpoint size of the trainer (MiB)")
    ap.add_argument("--kill-min", type=float, default=5, help="seconds between kills, at least")
    ap.add_argument("--kill-max", type=float, default=30, help="seconds between kills, at most")
    ap.add_argument("--quiet-frac", type=float, default=0.3,
                    help="last fraction of each mode without kills (the leak bound)")
    ap.add_argument("--leak-report-only", action="store_true",
                    help="report the RSS bound (soak.json's leak, a LEAK line) without failing "
                         "on it: CI's 3-minute form, whose quiet phase is mostly the "
                         "allocator's warm-up (the long soak judges it, docs/RELIABILITY.md)")
    ap.add_argument("--torch2", default="auto", choices=("auto", "off", "sid", "trixie"),
                    help="the torch 2.x dcp.async_save trainer (a side job) in a cached Debian "
                         "root: auto uses the sid root when scripts/torch_root.sh has built "
                         "it, sid/trixie build it if missing (minutes), off skips it")
    ap.add_argument("--keep", action="store_true", help="keep the work dirs even on success")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    try:
        node_counts = [int(x) for x in a.nodes.split(",") if x]
    except ValueError:
        node_counts = []
    if not node_counts or any(k not in (1, 2) for k in node_counts):
        print(f"soak.py: --nodes {a.nodes}: want 1, 2 or 1,2", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("soak.py: needs root (FUSE mounts, blkio cgroups)", file=sys.stderr)
        return 2
    if not os.access(harness.CKPTFS, os.X_OK):
        print(f"soak.py: no daemon at {harness.CKPTFS} (CKPTFS_BIN_DIR)", file=sys.stderr)
        return 2
    a.daemon_options = daemon_options(harness.CKPTFS, ["--journal-trace", "--fault-inject"])
    if a.faults != "none" and "--fault-inject" not in a.daemon_options:
        print(f"soak.py: the daemon at {harness.CKPTFS} has no --fault-inject (a build older "
              "than the fault layer): run it with --faults none", file=sys.stderr)
        return 2
    if "--journal-trace" not in a.daemon_options:
        print(f"soak.py: the daemon at {harness.CKPTFS} has no --journal-trace (an older build): "
              "nothing published twice is checked by the published files' inode and mtime "
              "alone", file=sys.stderr)
    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    modes = [m for m in a.modes.split(",") if m]
    out = a.out or tempfile.mkdtemp(prefix="ckptfs-soak-out-")
    os.makedirs(out, exist_ok=True)
    runs = [(mode, k) for k in node_counts for mode in modes]
    if a.runs:
        try:
            runs = [(x.split(":")[0], int(x.split(":")[1])) for x in a.runs.split(",") if x]
        except (IndexError, ValueError):
            runs = []
        if not runs or any(m not in ("async", "strict") or k not in (1, 2) for m, k in runs):
            print(f"soak.py: --runs {a.runs}: want MODE:NODES,...", file=sys.stderr)
            return 2
        modes = sorted({m for m, _ in runs})
        node_counts = sorted({k for _, k in runs})
    print(f"soak: seed {seed}, modes {modes}, nodes {node_counts}, {a.minutes} min, faults "
          f"{a.faults}, report in {out}", flush=True)
    reaper.start_guardian()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    reports, ok = [], True
    for mode, nodes in runs:
        run = ModeRun(a, mode, seed, out, nodes)
        try:
            run.run(a.minutes * 60 / len(runs))
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
        if not plot(rep, os.path.join(out, f"soak-{mode}-{nodes}n.png")):
            print(f"soak: no plot for {mode}, {nodes} node(s): no samples, or no matplotlib in "
                  f"{sys.executable} (scripts/setup.sh installs it for /usr/bin/python3)")
        c = rep["counts"]
        print(f"== {mode}, {nodes} node(s): {c['daemon_kills']} daemon kills "
              f"({c['peer_kills']} of the peer), {c['faults_injected']} faults injected, "
              f"{c['operator_aborts']} aborts, "
              f"{c['saves_train']} train saves, {c['saves_resave']} + {c['saves_recreate']} "
              f"re-saves, {c['rotations']} rotations, {c['torn_rank_kills']} rank kills, "
              f"{c['loads_mount']} loads, {c['verify_loads']} verified loads, "
              f"{c['saves_async2']} torch 2.x async_saves ({c['async2_verified']} verified), "
              f"{len(rep['failures'])} failures; leak {rep['leak']}", flush=True)
    ok = ok and all(not r["failures"] for r in reports) and len(reports) == len(runs)
    with open(os.path.join(out, "soak.json"), "w") as f:
        json.dump({"seed": seed, "minutes": a.minutes, "modes": modes, "nodes": node_counts,
                   "faults": a.faults, "ok": ok,
                   "argv": sys.argv, "runs": reports}, f, indent=1)
    print(f"soak: {'PASS' if ok else 'FAIL'}, seed {seed}; report {out}/soak.json", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
