#!/usr/bin/env python3
"""A model of cooperative loads (issue 12) from 1 to 1,000 nodes: docs/PEERS.md, "Modelling
1000 nodes". Not a measurement: a few lines of arithmetic over the measured figures of this
repository and assumed, clearly labelled fabric and file-system numbers.

For a checkpoint of S bytes and N nodes:
  direct, replicated   every node reads S from the shared FS: N*S bytes over it; time
                       max(N*S / B_fs, S / B_client).
  ckptfs, replicated   each node reads its owned share S/N from the FS (S in all, plus one
                       `.metadata` of M bytes per node), then receives (N-1)/N*S from the
                       other owners and sends the same to them: time
                       max(S / B_fs, S/N / B_client, (N-1)/N*S / B_peer).
  own shards           both: S/N per node, no peer traffic.
Fan-out: a node talks to N-1 owners in a replicated load; today one UCX context, worker and
progress thread per peer (PeerClient), so N-1 threads, and N-1 endpoints either way.
Writes model_scale.json and model_scale.png into --out.
"""
import argparse
import json
import os

GB = 1e9
TB = 1e12

# Assumed (published-class) numbers; change them on the command line.
DEFAULTS = {
    "checkpoint_tb": 1.1,       # 70B parameters with Adam state in fp32 (16 B/param)
    "metadata_mb": 100.0,       # a `.metadata` of ~1M items (~100 B each)
    "fs_gbps": 1000.0,          # aggregate read bandwidth of a large Lustre/GPFS (GB/s)
    "client_gbps": 25.0,        # one node's client read bandwidth from that FS (GB/s)
    "ndr_gbps": 45.0,           # UCX over one 400 Gb/s InfiniBand NDR port, ~90% of line rate
    "tcp_measured_gbps": 1.1,   # UCX over TCP measured here (bench_peer.py, 1 thread)
}


def model(n, p, b_peer):
    s = p["checkpoint_tb"] * TB
    m = p["metadata_mb"] * 1e6
    b_fs, b_cl = p["fs_gbps"] * GB, p["client_gbps"] * GB
    direct_t = max(n * s / b_fs, s / b_cl)
    coop_t = max(s / b_fs, s / n / b_cl, (n - 1) / n * s / b_peer if n > 1 else 0)
    return {
        "nodes": n,
        "direct_replicated_s": direct_t,
        "ckptfs_replicated_s": coop_t,
        "direct_per_node_gbps": s / direct_t / GB,
        "ckptfs_per_node_gbps": s / coop_t / GB,
        "direct_fs_bytes_over_ckpt": n * (s + m) / s,
        "ckptfs_fs_bytes_over_ckpt": (s + n * m) / s,
        "peer_bytes_in_per_node_gb": (n - 1) / n * s / GB,
        "fanout_endpoints": n - 1,
        "own_shard_s": max(s / b_fs, s / n / b_cl),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/bench")
    for k, v in DEFAULTS.items():
        ap.add_argument("--" + k.replace("_", "-"), type=float, default=v)
    a = ap.parse_args()
    p = {k: getattr(a, k) for k in DEFAULTS}
    ns = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000]
    rows = {"ndr": [model(n, p, p["ndr_gbps"] * GB) for n in ns],
            "tcp_measured": [model(n, p, p["tcp_measured_gbps"] * GB) for n in ns]}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "model_scale.json"), "w") as f:
        json.dump({"params": p, "rows": rows}, f, indent=1)
    print("N | direct s | ckptfs NDR s | ckptfs TCP(here) s | FS bytes/ckpt direct | ckptfs")
    for r, t in zip(rows["ndr"], rows["tcp_measured"]):
        print(f"{r['nodes']} | {r['direct_replicated_s']:.0f} | {r['ckptfs_replicated_s']:.0f} | "
              f"{t['ckptfs_replicated_s']:.0f} | {r['direct_fs_bytes_over_ckpt']:.2f} | "
              f"{r['ckptfs_fs_bytes_over_ckpt']:.3f}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    x = ns
    ax[0].plot(x, [r["direct_per_node_gbps"] for r in rows["ndr"]], "r-o", label="direct")
    ax[0].plot(x, [r["ckptfs_per_node_gbps"] for r in rows["ndr"]], "b-o",
               label=f"ckptfs, UCX on NDR ({p['ndr_gbps']:.0f} GB/s)")
    ax[0].plot(x, [r["ckptfs_per_node_gbps"] for r in rows["tcp_measured"]], "b--o",
               label=f"ckptfs, UCX/TCP as measured ({p['tcp_measured_gbps']} GB/s)")
    ax[0].set_ylabel("replicated load: per-node GB/s")
    ax[1].plot(x, [r["direct_fs_bytes_over_ckpt"] for r in rows["ndr"]], "r-o", label="direct")
    ax[1].plot(x, [r["ckptfs_fs_bytes_over_ckpt"] for r in rows["ndr"]], "b-o",
               label="ckptfs (S + N x .metadata)")
    ax[1].set_ylabel("bytes over the shared FS / checkpoint")
    ax[2].plot(x, [r["fanout_endpoints"] for r in rows["ndr"]], "k-o",
               label="peers per node (endpoints; today also threads)")
    ax[2].plot(x, [r["peer_bytes_in_per_node_gb"] for r in rows["ndr"]], "g-o",
               label="GB received per node")
    ax[2].set_ylabel("fan-out / GB")
    for a_ in ax:
        a_.set_xscale("log")
        a_.set_yscale("log")
        a_.set_xlabel("nodes N")
        a_.grid(alpha=0.3)
        a_.legend(fontsize=7)
    fig.suptitle(f"Model: {p['checkpoint_tb']} TB checkpoint, shared FS {p['fs_gbps']:.0f} GB/s, "
                 f"client {p['client_gbps']:.0f} GB/s per node")
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "model_scale.png"), dpi=100)


if __name__ == "__main__":
    main()
