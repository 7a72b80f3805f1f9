"""Shared pieces of the ckptfs benchmarks (see ../../../shared/BENCHMARKS.md).

A benchmark mounts a real daemon in the foreground (so it owns the PID),
measures ckptfs and the direct baseline side by side in one run, and prints
one JSON object per case. Nothing here is a test; it only measures.
"""
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN_DIR = os.environ.get("CKPTFS_BIN_DIR", os.path.join(REPO, "build", "bin"))
CKPTFS = os.path.join(BIN_DIR, "ckptfs")
ADMIN = os.path.join(BIN_DIR, "ckptfs-admin")
E2E_DIR = os.path.join(REPO, "tests", "e2e")
MiB = 1 << 20


def exit_cleanly_on_sigterm():
    """`kill PID` of a benchmark raises SystemExit instead of ending it at once, so its
    finally blocks and context managers unmount, unbind and stop what it started."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def is_mounted(path):
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def paired_ratio(ours, theirs, level=0.90, resamples=2000, seed=1):
    """The ratio of paired runs (ours[i] / theirs[i], the two sides of one rep, run one
    right after the other) as {"median": m, "ci": [lo, hi]}: m is the median of the
    per-rep ratios and [lo, hi] a bootstrap interval of that median at `level` (percentile
    method, a fixed seed so a run's JSON is reproducible). Pairing takes out what moves
    both sides of a rep together (the host's cache, other tenants); the interval says how
    far the median could be from the one this machine would give over many reps. None
    with fewer than 3 pairs."""
    import random
    pairs = [a / b for a, b in zip(ours, theirs) if a is not None and b]
    if len(pairs) < 3:
        return None
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(pairs, k=len(pairs)))
                  for _ in range(resamples))
    tail = (1 - level) / 2
    lo = meds[int(tail * (resamples - 1))]
    hi = meds[int((1 - tail) * (resamples - 1))]
    return {"median": round(statistics.median(pairs), 3), "ci": [round(lo, 3), round(hi, 3)],
            "level": level, "pairs": len(pairs)}


OP_LINE = re.compile(r'^ckptfs_fuse_op_duration_seconds_(bucket|sum|count)\{([^}]*)\} (\S+)$')


def op_histograms(mnt):
    """The daemon's per-op latency histograms from /.ckptfs/metrics: ({op: {"buckets":
    [(le, cumulative count)], "sum": seconds, "count": n}}, the metrics text). Reading
    them is itself a few requests to the daemon."""
    with open(os.path.join(mnt, ".ckptfs", "metrics")) as f:
        text = f.read()
    ops = {}
    for line in text.splitlines():
        m = OP_LINE.match(line)
        if not m:
            continue
        kind, labels, value = m.groups()
        lab = dict(kv.split("=", 1) for kv in labels.split(","))
        op = lab["op"].strip('"')
        h = ops.setdefault(op, {"buckets": []})
        if kind == "bucket":
            le = lab["le"].strip('"')
            h["buckets"].append((float("inf") if le == "+Inf" else float(le), float(value)))
        else:
            h[kind] = float(value)
    return ops, text


def sync():
    subprocess.run(["sync"], check=False)


def drop_caches():
    """Cold caches for reads; needs root. Returns False when not possible."""
    sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def vm_hwm(pid):
    """Peak resident set size of pid in bytes (VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def proc_io(pid):
    try:
        with open(f"/proc/{pid}/io") as f:
            return {k: int(v) for k, v in (line.split(": ") for line in f)}
    except OSError:
        return {}


def tree_bytes(path):
    total = 0
    for d, _, files in os.walk(path):
        for n in files:
            total += os.lstat(os.path.join(d, n)).st_size
    return total


def parse_size(s):
    s = s.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


class BlkioThrottle:
    """Context manager: this process (and every child it starts from now on: the
    daemon, the ranks) joins a cgroup-v1 blkio cgroup that throttles reads of the
    block device holding `path` to `bps` bytes/s. On exit the process returns to
    the root cgroup and the cgroup is removed. Needs root and cgroup v1 blkio;
    raises RuntimeError otherwise."""

    ROOT = "/sys/fs/cgroup/blkio"

    def __init__(self, path, bps, name=None):
        self.path = path
        self.bps = int(bps)
        self.dir = os.path.join(self.ROOT, name or f"ckptfs-bench-{os.getpid()}")

    def device(self):
        dev = os.stat(self.path).st_dev
        major, minor = os.major(dev), os.minor(dev)
        # A partition's throttle must name the whole disk it sits on.
        sys_dev = os.path.realpath(f"/sys/dev/block/{major}:{minor}")
        if os.path.exists(os.path.join(sys_dev, "partition")):
            with open(os.path.join(os.path.dirname(sys_dev), "dev")) as f:
                return f.read().strip()
        if not os.path.exists(sys_dev):
            raise RuntimeError(f"{self.path} is not on a block device ({major}:{minor})")
        return f"{major}:{minor}"

    def __enter__(self):
        if not os.path.isdir(self.ROOT):
            raise RuntimeError("no cgroup v1 blkio hierarchy at " + self.ROOT)
        dev = self.device()
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, "blkio.throttle.read_bps_device"), "w") as f:
            f.write(f"{dev} {self.bps}\n")
        with open(os.path.join(self.dir, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        log(f"blkio throttle: reads of {dev} at {self.bps / 1e6:.0f} MB/s ({self.dir})")
        return self

    def __exit__(self, *exc):
        with open(os.path.join(self.ROOT, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        for _ in range(50):  # children that outlived a case leave by themselves
            try:
                os.rmdir(self.dir)
                break
            except OSError:
                time.sleep(0.1)
        else:
            log(f"blkio throttle: could not remove {self.dir}")
        return False


class Daemon:
    """A foreground ckptfs this process owns; stop() always unmounts and
    kills exactly its PID."""

    def __init__(self, root, staging="2G", args=(), log_level="info", bin_dir=None):
        self.root = root
        # Another build's programs (an A/B of two commits side by side); default BIN_DIR.
        self.ckptfs = os.path.join(bin_dir, "ckptfs") if bin_dir else CKPTFS
        self.admin = os.path.join(bin_dir, "ckptfs-admin") if bin_dir else ADMIN
        self.backing = os.path.join(root, "backing")
        self.mnt = os.path.join(root, "mnt")
        self.state = os.path.join(root, "state")
        self.log = os.path.join(root, "ckptfs.log")
        self.staging = staging
        self.args = list(args)
        self.log_level = log_level
        self.proc = None
        os.makedirs(self.backing, exist_ok=True)
        os.makedirs(self.mnt, exist_ok=True)

    @property
    def pid(self):
        return self.proc.pid if self.proc else None

    def start(self, timeout=60):
        cmd = [self.ckptfs, "-f", "--staging-mem", self.staging, "--state-dir", self.state,
               "--log-file", self.log, "--log-level", self.log_level] + self.args + [
                   self.backing, self.mnt]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace")
                self.proc = None
                raise RuntimeError(f"ckptfs exited: {err}")
            if is_mounted(self.mnt) and os.path.exists(os.path.join(self.mnt, ".ckptfs", "stats")):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("ckptfs did not mount in time")

    def stats(self):
        with open(os.path.join(self.mnt, ".ckptfs", "stats")) as f:
            return json.load(f)

    def cpu_s(self):
        """CPU seconds (user + system, all threads) the daemon used so far (clock ticks)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def op_profile(self):
        """{op: [count, seconds]} the daemon spent serving each FUSE op so far
        (op_histograms)."""
        ops, _ = op_histograms(self.mnt)
        return {op: [int(h.get("count", 0)), round(h.get("sum", 0.0), 6)]
                for op, h in ops.items() if h.get("count")}

    def checkpoints(self):
        with open(os.path.join(self.mnt, ".ckptfs", "checkpoints")) as f:
            return json.load(f)

    def wait(self, path, timeout=600):
        """ckptfs-admin wait PATH; returns (ok, seconds)."""
        t0 = time.monotonic()
        r = subprocess.run([self.admin, "wait", path, "--timeout", str(timeout)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            log(f"ckptfs-admin wait {path} -> {r.returncode}: {r.stderr.strip()[-500:]}")
        return r.returncode == 0, time.monotonic() - t0

    def unmount(self, timeout=300):
        if self.proc is None:
            return None
        subprocess.run(["fusermount3", "-u", self.mnt], check=False)
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            self.stop()
        return rc

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None
        if is_mounted(self.mnt):
            subprocess.run(["fusermount3", "-u", "-z", self.mnt], check=False)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False


class StatsPoller:
    """Samples MOUNT/.ckptfs/stats every `interval` seconds in a thread:
    samples = [(monotonic time, stats dict)]."""

    def __init__(self, mnt, interval=0.05):
        self.path = os.path.join(mnt, ".ckptfs", "stats")
        self.interval = interval
        self.samples = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                with open(self.path) as f:
                    self.samples.append((t, json.load(f)))
            except (OSError, ValueError):
                pass
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - t)))

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join()
        return self.samples

    def first_time(self, key, above):
        """First sample time when stats[key] > above, or None."""
        return self.first_time_where(lambda s: s.get(key, 0) > above)

    def first_time_where(self, pred):
        """First sample time when pred(stats) holds, or None."""
        for t, s in self.samples:
            if pred(s):
                return t
        return None

    def series(self, t0, keys, base=None):
        """Samples from t0 on, times relative to t0; counters in `base`
        (a stats dict taken before the run) are shown relative to it."""
        base = base or {}
        rows = [(t, s) for t, s in self.samples if t >= t0]
        out = {"t": [round(t - t0, 3) for t, _ in rows]}
        for k in keys:
            b0 = base.get(k, 0) if k.startswith("bytes_") else 0
            out[k] = [None if s.get(k) is None else s[k] - b0 for _, s in rows]
        return out


def save_results(out_dir, name, raw, title, cases, **plot_args):
    """Writes NAME.json (raw) and, when there are cases, NAME.png (plot) into out_dir."""
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(raw, f, indent=1)
    if not cases:
        return
    try:
        plot(os.path.join(out_dir, f"{name}.png"), title, cases, **plot_args)
    except ImportError:
        log("matplotlib missing: no plot")


def emit(case):
    print(json.dumps(case), flush=True)


def plot(png, title, cases, progress=None, progress_title="", markers=(),
         ylabel="ckptfs / direct (lower is better)"):
    """Bar chart of ratios per case, plus (optionally) flush progress over
    time: progress = {"t": [...], name: [bytes...]}, markers = [(t, label)]."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = 2 if progress else 1
    fig, axes = plt.subplots(1, n, figsize=(7 * n, 4.5))
    axes = [axes] if n == 1 else list(axes)
    ax = axes[0]
    shown = [c for c in cases if c.get("ratio") is not None]
    names = [c["case"] for c in shown]
    vals = [c["ratio"] for c in shown]
    colors = ["tab:green" if v <= 1 else "tab:red" for v in vals]
    bars = ax.bar(range(len(vals)), vals, color=colors)
    # A case with paired reps (paired_ratio) shows the interval of its paired median.
    labelled = False
    for i, c in enumerate(shown):
        p = c.get("paired")
        if p:
            ax.errorbar(i, p["median"], yerr=[[p["median"] - p["ci"][0]],
                                              [p["ci"][1] - p["median"]]],
                        fmt="o", color="black", markersize=3, capsize=3, linewidth=0.8,
                        label=None if labelled else
                        f"median of per-rep ratios, {int(p['level'] * 100)}% interval")
            labelled = True
    if labelled:
        ax.legend(loc="lower right", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(vals)))
    ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    for b, v in zip(bars, vals):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{v:.2f}", ha="center",
                va="bottom", fontsize=8)
    if progress:
        ax = axes[1]
        t = progress["t"]
        for k, ys in progress.items():
            if k == "t":
                continue
            ax.plot(t, [(y or 0) / MiB for y in ys], label=k)
        for x, label in markers:
            if x is not None:
                ax.axvline(x, color="gray", linestyle=":", linewidth=1)
                ax.text(x, ax.get_ylim()[1] * 0.97, f" {label}", rotation=90, va="top",
                        fontsize=8, color="gray")
        ax.set_xlabel("seconds")
        ax.set_ylabel("MiB")
        ax.set_title(progress_title)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    log(f"wrote {png}")
