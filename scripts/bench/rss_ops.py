#!/usr/bin/env python3
"""Daemon memory under one of the soak's ingredients alone (issue 41's RSS bound, stop 48).

    sudo scripts/bench/rss_ops.py WHAT OPS EVERY [extra ckptfs options]

One async daemon started as scripts/bench/rss_loop.py starts it; then OPS operations of
WHAT, and after every EVERY of them `ckptfs-admin wait` on the mount and one JSON line:
RSS, RSS less staging, retained tier and cache ("other_mb", the soak's leak measure), the
heap in live allocations and the free heap glibc holds (stats `heap_in_use`,
`heap_free_held`), the daemon's inode count, fds and threads. WHAT:
  traffic  the soak's log-directory writer (scripts/soaklib/workloads.py traffic_op):
           appends to app.log, small files written under a temp name and renamed, the
           oldest removed past 40;
  files    only the small files (create, write, rename, unlink past 40);
  append   only the appends to app.log.
Environment: BIN (binaries, default build/bin). The work dir (printed) is kept."""
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time

WT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("BIN", os.path.join(WT, "build/bin"))


def small_file_bytes(name, rng):  # as scripts/soaklib/util.py writes them
    payload = rng.randbytes(rng.randrange(0, 64 << 10))
    return f"SOAK {name} {len(payload)} {hashlib.sha256(payload).hexdigest()}\n".encode() + payload


def log_line(seq):
    return f"{seq:08d} {hashlib.sha256(str(seq).encode()).hexdigest()[:16]}\n"


def traffic_op(rng, logs, n, what="traffic"):
    """Operation `n` of the log-directory writer in `logs`: an append to app.log (45 %
    under "traffic"), or a small file written under a temp name, renamed into place, and
    past 40 of them one of the older ones removed (a listing each time)."""
    if what == "append" or (what == "traffic" and rng.random() < 0.45):
        with open(os.path.join(logs, "app.log"), "a") as f:
            f.write(log_line(n))
        return
    name = f"f_{n:06d}"
    tmp = os.path.join(logs, name + ".tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        os.write(fd, small_file_bytes(name, rng))
    finally:
        os.close(fd)
    os.rename(tmp, os.path.join(logs, name + ".dat"))
    dats = sorted(x for x in os.listdir(logs) if x.endswith(".dat"))
    if len(dats) > 40:
        os.unlink(os.path.join(logs, dats[rng.randrange(len(dats) - 10)]))


def start_daemon(prefix, extra=(), wrap=()):
    """A daemon over a fresh work dir (printed, kept): (root, mnt, proc). Async unless
    `extra` names a --durability (e.g. rss_loop.py 1000 50 --durability strict)."""
    root = tempfile.mkdtemp(prefix=prefix)
    backing, mnt, state, log = (os.path.join(root, x) for x in ("backing", "mnt", "state", "log"))
    os.makedirs(backing)
    os.makedirs(mnt)
    cmd = list(wrap) + [os.path.join(BIN, "ckptfs"), "-f", "--staging-mem", "128M",
                        "--state-dir", state, "--log-file", log, "--log-level", "info",
                        "--flush-direct-io", "on"] + \
        ([] if any(x == "--durability" or x.startswith("--durability=") for x in extra)
         else ["--durability", "async"]) + list(extra) + \
        [backing, mnt]
    out = open(os.path.join(root, "daemon.out"), "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    print("root", root, "pid", proc.pid, flush=True)
    for _ in range(600):
        if os.path.exists(os.path.join(mnt, ".ckptfs", "stats")):
            break
        if proc.poll() is not None:
            out.close()
            with open(os.path.join(root, "daemon.out")) as f:
                raise SystemExit(f"the daemon exited {proc.returncode} at start: {f.read()[-500:]}")
        time.sleep(0.1)
    return root, mnt, proc


def figures(pid, mnt):
    """After `ckptfs-admin wait` on the mount: the daemon's RSS, RSS less staging, retained
    tier and cache ("other_mb", the soak's leak measure), its heap, inodes, fds, threads."""
    subprocess.run([os.path.join(BIN, "ckptfs-admin"), "wait", mnt, "--timeout", "300"],
                   capture_output=True)
    st = {}
    for line in open(f"/proc/{pid}/status"):
        k, _, v = line.partition(":")
        st[k] = v.split()
    s = json.load(open(os.path.join(mnt, ".ckptfs", "stats")))
    held = sum((s.get(k) or 0) for k in ("staging_resident", "retained_used", "cache_used",
                                         "cache_index"))
    rss = int(st["VmRSS"][0]) / 1024
    return {"rss_mb": round(rss, 1), "anon_mb": round(int(st["RssAnon"][0]) / 1024, 1),
            "held_mb": round(held / 2**20, 1), "other_mb": round(rss - held / 2**20, 1),
            "staging": round((s.get("staging_resident") or 0) / 2**20, 1),
            "retained": round((s.get("retained_used") or 0) / 2**20, 1),
            "cache": round((s.get("cache_used") or 0) / 2**20, 1),
            "heap_in_use_mb": round((s.get("heap_in_use") or 0) / 2**20, 2),
            "heap_free_mb": round((s.get("heap_free_held") or 0) / 2**20, 2),
            "inodes": s.get("inodes"), "pending": s.get("journal_pending"),
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "cpu_s": round(sum(int(x) for x in open(f"/proc/{pid}/stat").read()
                               .rsplit(")", 1)[1].split()[11:13]) / os.sysconf("SC_CLK_TCK"), 1),
            "threads": int(st["Threads"][0])}


def stop_daemon(proc, mnt):
    """A clean unmount; a daemon that does not exit in 2 minutes is killed (its PID)."""
    subprocess.run(["fusermount3", "-u", mnt])
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        subprocess.run(["fusermount3", "-uz", mnt])
    print("daemon exit", proc.returncode, flush=True)


def main():
    what, ops, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    root, mnt, proc = start_daemon("ckptfs-rss-ops-", sys.argv[4:])
    rng = random.Random(48)
    logs = os.path.join(mnt, "logs")
    try:
        os.makedirs(logs, exist_ok=True)
        t0 = time.time()
        print(json.dumps({"ops": 0, "t": 0, **figures(proc.pid, mnt)}), flush=True)
        for done in range(1, ops + 1):
            traffic_op(rng, logs, done, what)
            if done % every == 0:
                print(json.dumps({"ops": done, "t": round(time.time() - t0),
                                  **figures(proc.pid, mnt)}), flush=True)
    finally:
        stop_daemon(proc, mnt)


if __name__ == "__main__":
    main()
