#!/usr/bin/env python3
"""Deterministic multi-rank PyTorch DCP saves and verified loads, for tests and benchmarks.

CLI:
  dcp_tool.py save   --dir D [--ranks 4] [--mb 64] [--single-file-per-rank 0|1] [--seed S]
                     [--dtypes float32,bfloat16,...] [--timeout SEC]
  dcp_tool.py load   --dir D [--ranks 4] [--mode own|replicated|reshard] [--seed S] [--timeout SEC]
  dcp_tool.py train  --parent P [--ranks 4] [--mb 16] [--start N] [--iters K] [--keep 2]
                     [--single-file-per-rank 0|1] [--oplog FILE]
  dcp_tool.py sha256 --dir D
(verify(dirs, seeds) is importable only: one rank loads several checkpoints and reports each.)
Each prints one JSON object on stdout; save/load exit non-zero when any rank fails, and load
exits non-zero when a tensor differs from its expected value.

`train` is a Megatron-style loop: for N = start, start+1, ...: save checkpoint N (seed N) into
P/iter_{N:07d}, write P/latest_checkpointed_iteration.txt naming N (plain open/write/close),
then shutil.rmtree every P/iter_K with K <= N-keep. Rank 0 appends each step to --oplog as
a fsynced JSON line ({"op": save_begin|saved|tracker|rmtree_begin|rmtree_done, "iter": N}), so
a crash test knows exactly what the application had done.

Importable: save(), load(), train(), sha256_tree(), child_env(), iter_dir(); save, load and
train raise DcpToolError with the ranks' output tails when something fails.

The checkpoint content depends only on (seed, mb, dtypes), never on the number of ranks: the
value of every row is generated from (seed, fqn, row block), so a rank generates just its own
rows and a loader with any sharding can check what it got. Each save holds, per dtype, a
row-sharded 2-D ShardedTensor `model.<dtype>.weight` and a 1-D ShardedTensor
`model.<dtype>.bias` of odd length (uneven chunks), a plain tensor `step` written by the
coordinator, and a bytes item `manifest` ({seed, mb, dtypes}) from which a loader re-derives
the expected fqns and shapes and checks them against `.metadata`.

Ranks are separate /usr/bin/python3 processes (Debian's torch 1.13; override with
CKPTFS_TORCH_PYTHON) joined by gloo on 127.0.0.1 at a free port, with
sitecustomize_dcp/ on PYTHONPATH. With CKPTFS_DCP_ZYGOTE=1 (set for the e2e tests by
ctest) each rank is forked from a server that imported torch once (rank_zygote.py)
instead of a fresh interpreter: the same process per rank, without the 1.4 s import. The parent never imports torch. On failure or timeout the
parent kills its ranks by PID.
"""
import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import rank_zygote

HERE = os.path.dirname(os.path.abspath(__file__))
SITE_DIR = os.path.join(HERE, "sitecustomize_dcp")
TORCH_PYTHON = os.environ.get("CKPTFS_TORCH_PYTHON", "/usr/bin/python3")
RESULT_PREFIX = "DCP_TOOL_RESULT "
DEFAULT_DTYPES = ("float32", "bfloat16", "float16", "int64", "int8", "bool")
MODES = ("own", "replicated", "reshard")
ROW_BLOCK = 256          # rows generated from one seed
COLS = 1024              # columns of every 2-D tensor
BIAS_LEN = 1021          # odd, so chunks are uneven for most rank counts
MANIFEST_TAG = "ckptfs-dcp-tool/1"


class DcpToolError(RuntimeError):
    pass


# ----------------------------------------------------------------------------------------------
# Parent side: no torch.

def child_env(extra=None):
    """Environment for a torch child: sitecustomize fix on PYTHONPATH, one thread per rank."""
    env = dict(os.environ)
    paths = [SITE_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if extra:
        env.update(extra)
    return env


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path, n=4000):
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            try:
                p.kill()
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _run_ranks(job, ranks, timeout, grace=30):
    """Runs `job` (a JSON-able dict) on `ranks` worker processes; returns their results by rank.

    A rank that fails makes the others fail too (DCP propagates errors through collectives);
    if they still run `grace` seconds later, or at `timeout`, every rank is killed.
    """
    for attempt in range(3):
        port = free_port()
        tmp = tempfile.mkdtemp(prefix="dcp-tool-")
        # The ranks' temporary files go in `tmp`, removed below: torch 1.13 makes a
        # directory at import (torch.distributed.nn's instantiator) that only its interpreter's
        # teardown removes, and a rank ends with os._exit (see main), so each rank left one
        # in /tmp.
        env = child_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                         "WORLD_SIZE": str(ranks), "TMPDIR": tmp})
        procs, outs, errs = [], [], []
        try:
            for r in range(ranks):
                out, err = os.path.join(tmp, f"{r}.out"), os.path.join(tmp, f"{r}.err")
                outs.append(out)
                errs.append(err)
                if rank_zygote.enabled():
                    procs.append(rank_zygote.spawn(
                        TORCH_PYTHON, child_env(), os.path.abspath(__file__), "_worker_main",
                        [r, job], dict(env, RANK=str(r)), out, err))
                    continue
                with open(out, "wb") as fo, open(err, "wb") as fe:
                    procs.append(subprocess.Popen(
                        [TORCH_PYTHON, os.path.abspath(__file__), "_worker", "--rank", str(r),
                         "--job", json.dumps(job)],
                        stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                        env=dict(env, RANK=str(r))))
            deadline = time.monotonic() + timeout
            first_failure = None
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if first_failure is None and any(p.poll() not in (None, 0) for p in procs):
                    first_failure = now
                if now > deadline or (first_failure is not None and now - first_failure > grace):
                    break
                time.sleep(0.05)
            timed_out = any(p.poll() is None for p in procs)
            _kill(procs)
            codes = [p.returncode for p in procs]
            if timed_out or any(codes):
                text = "\n".join(
                    f"--- rank {r} exit {codes[r]} ---\n{_tail(errs[r])}{_tail(outs[r], 1000)}"
                    for r in range(ranks))
                if "Address already in use" in text and attempt < 2:
                    continue
                why = f"timed out after {timeout}s" if timed_out else f"exit codes {codes}"
                raise DcpToolError(f"{job['op']} on {ranks} ranks failed ({why}):\n{text}")
            results = []
            for r in range(ranks):
                with open(outs[r], errors="replace") as f:
                    lines = [l for l in f if l.startswith(RESULT_PREFIX)]
                if not lines:
                    raise DcpToolError(f"rank {r} printed no result:\n{_tail(errs[r])}")
                results.append(json.loads(lines[-1][len(RESULT_PREFIX):]))
            return results
        finally:
            _kill(procs)
            shutil.rmtree(tmp, ignore_errors=True)
    raise DcpToolError("no free port found")


def _rank_dir(job, rank):
    """The checkpoint dir `rank` uses: job["dirs"][rank % len] when given (ranks spread over
    several mounts of one backing dir, as on several nodes), else job["dir"]."""
    dirs = job.get("dirs")
    return dirs[rank % len(dirs)] if dirs else job["dir"]


def save(dir, ranks=4, mb=64, single_file_per_rank=True, seed=0, dtypes=DEFAULT_DTYPES,
         timeout=600, sync_files=True, dirs=None):
    """Saves the deterministic state for `seed` into `dir` with DCP on `ranks` gloo ranks.

    dirs: rank r saves through dirs[r % len(dirs)] instead (one checkpoint, several mounts).
    """
    job = {"op": "save", "dir": os.path.abspath(dir), "mb": mb, "seed": seed,
           "dtypes": list(dtypes), "single_file_per_rank": bool(single_file_per_rank),
           "sync_files": bool(sync_files)}
    if dirs:
        job["dirs"] = [os.path.abspath(d) for d in dirs]
    t0 = time.monotonic()
    per_rank = _run_ranks(job, ranks, timeout)
    return {"op": "save", "dir": job["dir"], "ranks": ranks, "mb": mb, "seed": seed,
            "dtypes": list(dtypes), "single_file_per_rank": bool(single_file_per_rank),
            "save_s_max": max(r["save_s"] for r in per_rank),
            "wall_s": time.monotonic() - t0, "per_rank": per_rank}


def resave(dir, ranks, seeds, mbs, single_file_per_rank=True, dtypes=DEFAULT_DTYPES,
           timeout=600, recreate=False, dtypes_per_save=None):
    """Saves the states of `seeds` (sizes `mbs`, MiB) one after another into the same `dir`
    with no pause between them; returns the ranks' per-save times.

    recreate: before each save rank 0 removes the directory (shutil.rmtree) and makes it
    again (os.makedirs), as PyTorch's test_load_with_different_shard_plan does.
    dtypes_per_save: save i uses dtypes_per_save[i] (another shard plan: with a file per
    item, another number of shard files) instead of `dtypes`."""
    job = {"op": "resave", "dir": os.path.abspath(dir), "seeds": list(seeds),
           "mbs": list(mbs), "dtypes": list(dtypes),
           "single_file_per_rank": bool(single_file_per_rank), "recreate": bool(recreate)}
    if dtypes_per_save is not None:
        job["dtypes_per_save"] = [list(d) for d in dtypes_per_save]
    return _run_ranks(job, ranks, timeout)


def verify(dirs, seeds=None, timeout=600):
    """Loads each of `dirs` on one rank (one torch start for all) and checks every value
    against the state of its seed: seeds[i], or, where that is None, the seed the
    checkpoint's own manifest names. Never raises for a checkpoint that fails: returns
    [{"dir", "ok", "seed", "errors"}] in order, a failed load's exception among the errors."""
    seeds = list(seeds) if seeds is not None else [None] * len(dirs)
    job = {"op": "verify", "dirs_to_verify": [os.path.abspath(d) for d in dirs],
           "seeds": seeds}
    return _run_ranks(job, 1, timeout)[0]["results"]


def load(dir, ranks=4, mode="own", seed=0, timeout=600, dirs=None):
    """Loads `dir` with DCP on `ranks` gloo ranks and checks every value; raises on mismatch.

    dirs: rank r loads through dirs[r % len(dirs)] instead.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    job = {"op": "load", "dir": os.path.abspath(dir), "mode": mode, "seed": seed}
    if dirs:
        job["dirs"] = [os.path.abspath(d) for d in dirs]
    t0 = time.monotonic()
    per_rank = _run_ranks(job, ranks, timeout)
    return {"op": "load", "dir": job["dir"], "ranks": ranks, "mode": mode, "seed": seed,
            "load_s_max": max(r["load_s"] for r in per_rank),
            "setup_s_max": max(r["setup_s"] for r in per_rank),
            "bytes_verified": sum(r["bytes_verified"] for r in per_rank),
            "wall_s": time.monotonic() - t0, "per_rank": per_rank}


TRACKER = "latest_checkpointed_iteration.txt"


def iter_dir(parent, n):
    return os.path.join(parent, f"iter_{n:07d}")


def train(parent, ranks=4, mb=16, start=1, iters=1000, keep=2, single_file_per_rank=True,
          dtypes=DEFAULT_DTYPES, oplog=None, timeout=3600, parents=None):
    """Runs the checkpoint/tracker/rotate loop (see the module doc) on `ranks` gloo ranks.

    parents: rank r saves through parents[r % len(parents)] instead (mounts of one backing
    dir on several nodes); rank 0, which writes the tracker and rotates, uses parents[0]."""
    job = {"op": "train", "parent": os.path.abspath(parent), "mb": mb, "start": start,
           "iters": iters, "keep": keep, "dtypes": list(dtypes),
           "single_file_per_rank": bool(single_file_per_rank),
           "oplog": os.path.abspath(oplog) if oplog else None}
    if parents:
        job["parents"] = [os.path.abspath(p) for p in parents]
    t0 = time.monotonic()
    per_rank = _run_ranks(job, ranks, timeout)
    return {"op": "train", "parent": job["parent"], "ranks": ranks, "start": start,
            "iters": iters, "wall_s": time.monotonic() - t0, "per_rank": per_rank}


def sha256_tree(dir):
    """{relative path: sha256 hex} of every regular file under `dir`, hidden ones included."""
    result = {}
    for root, dirs, files in os.walk(dir):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            if not os.path.isfile(path) or os.path.islink(path):
                continue
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            result[os.path.relpath(path, dir)] = h.hexdigest()
    return result


# ----------------------------------------------------------------------------------------------
# Worker side: one gloo rank.

def _apply_sitecustomize():
    """Applies the dataclass fix even if PYTHONPATH did not carry it (idempotent)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "ckptfs_sitecustomize_dcp", os.path.join(SITE_DIR, "sitecustomize.py"))
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def layout(mb, dtypes):
    """[(fqn, global shape, dtype name)] of the sharded tensors of a save; rank-independent."""
    import torch
    per_dtype = (mb << 20) // max(1, len(dtypes))
    out = []
    for name in dtypes:
        elsize = torch.empty(0, dtype=getattr(torch, name)).element_size()
        rows = max(64, per_dtype // (COLS * elsize))
        out.append((f"model.{name}.weight", (rows, COLS), name))
        out.append((f"model.{name}.bias", (BIAS_LEN,), name))
    return out


def _block_seed(seed, fqn, block):
    digest = hashlib.sha256(f"{seed}/{fqn}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def expected_rows(seed, fqn, shape, dtype_name, start, end):
    """Rows [start, end) (along dim 0) of the deterministic value of `fqn`."""
    import torch
    dtype = getattr(torch, dtype_name)
    row_shape = tuple(shape[1:])
    row_numel = 1
    for d in row_shape:
        row_numel *= d
    parts = []
    block = start // ROW_BLOCK
    while block * ROW_BLOCK < end:
        b0 = block * ROW_BLOCK
        b1 = min(b0 + ROW_BLOCK, shape[0])
        g = torch.Generator().manual_seed(_block_seed(seed, fqn, block))
        n = (b1 - b0) * row_numel
        if dtype.is_floating_point or dtype.is_complex:
            values = torch.randn(n, generator=g, dtype=torch.float32).to(dtype)
        elif dtype == torch.bool:
            values = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64).bool()
        else:
            info = torch.iinfo(dtype)
            lo, hi = max(info.min, -(1 << 62)), min(info.max, 1 << 62)
            values = torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)
        values = values.reshape((b1 - b0,) + row_shape)
        parts.append(values[max(start, b0) - b0:min(end, b1) - b0])
        block += 1
    if not parts:
        return torch.empty((0,) + row_shape, dtype=dtype)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _chunk_spec(nshards):
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    return ChunkShardingSpec(dim=0, placements=[f"rank:{i}/cpu" for i in range(nshards)])


def _sharded(shape, dtype_name, nshards, fill):
    """A ShardedTensor of `shape` row-chunked over ranks 0..nshards-1; fill(offset, rows)."""
    import torch
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    spec = _chunk_spec(nshards)
    props = TensorProperties(dtype=getattr(torch, dtype_name))
    md = spec.build_metadata(torch.Size(shape), props)
    rank = dist.get_rank()
    local = [Shard(fill(s.shard_offsets[0], s.shard_sizes[0]), s) for s in md.shards_metadata
             if s.placement.rank() == rank]
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, md, sharding_spec=spec)


def _rank_verify(errors, what, got, want):
    import torch
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        errors.append(f"{what}: got {got.dtype}{tuple(got.shape)}, "
                      f"want {want.dtype}{tuple(want.shape)}")
    elif not torch.equal(got, want):
        diff = (got != want).reshape(-1).nonzero()
        errors.append(f"{what}: {diff.numel()} of {got.numel()} elements differ, "
                      f"first at flat index {int(diff[0])}")


def _state(seed, mb, dtypes, world):
    """This rank's part of the deterministic state for `seed`."""
    import torch
    state = {}
    for fqn, shape, dt in layout(mb, dtypes):
        state[fqn] = _sharded(shape, dt, world, lambda off, n, fqn=fqn, shape=shape, dt=dt:
                              expected_rows(seed, fqn, shape, dt, off, off + n))
    state["step"] = torch.tensor([seed], dtype=torch.int64)
    state["manifest"] = {"tag": MANIFEST_TAG, "seed": seed, "mb": mb, "dtypes": list(dtypes)}
    return state


def _worker_save(job, rank, world):
    import torch.distributed as dist
    import torch.distributed._shard.checkpoint as dcp
    t0 = time.monotonic()
    state = _state(job["seed"], job["mb"], job["dtypes"], world)
    gen_s = time.monotonic() - t0
    dist.barrier()
    t1 = time.monotonic()
    dcp.save_state_dict(state, dcp.FileSystemWriter(
        _rank_dir(job, rank), single_file_per_rank=job["single_file_per_rank"],
        sync_files=job["sync_files"]))
    save_s = time.monotonic() - t1
    dist.barrier()
    return {"rank": rank, "gen_s": round(gen_s, 4), "save_s": round(save_s, 4)}


def _worker_resave(job, rank, world):
    """Saves into the same directory again and again, as fast as DCP's own collectives let
    it (torch's overwrite): save i holds the state of seeds[i] at size mbs[i]."""
    import torch.distributed as dist
    import torch.distributed._shard.checkpoint as dcp
    per_save = job.get("dtypes_per_save") or [job["dtypes"]] * len(job["seeds"])
    states = [_state(seed, mb, dts, world)
              for seed, mb, dts in zip(job["seeds"], job["mbs"], per_save)]
    dist.barrier()
    save_s = []
    for state in states:
        if job.get("recreate"):
            if rank == 0:
                import shutil
                shutil.rmtree(_rank_dir(job, rank), ignore_errors=True)
                os.makedirs(_rank_dir(job, rank))
            dist.barrier()
        t0 = time.monotonic()
        dcp.save_state_dict(state, dcp.FileSystemWriter(
            _rank_dir(job, rank), single_file_per_rank=job["single_file_per_rank"]))
        save_s.append(round(time.monotonic() - t0, 4))
    dist.barrier()
    return {"rank": rank, "save_s": save_s}


def _worker_train(job, rank, world):
    import shutil
    import torch.distributed as dist
    import torch.distributed._shard.checkpoint as dcp
    parents = job.get("parents")
    parent = parents[rank % len(parents)] if parents else job["parent"]
    oplog = open(job["oplog"], "a") if rank == 0 and job["oplog"] else None

    def log(op, n):
        if oplog:
            oplog.write(json.dumps({"op": op, "iter": n, "t": time.time()}) + "\n")
            oplog.flush()
            os.fsync(oplog.fileno())

    save_s = []
    for n in range(job["start"], job["start"] + job["iters"]):
        state = _state(n, job["mb"], job["dtypes"], world)
        dist.barrier()
        log("save_begin", n)
        t0 = time.monotonic()
        dcp.save_state_dict(state, dcp.FileSystemWriter(
            iter_dir(parent, n), single_file_per_rank=job["single_file_per_rank"]))
        save_s.append(round(time.monotonic() - t0, 4))
        dist.barrier()
        if rank == 0:
            log("saved", n)
            with open(os.path.join(parent, TRACKER), "w") as f:
                f.write(str(n))
            log("tracker", n)
            old = sorted(int(d[5:]) for d in os.listdir(parent)
                         if d.startswith("iter_") and d[5:].isdigit())
            for k in old:
                if k <= n - job["keep"]:
                    log("rmtree_begin", k)
                    shutil.rmtree(iter_dir(parent, k))
                    log("rmtree_done", k)
        dist.barrier()
    return {"rank": rank, "save_s": save_s}


def _worker_load(job, rank, world):
    import torch
    import torch.distributed as dist
    import torch.distributed._shard.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    seed, mode = job["seed"], job["mode"]   # seed None: the one the manifest names
    t0 = time.monotonic()
    metadata = dcp.FileSystemReader(_rank_dir(job, rank)).read_metadata()
    md = metadata.state_dict_metadata
    tensors = {fqn: (tuple(m.size), str(m.properties.dtype).replace("torch.", ""))
               for fqn, m in md.items() if isinstance(m, dcp.TensorStorageMetadata)}
    nshards = world if mode == "own" else max(1, world // 2)
    state = {}
    for fqn, (shape, dt) in tensors.items():
        if fqn == "step":
            state[fqn] = torch.zeros(shape, dtype=getattr(torch, dt))
        elif mode == "replicated":
            state[fqn] = torch.zeros(shape, dtype=getattr(torch, dt))
        else:
            state[fqn] = _sharded(shape, dt, nshards, lambda off, n, shape=shape, dt=dt:
                                  torch.zeros((n,) + shape[1:], dtype=getattr(torch, dt)))
    for fqn, m in md.items():
        if isinstance(m, dcp.BytesStorageMetadata):
            state[fqn] = None
    setup_s = time.monotonic() - t0
    dist.barrier()
    t1 = time.monotonic()
    dcp.load_state_dict(state, dcp.FileSystemReader(_rank_dir(job, rank)))
    load_s = time.monotonic() - t1
    dist.barrier()

    t2 = time.monotonic()
    errors = []
    manifest = state.get("manifest")
    if seed is None and isinstance(manifest, dict):
        seed = manifest.get("seed")
    if not isinstance(manifest, dict) or manifest.get("tag") != MANIFEST_TAG:
        errors.append(f"bad manifest item: {manifest!r}")
        want_layout = []
    else:
        if manifest.get("seed") != seed:
            errors.append(f"checkpoint seed {manifest.get('seed')} != expected {seed}")
        want_layout = layout(manifest["mb"], manifest["dtypes"])
        want = {fqn: (tuple(shape), dt) for fqn, shape, dt in want_layout}
        want["step"] = ((1,), "int64")
        if want != tensors:
            errors.append(f".metadata tensors {sorted(tensors.items())} != "
                          f"expected {sorted(want.items())}")
    if sorted(k for k, m in md.items() if isinstance(m, dcp.BytesStorageMetadata)) != ["manifest"]:
        errors.append(f"unexpected bytes items in .metadata: {sorted(md)}")
    _rank_verify(errors, "step", state["step"], torch.tensor([seed], dtype=torch.int64))
    verified = state["step"].numel() * state["step"].element_size()
    for fqn, shape, dt in want_layout:
        obj = state.get(fqn)
        if obj is None:
            continue
        if isinstance(obj, ShardedTensor):  # a torch.Tensor subclass in 1.13: test it first
            pieces = [(s.metadata.shard_offsets[0], s.tensor) for s in obj.local_shards()]
        else:
            pieces = [(0, obj)]
        for off, t in pieces:
            for r0 in range(0, t.shape[0], 8 * ROW_BLOCK):
                r1 = min(t.shape[0], r0 + 8 * ROW_BLOCK)
                _rank_verify(errors, f"{fqn} rows [{off + r0}, {off + r1})", t[r0:r1],
                             expected_rows(seed, fqn, shape, dt, off + r0, off + r1))
            verified += t.numel() * t.element_size()
    verify_s = time.monotonic() - t2
    return {"rank": rank, "setup_s": round(setup_s, 4), "load_s": round(load_s, 4),
            "verify_s": round(verify_s, 4), "bytes_verified": verified, "seed": seed,
            "errors": errors[:20]}


def _worker_verify(job, rank, world):
    """verify(): every directory in turn on this one rank; a failure is a result, not an
    exit code (the caller decides which failures count)."""
    results = []
    for d, seed in zip(job["dirs_to_verify"], job["seeds"]):
        try:
            r = _worker_load({"dir": d, "mode": "own", "seed": seed}, rank, world)
            results.append({"dir": d, "ok": not r["errors"], "seed": r["seed"],
                            "bytes": r["bytes_verified"], "errors": r["errors"]})
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # a missing or torn file (torch 1.13's
            # CheckpointException is a BaseException)
            results.append({"dir": d, "ok": False, "seed": seed, "bytes": 0,
                            "errors": [f"{type(e).__name__}: {str(e)[:500]}"]})
    return {"rank": rank, "results": results}


def zygote_preload():
    """What every rank imports, done once in the fork server (rank_zygote.py)."""
    _apply_sitecustomize()
    import datetime  # noqa: F401
    import torch
    import torch.distributed  # noqa: F401
    import torch.distributed._shard.checkpoint  # noqa: F401
    import torch.distributed._shard.sharded_tensor  # noqa: F401
    torch.set_num_threads(1)


def _worker_main(rank, job):
    _apply_sitecustomize()
    import datetime
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=job.get("pg_timeout", 300)))
    try:
        result = {"save": _worker_save, "load": _worker_load,
                  "train": _worker_train, "resave": _worker_resave,
                  "verify": _worker_verify}[job["op"]](job, rank, world)
    finally:
        dist.destroy_process_group()
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    if result.get("errors"):
        for e in result["errors"]:
            print(f"rank {rank}: MISMATCH {e}", file=sys.stderr)
        return 3
    return 0


# ----------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save")
    s.add_argument("--dir", required=True)
    s.add_argument("--ranks", type=int, default=4)
    s.add_argument("--mb", type=int, default=64)
    s.add_argument("--single-file-per-rank", type=int, choices=(0, 1), default=1)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES))
    s.add_argument("--no-sync", action="store_true", help="FileSystemWriter(sync_files=False)")
    s.add_argument("--timeout", type=float, default=600)
    l = sub.add_parser("load")
    l.add_argument("--dir", required=True)
    l.add_argument("--ranks", type=int, default=4)
    l.add_argument("--mode", choices=MODES, default="own")
    l.add_argument("--seed", type=int, default=0)
    l.add_argument("--timeout", type=float, default=600)
    t = sub.add_parser("train")
    t.add_argument("--parent", required=True)
    t.add_argument("--ranks", type=int, default=4)
    t.add_argument("--mb", type=int, default=16)
    t.add_argument("--start", type=int, default=1)
    t.add_argument("--iters", type=int, default=1000)
    t.add_argument("--keep", type=int, default=2)
    t.add_argument("--single-file-per-rank", type=int, choices=(0, 1), default=1)
    t.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES))
    t.add_argument("--oplog")
    t.add_argument("--timeout", type=float, default=3600)
    h = sub.add_parser("sha256")
    h.add_argument("--dir", required=True)
    w = sub.add_parser("_worker")
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--job", required=True)
    a = ap.parse_args(argv)

    if a.cmd == "_worker":
        rc = _worker_main(a.rank, json.loads(a.job))
        # Skip the interpreter's teardown: torch 1.13's gloo threads can be destroyed while
        # joinable at exit ("terminate called without an active exception", SIGABRT) after
        # the work is done and reported. Every file the rank wrote is closed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    # SIGTERM unwinds through _run_ranks' finally, which kills the ranks by PID.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        if a.cmd == "save":
            dtypes = [d for d in a.dtypes.split(",") if d]
            out = save(a.dir, a.ranks, a.mb, bool(a.single_file_per_rank), a.seed, dtypes,
                       a.timeout, not a.no_sync)
        elif a.cmd == "load":
            out = load(a.dir, a.ranks, a.mode, a.seed, a.timeout)
        elif a.cmd == "train":
            dtypes = [d for d in a.dtypes.split(",") if d]
            out = train(a.parent, a.ranks, a.mb, a.start, a.iters, a.keep,
                        bool(a.single_file_per_rank), dtypes, a.oplog, a.timeout)
        else:
            out = sha256_tree(a.dir)
    except DcpToolError as e:
        print(json.dumps({"op": a.cmd, "ok": False, "error": str(e)[-4000:]}))
        print(e, file=sys.stderr)
        return 1
    if a.cmd != "sha256":
        out["ok"] = True
    print(json.dumps(out, indent=None if a.cmd != "sha256" else 1, sort_keys=a.cmd == "sha256"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
