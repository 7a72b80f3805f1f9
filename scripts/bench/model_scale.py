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
With --fit (default docs/bench/bench_scale.json, when present; issue 39) it also fits a
per-node cost model y = a + b*g(K) to bench_scale.py's measured medians of K <= --fit-max-k
only (fit_scale), checks it at the larger K measured and predicts 100 and 1,000 nodes
(check_fit); bench_scale.py draws the same curves through its points.
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


# ----------------------------------------------------------------------------------------------
# Fit to bench_scale.py's measurements (issue 39): a per-node cost model y = a + b * g(K) per
# figure, least squares over the medians with K <= fit_max_k only, then checked at the larger
# K measured (16) and extrapolated to 100 and 1,000. g(K) says what the figure grows with:
#   "K"      the number of ranks/items (one rank per node: a checkpoint of K shards per tensor)
#            or the nodes sharing one machine's CPUs or store;
#   "K-1"    the peers a daemon knows or receives from;
#   "links"  open connections (sockets, UCX threads): min(K-1, --peer-max-links = 64) since
#            connections are made on demand and bounded (docs/PEERS.md, "Connections");
#            measured with eager all-to-all connections before that, where it was K-1;
#   "K^2"    K daemons each reading a `.metadata` that lists K shards per tensor (the store
#            bytes of a load beyond the checkpoint: K x M(K), M growing with the ranks);
#   "1"      nothing: own-shard loads read the checkpoint once from the store whatever K is
#            (time S / B_fs; the fit is the mean);
#   "1-1/K"  the share of a checkpoint a node receives from peers, (K-1)/K (separate nodes).
# Times on one machine grow with K because all K daemons and ranks share its 2 cores and one
# throttled store; "cluster" is the same figure for separate nodes (each its own cores): the
# fitted per-peer-transfer cost applied to a node's own (K-1)/K share, the store's part fixed.
MAX_LINKS = 64  # --peer-max-links default

FIT_FORMS = {
    "direct_replicated_s": "K",
    "replicated_s": "K-1",
    "replicated_reader_s": "K-1",
    "own_s": "1",
    "direct_own_s": "1",
    "commit_latency_s": "K",
    "start_connect_s": "K",
    "save_backing_total_over_ckpt": "K",
    "save_backing_max_node_over_ckpt": "K",
    "replicated_backing_total_over_ckpt": "K^2",
    "own_backing_total_over_ckpt": "K^2",
    "direct_replicated_backing_total_over_ckpt": "K",
    "tcp_established_mean": "links",
    "threads_idle_mean": "links",
    "threads_coordinator_after_save": "links",
    "tcp_established_coordinator_after_save": "links",
    "threads_after_load_max": "links",
    "rss_idle_mean_mb": "K-1",
    "rss_after_load_mean_mb": "K-1",
    "hwm_after_load_max_mb": "K-1",
}


def _g(form, k):
    return {"K": k, "K-1": k - 1, "links": min(k - 1, MAX_LINKS), "K^2": k * k,
            "1-1/K": (k - 1) / k, "1": 0.0}[form]


def predict(f, k):
    return f["a"] + f["b"] * _g(f["form"], k)


def _lsq(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def fit_scale(medians, fit_max_k=8):
    """{figure: {"form", "a", "b", "fit_ks", ["cluster": {...}]}} from bench_scale medians."""
    out = {}
    rows = [m for m in medians if m["nodes"] <= fit_max_k]
    for key, form in FIT_FORMS.items():
        pts = [(m["nodes"], m[key]) for m in rows if m.get(key) is not None]
        if len(pts) < 2:
            continue
        a, b = _lsq([_g(form, k) for k, _ in pts], [y for _, y in pts])
        f = {"form": form, "a": a, "b": b, "fit_ks": [k for k, _ in pts]}
        if key in ("replicated_s", "replicated_reader_s"):
            # Separate nodes: the store part (a) as measured, each node receiving (K-1)/K of
            # the checkpoint at the rate this machine moved one checkpoint between peers (b).
            f["cluster"] = {"form": "1-1/K", "a": a, "b": b}
        out[key] = f
    return out


def check_fit(medians, fits, fit_max_k=8, at=(16, 100, 1000)):
    """Per figure: the prediction at each K of `at`, and for the measured K > fit_max_k the
    measurement and the error (prediction / measurement - 1)."""
    rows = []
    measured = {m["nodes"]: m for m in medians}
    for key, f in fits.items():
        row = {"case": "fit", "figure": key, "form": f["form"], "a": round(f["a"], 6),
               "b": round(f["b"], 6)}
        for k in at:
            row[f"pred_{k}"] = round(predict(f, k), 4)
            if f.get("cluster"):
                row[f"pred_{k}_separate_nodes"] = round(predict(f["cluster"], k), 4)
            m = measured.get(k)
            if k > fit_max_k and m and m.get(key) is not None:
                row[f"measured_{k}"] = m[key]
                row[f"err_{k}"] = round(predict(f, k) / m[key] - 1, 4) if m[key] else None
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/bench")
    for k, v in DEFAULTS.items():
        ap.add_argument("--" + k.replace("_", "-"), type=float, default=v)
    ap.add_argument("--fit", default="docs/bench/bench_scale.json",
                    help="bench_scale.py's result: fit the per-node cost model on K <= "
                         "--fit-max-k and check it at the larger K measured (skipped when "
                         "the file is missing)")
    ap.add_argument("--fit-max-k", type=int, default=8)
    a = ap.parse_args()
    p = {k: getattr(a, k) for k in DEFAULTS}
    fitted = None
    if a.fit and os.path.exists(a.fit):
        with open(a.fit) as f:
            measured = json.load(f)
        fits = fit_scale(measured["medians"], a.fit_max_k)
        fitted = {"source": a.fit, "fit_max_k": a.fit_max_k, "fits": fits,
                  "check": check_fit(measured["medians"], fits, a.fit_max_k),
                  "measured": measured["medians"]}
    ns = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000]
    rows = {"ndr": [model(n, p, p["ndr_gbps"] * GB) for n in ns],
            "tcp_measured": [model(n, p, p["tcp_measured_gbps"] * GB) for n in ns]}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "model_scale.json"), "w") as f:
        json.dump({"params": p, "rows": rows, "fit": fitted}, f, indent=1)
    print("N | direct s | ckptfs NDR s | ckptfs TCP(here) s | FS bytes/ckpt direct | ckptfs")
    for r, t in zip(rows["ndr"], rows["tcp_measured"]):
        print(f"{r['nodes']} | {r['direct_replicated_s']:.0f} | {r['ckptfs_replicated_s']:.0f} | "
              f"{t['ckptfs_replicated_s']:.0f} | {r['direct_fs_bytes_over_ckpt']:.2f} | "
              f"{r['ckptfs_fs_bytes_over_ckpt']:.3f}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if fitted:
        print(f"fit on K <= {a.fit_max_k} ({a.fit}): figure | form | K=16 predicted / "
              "measured (error) | K=100 | K=1000")
        for r in fitted["check"]:
            print(f"{r['figure']} | a + b*g, g={r['form']}, a={r['a']:.4g}, b={r['b']:.4g} | "
                  f"{r['pred_16']:.4g} / {r.get('measured_16')} ({r.get('err_16')}) | "
                  f"{r['pred_100']:.4g} | {r['pred_1000']:.4g}")
    fig, ax = plt.subplots(1, 4 if fitted else 3, figsize=(20 if fitted else 15, 4))
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
    if fitted:
        ms = fitted["measured"]
        for key, label, color in (("tcp_established_mean", "TCP sockets per daemon", "tab:purple"),
                                  ("threads_idle_mean", "threads per daemon", "tab:olive"),
                                  ("rss_idle_mean_mb", "idle RSS per daemon (MB)", "tab:gray")):
            f = fitted["fits"].get(key)
            if not f:
                continue
            ax[3].plot([m["nodes"] for m in ms], [m.get(key) for m in ms], "o", color=color,
                       label=label + " (measured)")
            ax[3].plot(x, [predict(f, n) for n in x], "-", color=color, alpha=0.6,
                       label=f"fit on K <= {a.fit_max_k}: {f['a']:.3g} + {f['b']:.3g}(N-1)")
        ax[3].set_ylabel("per daemon, today (eager all-to-all)")
        ax[3].set_xscale("log")
        ax[3].set_yscale("log")
        ax[3].set_xlabel("nodes N (points: bench_scale.py on one machine)")
        ax[3].grid(alpha=0.3)
        ax[3].legend(fontsize=6)
    fig.suptitle(f"Model: {p['checkpoint_tb']} TB checkpoint, shared FS {p['fs_gbps']:.0f} GB/s, "
                 f"client {p['client_gbps']:.0f} GB/s per node")
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "model_scale.png"), dpi=100)


if __name__ == "__main__":
    main()
