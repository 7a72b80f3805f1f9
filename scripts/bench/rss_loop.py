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
root, mnt, proc = rss_ops.start_daemon(
    "ckptfs-rss-loop-", sys.argv[3:],
    wrap=["heaptrack", "-o", os.path.join(tempfile.gettempdir(), "ckptfs-rss-heap")]
    if os.environ.get("HEAPTRACK") else ())


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
        figs = rss_ops.figures(pid, mnt)
        if os.environ.get("SMAPS"):
            with open(f"/proc/{pid}/smaps") as f, open(os.path.join(root, f"smaps.{done}"), "w") as o:
                o.write(f.read())
        print(json.dumps({"saves": done, "t": round(time.time() - t0), **figs}), flush=True)
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
    rss_ops.stop_daemon(proc, mnt)
