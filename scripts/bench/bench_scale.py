#!/usr/bin/env python3
"""Scale benchmark (issue 39): K = 2, 4, 8, 16 ckptfs daemons on one machine, per-node costs
measured per K, beside direct reads of the same checkpoint, and the model's curve up to 1,000.

Per K and repetition: a fresh tests/e2e/netns.py Cluster of K daemons (one network namespace
each, small budgets: --staging-mem 64M --cache-mem 128M --retain-mem 64M by default) over one
backing dir whose disk reads are throttled for all of them together (a blkio cgroup, as
bench_cluster.py: a shared parallel file system of --pfs-mbps MiB/s). One gloo rank per node
(dcp_tool, rank r saves and loads through mount r), a torch 1.13 DCP checkpoint of --mb MiB in
total, a file per rank. Measured per node:

  save     backing bytes each daemon read from the backing store from before the save until
           the coordinator (node 0) has indexed the checkpoint and no daemon's reads have grown
           for 3 s (`backing_bytes_read` deltas from /.ckptfs/stats); commit latency = from
           the save's return on every rank to `.metadata` on the backing store (polled 2 ms).
  idle     after the daemons connect: `peers_connected`, TCP sockets of the daemon's network
           namespace (established and listening, /proc/PID/net/tcp{,6}: only the daemon lives
           there), threads and VmRSS (/proc/PID/status); after the loads again, with VmHWM.
  loads    cold (every daemon restarted, page cache dropped) and all nodes at once:
             replicated  every rank loads every tensor whole (dcp_tool --mode replicated);
             own         every rank loads its own shards;
             replicated, reader  the bench_cluster.py reader (`.metadata` then every file,
                         4 MiB reads) through each node's mount: the same work as direct;
           time = the slowest rank's (setup + load_state_dict), backing bytes per daemon.
  direct   no ckptfs: one reader process per simulated node in the throttled cgroup, O_DIRECT
           (separate nodes share no page cache), page cache dropped first; replicated (every
           file) and own (its rank's file).

The checkpoint is read once before timing (the VM's disk is cached by its host: a first cold
read after a write is slower), and direct and ckptfs loads alternate which goes first.
Median per K over the reps (a rep's per-node figures are first reduced to max / mean).
Prints one JSON line per K (benchlib.emit) and writes bench_scale.json and bench_scale.png
into --out; the PNG draws model_scale.py's fit (made on K <= --fit-max-k only) up to 1,000.
Needs root, ip, nsenter, cgroup v1 blkio, a ckptfs built with UCX (CKPTFS_BIN_DIR).
"""
import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import benchlib as bl

sys.path.insert(0, bl.E2E_DIR)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dcp_tool  # noqa: E402
from netns import Cluster  # noqa: E402
import bench_cluster  # noqa: E402  (READER, run_readers, files_for)
import model_scale  # noqa: E402

CKPT = os.path.join("run", "iter_0000001")
SEED = 39


def proc_status(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
            elif k == "Threads":
                out[k] = int(v)
    return out


def tcp_sockets(pid):
    """(established, listening) TCP sockets in pid's network namespace (IPv4 + IPv6)."""
    est = lis = 0
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                next(f)
                for line in f:
                    st = line.split()[3]
                    est += st == "01"
                    lis += st == "0A"
        except OSError:
            pass
    return est, lis


def probe(c):
    """Per node: peers_connected, sockets, threads, RSS, HWM."""
    rows = []
    for n in c.nodes:
        st = proc_status(n.proc.pid)
        est, lis = tcp_sockets(n.proc.pid)
        rows.append({"peers_connected": n.stats().get("peers_connected", 0),
                     "tcp_established": est, "tcp_listening": lis,
                     "threads": st.get("Threads"), "rss": st.get("VmRSS"),
                     "hwm": st.get("VmHWM")})
    return rows


def backing_reads(c):
    return [n.stats()["backing_bytes_read"] for n in c.nodes]


def settle(c, quiet_s=3.0, timeout=180):
    last, since = backing_reads(c), time.monotonic()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = backing_reads(c)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
    bl.log(f"backing reads still growing after {timeout} s")
    return last


def restart_all(c, timeout=120):
    """Every daemon stopped (SIGTERM to all, then each waited for) and started fresh: cold
    block caches, empty retained tiers; the same state dirs (journals drained)."""
    for n in c.nodes:
        if n.proc is not None and n.proc.poll() is None:
            n.proc.send_signal(signal.SIGTERM)
    for n in c.nodes:
        n.kill(signal.SIGTERM)
    for n in c.nodes:
        n.start(timeout=60)
    if not c.wait_connected(timeout=timeout):
        raise RuntimeError("peers did not reconnect: " +
                           str([n.stats().get("peers_connected") for n in c.nodes]))


class MetaWatch:
    """Polls (every 2 ms, in a thread) for `.metadata` in node 0's mount (rank 0's rename of
    `.metadata.tmp`: the last step of its save) and on the backing store (published)."""

    def __init__(self, mount_path, backing_path):
        self.paths = {"mount": mount_path, "backing": backing_path}
        self.seen = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set() and len(self.seen) < 2:
            for k, p in self.paths.items():
                if k not in self.seen and os.path.exists(p):
                    self.seen[k] = time.monotonic()
            time.sleep(0.002)

    def start(self):
        self._thread.start()
        return self

    def wait(self, timeout=120):
        self._thread.join(timeout)
        self._stop.set()
        return self.seen


def wait_indexed(node, timeout=120):
    pat = re.compile(r"key index: indexed '" + re.escape(CKPT) + r"': (\d+) items.*"
                     r"checksums: (\d+) from write-path blocks, (\d+) read \((\d+) bytes\), "
                     r"(\d+) none")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(node.log, errors="replace") as f:
            m = pat.search(f.read())
        if m:
            return dict(zip(("items", "from_blocks", "read_items", "read_bytes", "none"),
                            map(int, m.groups())))
        time.sleep(0.2)
    return None


def dcp_load(c, dirs, mode, k):
    before = backing_reads(c)
    peer0 = [n.stats().get("peer_bytes_read", 0) for n in c.nodes]
    if not bl.drop_caches():
        raise RuntimeError("cannot drop the page cache (needs root)")
    r = dcp_tool.load(dirs[0], k, mode, SEED, timeout=900, dirs=dirs)
    t = r["setup_s_max"] + r["load_s_max"]
    after = settle(c, quiet_s=1.0)
    stats = [n.stats() for n in c.nodes]
    return {"time_s": round(t, 3), "load_s_max": r["load_s_max"],
            "setup_s_max": r["setup_s_max"], "bytes_verified": r["bytes_verified"],
            "backing_per_node": [a - b for a, b in zip(after, before)],
            "peer_per_node": [s.get("peer_bytes_read", 0) - p for s, p in zip(stats, peer0)],
            "fallbacks": sum(s.get("peer_fallbacks", 0) for s in stats)}


def reader_load(c, dirs, file_lists, direct):
    if not bl.drop_caches():
        raise RuntimeError("cannot drop the page cache (needs root)")
    before = backing_reads(c) if not direct else None
    res = bench_cluster.run_readers(dirs, file_lists, c.cgroup, direct=direct)
    out = {"time_s": round(max(t for t, _ in res), 3),
           "per_node_s": [round(t, 3) for t, _ in res]}
    if direct:
        out["backing_per_node"] = [n for _, n in res]
    else:
        after = settle(c, quiet_s=1.0)
        out["backing_per_node"] = [a - b for a, b in zip(after, before)]
    return out


def run_rep(k, rep, a, root):
    c = Cluster(k, root=root, throttle_bps=a.pfs_mbps << 20, daemon_args=a.daemon_args.split())
    out = {"nodes": k, "rep": rep}
    try:
        c.setup()
        t0 = time.monotonic()
        c.start()
        if not c.wait_connected(timeout=120):
            raise RuntimeError("peers did not connect")
        out["start_connect_s"] = round(time.monotonic() - t0, 3)
        time.sleep(1.0)
        out["idle"] = probe(c)
        dirs = [os.path.join(n.mnt, CKPT) for n in c.nodes]
        os.makedirs(os.path.join(c.nodes[0].mnt, "run"))
        before = settle(c, quiet_s=1.0)
        # save: one rank per node
        meta = os.path.join(c.backing, CKPT, ".metadata")
        watch = MetaWatch(os.path.join(dirs[0], ".metadata"), meta).start()
        s = dcp_tool.save(dirs[0], k, a.mb, True, SEED, dtypes=a.dtypes.split(","),
                          timeout=900, dirs=dirs)
        t_ret = time.monotonic()
        out["save_s"] = round(s["save_s_max"], 3)
        seen = watch.wait()
        # commit latency: rank 0's save ends with its rename of .metadata (seen in the mount)
        # -> .metadata on the backing store (every shard durable, G5).
        out["commit_latency_s"] = (round(max(0.0, seen["backing"] - seen["mount"]), 4)
                                   if "backing" in seen and "mount" in seen else None)
        out["metadata_after_return_s"] = (round(max(0.0, seen["backing"] - t_ret), 4)
                                          if "backing" in seen else None)
        out["index"] = wait_indexed(c.nodes[0])
        after = settle(c)
        out["save_backing_per_node"] = [x - y for x, y in zip(after, before)]
        out["after_save"] = probe(c)
        gate = c.nodes[0].stats().get("commit_gate", {})
        out["peer_checksums"] = gate.get("peer_checksums")
        ckpt_dir = os.path.join(c.backing, CKPT)
        size = sum(os.path.getsize(os.path.join(ckpt_dir, f)) for f in os.listdir(ckpt_dir))
        out["checkpoint_bytes"] = size
        # prime the host's cache of the disk (a first read after a write is slower), untimed
        for f in os.listdir(ckpt_dir):
            with open(os.path.join(ckpt_dir, f), "rb") as fh:
                while fh.read(8 << 20):
                    pass
        repl_lists = [bench_cluster.files_for("replicated", ckpt_dir, i, k, k) for i in range(k)]
        own_lists = [bench_cluster.files_for("own", ckpt_dir, i, k, k) for i in range(k)]

        def direct_side():
            out["direct_replicated"] = reader_load(c, [ckpt_dir] * k, repl_lists, True)
            out["direct_own"] = reader_load(c, [ckpt_dir] * k, own_lists, True)

        def ckptfs_side():
            restart_all(c)
            out["replicated"] = dcp_load(c, dirs, "replicated", k)
            out["after_load"] = probe(c)
            restart_all(c)
            out["own"] = dcp_load(c, dirs, "own", k)
            restart_all(c)
            out["replicated_reader"] = reader_load(c, dirs, repl_lists, False)

        for side in ((direct_side, ckptfs_side) if rep % 2 == 0 else (ckptfs_side, direct_side)):
            side()
        return out
    finally:
        c.cleanup()


def per_node_summary(rep):
    """One rep reduced to scalars (max / mean over nodes)."""
    S = rep["checkpoint_bytes"]
    mean = statistics.mean
    r = {"nodes": rep["nodes"], "checkpoint_bytes": S,
         "save_s": rep["save_s"], "commit_latency_s": rep["commit_latency_s"],
         "start_connect_s": rep["start_connect_s"],
         "save_backing_max_node_over_ckpt": max(rep["save_backing_per_node"]) / S,
         "save_backing_total_over_ckpt": sum(rep["save_backing_per_node"]) / S,
         "peers_connected_min": min(x["peers_connected"] for x in rep["idle"]),
         "tcp_established_mean": mean(x["tcp_established"] for x in rep["idle"]),
         "tcp_established_max": max(x["tcp_established"] for x in rep["idle"]),
         "tcp_established_after_load_mean": mean(x["tcp_established"]
                                                 for x in rep["after_load"]),
         "threads_idle_mean": mean(x["threads"] for x in rep["idle"]),
         # node 0 committed the save: its commit querier's own connections and threads
         "threads_coordinator_after_save": rep["after_save"][0]["threads"],
         "tcp_established_coordinator_after_save": rep["after_save"][0]["tcp_established"],
         "threads_after_load_max": max(x["threads"] for x in rep["after_load"]),
         "rss_idle_mean_mb": mean(x["rss"] for x in rep["idle"]) / 1e6,
         "rss_after_load_mean_mb": mean(x["rss"] for x in rep["after_load"]) / 1e6,
         "hwm_after_load_max_mb": max(x["hwm"] for x in rep["after_load"]) / 1e6,
         "hwm_after_save_max_mb": max(x["hwm"] for x in rep["after_save"]) / 1e6}
    for case in ("replicated", "own", "replicated_reader", "direct_replicated", "direct_own"):
        c = rep[case]
        r[f"{case}_s"] = c["time_s"]
        r[f"{case}_backing_total_over_ckpt"] = sum(c["backing_per_node"]) / S
        r[f"{case}_backing_max_node_over_ckpt"] = max(c["backing_per_node"]) / S
        if "peer_per_node" in c:
            r[f"{case}_peer_total_over_ckpt"] = sum(c["peer_per_node"]) / S
            r[f"{case}_fallbacks"] = c["fallbacks"]
    r["replicated_over_direct"] = r["replicated_s"] / r["direct_replicated_s"]
    r["replicated_reader_over_direct"] = r["replicated_reader_s"] / r["direct_replicated_s"]
    r["own_over_direct"] = r["own_s"] / r["direct_own_s"]
    return r


def medians(summaries):
    keys = summaries[0].keys()
    out = {"nodes": summaries[0]["nodes"]}
    for key in keys:
        if key == "nodes":
            continue
        vals = [s[key] for s in summaries if s.get(key) is not None]
        if not vals:
            out[key] = None
        elif isinstance(vals[0], (int, float)):
            m = statistics.median(vals)
            out[key] = round(m, 6) if isinstance(m, float) else m
        else:
            out[key] = vals[0]
    out["reps"] = len(summaries)
    return out


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    meds = result["medians"]
    fit = result.get("fit") or {}
    ks = [m["nodes"] for m in meds]
    xs = [2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 100, 128, 200, 256, 400, 512, 700, 1000]
    panels = [
        ("replicated load, slowest node (s)", "log", [
            ("direct_replicated_s", "direct (O_DIRECT readers)", "tab:red"),
            ("replicated_s", "ckptfs, DCP load", "tab:blue"),
            ("replicated_reader_s", "ckptfs, same reader as direct", "tab:cyan")]),
        ("replicated load: ckptfs / direct", "log", [
            ("replicated_over_direct", "DCP load / direct", "tab:blue"),
            ("replicated_reader_over_direct", "reader / direct", "tab:cyan")]),
        ("backing bytes read / checkpoint", "symlog", [
            ("direct_replicated_backing_total_over_ckpt", "direct replicated, all nodes",
             "tab:red"),
            ("replicated_backing_total_over_ckpt", "ckptfs replicated, all nodes", "tab:blue"),
            ("save_backing_max_node_over_ckpt", "ckptfs per save, busiest node", "tab:green")]),
        ("per daemon: TCP sockets, threads", "log", [
            ("tcp_established_mean", "established TCP sockets", "tab:purple"),
            ("threads_idle_mean", "threads (idle)", "tab:olive")]),
        ("per daemon: RSS (MB)", "log", [
            ("rss_after_load_mean_mb", "RSS after replicated load", "tab:brown"),
            ("rss_idle_mean_mb", "RSS idle", "tab:gray")]),
        ("commit latency, own-shard load (s)", "symlog", [
            ("commit_latency_s", "rank 0's .metadata -> on store", "tab:green"),
            ("own_s", "ckptfs own-shard DCP load", "tab:blue"),
            ("direct_own_s", "direct own-shard read", "tab:red")]),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    for ax, (title, yscale, series) in zip(axes.flat, panels):
        for key, label, color in series:
            ax.plot(ks, [m.get(key) for m in meds], "o", color=color, label=label)
            f = fit.get(key)
            if key.endswith("_over_direct"):
                num = fit.get(key.replace("_over_direct", "_s"))
                den = fit.get("direct_replicated_s")
                if num and den:
                    ax.plot(xs, [model_scale.predict(num, x) / model_scale.predict(den, x)
                                 for x in xs], "-", color=color, alpha=0.6, linewidth=1)
                    if num.get("cluster"):
                        ax.plot(xs, [model_scale.predict(num["cluster"], x) /
                                     model_scale.predict(den, x) for x in xs], ":",
                                color=color, alpha=0.8, linewidth=1)
                if "reader" not in key:
                    ax.axhline(0.1, color="black", linewidth=0.6, linestyle="-.")
                continue
            if f:
                ax.plot(xs, [model_scale.predict(f, x) for x in xs], "-", color=color,
                        alpha=0.6, linewidth=1)
                if f.get("cluster"):
                    ax.plot(xs, [model_scale.predict(f["cluster"], x) for x in xs], ":",
                            color=color, alpha=0.8, linewidth=1)
        ax.set_xscale("log")
        if yscale == "symlog":
            ax.set_yscale("symlog", linthresh=0.01)
            ax.set_ylim(bottom=0)
        else:
            ax.set_yscale(yscale)
        ax.set_xlim(1.5, 1200)
        ax.set_xlabel(f"nodes K (points: measured; lines: fit on K <= {result.get('fit_max_k', 8)})",
                      fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.axvline(16, color="black", linewidth=0.5, linestyle="--")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"ckptfs, K = {', '.join(map(str, ks))} daemons on one 2-core machine, "
                 f"{result['mb']} MiB checkpoint, store read at {result['pfs_mbps']} MiB/s; "
                 "solid: fit extrapolated on one machine, dotted: separate nodes", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    bl.log(f"wrote {path}")


def main():
    bl.exit_cleanly_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(bl.REPO, "build-bench"))
    ap.add_argument("--nodes", default="2,4,8,16")
    ap.add_argument("--reps", default="3,3,3,2",
                    help="repetitions per K (one number, or one per --nodes entry)")
    ap.add_argument("--mb", type=int, default=48, help="dcp_tool --mb (whole checkpoint)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--pfs-mbps", type=int, default=40)
    ap.add_argument("--daemon-args", default="--cache-mem 128M --retain-mem 64M",
                    help="extra daemon flags (netns.Node adds --staging-mem 64M)")
    ap.add_argument("--fit-max-k", type=int, default=8)
    ap.add_argument("--from-json", help="skip measuring: refit and redraw this result")
    ap.add_argument("--merge", help="add this run's reps to the runs of an earlier result "
                                    "(its JSON) and take the medians over all of them")
    ap.add_argument("--first-rep", type=int, default=0,
                    help="number of the first rep (odd: ckptfs goes first)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.from_json:
        with open(a.from_json) as f:
            result = json.load(f)
    else:
        ks = [int(x) for x in a.nodes.split(",")]
        reps = [int(x) for x in a.reps.split(",")]
        reps = reps * len(ks) if len(reps) == 1 else reps
        result = {"mb": a.mb, "pfs_mbps": a.pfs_mbps, "daemon_args": a.daemon_args,
                  "dtypes": a.dtypes, "runs": [], "medians": [],
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        tmp = tempfile.mkdtemp(prefix="ckptfs-bench-scale-")
        try:
            for k, nrep in zip(ks, reps):
                sums = []
                for rep in range(a.first_rep, a.first_rep + nrep):
                    bl.log(f"K={k} rep {rep}")
                    with open("/proc/loadavg") as f:
                        load = f.read().split()[0]
                    run = run_rep(k, rep, a, os.path.join(tmp, f"k{k}-{rep}"))
                    run["loadavg"] = float(load)
                    result["runs"].append(run)
                    sums.append(per_node_summary(run))
                    bl.log(f"K={k} rep {rep}: " + json.dumps(sums[-1]))
                med = medians(sums)
                result["medians"].append(med)
                bl.emit({"case": f"scale_k{k}", **med})
                with open(os.path.join(a.out, "bench_scale.json"), "w") as f:
                    json.dump(result, f, indent=1)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if a.merge:
            with open(a.merge) as f:
                old = json.load(f)
            old["runs"] += result["runs"]
            old.setdefault("dates", [old.get("date")]).append(result["date"])
            result = old
    if a.merge or a.from_json:
        by_k = {}
        for run in result["runs"]:
            by_k.setdefault(run["nodes"], []).append(per_node_summary(run))
        result["medians"] = [medians(by_k[k]) for k in sorted(by_k)]
    result["fit_max_k"] = a.fit_max_k
    result["fit"] = model_scale.fit_scale(result["medians"], a.fit_max_k)
    result["check"] = model_scale.check_fit(result["medians"], result["fit"], a.fit_max_k)
    for row in result["check"]:
        bl.emit(row)
    with open(os.path.join(a.out, "bench_scale.json"), "w") as f:
        json.dump(result, f, indent=1)
    try:
        plot(result, os.path.join(a.out, "bench_scale.png"))
    except ImportError:
        bl.log("matplotlib missing: no PNG")


if __name__ == "__main__":
    main()
