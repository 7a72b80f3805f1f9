#!/usr/bin/env python3
"""Ownership plan benchmark (store/peer/plan.h): plan time and load imbalance of the
`balanced` and `fast` modes at 10k to 1M items, on 16, 64 and 128 nodes.

Each case runs `ckptfs-peer-tool plan` (a C++ binary: the same BuildPlan the daemon calls) on
a synthetic checkpoint (SyntheticPlanItems: 8 files per node, item sizes log-uniform from
1 KiB to 16 MiB, 1 in 20,000 items 1 GiB, back to back per file), best of --repeat runs.
plan_ms covers everything a daemon computes: owners, per-node bytes and every node's
prefetch list. max_over_mean is the largest node's bytes over the mean (1.0 is perfect).

The `auto` rule (plan.h: kAutoFastAboveItems, kAutoFastMaxNodes) comes from this table: the
JSON reports auto_threshold, the smallest measured item count at which fast plans at least
20% faster than balanced on 16 nodes, and, per node count, whether fast is faster at the
largest item count (fast_wins_at_max_items).
Writes bench_plan.json and bench_plan.png into --out.
"""
import argparse
import json
import os
import subprocess
import sys

import benchlib as bl

TOOL = os.path.join(bl.BIN_DIR, "ckptfs-peer-tool")


def run_case(items, nodes, mode, repeat):
    out = subprocess.run([TOOL, "plan", "--items", str(items), "--nodes", str(nodes),
                          "--mode", mode, "--repeat", str(repeat)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(bl.REPO, "build-bench"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--items", default="10000,100000,200000,500000,1000000")
    ap.add_argument("--nodes", default="16,64,128")
    args = ap.parse_args()
    if not os.access(TOOL, os.X_OK):
        sys.exit(f"bench_plan: {TOOL} missing (build with UCX, or set CKPTFS_BIN_DIR)")
    os.makedirs(args.out, exist_ok=True)
    items_list = [int(x) for x in args.items.split(",")]
    nodes_list = [int(x) for x in args.nodes.split(",")]
    cases = []
    for nodes in nodes_list:
        for items in items_list:
            for mode in ("balanced", "fast"):
                r = run_case(items, nodes, mode, args.repeat)
                bl.log(f"plan {mode:8s} items={items:>8} nodes={nodes:>4}: "
                       f"{r['plan_ms']:9.1f} ms  max/mean {r['max_over_mean']:.4f}")
                cases.append(r)
                print(json.dumps({"bench": "plan", **r}), flush=True)
    def ms(items, nodes, mode):
        return next(c["plan_ms"] for c in cases
                    if c["items"] == items and c["nodes"] == nodes and c["mode"] == mode)

    ref_nodes = 16 if 16 in nodes_list else nodes_list[0]
    threshold = next((i for i in items_list
                      if ms(i, ref_nodes, "fast") < 0.8 * ms(i, ref_nodes, "balanced")), None)
    top = max(items_list)
    wins = {str(n): ms(top, n, "fast") < ms(top, n, "balanced") for n in nodes_list}
    summary = {"bench": "plan_summary", "auto_threshold": threshold, "reference_nodes": ref_nodes,
               "fast_wins_at_max_items": wins}
    print(json.dumps(summary), flush=True)
    with open(os.path.join(args.out, "bench_plan.json"), "w") as f:
        json.dump({"cases": cases, **summary}, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        bl.log("bench_plan: matplotlib missing, no PNG")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for nodes in nodes_list:
        for mode, style in (("balanced", "-o"), ("fast", "--s")):
            pts = [c for c in cases if c["nodes"] == nodes and c["mode"] == mode]
            xs = [c["items"] for c in pts]
            ax1.plot(xs, [c["plan_ms"] for c in pts], style, label=f"{mode}, {nodes} nodes")
            ax2.plot(xs, [c["max_over_mean"] for c in pts], style, label=f"{mode}, {nodes} nodes")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xlabel("items in the checkpoint")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_yscale("log")
    ax1.set_ylabel("plan time (ms, best of %d)" % args.repeat)
    ax1.set_title("Plan time")
    ax2.set_ylabel("max / mean bytes per node")
    ax2.set_title("Load imbalance")
    if threshold:
        ax1.axvline(threshold, color="gray", lw=0.8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "bench_plan.png"), dpi=110)


if __name__ == "__main__":
    main()
