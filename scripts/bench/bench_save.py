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
  restart_load_sfpr{1,0}     after the last rep, the job restarts and loads the last
                             checkpoint through each mount (page cache dropped): with the
                             retained tier on, ok only when the backing store gave 0 bytes
                             and the tier every byte (issue 42: the tier kept the save)
  peak_rss                   daemon VmHWM vs the staging and retained-tier budgets
Every ckptfs checkpoint must commit, and on rep 0 its files on the backing
store must be byte-identical to the direct save of the same seed (ok=false
otherwise). Writes bench_save.png (ratios and flush progress over time,
from .ckptfs/stats polled every 50 ms) and bench_save.json (raw numbers)
into --out.

--mount NAME=ARG,ARG (repeatable) runs more mounts side by side, each with its
own daemon (the same flags plus ARGs), e.g. noretain=--retain-mem,0 for the
retained tier's A/B (issue 42); --bin-dir NAME=DIR runs mount NAME from another
build (ckptfs=DIR for the main one), so two commits can be compared in one run. Every rep saves into each side once, the
sides' order rotating from rep to rep; each extra mount gets its own stall and
durable cases (NAME suffix) and `stall_ckptfs_vs_NAME`, the paired per-rep
ratio of the main mount's stall to NAME's (ratio < 1: the main mount stalls
less).
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


def save_through(d, ckpt, name, a, sfpr, seed, run, plotted_ref, modes):
    """One save through mount `d`; fills `run` and returns (stall, durable, after, ok)."""
    base = d.stats()
    poller = bl.StatsPoller(d.mnt).start()
    t_call = time.monotonic()
    r = dcp_tool.save(ckpt, a.ranks, a.mb, bool(sfpr), seed, timeout=900)
    t_ret = time.monotonic()
    ok, wait_s = d.wait(ckpt)
    t_wait_end = time.monotonic()
    samples = poller.stop()
    t_first = poller.first_time("bytes_written", base["bytes_written"]) or t_call
    # The commit often lands while the ranks are still tearing down, before `wait` is
    # even called: take it from the 50 ms stats samples, and `wait` returning as the
    # fallback.
    committed0 = base.get("checkpoints", {}).get("committed", 0)
    t_commit = poller.first_time_where(
        lambda s: s.get("checkpoints", {}).get("committed", 0) > committed0) or t_wait_end
    states = {c.get("path"): c.get("state") for c in d.checkpoints()}
    state = next((s for p, s in states.items()
                  if p and os.path.basename(p.rstrip("/")) == name), None)
    ok = ok and state == "committed"
    run.update(save_s=r["save_s_max"], durable_s=t_commit - t_first,
               wait_returned_after_return_s=t_wait_end - t_ret,
               committed_after_return_s=t_commit - t_ret, wait_s=wait_s,
               state=state, samples=len(samples))
    if plotted_ref[0] is None or sfpr == modes[0]:
        t0 = t_first - 0.5
        plotted_ref[0] = {
            "name": name,
            "progress": poller.series(t0, PROGRESS_KEYS, base),
            "markers": [(round(t_first + r["save_s_max"] - t0, 3), "save_state_dict done"),
                        (round(t_commit - t0, 3), "committed")]}
    return r["save_s_max"], t_commit - t_first, t_commit - t_ret, ok


def restart_loads(daemons, name, a, sfpr, seed, cases):
    """After the A/B: the job restarts (new rank processes) and loads the last checkpoint
    through each mount, the page cache dropped first. With the retained tier on, the tier
    kept the save: every byte comes from its memory (retained hit_bytes), none from the
    backing store (daemon backing_bytes_read; a FUSE passthrough read would show as fewer
    hit bytes, since the kernel reads the backing file for the rank)."""
    for m, d in daemons.items():
        bl.drop_caches()
        s0 = d.stats()
        t0 = time.monotonic()
        dcp_tool.load(os.path.join(d.mnt, name), a.ranks, "own", seed, timeout=900)
        load_s = time.monotonic() - t0
        s1 = d.stats()
        size = bl.tree_bytes(os.path.join(d.backing, name))
        backing = s1.get("backing_bytes_read", 0) - s0.get("backing_bytes_read", 0)
        hits = ((s1.get("retained") or {}).get("hit_bytes", 0)
                - (s0.get("retained") or {}).get("hit_bytes", 0))
        tier_on = bool((s1.get("retained") or {}).get("budget_bytes"))
        suffix = "" if m == "ckptfs" else f"_{m}"
        cases.append({"case": f"restart_load_sfpr{sfpr}{suffix}", "ckptfs_s": round(load_s, 3),
                      "direct_s": None, "ratio": None, "backing_bytes": backing,
                      "retained_hit_bytes": hits, "checkpoint_bytes": size,
                      "tier_on": tier_on,
                      # The check: the tier kept the save (0 backing bytes, served
                      # from memory); a mount with the tier off only reports.
                      "ok": (backing == 0 and hits >= size * 0.99) if tier_on else True})
        bl.emit(cases[-1])


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
    ap.add_argument("--mount", action="append", default=[], metavar="NAME=ARG,ARG",
                    help="one more mount side by side with these extra daemon flags, e.g. "
                         "noretain=--retain-mem,0 (repeatable)")
    ap.add_argument("--bin-dir", action="append", default=[], metavar="NAME=DIR",
                    help="mount NAME runs the programs in DIR (another build: two commits "
                         "side by side); repeatable")
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
    mounts = {"ckptfs": []}
    for spec in a.mount:
        mname, _, margs = spec.partition("=")
        if not mname or mname in mounts or mname == "direct":
            ap.error(f"--mount {spec}: give a new name, NAME=ARG,ARG")
        mounts[mname] = [x for x in margs.split(",") if x]
    bins = dict(spec.partition("=")[::2] for spec in a.bin_dir)
    for mname in bins:
        if mname not in mounts:
            ap.error(f"--bin-dir {mname}=...: no such mount")
    modes = [int(x) for x in a.modes.split(",") if x != ""]
    raw = {"args": vars(a), "mounts": mounts, "runs": []}
    cases = []
    plotted = [None]
    daemons = {}
    try:
        for mname, margs in mounts.items():
            d = bl.Daemon(os.path.join(a.work, mname), staging=a.staging_mem,
                          args=extra + margs, bin_dir=bins.get(mname)).start()
            daemons[mname] = d
            bl.log(f"{mname}: ckptfs pid {d.pid} at {d.mnt}, staging {a.staging_mem} {margs}")
        io0 = {m: bl.proc_io(d.pid) for m, d in daemons.items()}
        sides = ["direct"] + list(mounts)
        for sfpr in modes:
            got = {m: {"stall": [], "durable": [], "after": [], "ok": [], "backing": []}
                   for m in mounts}
            stall_d = []
            for rep in range(a.reps):
                seed = 1000 * sfpr + rep + 1
                name = f"sfpr{sfpr}_r{rep}"
                k = rep % len(sides)
                order = sides[k:] + sides[:k]
                run = {"mode": sfpr, "rep": rep, "seed": seed, "order": order}
                direct_dir = os.path.join(direct_root, name)
                for side in order:
                    bl.sync()
                    if side == "direct":
                        r = dcp_tool.save(direct_dir, a.ranks, a.mb, bool(sfpr), seed, timeout=900)
                        run["direct_save_s"] = r["save_s_max"]
                        stall_d.append(r["save_s_max"])
                        bl.log(f"{name} direct: save {r['save_s_max']:.2f} s")
                        continue
                    d = daemons[side]
                    one = {}
                    stall, durable, after, ok = save_through(
                        d, os.path.join(d.mnt, name), name, a, sfpr, seed, one, plotted, modes)
                    run[side] = one
                    g = got[side]
                    g["stall"].append(stall)
                    g["durable"].append(durable)
                    g["after"].append(after)
                    g["ok"].append(ok)
                    g["backing"].append(bl.tree_bytes(os.path.join(d.backing, name)))
                    bl.log(f"{name} {side}: save {stall:.2f} s, committed {durable:.2f} s "
                           f"after the first write ({one['state']})")
                if rep == 0:
                    for m, d in daemons.items():
                        same = (dcp_tool.sha256_tree(direct_dir)
                                == dcp_tool.sha256_tree(os.path.join(d.backing, name)))
                        run.setdefault(m, {})["identical_to_direct"] = same
                        got[m]["ok"].append(same)
                        if not same:
                            bl.log(f"{name} {m}: backing files differ from the direct save!")
                if rep == a.reps - 1:
                    restart_loads(daemons, name, a, sfpr, seed, cases)
                shutil.rmtree(direct_dir)
                for d in daemons.values():  # through the mount, like a checkpoint rotation
                    shutil.rmtree(os.path.join(d.mnt, name))
                raw["runs"].append(run)
            for m, g in got.items():
                ok = all(g["ok"]) and len(g["stall"]) == a.reps
                suffix = "" if m == "ckptfs" else f"_{m}"
                for case, c in ((f"save_stall_sfpr{sfpr}{suffix}", g["stall"]),
                                (f"time_to_durable_sfpr{sfpr}{suffix}", g["durable"])):
                    mc, md = bl.median(c), bl.median(stall_d)
                    extra_fields = {}
                    if case.startswith("time_to_durable"):
                        extra_fields["committed_after_return_s"] = bl.median(g["after"])
                    else:
                        extra_fields["paired"] = bl.paired_ratio(c, stall_d)
                    cases.append({"case": case, "ckptfs_s": round(mc, 3),
                                  "direct_s": round(md, 3), "ratio": bl.ratio(mc, md),
                                  "backing_bytes": bl.median(g["backing"]), "ok": ok,
                                  "reps": a.reps, "mb": a.mb, "ranks": a.ranks,
                                  "ckptfs_all": [round(x, 3) for x in c],
                                  "direct_all": [round(x, 3) for x in stall_d], **extra_fields})
                    bl.emit(cases[-1])
                if m != "ckptfs":
                    main_stall = got["ckptfs"]["stall"]
                    cases.append({"case": f"stall_ckptfs_vs_{m}_sfpr{sfpr}",
                                  "ckptfs_s": round(bl.median(main_stall), 3),
                                  "direct_s": round(bl.median(g["stall"]), 3),
                                  "ratio": bl.ratio(bl.median(main_stall), bl.median(g["stall"])),
                                  "paired": bl.paired_ratio(main_stall, g["stall"]),
                                  "ok": ok, "reps": a.reps, "mb": a.mb, "ranks": a.ranks,
                                  "note": f"ckptfs_s: the main mount's stall, direct_s: {m}'s"})
                    bl.emit(cases[-1])
        for m, d in daemons.items():
            s = d.stats()
            hwm = bl.vm_hwm(d.pid)
            io1 = bl.proc_io(d.pid)
            limit = s.get("staging_limit") or bl.parse_size(a.staging_mem)
            # The retained tier (issue 23, on by default) keeps the committed bytes within
            # its own budget: the daemon's budget is staging + the tier's.
            retained = s.get("retained") or {}
            retain_limit = retained.get("budget_bytes") or 0
            budget = limit + retain_limit
            suffix = "" if m == "ckptfs" else f"_{m}"
            cases.append({"case": f"peak_rss{suffix}", "ckptfs_s": None, "direct_s": None,
                          "ratio": bl.ratio(hwm, budget),
                          "backing_bytes": s.get("backing_bytes_read"),
                          "ok": hwm <= budget + 512 * bl.MiB and s.get("errors", 0) == 0,
                          "peak_rss_bytes": hwm, "staging_limit": limit,
                          "retained_limit": retain_limit,
                          "retained": {k: retained.get(k) for k in (
                              "loans", "kept_bytes", "captured_bytes", "skipped_bytes",
                              "lent_bytes", "used_bytes", "peak_used_bytes")},
                          "staging_lent": s.get("staging_lent"),
                          "staging_spare": s.get("staging_spare"),
                          "proc_read_bytes": io1.get("read_bytes", 0) - io0[m].get("read_bytes", 0),
                          "proc_write_bytes": io1.get("write_bytes", 0) - io0[m].get("write_bytes", 0),
                          "daemon_errors": s.get("errors")})
            bl.emit(cases[-1])
            raw.setdefault("final_stats", {})[m] = s
        for m, d in daemons.items():
            rc = d.unmount()
            if rc != 0:
                bl.log(f"{m}: daemon exited {rc} on unmount")
    finally:
        for d in daemons.values():
            d.stop()
    shutil.rmtree(a.work, ignore_errors=True)

    plotted = plotted[0]
    raw["cases"] = cases
    raw["plotted"] = plotted
    with open(os.path.join(a.out, "bench_save.json"), "w") as f:
        json.dump(raw, f, indent=1)
    time_cases = [c for c in cases if not c["case"].startswith("peak_rss")]
    try:
        bl.plot(os.path.join(a.out, "bench_save.png"),
                f"DCP save, {a.ranks} ranks, {a.mb} MiB (median of {a.reps})", time_cases,
                progress=plotted and plotted["progress"],
                progress_title=f"flush progress, {plotted['name']}" if plotted else "",
                markers=plotted["markers"] if plotted else ())
    except ImportError:
        bl.log("matplotlib missing: no plot")
    return 0 if all(c["ok"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
