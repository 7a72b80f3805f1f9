#!/usr/bin/env python3
"""A restart from the retained tier over io_uring against /dev/fuse, side by side (issue 21).

A load right after the save is served by the daemon itself, from the retained tier (issue
23): every byte crosses the FUSE transport. Over /dev/fuse the kernel copies a reply
straight from the daemon's blocks; over io_uring the daemon first copies it into the ring
entry. This benchmark times that load on each transport.

Per rep and side (the sides take turns going first): a fresh daemon (--retain-mem 1G,
plus the side's arguments) over an empty backing dir, a torch 1.13 DCP save of --mb MiB
on --ranks gloo ranks (tests/e2e/dcp_tool.py, a file per rank), `ckptfs-admin wait` for
the commit, the page cache dropped, then the load (own shards, every value checked).
Timed: the max over ranks of load_state_dict. Also recorded: the daemon's CPU seconds
during the load and the retained tier's bytes served (every byte of the load, or the case
is not this one).

Sides: devfuse (--fuse-uring off) and uring (--fuse-uring on; root: the daemon turns the
kernel's switch on for its own start). ratio = uring / devfuse, medians over --reps, and the
paired median of per-rep ratios with its 90% interval. Output: one JSON line per case and
bench_retained_transport.{json,png} in --out. Needs root and a kernel with FUSE over
io_uring (Linux 6.14+, CONFIG_FUSE_IO_URING).
"""
import argparse
import os
import shutil
import sys

import benchlib as bl

sys.path.insert(0, bl.E2E_DIR)
import dcp_tool  # noqa: E402

SIDES = {"devfuse": ["--fuse-uring", "off"], "uring": ["--fuse-uring", "on"]}


def one_load(work, side, ranks, mb):
    root = os.path.join(work, side)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    d = bl.Daemon(root, staging="1G", args=["--retain-mem", "1G", *SIDES[side]])
    try:
        with d:
            ckpt = os.path.join(d.mnt, "run", "iter_0000001")
            dcp_tool.save(ckpt, ranks=ranks, mb=mb, single_file_per_rank=True)
            ok, _ = d.wait(ckpt)
            if not ok:
                raise RuntimeError(f"{side}: the checkpoint did not commit")
            bl.drop_caches()
            before, cpu0 = d.stats(), d.cpu_s()
            r = dcp_tool.load(ckpt, ranks=ranks, mode="own")
            after = d.stats()
            out = {"load_s": r["load_s_max"], "daemon_cpu_s": round(d.cpu_s() - cpu0, 3),
                   "transport": after.get("fuse_transport"),
                   "retained_bytes_served": (after.get("retained", {}).get("hit_bytes", 0)
                                             - before.get("retained", {}).get("hit_bytes", 0))}
            d.unmount()
            return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--ranks", default="1,4", help="rank counts, one case each")
    ap.add_argument("--work", default=os.path.join(bl.REPO, "build-bench", "retained-work"))
    ap.add_argument("--out", default=os.path.join(bl.REPO, "build-bench"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    raw = {"args": vars(a), "kernel": os.uname().release, "loads": []}
    cases = []
    sides = list(SIDES)
    for ranks in [int(x) for x in a.ranks.split(",") if x]:
        got = {s: [] for s in sides}
        for rep in range(a.reps):
            k = rep % len(sides)
            for side in sides[k:] + sides[:k]:
                r = one_load(a.work, side, ranks, a.mb)
                got[side].append(r)
                raw["loads"].append(dict(r, ranks=ranks, side=side, rep=rep))
                bl.log(f"{ranks} rank(s) rep {rep} {side}: {r['load_s']:.3f} s "
                       f"({r['transport']}, {r['retained_bytes_served'] >> 20} MiB retained)")
        med = {s: bl.median([r["load_s"] for r in got[s]]) for s in sides}
        c = {"case": f"retained_{ranks}rank", "devfuse_s": med["devfuse"], "uring_s": med["uring"],
             "ratio": bl.ratio(med["uring"], med["devfuse"]),
             "paired": bl.paired_ratio([r["load_s"] for r in got["uring"]],
                                       [r["load_s"] for r in got["devfuse"]]),
             "daemon_cpu_s": {s: bl.median([r["daemon_cpu_s"] for r in got[s]]) for s in sides},
             "transports": {s: got[s][0]["transport"] for s in sides},
             "retained_bytes_served": {s: min(r["retained_bytes_served"] for r in got[s])
                                       for s in sides}}
        cases.append(c)
        bl.emit(c)
    raw["cases"] = cases
    bl.save_results(a.out, "bench_retained_transport", raw,
                    f"retained-tier load, {a.mb} MiB: io_uring / /dev/fuse", cases,
                    ylabel="io_uring / /dev/fuse (lower is better)")


if __name__ == "__main__":
    main()
