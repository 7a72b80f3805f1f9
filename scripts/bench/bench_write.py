#!/usr/bin/env python3
"""Staged write throughput: `dd bs=1M` of 2 GiB into a ckptfs mount against
the same dd into a directory on the backing file system with conv=fsync,
side by side in one run.

Cases (one JSON object each, medians over --reps):
  staged_write     dd returns (data staged) vs direct dd conv=fsync
  write_durable    dd + `ckptfs-admin wait` (published) vs direct dd conv=fsync
  cold_read        dd of the published file back to /dev/null with the page
                   cache dropped, through the mount vs direct (root only)
  fuse_ceiling     the same dd into ckptfs-null-fuse (a FUSE server that discards
                   writes, as the issue defines the ceiling: libfuse's null example,
                   the cached write path, which copies each byte twice), measured in
                   the same reps; ckptfs_s is the staged dd, direct_s the null dd,
                   ratio their quotient. ckptfs's write-only opens bypass the page
                   cache (one copy), so it can stage faster than this ceiling (ratio
                   below 1.0 is faster here, as ckptfs_s / direct_s)
  fio_write_{4k,1m} fio sequential writes (psync, one job, no fsync) into the mount
                   vs into a plain directory on the backing file system;
                   throughput_ratio = ckptfs MB/s / direct MB/s (skipped without fio)
The source is a random file generated once and kept in the page cache; every
file written through ckptfs is compared (cmp) with it on the backing store.
Writes bench_write.png (ratios and flush progress of one dd) and
bench_write.json into --out.
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import benchlib as bl

PROGRESS_KEYS = ("bytes_written", "bytes_flushed", "bytes_published", "staging_used")


def warm(src):
    """A write's source comes from the page cache every time: the cold-read case drops
    it, and a dd that read it from disk would be slowed by that, not by its target."""
    subprocess.run(["cat", src], stdout=subprocess.DEVNULL, check=True)


def dd(src, dst, extra=(), warm_src=False):
    if warm_src:
        warm(src)
    t0 = time.monotonic()
    subprocess.run(["dd", f"if={src}", f"of={dst}", "bs=1M", "status=none", *extra], check=True)
    return time.monotonic() - t0


NULL_FUSE = os.path.join(bl.BIN_DIR, "ckptfs-null-fuse")


class NullFuse:
    """ckptfs-null-fuse mounted in the foreground, owned by this process."""

    def __init__(self, mnt):
        self.mnt = mnt
        self.proc = None

    def __enter__(self):
        if not os.access(NULL_FUSE, os.X_OK):
            return None
        os.makedirs(self.mnt, exist_ok=True)
        self.proc = subprocess.Popen([NULL_FUSE, self.mnt, "-f"], stderr=subprocess.DEVNULL)
        deadline = time.time() + 20
        while time.time() < deadline and not bl.is_mounted(self.mnt):
            time.sleep(0.05)
        if not bl.is_mounted(self.mnt):
            self.__exit__()
            return None
        return os.path.join(self.mnt, "null")

    def __exit__(self, *exc):
        if bl.is_mounted(self.mnt):
            subprocess.run(["fusermount3", "-u", self.mnt], check=False)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return False


def fio_write(directory, bs, size_mb):
    """Seconds and MB/s of a fio sequential write of size_mb into directory."""
    r = subprocess.run(["fio", "--name=w", f"--directory={directory}", "--rw=write",
                        f"--bs={bs}", f"--size={size_mb}M", "--ioengine=psync", "--numjobs=1",
                        "--unlink=1", "--output-format=json"],
                       capture_output=True, text=True, check=True)
    job = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0]["write"]
    secs = job["runtime"] / 1000.0
    return secs, job["bw_bytes"] / 1e6


def same(a, b):
    return subprocess.run(["cmp", "-s", a, b]).returncode == 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--staging-mem", default="2G")
    ap.add_argument("--flush-threads", type=int, default=None)
    ap.add_argument("--daemon-args", default="",
                    help="extra daemon flags, e.g. '--fuse-splice off' (one string)")
    ap.add_argument("--fio-mb", type=int, default=256, help="bytes per fio run (MiB)")
    ap.add_argument("--work", default=os.path.join(bl.REPO, "build-bench", "write-work"),
                    help="scratch dir on the backing file system (wiped)")
    ap.add_argument("--out", default=os.path.join(bl.REPO, "build-bench"))
    a = ap.parse_args()

    os.makedirs(a.out, exist_ok=True)
    shutil.rmtree(a.work, ignore_errors=True)
    direct = os.path.join(a.work, "direct")
    os.makedirs(direct)
    src = os.path.join(a.work, "src.bin")
    bl.log(f"generating {a.mb} MiB of random source data")
    subprocess.run(["dd", "if=/dev/urandom", f"of={src}", "bs=1M", f"count={a.mb}",
                    "status=none"], check=True)
    size = a.mb * bl.MiB
    extra = ["--durability", "async"]
    if a.flush_threads:
        extra += ["--flush-threads", str(a.flush_threads)]
    extra += shlex.split(a.daemon_args)
    can_drop = bl.drop_caches()
    if not can_drop:
        bl.log("cannot drop the page cache (not root): cold_read is skipped")
    subprocess.run(["cat", src], stdout=subprocess.DEVNULL, check=True)  # warm the source
    res = {k: [] for k in ("staged_c", "durable_c", "direct", "read_c", "read_d", "null")}
    fio = {bs: {"c": [], "d": []} for bs in ("4k", "1m")}
    have_fio = shutil.which("fio") is not None
    oks, raw, backing_read = [], {"args": vars(a), "runs": []}, []

    with bl.Daemon(os.path.join(a.work, "ckptfs"), staging=a.staging_mem, args=extra) as d:
        bl.log(f"ckptfs pid {d.pid} mounted at {d.mnt}, staging {a.staging_mem}")
        # The progress plot comes from one dd of its own, not timed: sampling the stats
        # every 50 ms costs this 2-core machine CPU that the null-FUSE dd does not pay.
        warm(src)
        base = d.stats()
        poller = bl.StatsPoller(d.mnt).start()
        t0 = time.monotonic()
        t_dd = dd(src, os.path.join(d.mnt, "plotted"))
        ok, _ = d.wait(os.path.join(d.mnt, "plotted"))
        t_pub = time.monotonic() - t0
        poller.stop()
        oks.append(ok)
        plotted = {"progress": poller.series(t0 - 0.2, PROGRESS_KEYS, base),
                   "markers": [(round(t_dd + 0.2, 3), "dd returned"),
                               (round(t_pub + 0.2, 3), "published")]}
        os.unlink(os.path.join(d.mnt, "plotted"))
        for rep in range(a.reps):
            run = {"rep": rep}
            order = ("direct", "ckptfs") if rep % 2 == 0 else ("ckptfs", "direct")
            dfile, cfile = os.path.join(direct, f"f{rep}"), os.path.join(d.mnt, f"f{rep}")
            with NullFuse(os.path.join(a.work, "null-mnt")) as null_file:
                if null_file:
                    t = dd(src, null_file, warm_src=True)
                    res["null"].append(t)
                    run["null_fuse_s"] = t
            for side in order:
                bl.sync()
                if side == "direct":
                    t = dd(src, dfile, ["conv=fsync"], warm_src=True)
                    res["direct"].append(t)
                    run["direct_s"] = t
                    continue
                warm(src)  # outside t_pub as well
                t0 = time.monotonic()
                t_dd = dd(src, cfile)
                ok, _ = d.wait(cfile)
                t_pub = time.monotonic() - t0
                res["staged_c"].append(t_dd)
                res["durable_c"].append(t_pub)
                run.update(staged_s=t_dd, durable_s=t_pub)
                ok = ok and same(src, os.path.join(d.backing, f"f{rep}"))
                oks.append(ok)
            bl.log(f"rep {rep}: ckptfs dd {run['staged_s']:.2f} s, published "
                   f"{run['durable_s']:.2f} s; direct dd conv=fsync {run['direct_s']:.2f} s")
            if can_drop:
                b0 = d.stats().get("backing_bytes_read", 0)
                bl.drop_caches()
                t_c = dd(cfile, "/dev/null")
                backing_read.append(d.stats().get("backing_bytes_read", 0) - b0)
                bl.drop_caches()
                t_d = dd(dfile, "/dev/null")
                res["read_c"].append(t_c)
                res["read_d"].append(t_d)
                run.update(read_ckptfs_s=t_c, read_direct_s=t_d)
                bl.log(f"rep {rep}: cold read ckptfs {t_c:.2f} s, direct {t_d:.2f} s")
            os.unlink(cfile)
            os.unlink(dfile)
            if have_fio:
                for bs in fio:
                    fdir_c, fdir_d = os.path.join(d.mnt, f"fio{rep}"), os.path.join(direct, "fio")
                    os.makedirs(fdir_c, exist_ok=True)
                    os.makedirs(fdir_d, exist_ok=True)
                    for side in order:
                        bl.sync()
                        secs, mbps = fio_write(fdir_c if side == "ckptfs" else fdir_d, bs,
                                               a.fio_mb)
                        fio[bs]["c" if side == "ckptfs" else "d"].append((secs, mbps))
                        run[f"fio_{bs}_{side}_MBps"] = round(mbps, 1)
                    shutil.rmtree(fdir_c)
                    shutil.rmtree(fdir_d)
                bl.log(f"rep {rep}: fio 4k {run['fio_4k_ckptfs_MBps']} vs "
                       f"{run['fio_4k_direct_MBps']} MB/s, 1m {run['fio_1m_ckptfs_MBps']} vs "
                       f"{run['fio_1m_direct_MBps']} MB/s")
            raw["runs"].append(run)
        s = d.stats()
        hwm = bl.vm_hwm(d.pid)
        rc = d.unmount()
        if rc != 0:
            bl.log(f"daemon exited {rc} on unmount")
            oks.append(False)
    shutil.rmtree(a.work, ignore_errors=True)

    ok = all(oks) and s.get("errors", 0) == 0
    md = bl.median(res["direct"])
    cases = []
    for case, key in (("staged_write", "staged_c"), ("write_durable", "durable_c")):
        mc = bl.median(res[key])
        cases.append({"case": case, "ckptfs_s": round(mc, 3), "direct_s": round(md, 3),
                      "ratio": bl.ratio(mc, md), "backing_bytes": size, "ok": ok,
                      "ckptfs_GBps": round(size / mc / 1e9, 3),
                      "direct_GBps": round(size / md / 1e9, 3), "reps": a.reps,
                      "ckptfs_all": [round(x, 3) for x in res[key]],
                      "direct_all": [round(x, 3) for x in res["direct"]],
                      "peak_rss_bytes": hwm, "staging_limit": s.get("staging_limit")})
        bl.emit(cases[-1])
    if res["read_c"]:
        mc, mdr = bl.median(res["read_c"]), bl.median(res["read_d"])
        cases.append({"case": "cold_read", "ckptfs_s": round(mc, 3), "direct_s": round(mdr, 3),
                      "ratio": bl.ratio(mc, mdr), "backing_bytes": bl.median(backing_read),
                      "ok": ok, "ckptfs_GBps": round(size / mc / 1e9, 3),
                      "direct_GBps": round(size / mdr / 1e9, 3), "reps": a.reps})
        bl.emit(cases[-1])
    if res["null"]:
        mc, mn = bl.median(res["staged_c"]), bl.median(res["null"])
        cases.append({"case": "fuse_ceiling", "ckptfs_s": round(mc, 3), "direct_s": round(mn, 3),
                      "ratio": bl.ratio(mc, mn), "ok": ok, "ckptfs_GBps": round(size / mc / 1e9, 3),
                      "null_fuse_GBps": round(size / mn / 1e9, 3), "reps": a.reps,
                      "null_all": [round(x, 3) for x in res["null"]]})
        bl.emit(cases[-1])
    for bs, r in fio.items():
        if not r["c"]:
            continue
        mc, md_ = bl.median([x[0] for x in r["c"]]), bl.median([x[0] for x in r["d"]])
        bc, bd = bl.median([x[1] for x in r["c"]]), bl.median([x[1] for x in r["d"]])
        cases.append({"case": f"fio_write_{bs}", "ckptfs_s": round(mc, 3), "direct_s": round(md_, 3),
                      "ratio": bl.ratio(mc, md_), "ok": ok, "ckptfs_MBps": round(bc, 1),
                      "direct_MBps": round(bd, 1), "throughput_ratio": bl.ratio(bc, bd),
                      "reps": a.reps, "mb": a.fio_mb})
        bl.emit(cases[-1])
    raw.update(cases=cases, final_stats=s, plotted=plotted)
    with open(os.path.join(a.out, "bench_write.json"), "w") as f:
        json.dump(raw, f, indent=1)
    bl.plot(os.path.join(a.out, "bench_write.png"),
            f"dd bs=1M {a.mb} MiB (median of {a.reps})", cases,
            progress=plotted and plotted["progress"], progress_title="flush progress of one dd (untimed)",
            markers=plotted["markers"] if plotted else ())
    return 0 if all(c["ok"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
