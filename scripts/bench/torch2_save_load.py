#!/usr/bin/env python3
"""ckptfs against what a torch 2.x user would pick instead (issue 22): the newest torch of
the cached Debian sid root (scripts/torch_root.sh sid), 4 gloo ranks, 1 GiB of DTensor
shards, all in one run, medians of --reps repetitions:

  save      dcp.save through ckptfs (--durability async) against dcp.async_save to a
            plain directory with the thread and the process checkpointer, and dcp.save to
            the plain directory; also dcp.async_save through ckptfs. Two figures each:
            the stall (until the call returns and training resumes) and the time to
            durable (plain: the save or its future finished, DCP fsyncs everything;
            ckptfs: the checkpoint committed on the backing store).
  load      cold dcp.load with FileSystemReader, default and thread_count > 1 where the
            torch has it, from the mount (a freshly started daemon) and from the plain
            directory; the page cache is dropped before each.

The plain directory and the backing directory are on the same disk. The programs run in
the root (torch2_bench_worker.py); the daemon on the host, mounted inside the root.
Writes torch2_save_load.json (one object per case, with ckptfs_s/direct_s/ratio where the
case has a baseline, and every sample) and torch2_save_load.png into --out. Needs root.
"""
import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys

import benchlib as bl
from torch_dcp_suite import RootMounts, root_tmpdir

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch2_bench_worker.py")


def run_worker(root, prog_in_root, args, timeout=1800):
    with root_tmpdir(root) as tmp:
        cmd = ["chroot", root, "env", "-i", "PATH=/usr/bin:/bin", "HOME=/root", "LANG=C.UTF-8",
               "PYTHONWARNINGS=ignore", f"TMPDIR={tmp}", "python3",
               f"{prog_in_root}/torch2_bench_worker.py", *args]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        try:
            out, _ = p.communicate(timeout=timeout)
        finally:
            try:
                os.killpg(p.pid, 9)  # its own group only: leftovers of the program
            except ProcessLookupError:
                pass
    for line in out.splitlines():
        if "rep " in line and "stall" in line:
            bl.log(line)
    if p.returncode != 0:
        raise RuntimeError(f"worker {args[:2]} failed:\n{out[-5000:]}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4, help="thread_count of the second load")
    ap.add_argument("--staging-mem", default="2G")
    ap.add_argument("--per-item", action="store_true",
                    help="save with single_file_per_rank=False (a file per item); the outputs "
                    "are named torch2_save_load_per_item.*")
    ap.add_argument("--work", default="/var/tmp/ckptfs-bench-torch2")
    ap.add_argument("--out", default=os.path.join(bl.REPO, "build-bench"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (chroot, mounts, drop_caches)", file=sys.stderr)
        return 1
    r = subprocess.run([os.path.join(bl.REPO, "scripts", "torch_root.sh"), "sid"],
                       stdout=subprocess.PIPE, text=True, timeout=3600)
    if r.returncode != 0:
        return 2 if r.returncode == 2 else 1
    root = r.stdout.strip().splitlines()[-1]
    os.makedirs(a.out, exist_ok=True)
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    lock = open(root + ".use.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    prog = os.path.join(root, "var/tmp/ckptfs-bench-torch2-prog")
    plain_in_root = "/var/tmp/ckptfs-bench-torch2-plain"
    plain = os.path.join(root, plain_in_root.lstrip("/"))
    mnt_in_root = "/mnt/ckptfs-bench-torch2"
    for d in (prog, plain):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    shutil.copy(WORKER, prog)
    prog_in_root = "/" + os.path.relpath(prog, root)
    daemon = bl.Daemon(a.work, staging=a.staging_mem, args=["--durability", "async"])
    os.rmdir(daemon.mnt)
    daemon.mnt = os.path.join(root, mnt_in_root.lstrip("/"))
    os.makedirs(daemon.mnt, exist_ok=True)
    stem = "torch2_save_load_per_item" if a.per_item else "torch2_save_load"
    raw = {"mib": a.mib, "reps": a.reps, "ranks": 4, "staging_mem": a.staging_mem,
           "single_file_per_rank": not a.per_item,
           "kernel": os.uname().release, "ckptfs_bin": os.path.realpath(bl.CKPTFS)}
    try:
        with RootMounts(root):
            daemon.start()
            bl.log(f"save phase: {a.reps} reps x 5 cases, {a.mib} MiB, 4 ranks")
            run_worker(root, prog_in_root, ["--phase", "save", "--mib", str(a.mib),
                                            "--reps", str(a.reps), "--mnt", mnt_in_root,
                                            "--plain", plain_in_root,
                                            *(["--per-item"] if a.per_item else []),
                                            "--out", f"{prog_in_root}/save.json"])
            with open(os.path.join(prog, "save.json")) as f:
                save = json.load(f)
            raw["torch"], raw["python"] = save["torch"], save["python"]
            raw["save_samples"], raw["warmup"] = save["samples"], save.get("warmup")
            loads = {}
            thread_counts = [1, a.threads]
            if not save.get("reader_thread_count"):
                loads[f"ckptfs_load_threads{a.threads}"] = {
                    "load_s": [], "unavailable": f"torch {save['torch']}: FileSystemReader "
                                                "has no thread_count"}
                thread_counts = [1]
            for rep in range(a.reps):
                for threads in thread_counts:
                    for where in ("ckptfs", "plain"):
                        key = f"{where}_load_threads{threads}"
                        target = (f"{mnt_in_root}/ckptfs_save_0" if where == "ckptfs"
                                  else f"{plain_in_root}/plain_save_0")
                        if where == "ckptfs":  # a freshly mounted daemon
                            rc = daemon.unmount(timeout=600)
                            if rc != 0:
                                raise RuntimeError(f"daemon exit code {rc}")
                            daemon.start()
                        if not bl.drop_caches():
                            raise RuntimeError("cannot drop the page cache")
                        run_worker(root, prog_in_root, [
                            "--phase", "load", "--mib", str(a.mib), "--target", target,
                            "--threads", str(threads), "--out", f"{prog_in_root}/load.json"])
                        with open(os.path.join(prog, "load.json")) as f:
                            lr = json.load(f)
                        rec = loads.setdefault(key, {"load_s": []})
                        if "unavailable" in lr:
                            rec["unavailable"] = lr["unavailable"]
                        else:
                            rec["load_s"].append(lr["load_s"])
                            bl.log(f"{key} rep {rep}: {lr['load_s']:.2f} s")
            raw["load_samples"] = loads
            rc = daemon.unmount(timeout=600)
            raw["daemon_rc"] = rc
    finally:
        daemon.stop()
        shutil.rmtree(prog, ignore_errors=True)
        shutil.rmtree(plain, ignore_errors=True)
        try:
            os.rmdir(daemon.mnt)
        except OSError:
            pass
    shutil.rmtree(a.work, ignore_errors=True)

    med = {c: {k: bl.median(v) for k, v in s.items()} for c, s in raw["save_samples"].items()}
    cases = []
    for c, m in med.items():
        cases.append({"case": c, "stall_s": m["stall_s"], "durable_s": m["durable_s"],
                      "samples": raw["save_samples"][c]})
    # Side-by-side figures: ckptfs against each baseline a torch 2.x user would pick.
    pairs = [("stall: dcp.save via ckptfs / async_save thread to plain", "ckptfs_save",
              "plain_async_thread", "stall_s"),
             ("stall: dcp.save via ckptfs / async_save process to plain", "ckptfs_save",
              "plain_async_process", "stall_s"),
             ("stall: dcp.save via ckptfs / dcp.save to plain", "ckptfs_save", "plain_save",
              "stall_s"),
             ("stall: async_save thread via ckptfs / to plain", "ckptfs_async_thread",
              "plain_async_thread", "stall_s"),
             ("durable: dcp.save via ckptfs / async_save thread to plain", "ckptfs_save",
              "plain_async_thread", "durable_s"),
             ("durable: dcp.save via ckptfs / async_save process to plain", "ckptfs_save",
              "plain_async_process", "durable_s"),
             ("durable: dcp.save via ckptfs / dcp.save to plain", "ckptfs_save", "plain_save",
              "durable_s"),
             ("durable: async_save thread via ckptfs / to plain", "ckptfs_async_thread",
              "plain_async_thread", "durable_s")]
    for name, ck, base, fig in pairs:
        cases.append({"case": name, "ckptfs_s": med[ck][fig], "direct_s": med[base][fig],
                      "ratio": bl.ratio(med[ck][fig], med[base][fig]), "ok": True})
    for threads in sorted({1, a.threads}):
        ck = raw["load_samples"].get(f"ckptfs_load_threads{threads}", {})
        pl = raw["load_samples"].get(f"plain_load_threads{threads}", {})
        if ck.get("unavailable"):
            cases.append({"case": f"cold load thread_count={threads}",
                          "unavailable": ck["unavailable"], "ok": True})
            continue
        c, p = bl.median(ck["load_s"]), bl.median(pl["load_s"])
        cases.append({"case": f"cold load thread_count={threads}", "ckptfs_s": c,
                      "direct_s": p, "ratio": bl.ratio(c, p), "ckptfs_samples": ck["load_s"],
                      "direct_samples": pl["load_s"], "ok": True})
    raw["cases"] = cases
    path = os.path.join(a.out, stem + ".json")
    with open(path, "w") as f:
        json.dump(raw, f, indent=1)
    for c in cases:
        print(json.dumps({k: v for k, v in c.items() if "samples" not in k}))
    bl.log(f"wrote {path}")
    try:
        plot(os.path.join(a.out, stem + ".png"), raw, med)
    except ImportError as e:
        bl.log(f"no PNG: {e}")
    return 0 if raw.get("daemon_rc") == 0 else 1


def plot(png, raw, med):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = list(med)
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [med[n]["stall_s"] for n in names], 0.4, label="stall")
    ax1.bar([i + 0.2 for i in x], [med[n]["durable_s"] for n in names], 0.4,
            label="time to durable")
    ax1.set_xticks(list(x))
    ax1.set_xticklabels([n.replace("_", "\n", 1) for n in names], fontsize=8)
    ax1.set_ylabel("seconds (median)")
    layout = "a file per rank" if raw.get("single_file_per_rank", True) else "a file per item"
    ax1.set_title(f"save, {raw['mib']} MiB DTensor shards, 4 ranks, {layout}")
    ax1.legend()
    loads = [(k, bl.median(v["load_s"])) for k, v in raw["load_samples"].items()
             if v.get("load_s")]
    ax2.bar(range(len(loads)), [v for _, v in loads],
            color=["tab:blue" if k.startswith("ckptfs") else "tab:gray" for k, _ in loads])
    ax2.set_xticks(range(len(loads)))
    ax2.set_xticklabels([k.replace("_load_", "\n") for k, _ in loads], fontsize=8)
    ax2.set_title("cold dcp.load (FileSystemReader)")
    ax2.set_ylabel("seconds (median)")
    fig.suptitle(f"torch {raw.get('torch')} (Debian sid), ckptfs --durability async vs a "
                 f"plain directory on the same disk, medians of {raw['reps']}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
