#!/usr/bin/env python3
"""PyTorch 2.x's own DCP tests (test/distributed/checkpoint/) with their TMPDIR on ckptfs.

The tests run unmodified, with the torch 2.x of a cached Debian root (scripts/torch_root.sh:
trixie = torch 2.6, sid = the newest), inside that root (chroot), each file with its own
unittest runner (`python3 FILE -v`; --runner pytest: `python3 -m pytest -q FILE`) and a
per-file timeout, in each of these modes:
  plain    TMPDIR a plain directory inside the root, on the same disk as the backing dir
  async    TMPDIR on a ckptfs mount at ROOT/mnt/ckptfs, --durability async
  strict   the same with --durability strict
For a mount, the backing and state dirs are on the host disk outside the root and the
mount; /proc, /sys and /dev (and a fresh tmpfs on /dev/shm) are bind-mounted into the
root. One daemon per mode serves all its rounds; after every round it must still be
running and its journal must not be halted (`ckptfs-admin stats --json`), else the mode
stops there. At the end the daemon is stopped with `ckptfs-admin unmount` and its exit
code recorded with its final stats and the log lines that mention a halt or a gate wait.

Writes torch_dcp_suite.json (per mode and file: rounds, passed/failed/timed-out rounds,
per-round wall time and test counts, the tests that failed or were running when the
timeout hit) and torch_dcp_suite.png into --out; prints a one-line summary per mode.
Exit 0 when every round of every mode passed, 1 otherwise, 2 when the root cannot be
built (the Debian archive is unreachable), 3 when there is nothing to run.
Every mount made here is undone on exit, failure included; only processes started here
are killed, by their process group.
"""
import argparse
import concurrent.futures
import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import benchlib as bl

DEFAULT_FILES = ["test_file_system_checkpoint_cpu.py"]
# --files cpu: the files that pass on a plain directory here (no GPU) and write through
# TMPDIR; test_dedup_tensors, test_nested_dict, test_traverse and test_utils pass too but
# touch no file, and test_fsspec, test_save_load_api and most of test_dtensor_resharding
# skip (CUDA).
CPU_FILES = ["test_file_system_checkpoint_cpu.py", "test_compatibility.py", "test_planner.py",
             "test_format_utils.py"]
TESTS_IN_ROOT = "/opt/torch-tests/test/distributed/checkpoint"
MNT_IN_ROOT = "/mnt/ckptfs"  # + "-async" / "-strict"
PLAIN_IN_ROOT = "/var/tmp/ckptfs-suite-plain"
STOP = threading.Event()     # SIGTERM/SIGINT once the root is mounted: wind down
MOUNTED = threading.Event()
LOG_PATTERN = re.compile(r"halted|waits|still halted|\[error\]|\[critical\]", re.I)


def register_mount(path):
    """Tells the e2e tests' guardian (tests/e2e/reaper.py) of a mount, when a test runs this."""
    try:
        import reaper
    except ImportError:
        return  # a benchmark, not a test: nothing guards it
    reaper.register_mount(path)


def sh(cmd, timeout=60, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


class RootMounts:
    """proc, sys, dev and a fresh /dev/shm inside the root; undone in reverse order."""

    def __init__(self, root):
        self.root = root
        self.done = []

    def mount(self, args, rel):
        target = os.path.join(self.root, rel)
        os.makedirs(target, exist_ok=True)
        r = sh(["mount", *args, target])
        if r.returncode != 0:
            raise RuntimeError(f"mount {args} {target}: {r.stderr.strip()}")
        register_mount(target)
        self.done.append(target)
        return target

    def __enter__(self):
        try:
            self.mount(["-t", "proc", "proc"], "proc")
            # Private, so that nothing mounted on them here (the tmpfs on dev/shm) reaches
            # the host's /dev through mount propagation, and the host's mounts stay out.
            self.mount(["--bind", "/sys"], "sys")
            self.private("sys")
            self.mount(["--bind", "/dev"], "dev")
            self.private("dev")
            self.mount(["-t", "tmpfs", "-o", "size=4g,mode=1777", "tmpfs"], "dev/shm")
        except BaseException:
            self.undo()
            raise
        return self

    def private(self, rel):
        target = os.path.join(self.root, rel)
        r = sh(["mount", "--make-private", target])
        if r.returncode != 0:
            raise RuntimeError(f"mount --make-private {target}: {r.stderr.strip()}")

    def undo(self):
        while self.done:
            t = self.done.pop()
            if sh(["umount", t]).returncode != 0:
                sh(["umount", "-l", t])

    def __exit__(self, *exc):
        self.undo()
        return False


@contextlib.contextmanager
def root_tmpdir(root):
    """A fresh directory in the root's /tmp, as the root sees it, for one program's TMPDIR;
    removed afterwards. A torch 2.x program's multiprocessing makes `pymp-*` directories in
    its TMPDIR that only a clean interpreter exit removes: a rank that ends with os._exit,
    or a process group killed after its run, left them in the cached root's /tmp."""
    d = tempfile.mkdtemp(prefix="ckptfs-run-", dir=os.path.join(root, "tmp"))
    try:
        yield "/" + os.path.relpath(d, root)
    finally:
        shutil.rmtree(d, ignore_errors=True)


START = re.compile(r"^(test\w*) \(([\w.]+)\)", re.M)  # "... ok" may follow a docstring line
RESULT = re.compile(r"(?:^|\.\.\. )(ok|FAIL|ERROR|skipped\b.*|expected failure|unexpected success)$",
                    re.M)


def parse_unittest(out):
    """Per-test results from a unittest -v log (a test's result may come lines after its
    name, after what its ranks printed), or the counts of a pytest -q summary."""
    res = {"ran": None, "ok": 0, "failed": [], "skipped": 0, "running": None, "tests": {}}
    m = re.findall(r"^Ran (\d+) tests? in ([\d.]+)s", out, re.M)
    if m:
        res["ran"] = int(m[-1][0])
    starts = list(START.finditer(out))
    for i, st in enumerate(starts):
        seg = out[st.start():starts[i + 1].start() if i + 1 < len(starts) else len(out)]
        name = st.group(1)
        r = RESULT.search(seg)
        if r is None:
            res["tests"][name] = "unfinished"
            res["running"] = name  # the one a timeout interrupted
            continue
        status = r.group(1)
        if status in ("ok", "expected failure"):
            res["ok"] += 1
            res["tests"][name] = "ok"
        elif status.startswith("skipped"):
            res["skipped"] += 1
            res["tests"][name] = "skipped"
        else:
            res["failed"].append(name)
            res["tests"][name] = status
    for kind, name in re.findall(r"^(FAIL|ERROR): (\w+)", out, re.M):
        if name not in res["failed"]:
            res["failed"].append(name)
    pm = re.search(r"^=+ (.*?) in ([\d.]+)s", out, re.M)
    if pm and not starts:  # pytest -q
        counts = dict((k, int(v)) for v, k in re.findall(r"(\d+) (\w+)", pm.group(1)))
        res["ok"] = counts.get("passed", 0)
        res["skipped"] = counts.get("skipped", 0)
        res["ran"] = sum(counts.values())
        res["failed"] += re.findall(r"^FAILED (\S+)", out, re.M)
    return res


def group_pids(pgid):
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid:
                    pids.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return sorted(pids)


def native_stacks(root, pgid):
    """What every process of the hung run is doing: gdb's native backtraces (named frames
    only), and a diagnosis where the pattern is known."""
    out = {}
    if shutil.which("gdb") is None:
        return {"error": "no gdb"}, None
    for pid in group_pids(pgid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
            r = sh(["gdb", "-p", str(pid), "-batch", "-ex", f"set sysroot {root}",
                    "-ex", "thread apply all bt 16"], timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        frames = [re.sub(r"^#\d+\s+0x[0-9a-f]+ in ", "", ln).split(" (")[0]
                  for ln in r.stdout.splitlines()
                  if ln.startswith("Thread ") or (ln.startswith("#") and " in ?? " not in ln)]
        out[str(pid)] = {"cmd": cmd, "frames": frames[:120]}
    text = "\n".join(f for v in out.values() for f in v["frames"])
    diagnosis = None
    if "ProcessGroupGloo::~ProcessGroupGloo" in text and "std::thread::join" in text:
        # Python 3.12+/torch 2.x: the process group's destructor joins a worker thread while
        # holding the GIL, and the worker waits for the GIL to free a tensor's PyObject.
        diagnosis = "torch: ProcessGroupGloo destructor joins a worker that waits for the GIL"
    return out, diagnosis


def run_file(root, fname, tmpdir_in_root, timeout, runner, log_path, select=(), stall=0,
             on_hang=None):
    """Runs one test file in the root; returns the round's record. A run is hung when it
    passes `timeout` seconds, or `stall` seconds with no test started or finished; then the
    native stacks of its processes and on_hang() (the daemon's view) are recorded before
    its process group is killed."""
    ks = "".join(f" -k {shlex.quote(k)}" for k in select)
    if runner == "pytest":
        cmd = f"python3 -m pytest -q -p no:cacheprovider {fname}{ks}"
    else:
        cmd = f"python3 {fname} -v{ks}"
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
           "TMPDIR": tmpdir_in_root, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    argv = ["chroot", root, "env", "-i", *[f"{k}={v}" for k, v in env.items()],
            "sh", "-c", f"cd {TESTS_IN_ROOT} && exec {cmd}"]
    t0 = time.monotonic()
    hang = None
    with open(log_path, "w") as logf:
        p = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            progress, last = -1, t0
            while True:
                try:
                    rc = p.wait(timeout=2)
                    break
                except subprocess.TimeoutExpired:
                    pass
                now = time.monotonic()
                with open(log_path, errors="replace") as f:
                    text = f.read()
                n = len(START.findall(text)) + len(RESULT.findall(text))
                if n != progress:
                    progress, last = n, now
                if STOP.is_set():
                    hang = {"kind": "interrupted", "after_s": round(now - t0, 1)}
                    os.killpg(p.pid, signal.SIGTERM)
                    rc = None
                    break
                if now - t0 > timeout or (stall and now - last > stall):
                    hang = {"kind": "timeout" if now - t0 > timeout else "stall",
                            "after_s": round(now - t0, 1),
                            "no_progress_s": round(now - last, 1)}
                    hang["stacks"], hang["diagnosis"] = native_stacks(root, p.pid)
                    if on_hang is not None:
                        hang["daemon"] = on_hang()
                    os.killpg(p.pid, signal.SIGTERM)
                    try:
                        p.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass
                    rc = None
                    break
        finally:
            # Ranks that outlived their parent (its process group) go too, also when this
            # script is interrupted.
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    wall = round(time.monotonic() - t0, 2)
    with open(log_path, errors="replace") as f:
        out = f.read()
    res = parse_unittest(out)
    status = ("interrupted" if hang["kind"] == "interrupted" else "timeout") if hang else \
        ("passed" if rc == 0 else "failed")
    rec = {"status": status, "rc": rc, "wall_s": wall, "ran": res["ran"], "ok": res["ok"],
           "skipped": res["skipped"], "failed_tests": res["failed"], "tests": res["tests"],
           "log": log_path}
    if hang:
        rec["running_at_timeout"] = res["running"]
        rec["hang"] = hang
    if status != "passed":
        rec["tail"] = out[-3000:]
    return rec


def admin_stats(mnt):
    r = sh([bl.ADMIN, "stats", mnt, "--json"], timeout=30)
    if r.returncode != 0:
        return None, f"ckptfs-admin stats -> {r.returncode}: {r.stderr.strip()[-300:]}"
    try:
        return json.loads(r.stdout), None
    except ValueError as e:
        return None, f"ckptfs-admin stats: bad JSON ({e})"


def log_lines(path, limit=200):
    try:
        with open(path, errors="replace") as f:
            hits = [line.rstrip() for line in f if LOG_PATTERN.search(line)]
    except OSError:
        return []
    return hits[:limit // 2] + (["..."] if len(hits) > limit else []) + hits[-limit // 2:] \
        if len(hits) > limit else hits


def uncommitted(log_path):
    """Checkpoints the daemon's log shows pending and neither committed nor removed since
    (a test's TemporaryDirectory may delete one before it commits), with the time they went
    pending."""
    state = {}
    pat = re.compile(r"^\[([^\]]+)\].*? checkpoint (\S+?):? (pending|committed|failed|removed|"
                     r"is being written again|aborted)")
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                m = pat.search(line)
                if m:
                    t, ck, what = m.groups()
                    if what == "pending" and ck not in state:
                        state[ck] = t
                    elif what in ("committed", "failed", "aborted", "removed"):
                        state.pop(ck, None)
    except OSError:
        return []
    return [f"{ck} (pending since {t})" for ck, t in state.items()]


def clear_dir(d):
    for n in os.listdir(d):
        p = os.path.join(d, n)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                os.unlink(p)
            except OSError:
                pass


def run_mode(a, root, mode, files):
    out = {"mode": mode, "rounds_asked": a.rounds, "rounds_run": 0, "files": {},
           "stopped_early": None}
    for f in files:
        out["files"][f] = {"passed": 0, "failed": 0, "timeouts": 0, "torch_deadlocks": 0,
                           "rounds": []}
    logs = os.path.join(a.work, f"logs-{mode}")
    os.makedirs(logs, exist_ok=True)
    daemon = None
    if mode == "plain":
        tmp_in_root = PLAIN_IN_ROOT
        tmp_host = os.path.join(root, PLAIN_IN_ROOT.lstrip("/"))
        shutil.rmtree(tmp_host, ignore_errors=True)
        os.makedirs(tmp_host)
    else:
        dwork = os.path.join(a.work, mode)
        shutil.rmtree(dwork, ignore_errors=True)
        daemon = bl.Daemon(dwork, staging=a.staging_mem, log_level=a.log_level,
                           args=["--durability", mode] + a.daemon_args.split())
        os.rmdir(daemon.mnt)  # the mount point is inside the root instead
        mnt_in_root = f"{MNT_IN_ROOT}-{mode}"
        daemon.mnt = os.path.join(root, mnt_in_root.lstrip("/"))
        os.makedirs(daemon.mnt, exist_ok=True)
        if bl.is_mounted(daemon.mnt):
            raise RuntimeError(f"{daemon.mnt} is already mounted (a leftover run?)")
        daemon.start()
        out["daemon_log"] = daemon.log
        tmp_in_root = mnt_in_root + "/tmp"
        tmp_host = os.path.join(daemon.mnt, "tmp")
        os.makedirs(tmp_host)
    def on_hang():  # the daemon's side of a hang: anything pending, halted, waiting?
        if daemon is None:
            return None
        st, err = admin_stats(daemon.mnt)
        keep = {k: v for k, v in (st or {}).items()
                if k.startswith(("journal_", "files_", "gate", "publication", "staging_used"))}
        return {"stats": keep, "stats_error": err, "alive": daemon.proc.poll() is None,
                "log": log_lines(daemon.log, 40)}

    t_mode = time.monotonic()
    try:
        for rnd in range(a.rounds):
            if STOP.is_set():
                out["stopped_early"] = out["stopped_early"] or f"interrupted before round {rnd}"
                break
            for f in files:
                fo = out["files"][f]
                rec = run_file(root, f, tmp_in_root, a.timeout, a.runner,
                               os.path.join(logs, f"{f[:-3]}.r{rnd}.log"), a.select, a.stall,
                               on_hang)
                if a.retry_torch_deadlock and torch_deadlock(rec):
                    # torch's own deadlock with the daemon idle: once more, both recorded
                    fo["torch_deadlocks"] += 1
                    bl.log(f"{mode} round {rnd + 1} {f}: {rec['hang']['diagnosis']} in "
                           f"{rec.get('running_at_timeout')} (daemon idle); running it again")
                    first = rec
                    rec = run_file(root, f, tmp_in_root, a.timeout, a.runner,
                                   os.path.join(logs, f"{f[:-3]}.r{rnd}.retry.log"), a.select,
                                   a.stall, on_hang)
                    rec["retried_after"] = first
                rec["round"] = rnd
                fo["rounds"].append(rec)
                if rec["status"] == "interrupted":
                    out["stopped_early"] = f"interrupted in round {rnd}"
                    break
                fo[{"passed": "passed", "failed": "failed", "timeout": "timeouts"}[rec["status"]]] += 1
                extra = ""
                if rec["status"] == "timeout":
                    extra = f" (running: {rec.get('running_at_timeout')})"
                    if rec["hang"].get("diagnosis"):
                        extra += f" [{rec['hang']['diagnosis']}]"
                elif rec["failed_tests"]:
                    extra = f" ({', '.join(rec['failed_tests'][:4])})"
                bl.log(f"{mode} round {rnd + 1}/{a.rounds} {f}: {rec['status']} "
                       f"{rec['ok']}/{rec['ran']} ok ({rec['skipped']} skipped) in {rec['wall_s']} s"
                       f"{extra}")
            out["rounds_run"] = rnd + 1
            if daemon is not None:
                if daemon.proc.poll() is not None:
                    out["stopped_early"] = f"daemon exited {daemon.proc.returncode} after round {rnd}"
                    break
                # Everything the round wrote must be published: the journal drains to 0
                # within --drain-wait s (a commit gate stuck behind a checkpoint leaves it
                # pending, not halted, until --commit-timeout).
                t_drain = time.monotonic()
                while True:
                    st, err = admin_stats(daemon.mnt)
                    if err or st.get("journal_halted") or \
                            (not st.get("journal_pending") and not st.get("files_pending")) or \
                            time.monotonic() - t_drain > a.drain_wait:
                        break
                    time.sleep(1)
                out.setdefault("drain_s", []).append(round(time.monotonic() - t_drain, 1))
                problem = err or (st.get("journal_halted") and
                                  f"journal halted {st['journal_halted']}")
                if not problem and (st.get("journal_pending") or st.get("files_pending")):
                    problem = (f"journal not drained {a.drain_wait} s after the round: "
                               f"journal_pending {st.get('journal_pending')}, files_pending "
                               f"{st.get('files_pending')}; never committed: "
                               f"{uncommitted(daemon.log)[:5]}")
                if problem:
                    out["stopped_early"] = f"after round {rnd}: {problem}"
                    out["stats_at_stop"] = st
                    break
            clear_dir(tmp_host)
    finally:
        out["wall_s"] = round(time.monotonic() - t_mode, 1)
        if daemon is not None:
            alive = daemon.proc is not None and daemon.proc.poll() is None
            if alive:
                out["stats_at_end"], out["stats_error"] = admin_stats(daemon.mnt)
            try:
                clear_dir(tmp_host)
            except OSError:
                pass
            out["unmount"] = stop_daemon(daemon, a.drain_timeout)
            out["daemon_log_lines"] = log_lines(daemon.log)
            out["never_committed"] = uncommitted(daemon.log)
    if out["stopped_early"]:
        bl.log(f"{mode}: stopped early: {out['stopped_early']}")
    return out


def torch_deadlock(rec):
    """A hang that is torch's own (a known stack) while the daemon had nothing pending."""
    h = rec.get("hang")
    if not h or not h.get("diagnosis"):
        return False
    d = h.get("daemon")
    if d is None:
        return True
    st = d.get("stats") or {}
    return d.get("alive") and not st.get("journal_halted") and not st.get("journal_pending") \
        and not st.get("files_pending")


def stop_daemon(daemon, timeout):
    """ckptfs-admin unmount, then the daemon's exit code; kills its PID only as a last resort."""
    res = {"admin_rc": None, "daemon_rc": None, "killed": False}
    if daemon.proc is None:
        return res
    if daemon.proc.poll() is None:
        try:
            r = sh([bl.ADMIN, "unmount", daemon.mnt], timeout=timeout)
            res["admin_rc"] = r.returncode
            res["admin_out"] = (r.stdout + r.stderr).strip()[-500:]
        except subprocess.TimeoutExpired:
            res["admin_rc"] = "timeout"
    try:  # after a clean unmount it exits at once; after a failed one it is not waited for
        res["daemon_rc"] = daemon.proc.wait(timeout=timeout if res["admin_rc"] == 0 else 10)
    except subprocess.TimeoutExpired:
        res["killed"] = True
    if daemon.proc.poll() is None or bl.is_mounted(daemon.mnt):
        daemon.stop()  # SIGKILL of its PID and a lazy fusermount3 -u
    daemon.proc = None
    return res


def plot(png, title, modes, files):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    names = [m["mode"] for m in modes]
    width = 0.8 / max(1, len(files))
    colors = {"passed": "tab:green", "failed": "tab:red", "timeouts": "tab:orange"}
    ax = axes[0]
    for i, f in enumerate(files):
        bottom = [0] * len(modes)
        for key in ("passed", "failed", "timeouts"):
            vals = [m["files"][f][key] for m in modes]
            xs = [j + i * width for j in range(len(modes))]
            ax.bar(xs, vals, width * 0.9, bottom=bottom, color=colors[key],
                   label=key if i == 0 else None, edgecolor="black", linewidth=0.4)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks([j + width * (len(files) - 1) / 2 for j in range(len(modes))])
    ax.set_xticklabels(names)
    ax.set_ylabel("rounds (per file)")
    ax.set_title("rounds passed / failed / timed out")
    ax.legend(fontsize=8)
    ax = axes[1]
    for i, f in enumerate(files):
        for j, m in enumerate(modes):
            rounds = m["files"][f]["rounds"]
            walls = [r["wall_s"] for r in rounds if r["status"] == "passed"]
            x = j + i * width
            if walls:
                ax.bar(x, bl.median(walls), width * 0.9, color="tab:blue",
                       label="median of passed rounds" if (i, j) == (0, 0) else None)
            for r in rounds:
                ax.scatter([x], [r["wall_s"]], s=12, zorder=3,
                           color="black" if r["status"] == "passed" else colors.get(
                               "timeouts" if r["status"] == "timeout" else "failed"))
    ax.set_xticks([j + width * (len(files) - 1) / 2 for j in range(len(modes))])
    ax.set_xticklabels(names)
    ax.set_ylabel("seconds per file and round")
    ax.set_title("wall time (dots: each round; orange: hung, red: failed)")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    bl.log(f"wrote {png}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--torch", default="trixie", choices=["trixie", "sid"])
    ap.add_argument("--modes", default="plain,async,strict")
    ap.add_argument("--files", default=",".join(DEFAULT_FILES),
                    help="comma-separated file names in test/distributed/checkpoint/, or cpu")
    ap.add_argument("--timeout", type=int, default=300, help="per file and round, seconds")
    ap.add_argument("-k", dest="select", action="append", default=[],
                    help="only tests matching this pattern (the runner's -k; repeatable)")
    ap.add_argument("--parallel", action="store_true",
                    help="run the modes at the same time (each its own daemon and mount)")
    ap.add_argument("--stall", type=int, default=180,
                    help="a file that starts or finishes no test for this long is hung (0: off)")
    ap.add_argument("--retry-torch-deadlock", action="store_true",
                    help="run a file again once when it hung in torch's own deadlock (known "
                    "stack) with the daemon idle; both are recorded")
    ap.add_argument("--runner", default="unittest", choices=["unittest", "pytest"])
    ap.add_argument("--staging-mem", default="1G")
    ap.add_argument("--log-level", default="debug",
                    help="daemon log level (debug shows the commit gate's waits)")
    ap.add_argument("--daemon-args", default="", help="extra daemon flags (one string)")
    ap.add_argument("--drain-wait", type=int, default=60,
                    help="after a round the journal must drain within this many seconds")
    ap.add_argument("--drain-timeout", type=int, default=300)
    ap.add_argument("--work", default="/var/tmp/ckptfs-torch-suite",
                    help="backing/state dirs and logs, on the host disk (wiped per mode)")
    ap.add_argument("--out", default=os.path.join(bl.REPO, "build-bench"))
    a = ap.parse_args()

    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in ("plain", "async", "strict"):
            ap.error(f"unknown mode {m}")
    files = CPU_FILES if a.files == "cpu" else [f for f in a.files.split(",") if f]
    if not files or not modes or a.rounds < 1:
        print("nothing to run", file=sys.stderr)
        return 3
    if os.geteuid() != 0:
        print("needs root (chroot, mounts)", file=sys.stderr)
        return 1

    def on_term(signum, _frame):
        # Before the mounts: just exit. After: every mode stops its running file (its
        # process group killed), stops its daemon, and the report is written as far as it got.
        if not STOP.is_set() and MOUNTED.is_set():
            STOP.set()
            bl.log(f"signal {signum}: stopping after the running files")
            return
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    r = subprocess.run([os.path.join(bl.REPO, "scripts", "torch_root.sh"), a.torch],
                       stdout=subprocess.PIPE, text=True, timeout=3600)
    if r.returncode != 0:
        print(f"torch_root.sh {a.torch} -> {r.returncode}", file=sys.stderr)
        return 2 if r.returncode == 2 else 1
    root = r.stdout.strip().splitlines()[-1]
    with open(os.path.join(root, ".ckptfs-torch-ready")) as f:
        info = dict(line.strip().split("=", 1) for line in f if "=" in line)
    for f in files:
        if not os.path.isfile(os.path.join(root, TESTS_IN_ROOT.lstrip("/"), f)):
            print(f"no such test file in the root: {f}", file=sys.stderr)
            return 3
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    bl.log(f"root {root}: torch {info.get('torch')} ({info.get('deb')}), tests of "
           f"{info.get('tests')}; files {files}; "
           f"modes {modes}; {a.rounds} rounds; timeout {a.timeout} s per file")
    raw = {"args": vars(a), "root": root, "torch": info.get("torch"), "deb": info.get("deb"),
           "tests_from": info.get("tests"), "ckptfs_bin": os.path.realpath(bl.CKPTFS),
           "kernel": os.uname().release, "modes": []}
    json_path = os.path.join(a.out, "torch_dcp_suite.json")
    ok = True
    # One run per root at a time (its proc/sys/dev mounts and mount points are shared).
    lock = open(root + ".use.lock", "w")
    t_lock = time.monotonic()
    fcntl.flock(lock, fcntl.LOCK_EX)
    if time.monotonic() - t_lock > 1:
        bl.log(f"waited {time.monotonic() - t_lock:.0f} s for another run on {root}")
    with RootMounts(root):
        MOUNTED.set()
        if a.parallel and len(modes) > 1:
            # One thread per mode, each with its own daemon and mount: the modes' rounds
            # overlap (for a CI machine with cores to spare; timings are then not comparable).
            with concurrent.futures.ThreadPoolExecutor(len(modes)) as ex:
                results = list(ex.map(lambda m: run_mode(a, root, m, files), modes))
        else:
            results = []
            for m in modes:
                results.append(run_mode(a, root, m, files))
                with open(json_path, "w") as f:
                    json.dump(dict(raw, modes=results), f, indent=1)
        for m, res in zip(modes, results):
            raw["modes"].append(res)
            good = all(fo["passed"] == a.rounds for fo in res["files"].values()) and \
                not res["stopped_early"]
            if "unmount" in res:
                good = good and res["unmount"]["daemon_rc"] == 0
            ok = ok and good
            counts = "; ".join(f"{f}: {fo['passed']} passed, {fo['failed']} failed, "
                               f"{fo['timeouts']} timed out" for f, fo in res["files"].items())
            print(f"{m}: {counts}; {res['wall_s']} s"
                  + (f"; daemon exit {res['unmount']['daemon_rc']}" if "unmount" in res else ""),
                  flush=True)
    raw["ok"] = ok
    with open(json_path, "w") as f:
        json.dump(raw, f, indent=1)
    bl.log(f"wrote {json_path}")
    try:
        plot(os.path.join(a.out, "torch_dcp_suite.png"),
             f"torch {info.get('torch')} running the tests of {info.get('tests')}, "
             f"TMPDIR per mode ({a.rounds} rounds{', modes at once' if a.parallel else ''})",
             raw["modes"], files)
    except ImportError as e:
        bl.log(f"no PNG: {e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
