#!/usr/bin/env python3
"""The torch 2.x side of bench_memory_tier.py: runs in the sid root, 4 gloo ranks, a state
dict of DTensor shards (--mib in total, fp32, Shard(0); torch2_bench_worker.py's state).

  --phase rate --case C --dirs D0[,D1...] --saves N [--step-s S]
      N saves back to back (S seconds of "training" between them), rank r saving through
      dirs[r * len(dirs) // 4] (one mount per node). C is one of
        ckptfs     dcp.save into the mount (the backing-store tier or a memory-only tree):
                   the call returns once the bytes are staged; the next one may wait for
                   staging space (that wait is stall too);
        async      dcp.async_save into a plain directory (thread checkpointer), waiting for
                   the previous save's future first, as a training loop must before it
                   starts the next (that wait is stall too).
      stall_s[i]: until save i's call returned (max over ranks); total_s: from the first
      call until the last checkpoint is committed (ckptfs: /.ckptfs/checkpoints of --mnt,
      the mount of rank 0's node) or its future is done (async). The rate a job can sustain
      is N / total_s.
  --phase load --target DIR: one dcp.load of DIR, checked exactly; load_s.
Writes --out (JSON, rank 0).
"""
import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from torch2_bench_worker import (WORLD, free_port, local_shards, max_all, state_dict,
                                 wait_committed)


def rate_phase(rank, a, mesh, res):
    sd = state_dict(rank, a.mib, mesh)
    # The saves' collectives get a group of their own: an async save's finish runs on its
    # background thread while this loop's all_reduce (max_all) runs on the default group,
    # and two threads must never issue collectives on one gloo group (they deadlock).
    pg = dist.new_group(backend="gloo")
    dirs = a.dirs.split(",")
    mine = dirs[rank * len(dirs) // WORLD]
    stalls = []
    fut = None
    dist.barrier()
    start = time.monotonic()
    for i in range(a.saves):
        writer = dcp.FileSystemWriter(os.path.join(mine, f"{a.prefix}{i:04d}"))
        t0 = time.monotonic()
        if a.case == "async":
            if fut is not None:
                fut.result()
            fut = dcp.async_save(sd, storage_writer=writer, process_group=pg)
        else:
            dcp.save(sd, storage_writer=writer, process_group=pg)
        stalls.append(round(max_all(time.monotonic() - t0), 3))
        if rank == 0:
            print(f"{a.case} save {i}: stall {stalls[-1]:.2f} s", flush=True)
        if a.step_s:
            time.sleep(a.step_s)
    if fut is not None:
        fut.result()
    if a.case == "ckptfs" and rank == 0:
        rel = os.path.relpath(os.path.join(dirs[0], f"{a.prefix}{a.saves - 1:04d}"), a.mnt)
        wait_committed(a.mnt, rel, timeout=1800)
    dist.barrier()
    res.update(stall_s=stalls, total_s=round(time.monotonic() - start, 3), saves=a.saves)


def load_phase(rank, a, mesh, res):
    sd = state_dict(rank, a.mib, mesh, zeros=True)
    dist.barrier()
    t0 = time.monotonic()
    dcp.load(sd, storage_reader=dcp.FileSystemReader(a.target))
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
    res = {"torch": torch.__version__, "mib": a.mib, "phase": a.phase, "case": a.case}
    try:
        (rate_phase if a.phase == "rate" else load_phase)(rank, a, mesh, res)
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
    ap.add_argument("--phase", choices=["rate", "load"], required=True)
    ap.add_argument("--case", choices=["ckptfs", "async"], default="ckptfs")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--step-s", type=float, default=0.0)
    ap.add_argument("--dirs", default="")
    ap.add_argument("--prefix", default="step_")
    ap.add_argument("--mnt", help="rank 0's mount (for the commit of the last save)")
    ap.add_argument("--target")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    mp.start_processes(rank_main, args=(a, free_port()), nprocs=WORLD, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
