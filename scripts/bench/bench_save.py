#!/usr/bin/env python3
"""Save stall and time to durable: a 4-rank torch DCP save of 1 GiB through a
ckptfs mount (--durability async) against the same save written directly to
a directory on the backing file system, side by side in one run.

Cases (one JSON object each, medians over --reps):
  save_stall_sfpr{1,0}       max over ranks of save_state_dict; ckptfs vs direct
  time_to_durable_sfpr{1,0}  first byte written -> checkpoint committed (from
                             .ckptfs/stats sampled every 50 ms; `ckptfs-admin
                             wait` must also succeed), vs the direct save time.
                             committed_after_return_s < 0 means it committed
                             before the rank processes had even exited.
  peak_rss                   daemon VmHWM vs the staging and retained-tier budgets
Every ckptfs checkpoint must commit, and on rep 0 its files on the backing
store must be byte-identical to the direct save of the same seed (ok=false
otherwise). Writes bench_save.png (ratios and flush progress over time,
from .ckptfs/stats polled every 50 ms) and bench_save.json (raw numbers)
into --out.
"""
import argparse
import json
import os
import shlex
import shutil
import sys
import time

import benchlib as bl

sys.path.insert(0, bl.E2E_DIR)
import dcp_tool  # noqa: E402  (parent side never imports torch)

PROGRESS_KEYS = ("bytes_written", "bytes_flushed", "bytes_published", "staging_used")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--modes", default="1,0", help="single_file_per_rank values to run")
    ap.add_argument("--staging-mem", default="2G")
    ap.add_argument("--flush-threads", type=int, default=None)
    ap.add_argument("--daemon-args", default="",
                    help="extra daemon flags, e.g. '--staging-hugepages on' (one string)")
    ap.add_argument("--work", default=os.path.join(bl.REPO, "build-bench", "save-work"),
                    help="scratch dir on the backing file system (wiped)")
    ap.add_argument("--out", default=os.path.join(bl.REPO, "build-bench"))
    a = ap.parse_args()

    os.makedirs(a.out, exist_ok=True)
    shutil.rmtree(a.work, ignore_errors=True)
    direct_root = os.path.join(a.work, "direct")
    os.makedirs(direct_root)
    extra = ["--durability", "async"]
    if a.flush_threads:
        extra += ["--flush-threads", str(a.flush_threads)]
    extra += shlex.split(a.daemon_args)
    modes = [int(x) for x in a.modes.split(",") if x != ""]
    raw = {"args": vars(a), "runs": []}
    cases = []
    plotted = None

    with bl.Daemon(os.path.join(a.work, "ckptfs"), staging=a.staging_mem, args=extra) as d:
        bl.log(f"ckptfs pid {d.pid} mounted at {d.mnt}, staging {a.staging_mem}")
        io0 = bl.proc_io(d.pid)
        for sfpr in modes:
            stall_c, stall_d, durable_c, after_c, oks, backing_bytes = [], [], [], [], [], []
            for rep in range(a.reps):
                seed = 1000 * sfpr + rep + 1
                name = f"sfpr{sfpr}_r{rep}"
                order = ("direct", "ckptfs") if rep % 2 == 0 else ("ckptfs", "direct")
                run = {"mode": sfpr, "rep": rep, "seed": seed}
                direct_dir = os.path.join(direct_root, name)
                ckpt = os.path.join(d.mnt, name)
                for side in order:
                    bl.sync()
                    if side == "direct":
                        r = dcp_tool.save(direct_dir, a.ranks, a.mb, bool(sfpr), seed, timeout=900)
                        run["direct_save_s"] = r["save_s_max"]
                        stall_d.append(r["save_s_max"])
                        bl.log(f"{name} direct: save {r['save_s_max']:.2f} s")
                        continue
                    base = d.stats()
                    poller = bl.StatsPoller(d.mnt).start()
                    t_call = time.monotonic()
                    r = dcp_tool.save(ckpt, a.ranks, a.mb, bool(sfpr), seed, timeout=900)
                    t_ret = time.monotonic()
                    ok, wait_s = d.wait(ckpt)
                    t_wait_end = time.monotonic()
                    samples = poller.stop()
                    t_first = poller.first_time("bytes_written", base["bytes_written"]) or t_call
                    # The commit often lands while the ranks are still tearing
                    # down, before `wait` is even called: take it from the
                    # 50 ms stats samples, and `wait` returning as the fallback.
                    committed0 = base.get("checkpoints", {}).get("committed", 0)
                    t_commit = poller.first_time_where(
                        lambda s: s.get("checkpoints", {}).get("committed", 0) > committed0
                    ) or t_wait_end
                    states = {c.get("path"): c.get("state") for c in d.checkpoints()}
                    state = next((s for p, s in states.items()
                                  if p and os.path.basename(p.rstrip("/")) == name), None)
                    ok = ok and state == "committed"
                    run.update(ckptfs_save_s=r["save_s_max"], durable_s=t_commit - t_first,
                               wait_returned_after_return_s=t_wait_end - t_ret,
                               committed_after_return_s=t_commit - t_ret, wait_s=wait_s,
                               state=state, samples=len(samples))
                    stall_c.append(r["save_s_max"])
                    durable_c.append(t_commit - t_first)
                    after_c.append(t_commit - t_ret)
                    backing_bytes.append(bl.tree_bytes(os.path.join(d.backing, name)))
                    oks.append(ok)
                    bl.log(f"{name} ckptfs: save {r['save_s_max']:.2f} s, committed "
                           f"{t_commit - t_first:.2f} s after the first write ({state})")
                    if plotted is None or sfpr == modes[0]:
                        t0 = t_first - 0.5
                        plotted = {
                            "name": name,
                            "progress": poller.series(t0, PROGRESS_KEYS, base),
                            "markers": [(round(t_first + r["save_s_max"] - t0, 3),
                                         "save_state_dict done"),
                                        (round(t_commit - t0, 3), "committed")]}
                if rep == 0:
                    same = (dcp_tool.sha256_tree(direct_dir)
                            == dcp_tool.sha256_tree(os.path.join(d.backing, name)))
                    run["identical_to_direct"] = same
                    oks.append(same)
                    if not same:
                        bl.log(f"{name}: backing files differ from the direct save!")
                shutil.rmtree(direct_dir)
                shutil.rmtree(ckpt)  # through the mount, like a checkpoint rotation
                raw["runs"].append(run)
            ok = all(oks) and len(stall_c) == a.reps
            for case, c, dd in ((f"save_stall_sfpr{sfpr}", stall_c, stall_d),
                                (f"time_to_durable_sfpr{sfpr}", durable_c, stall_d)):
                mc, md = bl.median(c), bl.median(dd)
                extra_fields = {}
                if case.startswith("time_to_durable"):
                    extra_fields["committed_after_return_s"] = bl.median(after_c)
                cases.append({"case": case, "ckptfs_s": round(mc, 3), "direct_s": round(md, 3),
                              "ratio": bl.ratio(mc, md), "backing_bytes": bl.median(backing_bytes),
                              "ok": ok, "reps": a.reps, "mb": a.mb, "ranks": a.ranks,
                              "ckptfs_all": [round(x, 3) for x in c],
                              "direct_all": [round(x, 3) for x in dd], **extra_fields})
                bl.emit(cases[-1])
        s = d.stats()
        hwm = bl.vm_hwm(d.pid)
        io1 = bl.proc_io(d.pid)
        limit = s.get("staging_limit") or bl.parse_size(a.staging_mem)
        # The retained tier (issue 23, on by default) keeps the committed bytes within its
        # own budget: the daemon's budget is staging + the tier's.
        retain_limit = s.get("retained_limit_bytes") or s.get("retained_limit") or 0
        budget = limit + retain_limit
        cases.append({"case": "peak_rss", "ckptfs_s": None, "direct_s": None,
                      "ratio": bl.ratio(hwm, budget), "backing_bytes": s.get("backing_bytes_read"),
                      "ok": hwm <= budget + 512 * bl.MiB and s.get("errors", 0) == 0,
                      "peak_rss_bytes": hwm, "staging_limit": limit,
                      "retained_limit": retain_limit,
                      "proc_read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
                      "proc_write_bytes": io1.get("write_bytes", 0) - io0.get("write_bytes", 0),
                      "daemon_errors": s.get("errors")})
        bl.emit(cases[-1])
        raw["final_stats"] = s
        rc = d.unmount()
        if rc != 0:
            bl.log(f"daemon exited {rc} on unmount")
    shutil.rmtree(a.work, ignore_errors=True)

    raw["cases"] = cases
    raw["plotted"] = plotted
    with open(os.path.join(a.out, "bench_save.json"), "w") as f:
        json.dump(raw, f, indent=1)
    time_cases = [c for c in cases if c["case"] != "peak_rss"]
    bl.plot(os.path.join(a.out, "bench_save.png"),
            f"DCP save, {a.ranks} ranks, {a.mb} MiB (median of {a.reps})", time_cases,
            progress=plotted and plotted["progress"],
            progress_title=f"flush progress, {plotted['name']}" if plotted else "",
            markers=plotted["markers"] if plotted else ())
    return 0 if all(c["ok"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
