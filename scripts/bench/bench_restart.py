#!/usr/bin/env python3
"""Restart from memory (issue 23): K ckptfs daemons in network namespaces
(tests/e2e/netns.py) over one backing dir whose disk is read-throttled by a blkio cgroup (a
shared parallel file system of --pfs-mbps MiB/s, as bench_cluster.py), torch DCP with
--ranks gloo ranks placed on the nodes as a launcher does (rank r on node r * K // ranks).

Per layout (single_file_per_rank 1 and 0) and repetition: save through the mounts, wait
for the commit (and for the replicas), kill every rank, then load again (own shards, every
value checked by dcp_tool) four ways, measured side by side in one run:
  a  same daemons        the training job restarted; the daemons kept the checkpoint
  b  one node replaced   node K-1's daemon killed and started fresh (empty tier, new state
                         dir): its share comes from its replica holder
  c  direct             no ckptfs: the ranks read the backing dir, in the throttled cgroup
  d  --retain-mem 0      ckptfs as before this issue (fresh save, same load)
Every load starts with the page cache dropped, once no daemon has read the backing store
for 3 s (the coordinator's key index checksums other nodes' shards after a commit; those
bytes are reported as background_backing_bytes, apart from the load's). Reported per case: the median load time
(max over ranks of load_state_dict, `.metadata` included), its ratio to (c), the bytes the
daemons read from the backing store during the load, and the daemons' peak RSS against
staging + cache + retain budgets. Writes bench_restart.json and bench_restart.png to --out.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import benchlib as bl

sys.path.insert(0, bl.E2E_DIR)
import dcp_tool  # noqa: E402
from netns import Cluster  # noqa: E402

CKPT = "run/iter_0000001"
ADMIN = os.path.join(bl.REPO, "build", "bin", "ckptfs-admin")


def parse_bytes(s):
    return bl.parse_size(s)


def dirs_for(nodes, ranks, rel=CKPT):
    return [os.path.join(nodes[r * len(nodes) // ranks].mnt, rel) for r in range(ranks)]


def join_cgroup(cg):
    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def leave_cgroup():
    with open("/sys/fs/cgroup/blkio/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))


def backing_reads(c):
    return [n.stats()["backing_bytes_read"] for n in c.nodes]


def wait_until(cond, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    bl.log(f"timed out waiting for {what}")
    return False


def quiesce(c, quiet_s=3.0, timeout=180):
    """Waits until no daemon reads the backing store for `quiet_s` (after a commit, the
    coordinator's key index reads the shards other nodes wrote to checksum them: background
    work of the save, not of the load). Returns the bytes read meanwhile."""
    start = last = backing_reads(c)
    quiet_since = time.monotonic()
    deadline = quiet_since + timeout
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = backing_reads(c)
        if now != last:
            last, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            break
    return [x - y for x, y in zip(last, start)]


def load(c, a, sfpr, seed, mode="own"):
    if not bl.drop_caches():
        raise RuntimeError("cannot drop the page cache (needs root)")
    before = backing_reads(c)
    r = dcp_tool.load(os.path.join(c.nodes[0].mnt, CKPT), a.ranks, mode, seed, timeout=900,
                      dirs=dirs_for(c.nodes, a.ranks))
    after = backing_reads(c)
    return r["load_s_max"], [x - y for x, y in zip(after, before)]


def rss(c):
    return [bl.vm_hwm(n.proc.pid) for n in c.nodes if n.proc and n.proc.poll() is None]


def cluster(a, root, backing, retain):
    args = ["--retain-mem", retain, "--cache-mem", a.cache_mem]  # staging: netns.Node's 64M
    c = Cluster(a.nodes, root=root, backing=backing, throttle_bps=a.pfs_mbps << 20,
                daemon_args=args)
    c.setup()
    c.start()
    if not c.wait_connected(timeout=30):
        raise RuntimeError("peers did not connect")
    return c


def save(c, a, sfpr, seed):
    r = dcp_tool.save(os.path.join(c.nodes[0].mnt, CKPT), a.ranks, a.mb, sfpr, seed,
                      timeout=900, dirs=dirs_for(c.nodes, a.ranks))
    for n in c.nodes:
        rc = subprocess.run([ADMIN, "wait", os.path.join(n.mnt, CKPT, ".metadata"),
                             "--timeout", "300"], stdout=subprocess.DEVNULL).returncode
        if rc != 0:
            raise RuntimeError(f"commit not seen on node {n.index}")
    return r["save_s_max"]


def one_rep(a, sfpr, rep, root, backing):
    seed = 100 + rep
    out = {}
    shutil.rmtree(os.path.join(backing, "run"), ignore_errors=True)
    # (a) and (b): retained tier with replicas.
    c = cluster(a, os.path.join(root, f"ret-{sfpr}-{rep}"), backing, a.retain_mem)
    try:
        out["save_s"] = save(c, a, sfpr, seed)
        share = 0
        ckdir = os.path.join(backing, CKPT)
        total = sum(os.path.getsize(os.path.join(ckdir, f)) for f in os.listdir(ckdir))
        share = total // a.nodes
        ok = wait_until(lambda: all(n.stats().get("retained", {}).get("replica_bytes", 0) >=
                                    0.9 * share for n in c.nodes), 120, "replicas")
        t_rep = time.monotonic()
        out["replicas_ready"] = ok
        out["background_backing_bytes"] = quiesce(c)
        t, b = load(c, a, sfpr, seed)
        out["a"] = {"load_s": t, "backing_bytes": b,
                    "retained_hit_bytes": [n.stats()["retained"]["hit_bytes"] for n in c.nodes]}
        if a.replicated:
            t, b = load(c, a, sfpr, seed, "replicated")
            out["a_replicated"] = {"load_s": t, "backing_bytes": b}
        out["rss_a"] = rss(c)
        victim = c.nodes[-1]
        victim.kill(signal.SIGKILL)
        victim.state = victim.state + "-fresh"
        victim.start()
        c.wait_connected(timeout=30)
        wait_until(lambda: victim.stats().get("retained", {}).get("replication", {})
                   .get("holder_connected"), 30, "holder connection")
        t, b = load(c, a, sfpr, seed)
        if a.replicated:
            tr, br = load(c, a, sfpr, seed, "replicated")
            out["b_replicated"] = {"load_s": tr, "backing_bytes": br}
        rep_stats = victim.stats()["retained"].get("replication", {})
        out["b"] = {"load_s": t, "backing_bytes": b,
                    "holder_bytes": rep_stats.get("holder_bytes", 0),
                    "holder_fallbacks": rep_stats.get("holder_fallbacks", 0)}
        out["rss_b"] = rss(c)
        out["checkpoint_bytes"] = total
        del t_rep
    finally:
        c.cleanup()
    # (c) direct from the throttled store: the ranks join the throttled cgroup.
    c = Cluster(1, root=os.path.join(root, f"direct-{sfpr}-{rep}"), backing=backing,
                throttle_bps=a.pfs_mbps << 20)
    try:
        c.setup()
        if not bl.drop_caches():
            raise RuntimeError("cannot drop the page cache")
        join_cgroup(c.cgroup)
        try:
            r = dcp_tool.load(os.path.join(backing, CKPT), a.ranks, "own", seed, timeout=900)
            if a.replicated:
                if not bl.drop_caches():
                    raise RuntimeError("cannot drop the page cache")
                rr = dcp_tool.load(os.path.join(backing, CKPT), a.ranks, "replicated", seed,
                                   timeout=900)
                out["c_replicated"] = {"load_s": rr["load_s_max"]}
        finally:
            leave_cgroup()
        out["c"] = {"load_s": r["load_s_max"]}
    finally:
        c.cleanup()
    # (d) --retain-mem 0: a fresh save, the same load.
    shutil.rmtree(os.path.join(backing, "run"), ignore_errors=True)
    c = cluster(a, os.path.join(root, f"off-{sfpr}-{rep}"), backing, "0")
    try:
        save(c, a, sfpr, seed)
        quiesce(c)
        t, b = load(c, a, sfpr, seed)
        out["d"] = {"load_s": t, "backing_bytes": b}
        if a.replicated:
            t, b = load(c, a, sfpr, seed, "replicated")
            out["d_replicated"] = {"load_s": t, "backing_bytes": b}
        out["rss_d"] = rss(c)
    finally:
        c.cleanup()
    return out


def plot(summary, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(14, 4.5))
    cases = [k for k in ("a", "b", "c", "d", "a_replicated", "b_replicated", "c_replicated",
                         "d_replicated") if all(k in s for s in summary.values())]
    names = {"a": "(a) same\ndaemons", "b": "(b) node\nreplaced", "c": "(c) direct",
             "d": "(d) retain\n0"}
    names.update({k + "_replicated": names[k] + "\nreplicated" for k in "abcd"})
    width = 0.38
    for i, layout in enumerate(sorted(summary)):
        s = summary[layout]
        xs = [j + i * width for j in range(len(cases))]
        ax[0].bar(xs, [s[k]["load_s"] for k in cases], width, label=layout)
        ax[1].bar(xs, [s[k]["ratio_to_c"] for k in cases], width, label=layout)
    for axis in ax:
        axis.set_xticks([j + width / 2 for j in range(len(cases))])
        axis.set_xticklabels([names[k] for k in cases], fontsize=8)
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3, axis="y")
    ax[0].set_ylabel("load time, median (s)")
    ax[1].set_ylabel("load time / direct (c)")
    ax[1].axhline(0.1, color="tab:green", ls="--", lw=1)
    ax[1].axhline(0.25, color="tab:orange", ls="--", lw=1)
    ax[1].set_yscale("log")
    fig.suptitle("Restart from memory: DCP load after a crash (own shards; replicated: every "
                 "rank reads every tensor)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "bench_restart.png"), dpi=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(bl.REPO, "build-bench"))
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mb", type=int, default=256, help="dcp_tool --mb of the checkpoint")
    ap.add_argument("--pfs-mbps", type=int, default=40, help="backing disk read throttle")
    ap.add_argument("--retain-mem", default="384M")
    ap.add_argument("--cache-mem", default="256M")
    ap.add_argument("--staging-mem", default="64M", help="what tests/e2e/netns.py gives a node")
    ap.add_argument("--layouts", default="1,0", help="single_file_per_rank values")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--replicated", type=int, default=1,
                    help="also load replicated (every rank reads every tensor)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    root = tempfile.mkdtemp(prefix="ckptfs-bench-restart-")
    results = {}
    summary = {}
    budget = (parse_bytes(a.retain_mem) + parse_bytes(a.cache_mem) + parse_bytes(a.staging_mem))
    try:
        backing = os.path.join(root, "backing")
        os.makedirs(backing)
        for layout in [int(x) for x in a.layouts.split(",")]:
            name = f"single_file_per_rank={layout}"
            runs = []
            for rep in range(a.reps):
                bl.log(f"{name} rep {rep}")
                runs.append(one_rep(a, bool(layout), rep, root, backing))
                bl.log(json.dumps(runs[-1]))
            results[name] = runs
            s = {}
            keys = list("abcd") + ([f"{k}_replicated" for k in "abcd"] if a.replicated else [])
            for k in keys:
                s[k] = {"load_s": round(bl.median([r[k]["load_s"] for r in runs]), 3),
                        "load_s_all": [round(r[k]["load_s"], 3) for r in runs]}
                if "backing_bytes" in runs[0][k]:
                    s[k]["backing_bytes_max"] = max(sum(r[k]["backing_bytes"]) for r in runs)
            for k in keys:
                base = "c_replicated" if k.endswith("_replicated") else "c"
                s[k]["ratio_to_c"] = bl.ratio(s[k]["load_s"], s[base]["load_s"])
            s["b"]["holder_bytes_min"] = min(r["b"]["holder_bytes"] for r in runs)
            s["checkpoint_bytes"] = runs[0]["checkpoint_bytes"]
            peak = max(max(x for x in r[key] if x) for r in runs for key in ("rss_a", "rss_b"))
            s["daemon_rss_peak"] = peak
            s["rss_budget"] = budget
            s["rss_within_budget"] = peak <= budget
            s["accept_a"] = all(s[k]["ratio_to_c"] <= 0.1 and s[k]["backing_bytes_max"] == 0
                                for k in keys if k.startswith("a"))
            s["accept_b"] = all(s[k]["ratio_to_c"] <= 0.25 for k in keys if k.startswith("b"))
            summary[name] = s
            for k in keys:
                base = "c_replicated" if k.endswith("_replicated") else "c"
                bl.emit({"case": f"{name} {k}", "ckptfs_s": s[k]["load_s"],
                         "direct_s": s[base]["load_s"], "ratio": s[k]["ratio_to_c"],
                         "backing_bytes": s[k].get("backing_bytes_max"), "ok": True})
    finally:
        shutil.rmtree(root, ignore_errors=True)
        with open(os.path.join(a.out, "bench_restart.json"), "w") as f:
            json.dump({"args": vars(a), "summary": summary, "runs": results}, f, indent=1)
    try:
        plot(summary, a.out)
    except ImportError:
        bl.log("matplotlib missing: no PNG")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
