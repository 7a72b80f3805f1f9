#!/usr/bin/env python3
"""The torch 2.x side of torch2_save_load.py: runs inside the sid root, 4 gloo ranks, a
state dict of DTensor shards (--mib in total, fp32, Shard(0) over the 4 ranks, 8 tensors).

  --phase save: for --reps repetitions, each case once per repetition in turn (--per-item:
  every save with FileSystemWriter(single_file_per_rank=False), one file per item):
      ckptfs_save          dcp.save into the ckptfs mount (--mnt, --durability async)
      plain_save           dcp.save into a plain directory (--plain), fsynced by DCP
      plain_async_thread   dcp.async_save into the plain directory, thread checkpointer
      plain_async_process  the same, process checkpointer (one untimed warm-up save first:
                           its first call starts the checkpoint processes)
      ckptfs_async_thread  dcp.async_save into the mount, thread checkpointer
    stall = until the call returned (the training loop resumes), max over ranks;
    durable = until the data is on the backing store: for a plain directory until the save
    (or the async future) finished, since DCP fsyncs every file and the .metadata; for the
    mount until /.ckptfs/checkpoints says the checkpoint is committed (every shard durable
    on the backing store, then .metadata published). Every checkpoint but the first
    ckptfs_save and plain_save ones (kept for the loads) is removed after it is measured,
    and the next case starts only once the daemon has nothing pending.
  --phase load --target DIR [--threads N]: one cold dcp.load of DIR (the host has just
    dropped the page cache and, for the mount, restarted the daemon), FileSystemReader,
    with thread_count=N where this torch's reader has one; the tensors are then checked.
Writes --out (JSON, rank 0).
"""
import argparse
import inspect
import json
import os
import shutil
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

WORLD = 4
NTENSORS = 8


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_shards(rank, mib):
    rows = (mib << 20) // (NTENSORS * 4 * 4096)  # global rows per tensor, fp32 x 4096 cols
    rows -= rows % WORLD
    out = {}
    for i in range(NTENSORS):
        g = torch.Generator().manual_seed(1000 * i + rank)
        out[f"layers.{i}.weight"] = torch.randn(rows // WORLD, 4096, generator=g)
    return out, rows


def state_dict(rank, mib, mesh, zeros=False):
    from torch.distributed.tensor import DTensor, Shard
    loc, rows = local_shards(rank, mib)
    sd = {}
    for k, v in loc.items():
        sd[k] = DTensor.from_local(torch.zeros_like(v) if zeros else v, mesh, [Shard(0)],
                                   run_check=False, shape=(rows, 4096), stride=(4096, 1))
    return sd


def max_all(x):
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def committed(mnt, rel):
    try:
        with open(os.path.join(mnt, ".ckptfs", "checkpoints")) as f:
            for c in json.load(f):
                if c["path"].strip("/") == rel:
                    return c["state"]
    except (OSError, ValueError):
        pass
    return None


def wait_committed(mnt, rel, timeout=600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = committed(mnt, rel)
        if st == "committed":
            return time.monotonic()
        if st in ("failed", "aborted"):
            raise RuntimeError(f"{rel}: {st}")
        time.sleep(0.01)
    raise RuntimeError(f"{rel} not committed in {timeout} s")


def wait_idle(mnt, timeout=600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(os.path.join(mnt, ".ckptfs", "stats")) as f:
            s = json.load(f)
        if not s.get("journal_pending") and not s.get("files_pending"):
            return
        time.sleep(0.05)
    raise RuntimeError("daemon still has work pending")


def save_phase(rank, a, mesh, res):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    sd = state_dict(rank, a.mib, mesh)
    cases = ["ckptfs_save", "plain_save", "plain_async_thread", "plain_async_process",
             "ckptfs_async_thread"]
    samples = {c: {"stall_s": [], "durable_s": []} for c in cases}
    res["samples"] = samples

    def one(case, rep, timed=True):
        on_mnt = case.startswith("ckptfs")
        top = a.mnt if on_mnt else a.plain
        rel = f"{case}_{rep}" if timed else f"{case}_warmup"
        path = os.path.join(top, rel)
        dist.barrier()
        t0 = time.monotonic()
        writer = dcp.FileSystemWriter(path, single_file_per_rank=not a.per_item)
        if case.endswith("_save"):
            dcp.save(sd, storage_writer=writer)
            stall = time.monotonic() - t0
            fut = None
        else:
            kind = (AsyncCheckpointerType.PROCESS if case.endswith("process")
                    else AsyncCheckpointerType.THREAD)
            fut = dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=kind)
            stall = time.monotonic() - t0
            fut.result()
        done = time.monotonic() - t0
        stall, done = max_all(stall), max_all(done)
        dist.barrier()
        durable = done
        if on_mnt and rank == 0:
            durable = wait_committed(a.mnt, rel) - t0
        durable = max_all(durable if rank == 0 else 0.0)
        if timed:
            samples[case]["stall_s"].append(round(stall, 3))
            samples[case]["durable_s"].append(round(durable, 3))
        else:
            res.setdefault("warmup", {})[case] = {"stall_s": round(stall, 3),
                                                  "durable_s": round(durable, 3)}
        if rank == 0:
            print(f"{case} rep {rep if timed else 'warm-up'}: stall {stall:.2f} s, durable "
                  f"{durable:.2f} s", flush=True)
            keep = timed and rep == 0 and case in ("ckptfs_save", "plain_save")
            if not keep:
                shutil.rmtree(path)
            if on_mnt or not keep:
                wait_idle(a.mnt)
        dist.barrier()

    res["reader_thread_count"] = (
        "thread_count" in inspect.signature(dcp.FileSystemReader.__init__).parameters)
    one("plain_async_process", 0, timed=False)
    for rep in range(a.reps):
        for case in cases:
            one(case, rep)


def load_phase(rank, a, mesh, res):
    sd = state_dict(rank, a.mib, mesh, zeros=True)
    kw = {}
    if a.threads > 1:
        if "thread_count" not in inspect.signature(dcp.FileSystemReader.__init__).parameters:
            res["unavailable"] = (f"torch {torch.__version__}: FileSystemReader has no "
                                  "thread_count")
            return
        kw["thread_count"] = a.threads
    reader = dcp.FileSystemReader(a.target, **kw)
    dist.barrier()
    t0 = time.monotonic()
    dcp.load(sd, storage_reader=reader)
    res["load_s"] = round(max_all(time.monotonic() - t0), 3)
    want, _ = local_shards(rank, a.mib)
    for k, v in want.items():
        if not torch.equal(sd[k].to_local(), v):
            raise AssertionError(f"rank {rank}: {k} differs after loading {a.target}")


def rank_main(rank, a, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), USE_LIBUV="0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (WORLD,))
    res = {"torch": torch.__version__, "python": sys.version.split()[0], "mib": a.mib,
           "phase": a.phase}
    try:
        (save_phase if a.phase == "save" else load_phase)(rank, a, mesh, res)
        try:
            import torch.distributed.checkpoint._async_process_executor as ape
            if ape._CHECKPOINT_PROCESS is not None:
                ape._CHECKPOINT_PROCESS.__del__()
                ape._CHECKPOINT_PROCESS = None
        except ImportError:
            pass
        dist.barrier()
        if rank == 0:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # not the Gloo group's destructor (torch's GIL deadlock at exit)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["save", "load"], required=True)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mnt")
    ap.add_argument("--plain")
    ap.add_argument("--target")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--per-item", action="store_true",
                    help="FileSystemWriter(single_file_per_rank=False): a file per item")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    mp.start_processes(rank_main, args=(a, free_port()), nprocs=WORLD, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
