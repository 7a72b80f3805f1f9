#!/usr/bin/env python3
"""Cold reads through ckptfs against the disk, side by side in one run (issue 21): plain
files by dd and by mmap, the FUSE read ceiling, whole DCP loads with torch 1.13 and a
torch 2.x (Debian sid root), and a throttled store (see ../../../shared/BENCHMARKS.md).

Sides of the plain-file part (a 2 GiB file of random bytes in the backing dir), direct and
ckptfs taking turns going first, each read cold (page cache dropped, a freshly mounted
daemon) and then warm:
  direct        the backing file itself
  ckptfs        through a mount with passthrough (the default)
  ckptfs_daemon through a mount with --passthrough off (the daemon serves every read)
  fuse_ceiling  /zero of ckptfs-null-fuse: a FUSE server that serves zeros from memory
                (no storage at all): the most a daemon-served FUSE read can do here
Reads: `dd bs=1M` and a page-by-page mmap read (one byte per 4 KiB page, as safetensors'
safe_open touches a mapping).

Every cold read of the plain part is primed, the same way for every side (--plain-prime,
on by default): right before it, the backing file is read once directly and the page cache
dropped again. Two things outside both sides decide a cold read on this machine, and the
prime holds both the same for every read:
  * The host caches the VM's disk: whoever reads the file first in a round pays for the
    others (a first cold dd took 2.8-4.6 s, a second one 0.9-1.8 s).
  * The VM reports free memory to its host (virtio-balloon free page reporting,
    page_reporting_order 9: free 2 MiB blocks, 2 s after they are freed), and the host takes
    those pages back. A page cache that lands on them pays a host fault on its first touch,
    which the guest sees as its reader's own CPU time: a 2 GiB mmap read took 0.59 s or
    1.1-2.1 s with the same I/O (530 requests of 3.9 MiB, 1430 faults) and 0.02 s or 0.6-1.8 s
    of user time, for either side, by how long ago the memory it got was freed (3 s of sleep
    after the drop made every read of both sides slow). A daemon's start between the drop
    and the read was enough to tip it. With the prime, the read is more likely to get the
    pages the prime's drop has just freed, before they are reported. It is not certain to:
    in 16 primed reps, 5 of direct's cold mmap reads and 8 of ckptfs's were still slow or
    partly slow (`git show 736072d:docs/bench/bench_reads.md`); `*_cold_user_s` shows which.
--plain-prime off measures the unprimed order: the medians then mix both effects (the
`by_position` medians split them by who read first).

Loads (the whole load_state_dict, 4 gloo ranks, fresh daemon, caches dropped, both sides
alternating first): torch 1.13 (tests/e2e/dcp_tool.py: ShardedTensors) in both layouts and
own/replicated/reshard, the own load again with reads of the backing disk throttled
(--throttle-mbps, blkio cgroup, both sides), and torch 2.x DTensors (t2_dcp.py, inside the
root by chroot with /proc /sys /dev bound, the mount and the backing dir inside the root).
Every rank of both torch versions runs one intra-op thread, as torchrun starts them.

Loads are timed whole: max over ranks of the setup (reading `.metadata`, allocating the
state) plus max over ranks of `load_state_dict` (the ranks meet at a barrier between them):
`ratio`; `load_only_ratio` is load_state_dict alone. `ckpt_bytes_read`: the checkpoint's
bytes in the page cache after the cold load (fincore) plus the bytes the daemon read
itself (O_DIRECT, past the page cache): the checkpoint bytes read from the disk, without
the torch libraries the ranks load (those land in `device_bytes` too).

Bytes read from the disk: each side runs in its own blkio cgroup (v1) and reports
blkio.throttle.io_service_bytes Read of the backing disk (`device_bytes`): passthrough
reads are the readers' own, so the daemon's counters (`daemon_backing_bytes`, kept) no
longer see them. The disk is shared with other users of the machine: their reads do not
land in this cgroup.

Output: one JSON line per case (ratio = ckptfs / direct, medians over --reps), and
bench_reads.json, bench_reads.png in --out. Needs root.
"""
import argparse
import contextlib
import fcntl
import json
import mmap
import os
import resource
import shutil
import subprocess
import sys
import time

import benchlib as bl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, bl.E2E_DIR)
import bench_load  # noqa: E402
import dcp_tool  # noqa: E402
from torch_dcp_suite import RootMounts, root_tmpdir  # noqa: E402

NULL_FUSE = os.path.join(bl.BIN_DIR, "ckptfs-null-fuse")
T2_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "t2_dcp.py")


class Cgroup:
    """This process and its later children in a blkio cgroup; reads of `dev` are counted
    (and throttled to `bps` when given). Removed on exit."""
    ROOT = "/sys/fs/cgroup/blkio"

    def __init__(self, dev, bps=0, name="acct"):
        self.dev, self.bps = dev, int(bps)
        self.dir = os.path.join(self.ROOT, f"ckptfs-reads-{name}-{os.getpid()}")

    def read_bytes(self):
        with open(os.path.join(self.dir, "blkio.throttle.io_service_bytes")) as f:
            for line in f:
                p = line.split()
                if len(p) == 3 and p[0] == self.dev and p[1] == "Read":
                    return int(p[2])
        return 0

    def __enter__(self):
        # On this kernel (6.18) the v1 throttle counts nothing on a disk until some rule has been
        # written for it (blk-throttle is set up per disk on first use): a freshly booted
        # machine reported 0 bytes for every read. A rule of 0 (no limit) in the root
        # cgroup sets it up and limits nothing.
        with open(os.path.join(self.ROOT, "blkio.throttle.read_bps_device"), "w") as f:
            f.write(f"{self.dev} 0\n")
        os.makedirs(self.dir, exist_ok=True)
        if self.bps:
            with open(os.path.join(self.dir, "blkio.throttle.read_bps_device"), "w") as f:
                f.write(f"{self.dev} {self.bps}\n")
        with open(os.path.join(self.dir, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        self.start = self.read_bytes()
        return self

    def bytes(self):
        return self.read_bytes() - self.start

    def __exit__(self, *exc):
        with open(os.path.join(self.ROOT, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        for _ in range(100):
            try:
                os.rmdir(self.dir)
                break
            except OSError:
                time.sleep(0.1)
        return False


def resident_bytes(dir):
    """Bytes of the files under `dir` in the page cache now (fincore): after a cold load,
    the checkpoint bytes its readers (and a page-cache prefetch) read from the disk. The
    blkio counter of the side's cgroup also counts the torch libraries its ranks load,
    which drop_caches evicted too; this counts the checkpoint's bytes alone."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(dir) for f in fs]
    if not files:
        return 0
    r = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES"] + files,
                       capture_output=True, text=True, check=True)
    return sum(int(x) for x in r.stdout.split())


def drop():
    if not bl.drop_caches():
        raise SystemExit("drop_caches failed: run as root")


def dd(path):
    t0 = time.monotonic()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.monotonic() - t0


def user_cpu():
    """User CPU seconds of this process and its waited-for children (dd)."""
    return (resource.getrusage(resource.RUSAGE_SELF).ru_utime +
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime)


def mmap_read(path):
    t0 = time.monotonic()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
            s = 0
            for off in range(0, size, 4096):
                s += m[off]
    return time.monotonic() - t0


@contextlib.contextmanager
def null_fuse(mnt, size):
    os.makedirs(mnt, exist_ok=True)
    p = subprocess.Popen([NULL_FUSE, mnt, "-f", "--zero-size", str(size)])
    try:
        for _ in range(200):
            if bl.is_mounted(mnt):
                break
            time.sleep(0.05)
        yield os.path.join(mnt, "zero")
    finally:
        subprocess.run(["fusermount3", "-u", mnt], check=False)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def plain_side(side, work, plain_rel, size, dev, prime, staging):
    """Cold and warm dd, then cold and warm mmap, of one side; returns its numbers."""
    r = {}
    root = os.path.join(work, "ckptfs")
    for read, fn in (("dd", dd), ("mmap", mmap_read)):
        # The cgroup first: the daemon started in it counts its own reads there.
        with Cgroup(dev, name=side) as cg, contextlib.ExitStack() as stack:
            if side == "direct":
                path = os.path.join(root, "backing", plain_rel)
            elif side == "fuse_ceiling":
                path = stack.enter_context(null_fuse(os.path.join(work, "null-mnt"), size))
            else:
                args = [] if side == "ckptfs" else ["--passthrough", "off"]
                d = stack.enter_context(bl.Daemon(root, staging=staging, args=args))
                path = os.path.join(d.mnt, plain_rel)
            drop()
            if prime:
                # The same host cache and the same just-freed memory for every side's cold
                # read (see the docstring): read the backing file once, drop it again.
                dd(os.path.join(root, "backing", plain_rel))
                drop()
            cg.start = cg.read_bytes()
            u0 = user_cpu()
            r[f"{read}_cold_s"] = fn(path)
            # The reader's user time: a few hundredths of a second for a read that got
            # memory its host still backs, 0.5-1.8 s for one that did not (see the docstring).
            r[f"{read}_cold_user_s"] = user_cpu() - u0
            r[f"{read}_device_bytes"] = cg.bytes()
            r[f"{read}_warm_s"] = fn(path)
            if side in ("ckptfs", "ckptfs_daemon"):
                s = d.stats()
                r[f"{read}_passthrough_opens"] = s.get("passthrough_opens")
                r[f"{read}_daemon_bytes_served"] = s.get("bytes_served")
    return r


def run_plain(a, work, dev, cases, raw):
    backing = os.path.join(work, "ckptfs", "backing")
    os.makedirs(backing, exist_ok=True)
    size = a.plain_mb << 20
    path = os.path.join(backing, "plain.bin")
    bl.log(f"writing a {a.plain_mb} MiB plain file")
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 64 << 20)
            f.write(os.urandom(n))
            left -= n
    bl.sync()
    sides = ["direct", "ckptfs", "ckptfs_daemon", "fuse_ceiling"]
    runs = {s: [] for s in sides}
    # Every side but the ceiling reads the same backing file, and this machine's disk is
    # cached by its host: whoever reads it first in a rep pays for the others. Direct and
    # ckptfs take turns going first, each right before the other, so neither gets the
    # host's cache more often (a rotation of the four put ckptfs right after direct in 3
    # reps of 4: its cold dd then read at 0.46x direct and its warm dd at 1.45x).
    for rep in range(a.plain_reps):
        order = (["direct", "ckptfs", "ckptfs_daemon", "fuse_ceiling"] if rep % 2 == 0 else
                 ["ckptfs", "direct", "fuse_ceiling", "ckptfs_daemon"])
        for side in order:
            la = os.getloadavg()[0]
            r = plain_side(side, work, "plain.bin", size, dev, a.plain_prime == "on", a.staging)
            r["loadavg"] = la
            runs[side].append(r)
            raw["plain"].append(dict(r, side=side, rep=rep))
            bl.log(f"plain rep {rep} {side}: " + json.dumps({k: round(v, 3) if isinstance(
                v, float) else v for k, v in r.items()}))
    med = {s: {k: bl.median([r[k] for r in runs[s] if r.get(k) is not None])
               for k in runs[s][0]} for s in sides}
    for read in ("dd", "mmap"):
        for temp in ("cold", "warm"):
            k = f"{read}_{temp}_s"
            c = {"case": f"plain_{read}_{temp}", "direct_s": med["direct"][k],
                 "ckptfs_s": med["ckptfs"][k], "ratio": bl.ratio(med["ckptfs"][k],
                                                                 med["direct"][k]),
                 "ckptfs_daemon_s": med["ckptfs_daemon"][k],
                 "daemon_ratio": bl.ratio(med["ckptfs_daemon"][k], med["direct"][k]),
                 "fuse_ceiling_s": med["fuse_ceiling"][k],
                 "ceiling_ratio": bl.ratio(med["fuse_ceiling"][k], med["direct"][k]),
                 "mib": a.plain_mb,
                 "paired": bl.paired_ratio([r.get(k) for r in runs["ckptfs"]],
                                           [r.get(k) for r in runs["direct"]]),
                 "loadavg": bl.median([r["loadavg"] for s in sides for r in runs[s]])}
            # The median of all reps mixes reads that went first with reads that went second
            # (the host's cache, see above): the same ratio within each position too.
            c["by_position"] = {}
            # "first": each side's reads in the reps it went first (ckptfs in odd reps,
            # direct in even ones); "second": the others.
            for going_first, label in ((True, "first"), (False, "second")):
                ck = [r[k] for i, r in enumerate(runs["ckptfs"]) if (i % 2 == 1) == going_first]
                di = [r[k] for i, r in enumerate(runs["direct"]) if (i % 2 == 0) == going_first]
                if ck and di:
                    c["by_position"][label] = {"ckptfs_s": bl.median(ck), "direct_s": bl.median(di),
                                               "ratio": bl.ratio(bl.median(ck), bl.median(di))}
            if temp == "cold":
                c["device_bytes"] = {s: med[s][f"{read}_device_bytes"] for s in sides}
                c["passthrough_opens"] = med["ckptfs"].get(f"{read}_passthrough_opens")
                c["cold_user_s"] = {s: med[s][f"{read}_cold_user_s"] for s in sides}
            cases.append(c)
            bl.emit(c)
    os.remove(path)


def run_loads(a, work, dev, cases, raw):
    root = os.path.join(work, "ckptfs")
    backing = os.path.join(root, "backing")
    for sfpr in [int(x) for x in a.sfpr.split(",") if x]:
        name = f"ckpt_sfpr{sfpr}"
        ckpt = os.path.join(backing, name)
        bl.log(f"torch 1.13: saving {a.mb} MiB, sfpr={sfpr}, directly into the backing dir")
        dcp_tool.save(ckpt, a.ranks, a.mb, bool(sfpr), a.seed, timeout=1800)
        ckpt_bytes = bl.tree_bytes(ckpt)
        plan = [(m, 0) for m in a.modes.split(",") if m]
        if a.throttle_mbps > 0:
            plan.append(("own", a.throttle_mbps))
        for mode, mbps in plan:
            case = f"{'throttled_' if mbps else ''}t113_{mode}_sfpr{sfpr}"
            got = {"direct": [], "ckptfs": []}
            ok = True
            for rep in range(a.reps):
                order = ("direct", "ckptfs") if rep % 2 == 0 else ("ckptfs", "direct")
                for side in order:
                    la = os.getloadavg()[0]
                    with Cgroup(dev, bps=mbps * 1e6, name=side) as cg:
                        if side == "direct":
                            load_s, setup_s = bench_load.load_direct(ckpt, a.ranks, mode,
                                                                     a.seed)
                            r = {"load_s": load_s, "setup_s": setup_s, "backing_bytes": 0}
                        else:
                            r = bench_load.load_ckptfs(root, name, a.ranks, mode, a.seed, [],
                                                       "256M", True)
                            ok = ok and not r["errors"] and r["exit"] == 0
                        r["device_bytes"] = cg.bytes()
                        # The checkpoint's bytes read: what landed in the page cache plus
                        # what the daemon read itself (O_DIRECT, past the page cache).
                        r["ckpt_bytes_read"] = resident_bytes(ckpt) + r["backing_bytes"]
                        # A restart waits for reading .metadata and allocating the state
                        # (setup) and load_state_dict: both timed (max over ranks each; the
                        # ranks meet at a barrier between them).
                        r["whole_s"] = r["setup_s"] + r["load_s"]
                    r["loadavg"] = la
                    got[side].append(r)
                    raw["loads"].append(dict(r, case=case, side=side, rep=rep))
                    bl.log(f"{case} rep {rep} {side}: {r['whole_s']:.2f} s "
                           f"(load_state_dict {r['load_s']:.2f} s), "
                           f"{r['ckpt_bytes_read'] / 2**20:.0f} MiB of the checkpoint read, "
                           f"{r['device_bytes'] / 2**20:.0f} MiB from the disk in all")
            c = {"case": case, "ckptfs_s": bl.median([r["whole_s"] for r in got["ckptfs"]]),
                 "direct_s": bl.median([r["whole_s"] for r in got["direct"]])}
            c["ratio"] = bl.ratio(c["ckptfs_s"], c["direct_s"])
            c["paired"] = bl.paired_ratio([r["whole_s"] for r in got["ckptfs"]],
                                          [r["whole_s"] for r in got["direct"]])
            c["loadavg"] = bl.median([r["loadavg"] for r in got["ckptfs"] + got["direct"]])
            c["load_only_ratio"] = bl.ratio(bl.median([r["load_s"] for r in got["ckptfs"]]),
                                            bl.median([r["load_s"] for r in got["direct"]]))
            c["ckpt_bytes_read"] = int(bl.median([r["ckpt_bytes_read"] for r in got["ckptfs"]]))
            c["direct_ckpt_bytes_read"] = int(bl.median(
                [r["ckpt_bytes_read"] for r in got["direct"]]))
            c["ckpt_bytes_ratio"] = bl.ratio(c["ckpt_bytes_read"], c["direct_ckpt_bytes_read"])
            c["device_bytes"] = int(bl.median([r["device_bytes"] for r in got["ckptfs"]]))
            c["direct_device_bytes"] = int(bl.median([r["device_bytes"] for r in got["direct"]]))
            c["backing_bytes_ratio"] = bl.ratio(c["device_bytes"], c["direct_device_bytes"])
            c["daemon_backing_bytes"] = int(bl.median(
                [r["backing_bytes"] for r in got["ckptfs"]]))
            c["checkpoint_bytes"] = ckpt_bytes
            c["throttle_mbps"] = mbps or None
            c["ok"] = ok
            cases.append(c)
            bl.emit(c)
        shutil.rmtree(ckpt, ignore_errors=True)


def chroot_py(root, args, timeout=1800):
    with root_tmpdir(root) as tmp:
        r = subprocess.run(["chroot", root, "env", f"TMPDIR={tmp}", "python3", *args],
                           capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"chroot python3 {args}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def t2_case(a, troot, script, rel, inside_direct, inside_mnt, droot, backing, dev, name, mode,
            sfpr, cases, raw):
    """One torch 2.x load case: direct, ckptfs and (with --alt-args) a third daemon, each
    going first in turn, medians and paired ratios over --t2-reps."""
    case = f"t2_{mode}_sfpr{sfpr}"
    sides = ["direct", "ckptfs"] + (["alt"] if a.alt_args else [])
    got = {side: [] for side in sides}
    version = None
    for rep in range(a.t2_reps or a.reps):
        # Each side goes first as often as the others: the host's cache of this VM's disk
        # favours whoever reads second.
        k = rep % len(sides)
        order = sides[k:] + sides[:k]
        for side in order:
            la = os.getloadavg()[0]
            with Cgroup(dev, name="t2" + side) as cg:
                if side == "direct":
                    drop()
                    r = chroot_py(troot, [rel(script), "load", rel(inside_direct) + "/" + name,
                                          str(a.mb), str(a.ranks), mode])
                else:
                    d = bl.Daemon(droot, staging=a.staging,
                                  args=a.alt_args.split() if side == "alt" else ())
                    d.mnt = inside_mnt
                    with d:
                        drop()
                        cpu0 = d.cpu_s()
                        r = chroot_py(troot, [rel(script), "load", rel(inside_mnt) + "/" + name,
                                              str(a.mb), str(a.ranks), mode])
                        r["daemon_cpu_s"] = round(d.cpu_s() - cpu0, 3)
                        st = d.stats()
                        r["daemon_ops"] = d.op_profile()
                        r["passthrough_opens"] = st.get("passthrough_opens")
                        r["backing_bytes"] = st.get("backing_bytes_read", 0)
                        r["page_cache_prefetched"] = st.get("passthrough_page_cache_prefetched")
                        d.unmount(timeout=120)
                r["device_bytes"] = cg.bytes()
                r["ckpt_bytes_read"] = (resident_bytes(os.path.join(backing, name))
                                        + r.get("backing_bytes", 0))
            r["loadavg"] = la
            version = r.get("torch")
            got[side].append(r)
            raw["loads"].append(dict(r, case=case, side=side, rep=rep))
            bl.log(f"torch {version} {case} rep {rep} {side}: {r['load_s_max']:.2f} s "
                   f"(load {la:.1f})")
    c = {"case": case, "ckptfs_s": bl.median([r["load_s_max"] for r in got["ckptfs"]]),
         "direct_s": bl.median([r["load_s_max"] for r in got["direct"]]), "torch": version,
         "loadavg": bl.median([r["loadavg"] for r in got["ckptfs"] + got["direct"]])}
    c["ratio"] = bl.ratio(c["ckptfs_s"], c["direct_s"])
    c["paired"] = bl.paired_ratio([r["load_s_max"] for r in got["ckptfs"]],
                                  [r["load_s_max"] for r in got["direct"]])
    if a.alt_args:
        # The variant against direct and against the default daemon, paired the same way.
        c["alt_args"] = a.alt_args
        c["alt_s"] = bl.median([r["load_s_max"] for r in got["alt"]])
        c["alt_paired"] = bl.paired_ratio([r["load_s_max"] for r in got["alt"]],
                                          [r["load_s_max"] for r in got["direct"]])
        c["alt_vs_ckptfs"] = bl.paired_ratio([r["load_s_max"] for r in got["alt"]],
                                             [r["load_s_max"] for r in got["ckptfs"]])
    # Whether the loads waited for the CPUs or for the disk: the ranks' CPU seconds and the
    # machine's idle CPU seconds during load_state_dict (t2_dcp.py), medians per side.
    for key in ("ranks_cpu_s", "idle_cpu_s"):
        c[key] = {side: round(bl.median([r[key] for r in got[side]]), 3) for side in sides
                  if all(key in r for r in got[side])}
    c["device_bytes"] = int(bl.median([r["device_bytes"] for r in got["ckptfs"]]))
    c["direct_device_bytes"] = int(bl.median([r["device_bytes"] for r in got["direct"]]))
    c["ckpt_bytes_read"] = int(bl.median([r["ckpt_bytes_read"] for r in got["ckptfs"]]))
    c["direct_ckpt_bytes_read"] = int(bl.median([r["ckpt_bytes_read"] for r in got["direct"]]))
    c["ckpt_bytes_ratio"] = bl.ratio(c["ckpt_bytes_read"], c["direct_ckpt_bytes_read"])
    c["checkpoint_bytes"] = bl.tree_bytes(os.path.join(backing, name))
    c["ok"] = True
    cases.append(c)
    bl.emit(c)


def run_torch2(a, work, dev, cases, raw):
    troot = a.torch2_root
    if not troot or not os.path.isdir(troot):
        bl.log(f"no torch 2.x root at {troot!r}: torch 2.x loads skipped")
        return
    lock = open(troot + ".use.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    tag = f"ckptfs-reads-{os.getpid()}"
    droot = os.path.join(work, "t2")
    backing = os.path.join(droot, "backing")
    os.makedirs(backing, exist_ok=True)
    inside_direct = os.path.join(troot, "mnt", tag + "-direct")
    inside_mnt = os.path.join(troot, "mnt", tag + "-ckptfs")
    script = os.path.join(troot, "tmp", tag + "-t2_dcp.py")
    shutil.copy(T2_SCRIPT, script)
    os.makedirs(inside_direct, exist_ok=True)
    os.makedirs(inside_mnt, exist_ok=True)
    bound = False
    try:
        with RootMounts(troot):
            subprocess.run(["mount", "--bind", backing, inside_direct], check=True)
            bound = True
            rel = lambda p: "/" + os.path.relpath(p, troot)  # noqa: E731
            for sfpr in [int(x) for x in a.t2_sfpr.split(",") if x]:
                name = f"ckpt_t2_sfpr{sfpr}"
                bl.log(f"torch 2.x ({troot}): saving {a.mb} MiB of DTensors, sfpr={sfpr}")
                chroot_py(troot, [rel(script), "save", rel(inside_direct) + "/" + name,
                                  str(a.mb), str(a.ranks), "" if sfpr else "per_item"])
                for mode in [m for m in a.modes.split(",") if m]:
                    t2_case(a, troot, script, rel, inside_direct, inside_mnt, droot, backing,
                            dev, name, mode, sfpr, cases, raw)
                shutil.rmtree(os.path.join(backing, name), ignore_errors=True)
    finally:
        if bl.is_mounted(inside_mnt):
            subprocess.run(["fusermount3", "-u", "-z", inside_mnt], check=False)
        if bound:
            subprocess.run(["umount", inside_direct], check=False)
        for p in (inside_direct, inside_mnt):
            with contextlib.suppress(OSError):
                os.rmdir(p)
        with contextlib.suppress(OSError):
            os.remove(script)
        lock.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plain-mb", type=int, default=2048)
    ap.add_argument("--staging", default="256M",
                    help="--staging-mem of every ckptfs daemon (host memory is pinned as "
                         "writes need it; a load pins none)")
    ap.add_argument("--plain-reps", type=int, default=16,
                    help="reps of the plain-file part (about 22 s each at 2 GiB): a cold "
                         "read can land on memory the host took back, whichever side")
    ap.add_argument("--plain-prime", choices=("on", "off"), default="on",
                    help="read the plain file directly and drop it right before every "
                         "cold read of every side (see the docstring)")
    ap.add_argument("--mb", type=int, default=int(os.environ.get("BENCH_MB", 1024)))
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=int(os.environ.get("BENCH_REPS", 3)))
    ap.add_argument("--t2-reps", type=int, default=0,
                    help="reps of each torch 2.x case (default --reps): its loads are "
                    "CPU-bound on 2 cores, and one case spreads 10-25%% between reps")
    ap.add_argument("--sfpr", default="1,0")
    ap.add_argument("--t2-sfpr", default="1,0", help="torch 2.x layouts (1: a file per rank)")
    ap.add_argument("--modes", default="own,replicated,reshard")
    ap.add_argument("--seed", type=int, default=4242)
    ap.add_argument("--throttle-mbps", type=float, default=300)
    ap.add_argument("--torch2-root", default="/var/cache/ckptfs/torchroot-sid")
    ap.add_argument("--alt-args", default="",
                    help="torch 2.x loads only: a third side, a daemon started with these "
                         "arguments (e.g. '--fuse-uring on'), in the same rotation")
    ap.add_argument("--parts", default="plain,loads,torch2")
    ap.add_argument("--work", default=os.path.join(bl.REPO, "build-bench", "reads-work"))
    ap.add_argument("--out", default=os.path.join(bl.REPO, "build-bench"))
    a = ap.parse_args()
    bl.exit_cleanly_on_sigterm()
    if os.geteuid() != 0:
        raise SystemExit("needs root (drop_caches, cgroups, chroot)")
    os.makedirs(a.out, exist_ok=True)
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    dev = bl.BlkioThrottle(a.work, 0).device()
    raw = {"args": vars(a), "kernel": os.uname().release, "plain": [], "loads": [],
           "loadavg_start": os.getloadavg()}
    cases = []
    parts = a.parts.split(",")
    try:
        if "plain" in parts:
            run_plain(a, a.work, dev, cases, raw)
        if "loads" in parts:
            run_loads(a, a.work, dev, cases, raw)
        if "torch2" in parts:
            run_torch2(a, a.work, dev, cases, raw)
    finally:
        raw["loadavg_end"] = os.getloadavg()
        raw["cases"] = cases
        bl.save_results(a.out, "bench_reads", raw,
                        "cold reads: ckptfs / direct (medians, one run)", cases)
        shutil.rmtree(a.work, ignore_errors=True)


if __name__ == "__main__":
    main()
