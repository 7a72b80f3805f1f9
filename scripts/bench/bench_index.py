#!/usr/bin/env python3
"""Key index benchmarks: first look at a 100,000-chunk checkpoint's tensor view, Resolve()
latency, and what checksumming costs staged writes. See ../../../shared/BENCHMARKS.md.

Checkpoints are generated with torch 1.13's own classes, fast: a DCP `Metadata` object
(TensorStorageMetadata / ChunkStorageMetadata / MetadataIndex / _StorageInfo, exactly what
FileSystemWriter pickles) is built directly and pickled to `.metadata`, and each item is a real
`torch.save` archive (one template per chunk shape, repeated back to back, as
single_file_per_rank=True lays them out), so the index build parses real zip directories and
data.pkl. With --sparse, a second copy has sparse (all-zero) data files of the same lengths:
every item is then unreadable and indexed as opaque, which times the metadata path alone.

Cases (one JSON object each, medians over --reps):
  index_first_look_warm   listdir of MOUNT/.ckptfs/tensors/<ckpt> on a fresh state dir (lazy
                          build: .metadata and each item's zip directory; no item is read to
                          checksum it, that happens on its first full read), page cache warm
                          vs. torch's own read of the .metadata (pickle.load), warm
  index_first_look_cold   the same with the page cache dropped before each side (root only)
  index_reload_rocksdb    first look after a daemon restart on the same state dir (index loaded
                          from RocksDB) vs. torch's pickle.load
  index_first_look_sparse the sparse copy (metadata + failed archive reads)
  store_tests             KeyIndexBench output when a store_tests with it is found: Resolve,
                          Locate (random and sequential) ns/op on 100k items, and Build of the
                          generated checkpoint without checksums (--build-reps runs, each into
                          a fresh state db: medians of wall, thread and process CPU) and once
                          with checksums (CKPTFS_BENCH_CKPT, CKPTFS_BENCH_REPS)
  index_build_100k        that Build's median wall time against the 1 s goal (ratio <= 1: met)
  resolve_100k            Resolve() thread CPU ns per random lookup against the 1 us goal
  locate_100k             Locate() (the allocation-free lookup) likewise
  write_during_index_build staged write throughput (dd bs=1M, --write-mb) into the mount
                          started right at the commit of a --verify-mb DCP-like checkpoint copied
                          in through the mount, so that it overlaps the background index build
                          (which takes item CRC32Cs from the block CRCs the flush threads
                          recorded, reading only item edges) vs. the same dd with the daemon idle
  write_checksums_inline  the real inline cost: staged write throughput (dd bs=1M, --write-mb,
                          --write-staging large enough to hold it) into a daemon with
                          --write-checksums=on vs. one with off, alternating, medians; plus the
                          flush threads' hashing time from /.ckptfs/stats
  post_commit_index_read  backing bytes read from copying a --verify-mb checkpoint in through the
                          mount until its background index (with checksums) is installed, with
                          --write-checksums=on (only .metadata, zip directories and item edges)
                          vs. off (every item read back)
Writes bench_index.json and bench_index.png into --out.
"""
import argparse
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import threading
import time

import benchlib as bl

sys.path.insert(0, bl.E2E_DIR)
import dcp_tool  # noqa: E402


def build_checkpoint(path, n_fqns, chunks_per_fqn, rows, cols, n_files, sparse=False):
    """Writes a DCP checkpoint of n_fqns float32 tensors [chunks_per_fqn*rows, cols], each
    row-sharded in chunks_per_fqn chunks; chunk c lives in __{c % n_files}_0.distcp."""
    dcp_tool._apply_sitecustomize()
    import torch
    from torch.distributed._shard.checkpoint.filesystem import _StorageInfo
    from torch.distributed._shard.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata)
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    os.makedirs(path, exist_ok=True)
    buf = io.BytesIO()
    torch.save(torch.zeros(rows, cols, dtype=torch.float32), buf)
    template = buf.getvalue()
    props = TensorProperties(dtype=torch.float32)
    size = torch.Size([chunks_per_fqn * rows, cols])
    sdm, storage, counts = {}, {}, [0] * n_files
    for i in range(n_fqns):
        fqn = f"model.layers.{i}.weight"
        chunks = []
        for c in range(chunks_per_fqn):
            offsets = torch.Size([c * rows, 0])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([rows, cols])))
            f = c % n_files
            storage[MetadataIndex(fqn, offsets)] = _StorageInfo(
                f"__{f}_0.distcp", counts[f] * len(template), len(template))
            counts[f] += 1
        sdm[fqn] = TensorStorageMetadata(properties=props, size=size, chunks=chunks)
    md = Metadata(state_dict_metadata=sdm)
    md.storage_data = storage
    for f in range(n_files):
        name = os.path.join(path, f"__{f}_0.distcp")
        if sparse:
            with open(name, "wb") as out:
                out.truncate(counts[f] * len(template))
        else:
            with open(name, "wb") as out:
                block = template * 1024
                left = counts[f]
                while left:
                    n = min(left, 1024)
                    out.write(block if n == 1024 else template * n)
                    left -= n
    with open(os.path.join(path, ".metadata"), "wb") as out:
        pickle.dump(md, out)
    return {"chunks": n_fqns * chunks_per_fqn, "fqns": n_fqns, "files": n_files,
            "item_bytes": len(template), "data_bytes": sum(counts) * len(template),
            "metadata_bytes": os.path.getsize(os.path.join(path, ".metadata"))}


def torch_read_metadata(path):
    """What torch's FileSystemReader.read_metadata does: pickle.load of .metadata."""
    dcp_tool._apply_sitecustomize()
    import torch.distributed._shard.checkpoint  # noqa: F401  (the classes to unpickle)
    t0 = time.monotonic()
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    dt = time.monotonic() - t0
    return dt, len(md.storage_data)


def daemon(root, backing, state, staging="2G", args=()):
    d = bl.Daemon(root, staging=staging, args=list(args))
    d.backing, d.state = backing, state  # Daemon() made root/backing; use the shared one
    return d


def cpu_s(pid):
    """User + system CPU seconds of pid so far (all threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


CPU = {}


def first_look(d, rel):
    """Seconds for the first listdir of the checkpoint's view; the daemon's CPU seconds for it
    go to CPU[rel] (a figure that the machine's noise moves less than wall time)."""
    view = os.path.join(d.mnt, ".ckptfs", "tensors", rel)
    c0 = cpu_s(d.pid)
    t0 = time.monotonic()
    names = os.listdir(view)
    dt = time.monotonic() - t0
    CPU[rel] = cpu_s(d.pid) - c0
    return dt, names


def check_view(d, rel, n_fqns, chunks_per_fqn, want_checksums=False):
    view = os.path.join(d.mnt, ".ckptfs", "tensors", rel)
    with open(os.path.join(view, "model.layers.0.weight", "meta.json")) as f:
        meta = json.load(f)
    ok = len(meta["chunks"]) == chunks_per_fqn and meta["kind"] == "tensor"
    if want_checksums:
        ok = ok and all(c["checksum"] for c in meta["chunks"])
    return ok, meta


def find_store_tests():
    cands = [os.environ.get("CKPTFS_STORE_TESTS", ""), os.path.join(bl.BIN_DIR, "store_tests")]
    for d in sorted(os.listdir(bl.REPO)):
        # sanitizer and fuzzing builds run many times slower: their figures mean nothing
        if d.startswith("build") and not re.search(r"asan|tsan|ubsan|msan|sanit|fuzz", d):
            cands.append(os.path.join(bl.REPO, d, "bin", "store_tests"))
    best = None
    for c in cands:
        if not c or not os.access(c, os.X_OK):
            continue
        r = subprocess.run([c, "--gtest_list_tests", "--gtest_filter=KeyIndexBench.*"],
                           capture_output=True, text=True)
        if "ResolveLatencyOn100kItems" in r.stdout:
            if best is None or os.path.getmtime(c) > os.path.getmtime(best):
                best = c
    return best


def run_store_bench(binary, ckpt, build_reps):
    env = dict(os.environ, CKPTFS_BENCH_CKPT=ckpt, CKPTFS_BENCH_REPS=str(build_reps))
    r = subprocess.run([binary, "--gtest_filter=KeyIndexBench.*"], capture_output=True,
                       text=True, env=env, timeout=600)
    out = {"binary": binary, "rc": r.returncode,
           "lines": [l for l in r.stdout.split("\n") if l.startswith("[bench]")]}
    lookup = (r"([\d.]+) ns/op wall, ([\d.]+) ns/op thread CPU, best round ([\d.]+) ns/op")
    for l in out["lines"]:
        for label, key in (("Resolve random", "resolve"), ("Locate random", "locate"),
                           ("Locate sequential", "locate_seq")):
            m = re.search(re.escape(label) + r".*?" + lookup, l)
            if m:
                out.update({f"{key}_ns_wall": float(m[1]), f"{key}_ns_cpu": float(m[2]),
                            f"{key}_ns_best_round": float(m[3])})
        m = re.search(r"BuildFrom \(no shard files\) ([\d.]+) ms wall, ([\d.]+) ms thread CPU; "
                      r"load from RocksDB ([\d.]+) ms", l)
        if m:
            out.update(buildfrom_100k_ms=float(m[1]), buildfrom_100k_cpu_ms=float(m[2]),
                       load_rocksdb_ms=float(m[3]))
        m = re.search(r"(\d+) chunks, .metadata (\d+) bytes \(ms wall / thread CPU\): "
                      r"ParseDcpMetadata ([\d.]+) / ([\d.]+), Build without checksums ([\d.]+) / "
                      r"([\d.]+), Build with checksums ([\d.]+) / ([\d.]+)", l)
        if m:
            out.update(chunks=int(m[1]), parse_ms=float(m[3]), parse_cpu_ms=float(m[4]),
                       build_no_sums_ms=float(m[5]), build_no_sums_cpu_ms=float(m[6]),
                       build_sums_ms=float(m[7]), build_sums_cpu_ms=float(m[8]))
        m = re.search(r"Build without checksums, (\d+) runs \(ms\): wall median ([\d.]+) "
                      r"\[([\d,]*)\], thread CPU median ([\d.]+) \[([\d,]*)\], process CPU "
                      r"median ([\d.]+) \[([\d,]*)\]", l)
        if m:
            ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
            out.update(build_runs=int(m[1]), build_no_sums_ms=float(m[2]),
                       build_no_sums_all_ms=ints(m[3]), build_no_sums_cpu_ms=float(m[4]),
                       build_no_sums_cpu_all_ms=ints(m[5]),
                       build_no_sums_proc_cpu_ms=float(m[6]),
                       build_no_sums_proc_cpu_all_ms=ints(m[7]))
    return out


def dd(src, dst):
    t0 = time.monotonic()
    subprocess.run(["dd", f"if={src}", f"of={dst}", "bs=1M", "status=none"], check=True)
    return time.monotonic() - t0


def wait_checksummed(d, rel, timeout=600):
    """Waits until the index of `rel` (built after its commit) carries checksums: the build
    installs a checkpoint's index at once, so one fqn with checksums means all are done."""
    meta = os.path.join(d.mnt, ".ckptfs", "tensors", rel, "model.layers.0.weight", "meta.json")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(meta) as f:
                chunks = json.load(f)["chunks"]
            if chunks and all(c["checksum"] for c in chunks):
                return True
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return False


def bench_inline(a, backing, src, vck, vgen):
    """write_checksums_inline and post_commit_index_read: one daemon with write checksums on,
    one with off, each on its own backing dir; the same dd alternates between them."""
    size = a.write_mb * bl.MiB
    sides = ("on", "off")
    t = {s: [] for s in sides}
    read = {s: [] for s in sides}
    hashed = {s: [] for s in sides}
    oks = []
    ds = {}
    try:
        for s in sides:
            b = os.path.join(a.work, f"backing_{s}")
            os.makedirs(b, exist_ok=True)
            ds[s] = daemon(os.path.join(a.work, f"di_{s}"), b, os.path.join(a.work, f"statei_{s}"),
                           staging=a.write_staging, args=[f"--write-checksums={s}"])
            ds[s].__enter__()
        for rep in range(a.reps):
            for s in (sides if rep % 2 == 0 else sides[::-1]):
                d = ds[s]
                dst = os.path.join(d.mnt, f"w{rep}")
                bl.sync()
                h0 = d.stats().get("checksum_hash_s", 0.0)
                t[s].append(dd(src, dst))
                okw, _ = d.wait(dst)
                hashed[s].append(d.stats().get("checksum_hash_s", 0.0) - h0)
                oks.append(okw and subprocess.run(
                    ["cmp", "-s", src, os.path.join(d.backing, f"w{rep}")]).returncode == 0)
                os.unlink(dst)
                # A checkpoint through the mount, until its index with checksums is installed.
                r0 = d.stats()["backing_bytes_read"]
                ck = os.path.join(d.mnt, f"ckpt{rep}")
                os.mkdir(ck)
                for n in sorted(os.listdir(vck), key=lambda n: n == ".metadata"):
                    shutil.copyfile(os.path.join(vck, n), os.path.join(ck, n))
                okc, _ = d.wait(ck)
                oks.append(okc and wait_checksummed(d, f"ckpt{rep}"))
                read[s].append(d.stats()["backing_bytes_read"] - r0)
            bl.log(f"inline rep {rep}: dd {a.write_mb} MiB checksums on {t['on'][-1]:.3f} s, "
                   f"off {t['off'][-1]:.3f} s; post-commit index read on "
                   f"{read['on'][-1] >> 20} MiB, off {read['off'][-1] >> 20} MiB")
    finally:
        for d in ds.values():
            d.unmount()
            d.__exit__(None, None, None)
    on, off = bl.median(t["on"]), bl.median(t["off"])
    c1 = {"case": "write_checksums_inline", "ckptfs_s": round(on, 3), "direct_s": round(off, 3),
          "ratio": bl.ratio(on, off), "backing_bytes": size, "ok": all(oks),
          "baseline": "same dd into a daemon with --write-checksums=off",
          "on_GBps": round(size / on / 1e9, 3), "off_GBps": round(size / off / 1e9, 3),
          "throughput_cost_share": round(1 - off / on, 4), "under_5pct": on <= off * 1.05,
          "flush_thread_hash_s_median": round(bl.median(hashed["on"]), 3),
          "on_all": [round(x, 3) for x in t["on"]], "off_all": [round(x, 3) for x in t["off"]],
          "reps": a.reps, "staging": a.write_staging}
    c2 = {"case": "post_commit_index_read", "ok": all(oks),
          "checkpoint_bytes": vgen["data_bytes"], "items": vgen["chunks"],
          "backing_bytes_read_on": int(bl.median(read["on"])),
          "backing_bytes_read_off": int(bl.median(read["off"])),
          "on_all": read["on"], "off_all": read["off"],
          "note": "bytes read by the daemon from the copy-in until the index with checksums is "
                  "installed (.metadata for the commit gate, zip directories, item edges)"}
    for c in (c1, c2):
        bl.emit(c)
    return [c1, c2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fqns", type=int, default=1000)
    ap.add_argument("--chunks-per-fqn", type=int, default=100)
    ap.add_argument("--rows", type=int, default=4, help="rows per chunk (x 16 float32 cols)")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--build-reps", type=int, default=5,
                    help="index builds of the 100k-chunk checkpoint in store_tests (medians)")
    ap.add_argument("--sparse", type=int, choices=(0, 1), default=1)
    ap.add_argument("--write-mb", type=int, default=1024, help="staged write size (0: skip)")
    ap.add_argument("--write-staging", default="4G",
                    help="--staging-mem of the write_checksums_inline daemons (holds --write-mb)")
    ap.add_argument("--verify-mb", type=int, default=1024,
                    help="size of the checkpoint committed (and then indexed) before the write")
    ap.add_argument("--work", default="/var/tmp/ckptfs-bench-index",
                    help="scratch dir on the backing file system (wiped); keep it outside the "
                         "repository, where a recursive grep of the tree would walk the mounts")
    ap.add_argument("--parts", default="index,store,write",
                    help="which parts to run: index (first look), store (store_tests "
                         "KeyIndexBench), write (staged writes during the index build), "
                         "inline (write checksums on vs. off)")
    ap.add_argument("--out", default=os.path.join(bl.REPO, "build-bench"))
    a = ap.parse_args()
    parts = set(a.parts.split(","))

    os.makedirs(a.out, exist_ok=True)
    shutil.rmtree(a.work, ignore_errors=True)
    backing = os.path.join(a.work, "backing")
    big = os.path.join(backing, "big")
    t0 = time.monotonic()
    gen = build_checkpoint(big, a.fqns, a.chunks_per_fqn, a.rows, 16, a.files)
    bl.log(f"generated {gen['chunks']} chunks in {time.monotonic() - t0:.1f} s: {gen}")
    if a.sparse:
        build_checkpoint(os.path.join(backing, "big_sparse"), a.fqns, a.chunks_per_fqn, a.rows,
                         16, a.files, sparse=True)
    can_drop = bl.drop_caches()
    raw = {"args": vars(a), "generated": gen, "runs": []}
    cases, oks = [], []

    # --- first look, lazy build ---------------------------------------------------------------
    res = {k: [] for k in ("warm", "cold", "reload", "sparse", "torch_warm", "torch_cold",
                           "warm_cpu", "reload_cpu", "sparse_cpu")}
    for rep in range(a.reps if "index" in parts else 0):
        run = {"rep": rep}
        state = os.path.join(a.work, f"state{rep}")
        root = os.path.join(a.work, f"d{rep}")
        # torch's read of the same .metadata, warm (read once first) and cold
        torch_read_metadata(big)
        run["torch_warm_s"], n = torch_read_metadata(big)
        res["torch_warm"].append(run["torch_warm_s"])
        oks.append(n == gen["chunks"])
        with daemon(root, backing, state) as d:
            dt, names = first_look(d, "big")
            ok, _ = check_view(d, "big", a.fqns, a.chunks_per_fqn)
            ok = ok and len(names) == a.fqns
            oks.append(ok)
            run["first_look_warm_s"] = dt
            run["first_look_warm_daemon_cpu_s"] = CPU["big"]
            res["warm"].append(dt)
            res["warm_cpu"].append(CPU["big"])
            t1 = time.monotonic()
            os.listdir(os.path.join(d.mnt, ".ckptfs", "tensors", "big"))
            run["second_look_s"] = time.monotonic() - t1
            if a.sparse:
                dt, names = first_look(d, "big_sparse")
                run["first_look_sparse_s"] = dt
                res["sparse"].append(dt)
                res["sparse_cpu"].append(CPU["big_sparse"])
                run["sparse_listed"] = len(names)
            stats = d.stats()
            run["backing_bytes_read"] = stats.get("backing_bytes_read")
            d.unmount()
        # restart on the same state: the index comes from RocksDB
        with daemon(root, backing, state) as d:
            dt, names = first_look(d, "big")
            oks.append(len(names) == a.fqns and check_view(d, "big", a.fqns,
                                                           a.chunks_per_fqn)[0])
            run["reload_rocksdb_s"] = dt
            res["reload"].append(dt)
            res["reload_cpu"].append(CPU["big"])
            d.unmount()
        if can_drop:
            with daemon(root + "c", backing, state + "c") as d:
                bl.drop_caches()
                dt, names = first_look(d, "big")
                oks.append(len(names) == a.fqns)
                run["first_look_cold_s"] = dt
                res["cold"].append(dt)
                d.unmount()
            bl.drop_caches()
            run["torch_cold_s"], _ = torch_read_metadata(big)
            res["torch_cold"].append(run["torch_cold_s"])
        bl.log(f"rep {rep}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in run.items()))
        raw["runs"].append(run)
        for p in (state, root, state + "c", root + "c"):
            shutil.rmtree(p, ignore_errors=True)

    ok_index = all(oks)
    tw = bl.median(res["torch_warm"])

    def case(name, key, base, **extra):
        mc = bl.median(res[key])
        if res.get(key + "_cpu"):
            extra["daemon_cpu_s"] = round(bl.median(res[key + "_cpu"]), 4)
        c = {"case": name, "ckptfs_s": round(mc, 4), "direct_s": round(base, 4),
             "ratio": bl.ratio(mc, base), "backing_bytes": gen["data_bytes"], "ok": ok_index,
             "chunks": gen["chunks"], "metadata_bytes": gen["metadata_bytes"],
             "baseline": "torch pickle.load of .metadata", "reps": a.reps,
             "ckptfs_all": [round(x, 4) for x in res[key]], "under_1s": mc < 1.0}
        c.update(extra)
        cases.append(c)
        bl.emit(c)

    if res["warm"]:
        case("index_first_look_warm", "warm", tw, checksums=False)
    if res["cold"]:
        case("index_first_look_cold", "cold", bl.median(res["torch_cold"]), checksums=False)
    if res["reload"]:
        case("index_reload_rocksdb", "reload", tw)
    if res["sparse"]:
        case("index_first_look_sparse", "sparse", tw, checksums=False,
             note="sparse data files: every archive read fails, items indexed as opaque")

    # --- store_tests KeyIndexBench -------------------------------------------------------------
    binary = find_store_tests() if "store" in parts else None
    if binary:
        sb = run_store_bench(binary, big, a.build_reps)
        raw["store_tests"] = sb
        c = {"case": "store_tests", "ok": sb["rc"] == 0, **sb}
        if sb.get("build_sums_cpu_ms"):
            c["checksum_share_of_build_cpu"] = round(
                1 - sb["build_no_sums_cpu_ms"] / sb["build_sums_cpu_ms"], 3)
        cases.append(c)
        bl.emit(c)
        # The goals as ratios (<= 1 met): Build of the 100k-chunk checkpoint without
        # checksums under 1 s, a lookup under 1 us. Wall time moves with the machine's load;
        # CPU time is given beside it.
        if sb.get("build_no_sums_ms") is not None:
            c = {"case": "index_build_100k", "ckptfs_s": round(sb["build_no_sums_ms"] / 1e3, 4),
                 "direct_s": 1.0, "ratio": bl.ratio(sb["build_no_sums_ms"] / 1e3, 1.0),
                 "baseline": "goal: 1 s", "chunks": sb.get("chunks"),
                 "thread_cpu_s": round(sb["build_no_sums_cpu_ms"] / 1e3, 4),
                 "process_cpu_s": round(sb.get("build_no_sums_proc_cpu_ms", 0) / 1e3, 4),
                 "runs": sb.get("build_runs", 1), "wall_all_ms": sb.get("build_no_sums_all_ms"),
                 "ok": sb["rc"] == 0, "under_1s": sb["build_no_sums_ms"] < 1000}
            cases.append(c)
            bl.emit(c)
        for key, name in (("resolve", "resolve_100k"), ("locate", "locate_100k")):
            if sb.get(f"{key}_ns_cpu") is None:
                continue
            ns = sb[f"{key}_ns_cpu"]
            c = {"case": name, "ns_per_op_cpu": ns, "ns_per_op_wall": sb[f"{key}_ns_wall"],
                 "ns_per_op_best_round": sb[f"{key}_ns_best_round"], "ratio": bl.ratio(ns, 1000),
                 "baseline": "goal: 1 us (thread CPU per random lookup)", "ok": sb["rc"] == 0}
            cases.append(c)
            bl.emit(c)
    elif "store" in parts:
        bl.log("no store_tests with KeyIndexBench found (set CKPTFS_STORE_TESTS): skipped")

    # --- checksum cost in the write path --------------------------------------------------------
    # The flush threads CRC32C every staged chunk before it leaves staging; the background
    # indexer combines those block CRCs into item checksums after the commit, reading only the
    # items' zip directories and unaligned edges. What the index build costs writers: a
    # DCP-like checkpoint of --verify-mb is copied in through the mount (shards, then
    # .metadata), `ckptfs-admin wait` returns at the commit, and a --write-mb dd starts at once,
    # overlapping the index build; `ckptfs-admin ls` afterwards waits for that build. Baseline:
    # the same dd with the daemon idle.
    src = os.path.join(a.work, "src.bin")
    vck = os.path.join(a.work, "dcp_src")
    vgen = None
    if a.write_mb and parts & {"write", "inline"}:
        subprocess.run(["dd", "if=/dev/urandom", f"of={src}", "bs=1M", f"count={a.write_mb}",
                        "status=none"], check=True)
        subprocess.run(["cat", src], stdout=subprocess.DEVNULL, check=True)
        # 4 MiB chunks, 4 files: the shape of a DCP save of --verify-mb
        vgen = build_checkpoint(vck, max(1, a.verify_mb // 16), 4, 65536, 16, 4)
        subprocess.run(["cat"] + [os.path.join(vck, n) for n in os.listdir(vck)],
                       stdout=subprocess.DEVNULL, check=True)
    if a.write_mb and "write" in parts:
        idle, busy, index_s, wok = [], [], [], []
        with daemon(os.path.join(a.work, "dw"), backing, os.path.join(a.work, "statew")) as d:
            for rep in range(a.reps):
                for side in (("idle", "busy") if rep % 2 == 0 else ("busy", "idle")):
                    dst = os.path.join(d.mnt, f"w{rep}_{side}")
                    bl.sync()
                    if side == "idle":
                        idle.append(dd(src, dst))
                    else:
                        ck = os.path.join(d.mnt, f"ckpt{rep}")
                        os.mkdir(ck)
                        names = sorted(os.listdir(vck), key=lambda n: n == ".metadata")
                        for n in names:
                            shutil.copyfile(os.path.join(vck, n), os.path.join(ck, n))
                        okc, _ = d.wait(ck)
                        t0 = time.monotonic()
                        busy.append(dd(src, dst))
                        r = subprocess.run([bl.ADMIN, "ls", ck, "--json"], capture_output=True,
                                           text=True)
                        index_s.append(time.monotonic() - t0)
                        rows = json.loads(r.stdout) if r.returncode == 0 else []
                        wok.append(okc and len(rows) == vgen["fqns"])
                        with open(os.path.join(d.mnt, ".ckptfs", "tensors", f"ckpt{rep}",
                                               "model.layers.0.weight", "meta.json")) as f:
                            wok.append(all(c["checksum"] for c in json.load(f)["chunks"]))
                    okw, _ = d.wait(dst)
                    wok.append(okw and subprocess.run(
                        ["cmp", "-s", src, os.path.join(backing, os.path.basename(dst))]
                    ).returncode == 0)
                    os.unlink(dst)
                bl.log(f"write rep {rep}: idle {idle[-1]:.2f} s, right after a "
                       f"{vgen['data_bytes'] >> 20} MiB commit {busy[-1]:.2f} s (index done "
                       f"{index_s[-1]:.2f} s after the dd began)")
            d.unmount()
        size = a.write_mb * bl.MiB
        mi, mb = bl.median(idle), bl.median(busy)
        c = {"case": "write_during_index_build", "ckptfs_s": round(mb, 3),
             "direct_s": round(mi, 3), "ratio": bl.ratio(mb, mi), "backing_bytes": size,
             "ok": all(wok), "baseline": "same dd into the mount, daemon idle",
             "idle_GBps": round(size / mi / 1e9, 3), "busy_GBps": round(size / mb / 1e9, 3),
             "indexed_ckpt_bytes": vgen["data_bytes"],
             "index_done_after_s": [round(x, 3) for x in index_s],
             "idle_all": [round(x, 3) for x in idle], "busy_all": [round(x, 3) for x in busy]}
        cases.append(c)
        bl.emit(c)

    # --- write checksums on vs. off -----------------------------------------------------------
    if a.write_mb and "inline" in parts:
        cases.extend(bench_inline(a, backing, src, vck, vgen))

    raw["cases"] = cases
    with open(os.path.join(a.out, "bench_index.json"), "w") as f:
        json.dump(raw, f, indent=1)
    bl.plot(os.path.join(a.out, "bench_index.png"),
            f"key index, {gen['chunks']} chunks (median of {a.reps})",
            [c for c in cases if c.get("ratio") is not None])
    shutil.rmtree(a.work, ignore_errors=True)
    return 0 if all(c["ok"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
