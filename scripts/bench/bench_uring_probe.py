#!/usr/bin/env python3
"""How much FUSE over io_uring cuts an open's round trips on this kernel (issue 21's next
step), side by side in one run.

ckptfs-uring-probe (scripts/bench/uring_probe/) serves 64 files of 1 MiB either the
classic way (/dev/fuse read/write, as libfuse 3.14 and ckptfs do) or over io_uring (a queue
per CPU). Readers time Python's open() on them as bench_opens.py does: each reader opens
its own files or all of them, reads 64 KiB and closes them, for 5 rounds. An open here is
an OPEN, a GETATTR (the reads marked the atime stale) and, on close, a FLUSH and a RELEASE.

The uring side sets /sys/module/fuse/parameters/enable_uring to Y for its mount. The
parameter is put back to what it was at the end, and it only lets servers that ask for
io_uring at INIT use it. The probe counts the requests each path served, and a uring side
whose requests did not come over the ring fails the run.

Output: one JSON line per case (open() median and p90 per side, ratio = uring / classic of
the readers' whole time, medians over --reps), bench_uring_probe.json and .png in --out.
Needs root (mount, the module parameter).
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

import bench_opens
import benchlib as bl

PROBE = os.path.join(bl.BIN_DIR, "ckptfs-uring-probe")
PARAM = "/sys/module/fuse/parameters/enable_uring"
NAMES = [f"f{i:03d}" for i in range(64)]


class Probe:
    """A mounted ckptfs-uring-probe; on exit it is stopped by PID and unmounted."""

    def __init__(self, mode, mnt):
        self.mode, self.mnt, self.proc, self.counts = mode, mnt, None, {}

    def __enter__(self):
        if self.mode == "uring":
            with open(PARAM, "w") as f:
                f.write("Y\n")
        self.proc = subprocess.Popen([PROBE, self.mode, self.mnt], stderr=subprocess.PIPE,
                                     text=True)
        deadline = time.time() + 10
        while not bl.is_mounted(self.mnt):
            if self.proc.poll() is not None or time.time() > deadline:
                self.__exit__()
                raise SystemExit(f"ckptfs-uring-probe {self.mode} did not mount")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            try:
                _, err = self.proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                _, err = self.proc.communicate()
            m = re.search(r"requests: classic (\d+) uring (\d+)", err or "")
            if m:
                self.counts = {"classic": int(m.group(1)), "uring": int(m.group(2))}
            self.proc = None
        if bl.is_mounted(self.mnt):
            subprocess.run(["umount", "-l", self.mnt], check=False)
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(bl.REPO, "build-bench"))
    a = ap.parse_args()
    if not os.path.exists(PARAM):
        raise SystemExit(f"{PARAM} is missing: this kernel has no FUSE over io_uring "
                         "(CONFIG_FUSE_IO_URING, Linux 6.14+)")
    if not os.path.exists(PROBE):
        raise SystemExit(f"{PROBE} is missing: build the tree (CKPTFS_BUILD_BENCH=ON)")
    with open(PARAM) as f:
        before = f.read().strip()
    os.makedirs(a.out, exist_ok=True)
    mnt = tempfile.mkdtemp(prefix="ckptfs-uring-probe-")
    raw, cases = [], []
    try:
        for readers, layout in ((1, "own"), (4, "own"), (4, "shared")):
            case = f"{layout}_{readers}_readers"
            runs = {"classic": [], "uring": []}
            for rep in range(a.reps):
                for mode in (("classic", "uring") if rep % 2 == 0 else ("uring", "classic")):
                    with Probe(mode, mnt) as p:
                        for n in NAMES:
                            with open(os.path.join(mnt, n), "rb") as f:
                                f.read()
                        r = bench_opens.run_readers(mnt, NAMES, readers, a.rounds, layout)
                    with open(PARAM, "w") as f:
                        f.write(before + "\n")
                    if mode == "uring" and p.counts.get("uring", 0) < r["opens"]:
                        raise SystemExit(f"the uring side served {p.counts} over the ring: "
                                         "not a measurement of io_uring")
                    r.update(case=case, side=mode, rep=rep, requests=p.counts)
                    raw.append(r)
                    runs[mode].append(r)
                    bl.log(f"{case} rep {rep} {mode}: open median {r['open_us_median']:.0f} us, "
                           f"p90 {r['open_us_p90']:.0f} us, whole {r['whole_s'] * 1000:.1f} ms, "
                           f"requests {p.counts}")
            out = bench_opens.open_case(case, runs, "classic", "uring")
            bl.emit(out)
            cases.append(out)
    finally:
        with open(PARAM, "w") as f:
            f.write(before + "\n")
        if bl.is_mounted(mnt):
            subprocess.run(["umount", "-l", mnt], check=False)
        shutil.rmtree(mnt, ignore_errors=True)
    bl.save_results(a.out, "bench_uring_probe",
                    {"args": vars(a), "kernel": os.uname().release, "cases": cases, "runs": raw},
                    "open round trips: io_uring / /dev/fuse (medians)", cases,
                    ylabel="io_uring / /dev/fuse, whole time (lower is better)")

if __name__ == "__main__":
    main()
