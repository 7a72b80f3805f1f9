#!/usr/bin/env python3
"""Peer transport benchmark (store/peer/): throughput of 1 MiB blocks over loopback with UCX
(PeerServer/PeerClient, UCX_TLS=tcp, UCX_NET_DEVICES=lo) against a plain TCP socket baseline,
with the CPU time each side spends.

Each case starts a server process (`ckptfs-peer-tool serve` or `tcp-serve`), then a client
process (`fetch` or `tcp-fetch`) that fetches blocks of synthetic files for --seconds with T
threads (T outstanding requests). UCX: one connection, requests pipelined, replies by
rendezvous; TCP: one connection per thread, blocking send/recv, TCP_NODELAY. Both sides
compute and check a CRC32C per block in both transports, and the server fills each block
from a pattern with memcpy, so the difference is the transport. CPU: the client's own
getrusage, the server's utime+stime from /proc/PID/stat before and after the client ran;
reported as CPU seconds per GB moved (lower is better) and as cores busy.

Loopback on one 2-core machine is not a network: both ends share the cores, and the numbers
bound the transport's software cost rather than a fabric's bandwidth.
Writes bench_peer.json and bench_peer.png into --out.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import benchlib as bl

TOOL = os.path.join(bl.BIN_DIR, "ckptfs-peer-tool")
TICK = os.sysconf("SC_CLK_TCK")
SECRET = "bench-secret-bench-secret-bench"


def proc_cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def start_server(kind, env, secret_file, files, file_size):
    cmd = [TOOL, "serve" if kind == "ucx" else "tcp-serve", "--listen", "127.0.0.1:0",
           "--files", str(files), "--file-size", str(file_size)]
    if kind == "ucx":
        cmd += ["--secret-file", secret_file, "--allow", "127.0.0.1:7001", "--threads", "2"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = p.stdout.readline()
    if not line.startswith("PORT "):
        p.kill()
        p.wait()
        raise RuntimeError(f"bench_peer: {kind} server did not start: {line!r}")
    return p, int(line.split()[1])


def run_case(kind, threads, block, seconds, env, secret_file, files, file_size):
    server, port = start_server(kind, env, secret_file, files, file_size)
    try:
        time.sleep(0.3)
        cpu0 = proc_cpu(server.pid)
        cmd = [TOOL, "fetch" if kind == "ucx" else "tcp-fetch", "--server", f"127.0.0.1:{port}",
               "--files", str(files), "--file-size", str(file_size), "--block", str(block),
               "--threads", str(threads), "--seconds", str(seconds)]
        if kind == "ucx":
            cmd += ["--secret-file", secret_file, "--node-id", "127.0.0.1:7001"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        server_cpu = proc_cpu(server.pid) - cpu0
    finally:
        server.kill()  # by PID, ours
        server.wait()
    r = json.loads(out.strip().splitlines()[-1])
    gb = r["bytes"] / 1e9
    return {
        "bench": "peer", "transport": kind, "threads": threads, "block_bytes": block,
        "seconds": r["seconds"], "MBps": r["MBps"], "errors": r["errors"],
        "client_cpu_s_per_GB": round(r["client_cpu_s"] / gb, 3) if gb else None,
        "server_cpu_s_per_GB": round(server_cpu / gb, 3) if gb else None,
        "client_cores": round(r["client_cpu_s"] / r["seconds"], 2),
        "server_cores": round(server_cpu / r["seconds"], 2),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(bl.REPO, "build-bench"))
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--threads", default="1,4,8")
    ap.add_argument("--block", type=int, default=bl.MiB)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    if not os.access(TOOL, os.X_OK):
        sys.exit(f"bench_peer: {TOOL} missing (build with UCX, or set CKPTFS_BIN_DIR)")
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo", CKPTFS_LOG_LEVEL="warn")
    files, file_size = 4, 256 * bl.MiB
    cases = []
    with tempfile.NamedTemporaryFile("w", delete=False) as f:
        f.write(SECRET)
        secret_file = f.name
    os.chmod(secret_file, 0o600)
    try:
        for threads in [int(t) for t in args.threads.split(",")]:
            for kind in ("ucx", "tcp"):
                reps = [run_case(kind, threads, args.block, args.seconds, env, secret_file,
                                 files, file_size) for _ in range(args.reps)]
                best = max(reps, key=lambda r: r["MBps"])
                best["reps_MBps"] = [r["MBps"] for r in reps]
                bl.log(f"{kind} threads={threads}: {best['MBps']:.0f} MB/s, client "
                       f"{best['client_cpu_s_per_GB']} s/GB, server {best['server_cpu_s_per_GB']} s/GB")
                cases.append(best)
                print(json.dumps(best), flush=True)
    finally:
        os.unlink(secret_file)
    ratios = []
    for t in sorted({c["threads"] for c in cases}):
        u = next(c for c in cases if c["transport"] == "ucx" and c["threads"] == t)
        p = next(c for c in cases if c["transport"] == "tcp" and c["threads"] == t)
        cpu_u = u["client_cpu_s_per_GB"] + u["server_cpu_s_per_GB"]
        cpu_p = p["client_cpu_s_per_GB"] + p["server_cpu_s_per_GB"]
        r = {"bench": "peer_ratio", "threads": t, "throughput_ucx_over_tcp": bl.ratio(u["MBps"], p["MBps"]),
             "cpu_per_GB_ucx_over_tcp": bl.ratio(cpu_u, cpu_p)}
        ratios.append(r)
        print(json.dumps(r), flush=True)
    with open(os.path.join(args.out, "bench_peer.json"), "w") as f:
        json.dump({"cases": cases, "ratios": ratios, "loadavg_at_end": os.getloadavg()}, f,
                  indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        bl.log("bench_peer: matplotlib missing, no PNG")
        return
    threads = sorted({c["threads"] for c in cases})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    w = 0.38
    for k, kind in enumerate(("ucx", "tcp")):
        pts = [next(c for c in cases if c["transport"] == kind and c["threads"] == t) for t in threads]
        xs = [i + (k - 0.5) * w for i in range(len(threads))]
        ax1.bar(xs, [c["MBps"] for c in pts], w, label=kind)
        ax2.bar(xs, [c["client_cpu_s_per_GB"] + c["server_cpu_s_per_GB"] for c in pts], w,
                label=f"{kind} (client+server)")
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(threads)))
        ax.set_xticklabels([f"{t} threads" for t in threads])
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    ax1.set_ylabel("MB/s (1 MiB blocks, loopback)")
    ax1.set_title("Throughput")
    ax2.set_ylabel("CPU seconds per GB moved")
    ax2.set_title("CPU cost")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "bench_peer.png"), dpi=110)


if __name__ == "__main__":
    main()
