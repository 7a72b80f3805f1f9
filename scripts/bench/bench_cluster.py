#!/usr/bin/env python3
"""Cooperative load benchmark (issue 12): K ckptfs daemons, each in its own network
namespace (tests/e2e/netns.py), over one backing dir whose disk is read-throttled by a blkio
cgroup holding every reader: a shared parallel file system of --pfs-mbps MiB/s in total.

One DCP checkpoint (dcp_tool, --ranks writer ranks) is saved once into the backing dir. For
K in --nodes, two ways, measured side by side in one run:
  ckptfs  K daemons (with --peers when K > 1); node i's reader reads through mount i;
  direct  no ckptfs: node i's reader reads the backing dir itself, in the same throttled
          cgroup. Separate nodes do not share a page cache, so each simulated node is its
          own process reading with O_DIRECT (every byte it needs comes from the disk, as on
          a node of its own), and the page cache is dropped before every case.
What a node reads (all nodes at once; the same access pattern both ways, whole files in
4 MiB reads after `.metadata`, as DCP's FileSystemReader does per file):
  replicated  every file: every node loads the whole checkpoint;
  own         the files its ranks wrote (__<r>_0.distcp with r * K // ranks == i);
  reshard     the files of writer ranks laid out differently over the nodes
              ((r + 1) % ranks * K // ranks == i): at K=4 every node reads only what
              another node wrote (a restart on a different rank layout).
Each case reports the slowest node's time and the backing-store bytes: each daemon's
backing_bytes_read delta for ckptfs, the bytes read for direct. Caches are cold: daemons
start fresh per case and their cache reads bypass the page cache (O_DIRECT).
Writes bench_cluster.json and bench_cluster.png into --out.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import benchlib as bl

sys.path.insert(0, bl.E2E_DIR)
import dcp_tool  # noqa: E402
from netns import Cluster  # noqa: E402

# One simulated node's reader: `.metadata`, then the listed files, whole, 4 MiB reads,
# O_DIRECT when asked (direct: no shared page cache between simulated nodes). Prints the
# seconds and bytes it took. Run with $CG set: it joins that cgroup first.
READER = r"""
import mmap, os, sys, time
cg = os.environ.get("CG")
if cg:
    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
direct, d, files = sys.argv[1] == "1", sys.argv[2], sys.argv[3:]
buf = mmap.mmap(-1, 4 << 20)
t0 = time.monotonic()
got = 0
for name in [".metadata"] + files:
    fd = os.open(os.path.join(d, name), os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        while True:
            n = os.readv(fd, [buf])
            if n == 0:
                break
            got += n
    finally:
        os.close(fd)
print(time.monotonic() - t0, got)
"""


def files_for(mode, ckpt_dir, node, k, ranks):
    out = []
    for f in sorted(os.listdir(ckpt_dir)):
        if not f.endswith(".distcp"):
            continue
        r = int(f[2:].split("_")[0])
        if mode == "replicated" or (mode == "own" and r * k // ranks == node) or \
                (mode == "reshard" and (r + 1) % ranks * k // ranks == node):
            out.append(f)
    return out


def run_readers(dirs, file_lists, cgroup, direct):
    procs = []
    for d, files in zip(dirs, file_lists):
        procs.append(subprocess.Popen(
            ["/usr/bin/python3", "-c", READER, "1" if direct else "0", d] + files,
            env=dict(os.environ, CG=cgroup or ""), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        o, e = p.communicate(timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"reader failed: {e[-2000:]}")
        t, n = o.split()
        out.append((float(t), int(n)))
    return out


def run_case(backing, ckpt_rel, k, ranks, how, mode, mbps, root):
    c = Cluster(k, root=root, backing=backing, throttle_bps=mbps << 20)
    ckpt_dir = os.path.join(backing, ckpt_rel)
    file_lists = [files_for(mode, ckpt_dir, i, k, ranks) for i in range(k)]
    try:
        c.setup()
        stats_before = None
        if how == "ckptfs":
            if k == 1:
                _start_alone(c.nodes[0], c)
            else:
                c.start()
                if not c.wait_connected(timeout=30):
                    raise RuntimeError("peers did not connect")
            stats_before = [n.stats()["backing_bytes_read"] for n in c.nodes]
            dirs = [os.path.join(n.mnt, ckpt_rel) for n in c.nodes]
        else:
            dirs = [ckpt_dir] * k
        if not bl.drop_caches():
            raise RuntimeError("cannot drop the page cache (needs root)")
        res = run_readers(dirs, file_lists, c.cgroup, direct=(how == "direct"))
        want = [os.path.getsize(os.path.join(ckpt_dir, ".metadata")) +
                sum(os.path.getsize(os.path.join(ckpt_dir, f)) for f in fl) for fl in file_lists]
        if [n for _, n in res] != want:
            raise RuntimeError(f"read {[n for _, n in res]} bytes, expected {want}")
        case = {"nodes": k, "how": how, "mode": mode, "pfs_mbps": mbps,
                "time_s": round(max(t for t, _ in res), 3),
                "per_node_s": [round(t, 3) for t, _ in res]}
        if how == "ckptfs":
            stats = [n.stats() for n in c.nodes]
            case["backing_bytes_per_node"] = [s["backing_bytes_read"] - b
                                              for s, b in zip(stats, stats_before)]
            case["peer_bytes_per_node"] = [s.get("peer_bytes_read", 0) for s in stats]
            case["fallbacks"] = sum(s.get("peer_fallbacks", 0) for s in stats)
        else:
            case["backing_bytes_per_node"] = [n for _, n in res]
        return case
    finally:
        c.cleanup()


def _start_alone(node, cluster):
    """Starts `node` without peer options (one node: nobody to cooperate with)."""
    from harness import CKPTFS, is_mounted
    cmd = [CKPTFS, "-f", "--staging-mem", "64M", "--state-dir", node.state, "--log-file",
           node.log, cluster.backing, node.mnt]
    env = dict(os.environ, CG=cluster.cgroup or "", NS=node.ns)
    wrapper = ['sh', '-c', 'if [ -n "$CG" ]; then echo $$ > "$CG/cgroup.procs" || exit 99; fi; '
               'exec nsenter --net=/run/netns/"$NS" "$@"', 'sh']
    node.proc = subprocess.Popen(wrapper + cmd, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while time.time() < deadline:
        if node.proc.poll() is not None:
            raise RuntimeError(node.proc.stdout.read().decode(errors="replace"))
        if is_mounted(node.mnt) and os.path.exists(os.path.join(node.mnt, ".ckptfs", "stats")):
            return
        time.sleep(0.05)
    raise RuntimeError("no mount")


def plot(cases, out, mbps):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    styles = {"replicated": "-", "own": "--", "reshard": ":"}
    for mode, ls in styles.items():
        for how, color in (("direct", "tab:red"), ("ckptfs", "tab:blue")):
            sel = [c for c in cases if c["mode"] == mode and c["how"] == how]
            if not sel:
                continue
            label = f"{mode}, {how}"
            axes[0].plot([c["nodes"] for c in sel], [c["time_s"] for c in sel], ls,
                         color=color, marker="o", label=label)
            axes[1].plot([c["nodes"] for c in sel],
                         [c["backing_total_over_checkpoint"] for c in sel], ls,
                         color=color, marker="o", label=label)
    axes[0].set_xlabel("nodes (K)")
    axes[0].set_ylabel("load time, slowest node (s)")
    axes[1].set_xlabel("nodes (K)")
    axes[1].set_ylabel("backing bytes read, all nodes / checkpoint")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"ckptfs vs direct reads over a {mbps} MiB/s shared backing store")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "bench_cluster.png"), dpi=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(bl.REPO, "build-bench"))
    ap.add_argument("--nodes", default="1,2,4")
    ap.add_argument("--mb", type=int, default=160,
                    help="dcp_tool --mb of the checkpoint; at 40 MiB/s a smaller one makes "
                         "the throttle's 0.1 s slices a large part of every time")
    ap.add_argument("--ranks", type=int, default=4, help="ranks that save the checkpoint")
    ap.add_argument("--pfs-mbps", type=int, default=40, help="backing disk read throttle")
    ap.add_argument("--modes", default="replicated,own,reshard")
    ap.add_argument("--reps", type=int, default=3,
                    help="repetitions per case and way; the median (by time) is reported")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    root = tempfile.mkdtemp(prefix="ckptfs-bench-cluster-")
    cases = []
    try:
        backing = os.path.join(root, "backing")
        ckpt_rel = "run/iter_0000001"
        os.makedirs(os.path.join(backing, ckpt_rel))
        bl.log(f"saving a {a.mb} MB checkpoint with {a.ranks} ranks")
        dcp_tool.save(os.path.join(backing, ckpt_rel), ranks=a.ranks, mb=a.mb, seed=3,
                      dtypes=("float32", "bfloat16"), timeout=900)
        size = sum(os.path.getsize(os.path.join(backing, ckpt_rel, f))
                   for f in os.listdir(os.path.join(backing, ckpt_rel)))
        for mode in a.modes.split(","):
            for k in [int(x) for x in a.nodes.split(",")]:
                reps = {"direct": [], "ckptfs": []}
                for rep in range(a.reps):
                    # alternate the order so that drift on a shared machine cancels out
                    order = ("direct", "ckptfs") if rep % 2 == 0 else ("ckptfs", "direct")
                    for how in order:
                        bl.log(f"{mode}: K={k} {how} rep {rep}")
                        case = run_case(backing, ckpt_rel, k, a.ranks, how, mode, a.pfs_mbps,
                                        os.path.join(root, f"{mode}-{k}-{how}-{rep}"))
                        case["checkpoint_bytes"] = size
                        case["backing_total_over_checkpoint"] = round(
                            sum(case["backing_bytes_per_node"]) / size, 3)
                        if how == "ckptfs":
                            case["peer_total_over_checkpoint"] = round(
                                sum(case["peer_bytes_per_node"]) / size, 3)
                        reps[how].append(case)
                pair = {}
                for how, runs in reps.items():
                    # the median rep by time; every rep's time is kept
                    runs = sorted(runs, key=lambda c: c["time_s"])
                    case = dict(runs[len(runs) // 2])
                    case["reps"] = len(runs)
                    case["times_s"] = [c["time_s"] for c in runs]
                    case["backing_total_over_checkpoint_max"] = max(
                        c["backing_total_over_checkpoint"] for c in runs)
                    pair[how] = case
                    cases.append(case)
                pair["ckptfs"]["time_over_direct"] = bl.ratio(pair["ckptfs"]["time_s"],
                                                              pair["direct"]["time_s"])
                bl.emit(pair["direct"])
                bl.emit(pair["ckptfs"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    with open(os.path.join(a.out, "bench_cluster.json"), "w") as f:
        json.dump({"cases": cases}, f, indent=1)
    try:
        plot(cases, a.out, a.pfs_mbps)
    except ImportError:
        bl.log("matplotlib missing: no PNG")


if __name__ == "__main__":
    main()
