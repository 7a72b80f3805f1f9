#!/usr/bin/env python3
"""Checkpoints per minute at memory speed (issue 42): memory-only directories against the
backing-store tier and against torch's own async_save, side by side in one run.

--nodes daemons in network namespaces (tests/e2e/netns.py) over one backing directory whose
disk is write- and read-throttled by one blkio cgroup holding every daemon and every direct
writer: a shared store of --store-mbps MiB/s each way. A 4-rank torch 2.x job (the cached
sid root, mem_tier_worker.py; every rank through node 0's mount, the other nodes hold
the memory-only checkpoints' replicas) saves --mib MiB of
DTensor shards --saves times back to back, per repetition and case:

  (a) disk    dcp.save through ckptfs into a directory of the backing-store tier
  (b) memory  dcp.save through ckptfs into a memory-only directory (user.ckptfs.tier=memory)
  (c) async   dcp.async_save (thread checkpointer) into a plain directory on the throttled
              disk, waiting for the previous future before the next save, as a loop must

For each: the stall per save (until the call returned; for (c) the wait for the previous
future too) and the rate a job can sustain: saves x 60 / (first call until the last
checkpoint is committed in its tier, or its future is done). Then a direct load of (c)'s
last checkpoint from the throttled disk (page cache dropped) and, with --restart, the
restart figure: node 0's daemon SIGKILLed and started again, then a load of the newest
memory-only checkpoint through the mounts, timed, with the backing bytes it read; with
--replace, the node replacement: node 0 lost, a spare on a new address with an empty state
dir takes its rank, and the same load through it (kill to loaded, load, backing bytes).

The daemons' state dirs are on a tmpfs each (a node's local disk), not on the store.
Buffered writes of a plain directory are throttled where they are written back by the
writer itself (DCP fsyncs every file: the fsync's writeback runs in the rank, inside the
cgroup); a background writeback of the kernel's flusher would escape a cgroup-v1 throttle.
Writes bench_memory_tier.json and .png into --out. Needs root, ip, the sid root.
"""
import argparse
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import benchlib as bl

sys.path.insert(0, bl.E2E_DIR)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns  # noqa: E402
from torch_dcp_suite import RootMounts, root_tmpdir  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FILES = ("mem_tier_worker.py", "torch2_bench_worker.py")
TIER = "user.ckptfs.tier"


def run_worker(root, prog_in_root, args, cgroup=None, timeout=1800):
    """Runs the worker in the root; with `cgroup`, inside it (the throttled store)."""
    with root_tmpdir(root) as tmp:
        cmd = ["chroot", root, "env", "-i", "PATH=/usr/bin:/bin", "HOME=/root", "LANG=C.UTF-8",
               "PYTHONWARNINGS=ignore", f"TMPDIR={tmp}", f"PYTHONPATH={prog_in_root}",
               "python3", f"{prog_in_root}/mem_tier_worker.py", *args]
        wrapper = ["sh", "-c", 'if [ -n "$CG" ]; then echo $$ > "$CG/cgroup.procs" || exit 99; '
                   'fi; exec "$@"', "sh"]
        p = subprocess.Popen(wrapper + cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True,
                             env=dict(os.environ, CG=cgroup or ""))
        try:
            out, _ = p.communicate(timeout=timeout)
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its own group only
            except ProcessLookupError:
                pass
    if p.returncode != 0:
        raise RuntimeError(f"worker {args[:4]} failed:\n{out[-5000:]}")
    return out


def read_json(prog, name):
    with open(os.path.join(prog, name)) as f:
        return json.load(f)


def backing_read_bytes(nodes):
    return sum(n.stats().get("backing_bytes_read", 0) for n in nodes if n.proc)


def wait_idle(nodes, timeout=900):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = False
        for n in nodes:
            s = n.stats()
            busy |= bool(s.get("journal_pending") or s.get("files_pending"))
        if not busy:
            return
        time.sleep(0.1)
    raise RuntimeError("daemons still have work pending")


def replace_node(cluster, state_mounts, raw, root, prog, prog_in_root, a, newest, in_root):
    """Node 0 is lost and a spare takes its rank: another address, an empty state dir (a
    tmpfs of its own), the peers file rewritten (docs/PEERS.md, "Membership"). Timed from
    the kill until the newest memory-only checkpoint is loaded through the spare, with the
    bytes it read from the backing store (0: its rank's checkpoint came from node 1)."""
    node, other = cluster.nodes[0], cluster.nodes[1]
    epoch = other.stats()["peers"]["membership"]["epoch"]
    node.kill(signal.SIGKILL)
    t0 = time.monotonic()
    new_ip = f"{cluster.subnet}.{node.index + 11}"
    netns._run("ip", "-n", node.ns, "addr", "del", f"{node.ip}/24", "dev", node.veth_ns)
    netns._run("ip", "-n", node.ns, "addr", "add", f"{new_ip}/24", "dev", node.veth_ns)
    node.ip = new_ip
    node.address = f"{new_ip}:{netns.PORT + 1}"
    node.state = node.state + "-spare"
    os.makedirs(node.state, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", node.state], check=True)
    state_mounts.append(node.state)
    tmp = cluster.peers_file + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join(n.address + "\n" for n in cluster.nodes))
    os.rename(tmp, cluster.peers_file)
    deadline = time.monotonic() + 60
    while other.stats()["peers"]["membership"]["epoch"] == epoch:
        if time.monotonic() > deadline:
            raise RuntimeError("node 1 kept the old peers list")
        time.sleep(0.1)
    node.start(extra_args=["--peer-listen", f"0.0.0.0:{netns.PORT + 1}"])
    started = time.monotonic() - t0
    bytes_before = backing_read_bytes(cluster.nodes)
    try:
        run_worker(root, prog_in_root, ["--phase", "load", "--mib", str(a.mib),
                                        "--target", in_root(newest),
                                        "--out", f"{prog_in_root}/load.json"])
        raw["replace_load_s"] = read_json(prog, "load.json")["load_s"]
        raw["replace_total_s"] = round(time.monotonic() - t0, 3)
        raw["replace_start_s"] = round(started, 3)
        raw["replace_backing_bytes"] = backing_read_bytes(cluster.nodes) - bytes_before
        raw["replace_restored"] = node.stats()["memory_ckpt"]["restored_checkpoints"]
        bl.log(f"after a node replacement: load {raw['replace_load_s']:.2f} s, kill to loaded "
               f"{raw['replace_total_s']:.1f} s, {raw['replace_backing_bytes']} backing bytes, "
               f"{raw['replace_restored']} checkpoint(s) restored")
    except RuntimeError as e:
        raw["replace_error"] = str(e)[-2000:]
        bl.log("after a node replacement: the memory-only checkpoint did not load")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--mib", type=int, default=256, help="checkpoint size (all ranks)")
    ap.add_argument("--saves", type=int, default=6, help="saves per case and repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--store-mbps", type=int, default=32, help="store write and read throttle")
    ap.add_argument("--staging-mem", default="512M", help="per daemon")
    ap.add_argument("--memory-ckpt-mem", default=None,
                    help="per daemon (default: 2.5 checkpoints, 3.5 with a replica: node 0 takes every rank)")
    ap.add_argument("--restart", action="store_true",
                    help="also time a restart after a daemon SIGKILL (needs peers' replicas)")
    ap.add_argument("--writers", type=int, default=1,
                    help="nodes the ranks of the ckptfs cases write through (rank r through "
                         "node r * writers // 4): 2 saves each memory-only checkpoint through "
                         "two nodes, each node's part replicated to the other")
    ap.add_argument("--replace", action="store_true",
                    help="also time a whole-node replacement: node 0 killed, a spare on a new "
                         "address with an empty state dir takes its rank (peers file "
                         "rewritten), then loads the newest memory-only checkpoint")
    ap.add_argument("--cases", default="disk,memory,async")
    ap.add_argument("--daemon-arg", action="append", default=[],
                    help="one more daemon argument (repeat), e.g. --daemon-arg=--retain-mem=0")
    ap.add_argument("--out", default=os.path.join(bl.REPO, "build-bench"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (chroot, namespaces, cgroups, mounts)", file=sys.stderr)
        return 1
    r = subprocess.run([os.path.join(bl.REPO, "scripts", "torch_root.sh"), "sid"],
                       stdout=subprocess.PIPE, text=True, timeout=3600)
    if r.returncode != 0:
        return 2 if r.returncode == 2 else 1
    root = r.stdout.strip().splitlines()[-1]
    os.makedirs(a.out, exist_ok=True)
    lock = open(root + ".use.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    work_in_root = f"/var/tmp/ckptfs-bench-memtier-{os.getpid()}"
    work = os.path.join(root, work_in_root.lstrip("/"))
    shutil.rmtree(work, ignore_errors=True)
    prog = os.path.join(work, "prog")
    os.makedirs(prog)
    for f in FILES:
        shutil.copy(os.path.join(HERE, f), prog)
    plain = os.path.join(work, "plain")
    os.makedirs(plain)
    # Every rank writes through node 0 (a memory-only checkpoint is written through one
    # node; the others hold its replica): node 0 holds the whole checkpoint, and so does
    # its holder. One node: two of them (the newest and the one it replaces). With a
    # replica: three, since the older one stays until the newer is replicated and the
    # next save may begin before that (a smaller budget fails that save with ENOSPC,
    # which torch 2.x reports as its zip writer's "unexpected pos").
    share = a.mib << 20
    copies_x2 = 5 if a.nodes == 1 else 7
    mem_budget = a.memory_ckpt_mem or f"{(share * copies_x2 // 2 >> 20) + 8}M"
    bps = a.store_mbps << 20
    cluster = netns.Cluster(a.nodes, root=os.path.join(work, "cluster"),
                            throttle_bps=bps, write_throttle_bps=bps, staging=a.staging_mem,
                            daemon_args=["--durability", "async",
                                         "--memory-ckpt-mem", mem_budget, *a.daemon_arg]
                            + (["--retain-replicas", "0"] if a.nodes == 1 else []))
    raw = {"nodes": a.nodes, "mib": a.mib, "saves": a.saves, "reps": a.reps,
           "store_mbps": a.store_mbps, "staging_mem": a.staging_mem,
           "memory_ckpt_mem": mem_budget, "kernel": os.uname().release,
           "ckptfs_bin": os.path.realpath(bl.CKPTFS),
           "daemon_args": a.daemon_arg, "writers": min(a.writers, a.nodes),
           "samples": {c: {"rate_per_min": [], "stall_s": []} for c in a.cases.split(",")}}

    def in_root(path):
        return "/" + os.path.relpath(path, root)

    state_mounts = []
    try:
        with RootMounts(root):
            cluster.setup()
            # The state dirs on a device of their own (a node's local disk), not the
            # throttled store: else every journaled create and rename queues behind the
            # shards' bytes in the store's throttle, which no deployment does.
            for n in cluster.nodes:
                os.makedirs(n.state, exist_ok=True)
                subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", n.state],
                               check=True)
                state_mounts.append(n.state)
            cluster.start()
            if not cluster.wait_connected():
                raise RuntimeError("peers did not come up")
            mnts = [n.mnt for n in cluster.nodes]
            for sub in ("disk", "memory"):
                os.makedirs(os.path.join(mnts[0], sub))
            os.setxattr(os.path.join(mnts[0], "memory"), TIER, b"memory")
            prog_in_root = in_root(prog)
            for rep in range(a.reps):
                for case in a.cases.split(","):
                    if case == "async":
                        dirs = [os.path.join(plain, f"rep{rep}")]
                        os.makedirs(dirs[0])
                    else:
                        # Every rank through node 0's mount (--writers 1), the others hold
                        # the memory-only checkpoint's replica; or the ranks spread over
                        # --writers nodes, each node's part replicated to the next. The
                        # disk case runs the same way, side by side.
                        dirs = [os.path.join(mnts[i], case, f"rep{rep}")
                                for i in range(min(a.writers, a.nodes))]
                        os.makedirs(dirs[0])
                    args = ["--phase", "rate", "--case", "async" if case == "async" else "ckptfs",
                            "--mib", str(a.mib), "--saves", str(a.saves),
                            "--dirs", ",".join(in_root(d) for d in dirs),
                            "--mnt", in_root(mnts[0]), "--out", f"{prog_in_root}/rate.json"]
                    ops_before = None if case == "async" else bl.op_histograms(mnts[0])[0]
                    run_worker(root, prog_in_root, args,
                               cgroup=cluster.cgroup if case == "async" else None)
                    if ops_before is not None:
                        # Where the stall went: the FUSE ops that took the most time.
                        ops = bl.op_histograms(mnts[0])[0]
                        spent = {op: round(h.get("sum", 0) - ops_before.get(op, {}).get("sum", 0), 3)
                                 for op, h in ops.items()}
                        top = sorted(spent.items(), key=lambda kv: -kv[1])[:4]
                        raw["samples"][case].setdefault("fuse_op_seconds", []).append(dict(top))
                        bl.log(f"rep {rep} {case}: FUSE op seconds (node 0) {dict(top)}")
                    res = read_json(prog, "rate.json")
                    rate = res["saves"] * 60.0 / res["total_s"]
                    s = raw["samples"][case]
                    s["rate_per_min"].append(round(rate, 2))
                    s["stall_s"].append(bl.median(res["stall_s"]))
                    s.setdefault("per_save_stall_s", []).append(res["stall_s"])
                    raw["torch"] = res["torch"]
                    bl.log(f"rep {rep} {case}: {rate:.2f} checkpoints/min, median stall "
                           f"{s['stall_s'][-1]:.2f} s (total {res['total_s']:.1f} s)")
                    # Space for the next case: the older checkpoints of this one go.
                    if case == "async":
                        keep = rep == a.reps - 1
                        if not keep:
                            shutil.rmtree(dirs[0])
                    elif case == "disk":
                        shutil.rmtree(dirs[0])
                        wait_idle(cluster.nodes)
            # A direct load of the newest plain checkpoint from the throttled disk.
            newest_plain = os.path.join(plain, f"rep{a.reps - 1}", f"step_{a.saves - 1:04d}")
            if "async" in raw["samples"]:
                bl.drop_caches()
                run_worker(root, prog_in_root, ["--phase", "load", "--mib", str(a.mib),
                                                "--target", in_root(newest_plain),
                                                "--out", f"{prog_in_root}/load.json"],
                           cgroup=cluster.cgroup)
                raw["direct_load_s"] = read_json(prog, "load.json")["load_s"]
                bl.log(f"direct load from the throttled store: {raw['direct_load_s']:.2f} s")
            if a.restart and "memory" in raw["samples"]:
                newest_mem = os.path.join("memory", f"rep{a.reps - 1}",
                                          f"step_{a.saves - 1:04d}")
                node = cluster.nodes[0]
                node.kill(signal.SIGKILL)
                t0 = time.monotonic()
                node.start()
                bytes_before = backing_read_bytes(cluster.nodes)
                try:
                    run_worker(root, prog_in_root, [
                        "--phase", "load", "--mib", str(a.mib),
                        "--target", in_root(os.path.join(mnts[0], newest_mem)),
                        "--out", f"{prog_in_root}/load.json"])
                    raw["restart_load_s"] = read_json(prog, "load.json")["load_s"]
                    raw["restart_total_s"] = round(time.monotonic() - t0, 3)
                    raw["restart_backing_bytes"] = backing_read_bytes(cluster.nodes) - bytes_before
                    bl.log(f"after a SIGKILL: load {raw['restart_load_s']:.2f} s, "
                           f"{raw['restart_backing_bytes']} backing bytes")
                except RuntimeError as e:
                    raw["restart_error"] = str(e)[-2000:]
                    bl.log("after a SIGKILL: the memory-only checkpoint did not load")
            if a.replace and "memory" in raw["samples"] and a.nodes > 1:
                newest_mem = os.path.join("memory", f"rep{a.reps - 1}",
                                          f"step_{a.saves - 1:04d}")
                replace_node(cluster, state_mounts, raw, root, prog, prog_in_root, a,
                             os.path.join(mnts[0], newest_mem), in_root)
    finally:
        cluster.cleanup()
        for d in state_mounts:
            subprocess.run(["umount", "-l", d], check=False)
        shutil.rmtree(work, ignore_errors=True)

    path = os.path.join(a.out, "bench_memory_tier.json")
    with open(path, "w") as f:  # the raw samples first, whatever the summary meets
        json.dump(raw, f, indent=1)
    med = {c: {k: bl.median(s[k]) for k in ("rate_per_min", "stall_s")}
           for c, s in raw["samples"].items()}
    cases = [{"case": f"{c}: checkpoints per minute", "value": med[c]["rate_per_min"],
              "stall_s": med[c]["stall_s"], "samples": raw["samples"][c]} for c in med]
    for other in ("disk", "async"):
        if "memory" not in med or other not in med:
            continue
        cases.append({"case": f"rate: memory / {other}",
                      "ratio": bl.ratio(med["memory"]["rate_per_min"],
                                        med[other]["rate_per_min"]),
                      "ok": med["memory"]["rate_per_min"] >= 5 * med[other]["rate_per_min"]})
    if "memory" in med and "disk" in med:
        cases.append({"case": "stall: memory / disk",
                      "ratio": bl.ratio(med["memory"]["stall_s"], med["disk"]["stall_s"]),
                      "ok": med["memory"]["stall_s"] <= med["disk"]["stall_s"]})
    if "replace_load_s" in raw and "direct_load_s" in raw:
        cases.append({"case": "node replaced by a spare: load / direct load",
                      "ckptfs_s": raw["replace_load_s"], "direct_s": raw["direct_load_s"],
                      "ratio": bl.ratio(raw["replace_load_s"], raw["direct_load_s"]),
                      "kill_to_loaded_s": raw["replace_total_s"],
                      "backing_bytes": raw["replace_backing_bytes"],
                      "ok": raw["replace_load_s"] <= 0.1 * raw["direct_load_s"]
                      and raw["replace_backing_bytes"] == 0})
    if "restart_load_s" in raw and "direct_load_s" in raw:
        cases.append({"case": "restart after SIGKILL: load / direct load",
                      "ckptfs_s": raw["restart_load_s"], "direct_s": raw["direct_load_s"],
                      "ratio": bl.ratio(raw["restart_load_s"], raw["direct_load_s"]),
                      "backing_bytes": raw["restart_backing_bytes"],
                      "ok": raw["restart_load_s"] <= 0.1 * raw["direct_load_s"]
                      and raw["restart_backing_bytes"] == 0})
    raw["cases"] = cases
    path = os.path.join(a.out, "bench_memory_tier.json")
    with open(path, "w") as f:
        json.dump(raw, f, indent=1)
    for c in cases:
        print(json.dumps({k: v for k, v in c.items() if k != "samples"}))
    bl.log(f"wrote {path}")
    try:
        plot(os.path.join(a.out, "bench_memory_tier.png"), raw, med)
    except ImportError:
        bl.log("no matplotlib: no plot")
    return 0


def plot(png, raw, med):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(med)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    ax1.bar(names, [med[n]["rate_per_min"] for n in names],
            color=["tab:gray", "tab:blue", "tab:orange"])
    ax1.set_ylabel("checkpoints per minute (median)")
    ax1.set_title("sustained save rate")
    ax2.bar(names, [med[n]["stall_s"] for n in names],
            color=["tab:gray", "tab:blue", "tab:orange"])
    ax2.set_ylabel("stall per save, s (median)")
    ax2.set_title("stall")
    fig.suptitle(f"{raw['mib']} MiB, 4 ranks on {raw['nodes']} node(s), store "
                 f"{raw['store_mbps']} MiB/s, torch {raw.get('torch')}, {raw['reps']} reps")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    bl.exit_cleanly_on_sigterm()
    sys.exit(main())
