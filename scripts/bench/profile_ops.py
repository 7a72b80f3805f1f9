#!/usr/bin/env python3
"""Where the time goes: per-FUSE-op latency (request -> reply, from the daemon's
/metrics histograms), syscalls of the daemon (strace -c, optional) and the
state-db write counters, over one 4-rank DCP save per layout and one cold
own-shard load per layout, on a fresh daemon each.

  profile_ops.py [--mb 256] [--strace] [--bin-dir DIR] [--out DIR]

Prints one JSON object per phase: {"phase": "save_sfpr0", "ops": {op: {"n":..,
"mean_us":.., "p50_us":.., "p99_us":..}}, "files":.., "syscalls": {...},
"stats": {selected counters}}. Not a benchmark with a baseline (see
bench_save.py / bench_load.py for ratios); it explains them.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import benchlib as bl

sys.path.insert(0, bl.E2E_DIR)
import dcp_tool  # noqa: E402

def diff(before, after):
    out = {}
    for op, h in after.items():
        b = before.get(op, {"buckets": [(le, 0.0) for le, _ in h["buckets"]], "sum": 0, "count": 0})
        n = h.get("count", 0) - b.get("count", 0)
        if n <= 0:
            continue
        s = h.get("sum", 0) - b.get("sum", 0)
        cum = [(le, c - bc) for (le, c), (_, bc) in zip(h["buckets"], b["buckets"])]

        def q(p):
            for le, c in cum:
                if c >= p * n:
                    return le * 1e6
            return None

        out[op] = {"n": int(n), "mean_us": round(s / n * 1e6, 1), "total_s": round(s, 3),
                   "p50_le_us": q(0.5), "p99_le_us": q(0.99)}
    return out


def strace_start(pid, path):
    return subprocess.Popen(["strace", "-f", "-c", "-o", path, "-p", str(pid)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def strace_stop(proc, path):
    proc.send_signal(2)
    proc.wait(timeout=30)
    calls = {}
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 5 and parts[-1].isidentifier() and parts[3].isdigit():
                    calls[parts[-1]] = {"calls": int(parts[3]), "seconds": float(parts[1])}
    except OSError:
        pass
    return calls


KEEP = ("bytes_written", "bytes_flushed", "bytes_published", "backing_bytes_read",
        "bytes_served", "prefetched_bytes", "state_db_writes", "state_db_synced_writes")


def phase(name, d, fn, use_strace, out):
    before, _ = bl.op_histograms(d.mnt)
    s0 = d.stats()
    st = strace_start(d.pid, os.path.join(out, f"strace_{name}.txt")) if use_strace else None
    if st:
        time.sleep(1.0)
    t0 = time.monotonic()
    info = fn()
    wall = time.monotonic() - t0
    sys_calls = strace_stop(st, os.path.join(out, f"strace_{name}.txt")) if st else None
    after, text = bl.op_histograms(d.mnt)
    s1 = d.stats()
    with open(os.path.join(out, f"metrics_{name}.txt"), "w") as f:
        f.write(text)
    stats = {k: s1[k] - s0.get(k, 0) for k in KEEP if isinstance(s1.get(k), (int, float))}
    row = {"phase": name, "wall_s": round(wall, 3), "info": info, "ops": diff(before, after),
           "stats": stats}
    if sys_calls is not None:
        row["syscalls"] = {k: v for k, v in sys_calls.items()
                           if k in ("fsync", "fdatasync", "pwrite64", "pread64", "write", "read",
                                    "writev", "futex", "openat", "renameat2", "fstat",
                                    "newfstatat", "splice", "statfs", "sync_file_range")}
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--strace", action="store_true")
    ap.add_argument("--sfpr", default="0,1")
    ap.add_argument("--work", default=os.path.join(bl.REPO, "build-bench", "profile-work"))
    ap.add_argument("--out", default=os.path.join(bl.REPO, "build-bench"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    shutil.rmtree(a.work, ignore_errors=True)
    rows = []
    for sfpr in [int(x) for x in a.sfpr.split(",") if x]:
        root = os.path.join(a.work, f"sfpr{sfpr}")
        name = f"ckpt{sfpr}"
        with bl.Daemon(root, args=["--durability", "async"]) as d:
            def save():
                r = dcp_tool.save(os.path.join(d.mnt, name), a.ranks, a.mb, bool(sfpr), 7,
                                  timeout=900)
                ok, wait_s = d.wait(os.path.join(d.mnt, name))
                files = len(os.listdir(os.path.join(d.mnt, name)))
                return {"save_s_max": round(r["save_s_max"], 3), "committed": ok,
                        "wait_after_s": round(wait_s, 3), "files": files}
            rows.append(phase(f"save_sfpr{sfpr}", d, save, a.strace, a.out))
            d.unmount()
        shutil.rmtree(os.path.join(root, "state"), ignore_errors=True)
        with bl.Daemon(root) as d:
            bl.drop_caches()

            def load():
                r = dcp_tool.load(os.path.join(d.mnt, name), a.ranks, "own", 7, timeout=900)
                return {"load_s_max": round(r["load_s_max"], 3)}
            rows.append(phase(f"load_own_sfpr{sfpr}", d, load, a.strace, a.out))
            d.unmount()
    shutil.rmtree(a.work, ignore_errors=True)
    with open(os.path.join(a.out, "profile_ops.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
