#!/usr/bin/env python3
"""Cold load time and backing bytes read: a 4-rank torch DCP load of a 1 GiB
checkpoint through a ckptfs mount against the same load straight from the
backing directory, side by side in one run (see ../../../shared/BENCHMARKS.md).

The checkpoint is saved once per single_file_per_rank setting with dcp_tool
DIRECTLY into the daemon's backing directory; both sides then load those very
files. Before every load the page cache is dropped (root), and every ckptfs
load runs on a freshly started daemon (cold block cache).

Cases (one JSON line each, medians over BENCH_REPS repetitions):
  load_{own,replicated,reshard}_sfpr{1,0}
    ckptfs_s, direct_s   max over ranks of load_state_dict (dcp_tool load_s_max)
    setup_s              median over reps of the slowest rank's setup before it: reading
                         `.metadata` and allocating the state to load into (not timed in
                         ckptfs_s/direct_s; the daemon's checkpoint prefetch, started by
                         the `.metadata` open, already runs during it)
    ratio                ckptfs_s / direct_s
    backing_bytes        bytes the daemon read from the backing store during the
                         load (stats backing_bytes_read, index reads included)
    io_read_bytes        the daemon's /proc/<pid>/io read_bytes over the same span
                         (cold caches, so storage reads), the cross-check
    checkpoint_bytes     size of the checkpoint directory
    (throttled_load_own_sfpr{1,0}: the same own-shard load with both sides in a
    blkio cgroup that throttles reads of the backing disk, --throttle-mbps)
    crosscheck_ok        the daemon's counter agrees with /proc/<pid>/io within
                         10% (+4 MiB) in every rep (the counter also counts bytes the
                         backing file system served from its page cache, so a daemon
                         that reads a range twice shows up here)
    ok                   every load (both sides) verified every tensor, and every
                         daemon exited 0 with no errors
By default each ckptfs run also starts with an empty --state-dir (--keep-state to
reuse one), so every rep is this node's first look at the checkpoint: nothing of
its key index persisted from an earlier rep.
Env: BENCH_MB (default 1024), BENCH_REPS (default 3), CKPTFS_BIN_DIR.
Writes bench_load.png (ratios, backing bytes / checkpoint bytes) and bench_load.json
(raw numbers) into --out.
"""
import argparse
import contextlib
import json
import os
import shutil
import sys
import time

import benchlib as bl

sys.path.insert(0, bl.E2E_DIR)
import dcp_tool  # noqa: E402  (parent side never imports torch)

MODES = ("own", "replicated", "reshard")


def crosscheck(counter, io_bytes):
    if counter is None or io_bytes is None:
        return False
    return abs(io_bytes - counter) <= 0.10 * max(counter, 1) + 4 * bl.MiB


def load_direct(ckpt, ranks, mode, seed):
    if not bl.drop_caches():
        raise SystemExit("drop_caches failed: run as root")
    r = dcp_tool.load(ckpt, ranks, mode, seed, timeout=1800)
    return r["load_s_max"], r["setup_s_max"]


def load_ckptfs(root, name, ranks, mode, seed, daemon_args, staging, fresh_state):
    """Fresh daemon, cold caches; returns a dict of the measurements."""
    if fresh_state:
        shutil.rmtree(os.path.join(root, "state"), ignore_errors=True)
    with bl.Daemon(root, staging=staging, args=daemon_args) as d:
        if not bl.drop_caches():
            raise SystemExit("drop_caches failed: run as root")
        s0, io0 = d.stats(), bl.proc_io(d.pid).get("read_bytes")
        r = dcp_tool.load(os.path.join(d.mnt, name), ranks, mode, seed, timeout=1800)
        time.sleep(0.2)  # a prefetch still finishing is part of this load's reads
        s1, io1 = d.stats(), bl.proc_io(d.pid).get("read_bytes")
        hwm = bl.vm_hwm(d.pid)
        errors = s1.get("errors", 0)
        rc = d.unmount(timeout=120)
    return {
        "load_s": r["load_s_max"],
        "setup_s": r["setup_s_max"],
        "wall_s": r["wall_s"],
        "backing_bytes": s1["backing_bytes_read"] - s0["backing_bytes_read"],
        "cache_backing_bytes": s1.get("cache_backing_bytes_read", 0)
        - s0.get("cache_backing_bytes_read", 0),
        "bytes_served": s1.get("bytes_served", 0) - s0.get("bytes_served", 0),
        "prefetched_bytes": s1.get("prefetched_bytes", 0) - s0.get("prefetched_bytes", 0),
        "cache_peak": s1.get("cache_peak"),
        "io_read_bytes": None if io0 is None or io1 is None else io1 - io0,
        "vm_hwm": hwm,
        "errors": errors,
        "exit": rc,
    }


def plot(cases, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        bl.log("matplotlib missing: no plot")
        return
    names = [c["case"] for c in cases]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = range(len(names))
    ratios = [c["ratio"] or 0 for c in cases]
    ax1.bar(xs, ratios, color=["tab:green" if r <= 1.0 else "tab:red" for r in ratios])
    ax1.axhline(1.0, color="k", lw=1, ls="--", label="direct (1.0x)")
    ax1.axhline(0.8, color="tab:blue", lw=1, ls=":", label="goal for own (0.8x)")
    ax1.set_xticks(list(xs), names, rotation=30, ha="right")
    ax1.set_ylabel("load time, ckptfs / direct (median)")
    ax1.set_title("cold DCP load, 4 ranks")
    ax1.legend(fontsize=8)
    bb = [c["backing_bytes"] / c["checkpoint_bytes"] if c["backing_bytes"] is not None else 0
          for c in cases]
    io = [(c["io_read_bytes"] or 0) / c["checkpoint_bytes"] for c in cases]
    w = 0.4
    ax2.bar([x - w / 2 for x in xs], bb, w, label="daemon counter")
    ax2.bar([x + w / 2 for x in xs], io, w, label="/proc/pid/io read_bytes")
    ax2.axhline(1.05, color="tab:red", lw=1, ls="--", label="limit for replicated (1.05x)")
    ax2.set_xticks(list(xs), names, rotation=30, ha="right")
    ax2.set_ylabel("backing bytes read / checkpoint bytes")
    ax2.set_title("bytes read from the backing store")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    bl.log(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=int(os.environ.get("BENCH_MB", 1024)))
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=int(os.environ.get("BENCH_REPS", 3)))
    ap.add_argument("--sfpr", default="1,0", help="single_file_per_rank values to run")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--cache-mem", default=None, help="daemon --cache-mem (default: its own)")
    ap.add_argument("--staging-mem", default="256M")
    ap.add_argument("--daemon-args", default="",
                    help="extra daemon options, space separated (e.g. '--read-ahead 0')")
    ap.add_argument("--seed", type=int, default=4242)
    ap.add_argument("--throttle-mbps", type=float, default=300,
                    help="also run own-shard loads with backing reads throttled to this "
                    "(blkio cgroup, both sides); 0 skips")
    ap.add_argument("--keep-state", action="store_true",
                    help="reuse the daemon's state dir (persisted key index) across reps")
    ap.add_argument("--work", default=os.path.join(bl.REPO, "build-bench", "load-work"),
                    help="scratch dir on the backing file system (wiped)")
    ap.add_argument("--out", default=os.path.join(bl.REPO, "build-bench"))
    a = ap.parse_args()

    os.makedirs(a.out, exist_ok=True)
    shutil.rmtree(a.work, ignore_errors=True)
    root = os.path.join(a.work, "ckptfs")
    backing = os.path.join(root, "backing")
    os.makedirs(backing)
    daemon_args = ["--cache-mem", a.cache_mem] if a.cache_mem else []
    daemon_args += a.daemon_args.split()
    modes = [m for m in a.modes.split(",") if m]
    sfprs = [int(x) for x in a.sfpr.split(",") if x != ""]
    raw = {"args": vars(a), "runs": []}
    cases = []

    try:
        for sfpr in sfprs:
            name = f"ckpt_sfpr{sfpr}"
            ckpt = os.path.join(backing, name)
            bl.log(f"saving {a.mb} MiB, sfpr={sfpr} directly into the backing dir")
            dcp_tool.save(ckpt, a.ranks, a.mb, bool(sfpr), a.seed, timeout=1800)
            ckpt_bytes = bl.tree_bytes(ckpt)
            plan = [(m, False) for m in modes]
            if a.throttle_mbps > 0 and "own" in modes:
                plan.append(("own", True))
            for mode, throttled in plan:
                case = f"{'throttled_' if throttled else ''}load_{mode}_sfpr{sfpr}"
                throttle = (bl.BlkioThrottle(backing, a.throttle_mbps * 1e6) if throttled
                            else contextlib.nullcontext())
                direct, direct_setup, runs, ok, xok = [], [], [], True, True
                for rep in range(a.reps):
                    # alternate the order so that drift on a shared machine cancels out
                    order = ("direct", "ckptfs") if rep % 2 == 0 else ("ckptfs", "direct")
                    for side in order:
                        with throttle:
                            try:
                                if side == "direct":
                                    load_s, setup_s = load_direct(ckpt, a.ranks, mode, a.seed)
                                    direct.append(load_s)
                                    direct_setup.append(setup_s)
                                else:
                                    r = load_ckptfs(root, name, a.ranks, mode, a.seed,
                                                    daemon_args, a.staging_mem, not a.keep_state)
                                    runs.append(r)
                                    raw["runs"].append(dict(r, case=case, rep=rep))
                                    if r["errors"] or r["exit"] != 0:
                                        ok = False
                                    if not crosscheck(r["backing_bytes"], r["io_read_bytes"]):
                                        xok = False
                            except dcp_tool.DcpToolError as e:
                                bl.log(f"{case} {side} rep {rep} failed: {str(e)[-2000:]}")
                                ok = False
                    bl.log(f"{case} rep {rep}: direct {direct[-1] if direct else None} "
                           f"ckptfs {runs[-1]['load_s'] if runs else None}")
                ck_s = bl.median([r["load_s"] for r in runs])
                di_s = bl.median(direct)
                bb = bl.median([r["backing_bytes"] for r in runs])
                io = bl.median([r["io_read_bytes"] for r in runs])
                c = {"case": case, "ckptfs_s": ck_s and round(ck_s, 3),
                     "direct_s": di_s and round(di_s, 3), "ratio": bl.ratio(ck_s, di_s),
                     "backing_bytes": bb and int(bb), "io_read_bytes": io and int(io),
                     "checkpoint_bytes": ckpt_bytes,
                     "setup_s": {"ckptfs": bl.median([r["setup_s"] for r in runs]),
                                 "direct": bl.median(direct_setup)},
                     "backing_ratio": bl.ratio(bb, ckpt_bytes),
                     "cache_backing_bytes": int(bl.median(
                         [r["cache_backing_bytes"] for r in runs]) or 0),
                     "daemon_vm_hwm": max((r["vm_hwm"] or 0) for r in runs) if runs else None,
                     "reps": a.reps, "mb": a.mb, "fresh_state": not a.keep_state,
                     "crosscheck_ok": xok and bool(runs),
                     "ok": ok and len(runs) == a.reps and len(direct) == a.reps}
                cases.append(c)
                print(json.dumps(c), flush=True)
    finally:
        with open(os.path.join(a.out, "bench_load.json"), "w") as f:
            json.dump(dict(raw, cases=cases), f, indent=1)
        if cases:
            plot(cases, os.path.join(a.out, "bench_load.png"))
        shutil.rmtree(a.work, ignore_errors=True)
    return 0 if cases and all(c["ok"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
