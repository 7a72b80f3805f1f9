#!/usr/bin/env python3
"""What an open costs through ckptfs against the disk, side by side in one run (issue 21).

A DCP load with a file per item opens every file it reads: torch 2.14, 4 ranks, 64 files,
where every rank reads every file, came out 1.07x (replicated) and 1.11x (reshard) direct,
all of it in open() (docs/BENCHMARKS.md). This benchmark times that cost alone.

Each case runs --readers reader processes, started together. Each opens each of --files
files of 1 MiB with Python's open() (openat + fstat), reads the first 64 KiB and closes it,
for --rounds rounds. The files are in the page cache, so what is timed is the open, not
the disk.
  own      reader i opens only files i, i + R, i + 2R, ...
  shared   every reader opens every file (a replicated or resharded load). Once another
           reader has read a file through passthrough, the kernel holds the inode's atime
           stale, so the fstat is a GETATTR round trip as well as the OPEN.
Each case runs with no other load, and with --burners CPU-bound processes beside the
readers (default: one per core), as when a node runs more ranks than it has cores.

Sides, in alternating order per rep: direct (the backing dir) and ckptfs (one mount with
passthrough, the default, for the whole run).

Output: one JSON line per case: open() latency median and p90 in microseconds per side,
the readers' whole time per side, ratio = ckptfs / direct of the whole time (medians over
--reps), and the daemon's round trips per open (open, getattr, lookup). bench_opens.json and
bench_opens.png go in --out. Run it as root, as the other read benchmarks: passthrough
needs CAP_SYS_ADMIN.
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

import benchlib as bl

READER = r"""
import json, os, sys, time
start_at, rounds, files = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
lat = []
while time.monotonic() < start_at:
    time.sleep(0.0005)
t0 = time.monotonic()
for _ in range(rounds):
    for f in files:
        a = time.perf_counter()
        fh = open(f, "rb")
        lat.append(time.perf_counter() - a)
        fh.read(65536)
        fh.close()
print(json.dumps({"whole_s": time.monotonic() - t0, "lat": lat}))
"""
BURNER = "while True: pass"
OPS = ("open", "getattr", "lookup")


def op_counts(mnt):
    ops, _ = bl.op_histograms(mnt)
    return {op: int(ops.get(op, {}).get("count", 0)) for op in OPS}


def run_readers(base, names, readers, rounds, layout):
    start_at = time.monotonic() + 0.5
    procs = []
    for i in range(readers):
        mine = names if layout == "shared" else names[i::readers]
        procs.append(subprocess.Popen(
            [sys.executable, "-c", READER, str(start_at), str(rounds)] +
            [os.path.join(base, n) for n in mine], stdout=subprocess.PIPE, text=True))
    res = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"a reader exited {p.returncode}")
        res.append(json.loads(out))
    lat = sorted(x for r in res for x in r["lat"])
    return {"whole_s": max(r["whole_s"] for r in res),
            "open_us_median": statistics.median(lat) * 1e6,
            "open_us_p90": lat[int(0.9 * (len(lat) - 1))] * 1e6,
            "opens": len(lat)}


def open_case(case, runs, base, other):
    """The summary of one case: medians over reps of each side's whole time and open()
    latency; ratio = other / base of the whole time. runs: {side: [run_readers results]}."""
    med = {s: {k: statistics.median(x[k] for x in v)
               for k in ("whole_s", "open_us_median", "open_us_p90")}
           for s, v in runs.items()}
    out = {"case": case, "ratio": bl.ratio(med[other]["whole_s"], med[base]["whole_s"])}
    for s in (base, other):
        out[f"{s}_s"] = med[s]["whole_s"]
        out[f"{s}_open_us"] = round(med[s]["open_us_median"], 1)
        out[f"{s}_open_us_p90"] = round(med[s]["open_us_p90"], 1)
    return out


class Burners:
    """n CPU-bound processes, killed by PID on exit."""

    def __init__(self, n):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(self.n)]
        time.sleep(0.3)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--burners", type=int, default=os.cpu_count())
    ap.add_argument("--work", default=os.path.join(bl.REPO, "build-bench", "opens-work"))
    ap.add_argument("--out", default=os.path.join(bl.REPO, "build-bench"))
    ap.add_argument("--ckptfs-args", default="", help="more daemon arguments, e.g. "
                    "'--fuse-uring on'")
    a = ap.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.out, exist_ok=True)
    d = bl.Daemon(a.work, staging="256M", args=a.ckptfs_args.split())
    data = os.path.join(d.backing, "opens")
    os.makedirs(data)
    names = [f"item_{i:03d}.bin" for i in range(a.files)]
    block = os.urandom(1 << 20)
    for n in names:
        with open(os.path.join(data, n), "wb") as f:
            f.write(block)
    bl.sync()
    raw, cases = [], []
    with d:
        mdata = os.path.join(d.mnt, "opens")
        for n in names:  # into the page cache, and every dentry looked up once
            with open(os.path.join(mdata, n), "rb") as f:
                f.read()
        for burners in (0, a.burners):
            for layout in ("own", "shared"):
                case = f"{layout}_{'loaded' if burners else 'idle'}"
                runs = {"direct": [], "ckptfs": []}
                trips = []
                with Burners(burners):
                    for rep in range(a.reps):
                        for side in (("direct", "ckptfs") if rep % 2 == 0 else
                                     ("ckptfs", "direct")):
                            base = data if side == "direct" else mdata
                            c0 = op_counts(d.mnt)
                            r = run_readers(base, names, a.readers, a.rounds, layout)
                            c1 = op_counts(d.mnt)
                            if side == "ckptfs":
                                trips.append({op: (c1[op] - c0[op]) / r["opens"] for op in OPS})
                            r.update(case=case, side=side, rep=rep)
                            raw.append(r)
                            runs[side].append(r)
                            bl.log(f"{case} rep {rep} {side}: {r['whole_s']:.3f} s, open "
                                   f"median {r['open_us_median']:.0f} us, p90 "
                                   f"{r['open_us_p90']:.0f} us")
                out = open_case(case, runs, "direct", "ckptfs")
                out.update(readers=a.readers, files=a.files, burners=burners, rounds=a.rounds,
                           round_trips_per_open={op: round(statistics.median(t[op] for t in trips), 2)
                                                 for op in OPS})
                bl.emit(out)
                cases.append(out)
        d.unmount()
    bl.save_results(a.out, "bench_opens",
                    {"args": vars(a), "kernel": os.uname().release, "cases": cases, "runs": raw},
                    "open + 64 KiB read + close: ckptfs / direct (medians)", cases)
    shutil.rmtree(a.work, ignore_errors=True)


if __name__ == "__main__":
    main()
