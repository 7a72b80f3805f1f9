#!/usr/bin/env python3
"""Save loop for the async RSS bound (issue 41 (c), docs/RELIABILITY.md finding 2).

    sudo scripts/bench/rss_loop.py 1000 50 [extra ckptfs options]

One async daemon started as the soak starts it (128 MiB staging, direct-I/O flushes), then
`dcp_tool train` (2 gloo ranks, 2 MiB, rotation keep 3) in chunks of CHUNK saves; after each
chunk the trainer has exited and `ckptfs-admin wait` drained publication, and one JSON line
gives the daemon's RSS, RssAnon, what staging, the retained tier and the block cache hold
(stats), RSS less those ("other_mb", the soak's leak measure), fds and threads.
Environment: BIN (binaries, default build/bin), HEAPTRACK=1 (run the daemon under
heaptrack; with KILL_AT_END=1 it is SIGKILLed at the end, so heaptrack_print --print-leaks
lists what was live), SMAPS=1 (copy /proc/PID/smaps after each chunk), TRIM_AT_END=1
(malloc_trim(0) through gdb, then RSS again), TRAFFIC=1 (the soak's log-directory writer
on the mount meanwhile, scripts/bench/rss_ops.py's `traffic`, at the soak's pace: appends,
small files renamed into place and listed, the older ones removed). The work dir
(printed) is kept."""
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

WT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("BIN", os.path.join(WT, "build/bin"))
sys.path.insert(0, os.path.join(WT, "tests/e2e"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rss_ops  # noqa: E402
saves, chunk = int(sys.argv[1]), int(sys.argv[2])
extra = sys.argv[3:]
root = tempfile.mkdtemp(prefix="ckptfs-rss-loop-")
backing, mnt, state, log = (os.path.join(root, x) for x in ("backing", "mnt", "state", "log"))
os.makedirs(backing)
os.makedirs(mnt)
cmd = [os.path.join(BIN, "ckptfs"), "-f", "--staging-mem", "128M", "--state-dir", state,
       "--log-file", log, "--log-level", "info", "--durability", "async",
       "--flush-direct-io", "on"] + extra + [backing, mnt]
if os.environ.get("HEAPTRACK"):
    cmd = ["heaptrack", "-o", os.path.join(root, "heap")] + cmd
out = open(os.path.join(root, "daemon.out"), "w")
proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
print("root", root, "pid", proc.pid, flush=True)
def daemon_pid():
    if not os.environ.get("HEAPTRACK"):
        return proc.pid
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if open(f"/proc/{p}/cmdline").read().split("\0")[0].endswith("/ckptfs") and \
                        mnt in open(f"/proc/{p}/cmdline").read():
                    return int(p)
            except OSError:
                pass
    return None
try:
    for _ in range(600):
        if os.path.exists(os.path.join(mnt, ".ckptfs", "stats")):
            break
        time.sleep(0.1)
    pid = daemon_pid()
    done, t0 = 0, time.time()
    stop_traffic = threading.Event()
    if os.environ.get("TRAFFIC"):
        def traffic():
            rng = random.Random(41)
            logs = os.path.join(mnt, "logs")
            os.makedirs(logs, exist_ok=True)
            n = 0
            while not stop_traffic.wait(rng.uniform(0.02, 0.3)):
                rss_ops.traffic_op(rng, logs, n)
                n += 1
        threading.Thread(target=traffic, daemon=True).start()
    while done < saves:
        r = subprocess.run(["/usr/bin/python3", os.path.join(WT, "tests/e2e/dcp_tool.py"), "train",
                            "--parent", mnt, "--ranks", "2", "--mb", "2", "--start", str(done + 1),
                            "--iters", str(chunk), "--keep", "3",
                            "--single-file-per-rank", str((done // chunk) % 2)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            print("train failed", r.stdout[-2000:], r.stderr[-2000:])
            break
        done += chunk
        subprocess.run([os.path.join(BIN, "ckptfs-admin"), "wait", mnt, "--timeout", "300"],
                       capture_output=True)
        if os.environ.get("SMAPS"):
            with open(f"/proc/{pid}/smaps") as f, open(os.path.join(root, f"smaps.{done}"), "w") as o:
                o.write(f.read())
        st = {}
        for line in open(f"/proc/{pid}/status"):
            k, _, v = line.partition(":")
            st[k] = v.split()
        s = json.load(open(os.path.join(mnt, ".ckptfs", "stats")))
        held = sum((s.get(k) or 0) for k in ("staging_resident", "retained_used", "cache_used"))
        rss = int(st["VmRSS"][0]) / 1024
        print(json.dumps({"saves": done, "t": round(time.time() - t0), "rss_mb": round(rss, 1),
                          "anon_mb": round(int(st["RssAnon"][0]) / 1024, 1),
                          "held_mb": round(held / 2**20, 1),
                          "other_mb": round(rss - held / 2**20, 1),
                          "staging": round((s.get("staging_resident") or 0) / 2**20, 1),
                          "retained": round((s.get("retained_used") or 0) / 2**20, 1),
                          "cache": round((s.get("cache_used") or 0) / 2**20, 1),
                          "heap_in_use": round((s.get("heap_in_use") or 0) / 2**20, 2),
                          "heap_free": round((s.get("heap_free_held") or 0) / 2**20, 2),
                          "inodes": s.get("inodes"),
                          "fds": len(os.listdir(f"/proc/{pid}/fd")),
                          "cpu_s": round(sum(int(x) for x in open(f"/proc/{pid}/stat").read()
                                             .rsplit(")", 1)[1].split()[11:13])
                                         / os.sysconf("SC_CLK_TCK"), 1),
                          "threads": int(st["Threads"][0])}), flush=True)
    stop_traffic.set()
    if os.environ.get("TRIM_AT_END"):
        r = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "call (int)malloc_trim(0)"],
                           capture_output=True, text=True)
        print("malloc_trim:", r.stdout.strip().splitlines()[-1:] if r.stdout else r.stderr[-300:])
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(("VmRSS", "RssAnon")): print(line.strip())
finally:
    if os.environ.get("KILL_AT_END"):
        os.kill(daemon_pid(), signal.SIGKILL)
        time.sleep(2)
        subprocess.run(["fusermount3", "-uz", mnt])
    subprocess.run(["fusermount3", "-u", mnt])
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        subprocess.run(["fusermount3", "-uz", mnt])
    print("daemon exit", proc.returncode, flush=True)
