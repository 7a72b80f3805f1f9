#!/usr/bin/env python3
"""Cooperative load benchmark (issue 12): K ckptfs daemons, each in its own network
namespace (tests/e2e/netns.py), over one backing dir whose disk is read-throttled by a blkio
cgroup holding every daemon: a shared parallel file system of --pfs-mbps MB/s in total.

One DCP checkpoint (dcp_tool, --ranks writer ranks) is saved once into the backing dir. For
K in --nodes, with and without --peers, measured side by side in one run:
  replicated  every node loads the whole checkpoint (dcp_tool load, 1 rank per node,
              mode replicated, every value verified), all nodes at once;
  own         node i reads `.metadata` and then only the files its ranks wrote
              (__<r>_0.distcp with r * K / ranks == i), all nodes at once: an own-shard load.
Each case reports the slowest node's time and the bytes every daemon read from the backing
store (its backing_bytes_read delta). Caches are cold: daemons start fresh per case and the
cache reads bypass the page cache (O_DIRECT).
Writes bench_cluster.json and bench_cluster.png into --out.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import benchlib as bl

sys.path.insert(0, bl.E2E_DIR)
import dcp_tool  # noqa: E402
from netns import Cluster  # noqa: E402


def run_case(backing, ckpt_rel, k, ranks, peers, mode, mbps, root):
    c = Cluster(k, root=root, backing=backing, throttle_bps=mbps << 20)
    try:
        c.setup()
        if not peers:
            # The same daemons without --peers: every node reads on its own (today).
            for n in c.nodes:
                _start_alone(n, c)
        else:
            c.start()
            if k > 1 and not c.wait_connected(timeout=30):
                raise RuntimeError("peers did not connect")
        before = [n.stats()["backing_bytes_read"] for n in c.nodes]
        results, threads = {}, []

        def work(n):
            t0 = time.monotonic()
            try:
                path = os.path.join(n.mnt, ckpt_rel)
                if mode == "replicated":
                    r = dcp_tool.load(path, ranks=1, mode="replicated", seed=3, timeout=900)
                    results[n.index] = {"s": r["load_s_max"], "wall_s": time.monotonic() - t0}
                else:
                    # A DCP load starts with .metadata (FileSystemReader.read_metadata).
                    with open(os.path.join(path, ".metadata"), "rb") as fh:
                        got = len(fh.read())
                    for f in sorted(os.listdir(path)):
                        if not f.endswith(".distcp"):
                            continue
                        rank = int(f[2:].split("_")[0])
                        if rank * k // ranks != n.index:
                            continue
                        with open(os.path.join(path, f), "rb", buffering=0) as fh:
                            while True:
                                b = fh.read(4 << 20)
                                if not b:
                                    break
                                got += len(b)
                    results[n.index] = {"s": time.monotonic() - t0, "bytes": got}
            except Exception as e:  # noqa: BLE001
                results[n.index] = {"error": str(e)[-2000:]}

        for n in c.nodes:
            t = threading.Thread(target=work, args=(n,))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        stats = [n.stats() for n in c.nodes]
        errors = [r["error"] for r in results.values() if "error" in r]
        if errors:
            raise RuntimeError(errors[0])
        return {
            "nodes": k, "peers": peers, "mode": mode, "pfs_mbps": mbps,
            "time_s": round(max(r["s"] for r in results.values()), 3),
            "per_node_s": [round(results[i]["s"], 3) for i in range(k)],
            "backing_bytes_per_node": [s["backing_bytes_read"] - b for s, b in zip(stats, before)],
            "peer_bytes_per_node": [s.get("peer_bytes_read", 0) for s in stats],
            "fallbacks": sum(s.get("peer_fallbacks", 0) for s in stats),
        }
    finally:
        c.cleanup()


def _start_alone(node, cluster):
    """Starts `node` without peer options (the daemon as it was before issue 12)."""
    import subprocess
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(bl.REPO, "build-bench"))
    ap.add_argument("--nodes", default="1,2,4")
    ap.add_argument("--mb", type=int, default=48, help="dcp_tool --mb of the checkpoint")
    ap.add_argument("--ranks", type=int, default=4, help="ranks that save the checkpoint")
    ap.add_argument("--pfs-mbps", type=int, default=40, help="backing disk read throttle")
    ap.add_argument("--modes", default="replicated,own")
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
                   for f in os.listdir(os.path.join(backing, ckpt_rel)) if f.endswith(".distcp"))
        for mode in a.modes.split(","):
            for k in [int(x) for x in a.nodes.split(",")]:
                for peers in ([False, True] if k > 1 else [False]):
                    bl.log(f"{mode}: K={k} peers={peers}")
                    case = run_case(backing, ckpt_rel, k, a.ranks, peers, mode, a.pfs_mbps,
                                    os.path.join(root, f"{mode}-{k}-{int(peers)}"))
                    case["checkpoint_bytes"] = size
                    case["backing_total_over_checkpoint"] = round(
                        sum(case["backing_bytes_per_node"]) / size, 3)
                    bl.emit(case)
                    cases.append(case)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    with open(os.path.join(a.out, "bench_cluster.json"), "w") as f:
        json.dump({"cases": cases}, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for mode, ls in (("replicated", "-"), ("own", "--")):
            for peers, color in ((False, "tab:red"), (True, "tab:blue")):
                sel = [c for c in cases if c["mode"] == mode and (c["peers"] == peers or c["nodes"] == 1)]
                if not sel:
                    continue
                label = f"{mode}, {'peers' if peers else 'no peers'}"
                axes[0].plot([c["nodes"] for c in sel], [c["time_s"] for c in sel], ls,
                             color=color, marker="o", label=label)
                axes[1].plot([c["nodes"] for c in sel],
                             [c["backing_total_over_checkpoint"] for c in sel], ls,
                             color=color, marker="o", label=label)
        axes[0].set_xlabel("nodes (K)")
        axes[0].set_ylabel("load time, slowest node (s)")
        axes[1].set_xlabel("nodes (K)")
        axes[1].set_ylabel("backing bytes read, all daemons / checkpoint")
        for ax in axes:
            ax.legend()
            ax.grid(alpha=0.3)
        fig.suptitle(f"Cooperative loads over a {a.pfs_mbps} MB/s shared backing store")
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "bench_cluster.png"), dpi=100)
    except ImportError:
        bl.log("matplotlib missing: no PNG")


if __name__ == "__main__":
    main()
