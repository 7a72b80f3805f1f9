#!/usr/bin/env python3
"""The soak's torch 2.x trainer (issue 41), run inside a Debian root with torch 2.x
(scripts/torch_root.sh sid) by scripts/soaklib/torch2.py, over the soak's ckptfs mounts.

  async_trainer.py train --parent P [--parent P2] --start N --iters K --keep KEEP --oplog F
  async_trainer.py check --dir D [--dir D2] --seed N

train: the Megatron-style loop of an asynchronous trainer. For n = start, start+1, ...:
  finalize save n-1 (its future's result(); rank 0 then writes P/latest_checkpointed_
  iteration.txt naming n-1 and removes P/iter_K for K <= n-1-KEEP), then
  dcp.async_save(state n) into P/iter_{n:07d} (the thread checkpointer, on a gloo group of
  its own) while the "training" goes on; the last save is finalized before the exit. Rank r
  works through P[r % len(P)] (two nodes: one mount each, the same directory). Rank 0
  appends {"op": save_begin|saved|tracker|rmtree_done, "iter": N} to --oplog, fsynced after
  the step returned, so the soak knows what the application had done when a daemon is killed.
check: every rank loads D[rank % len(D)] (a checkpoint, through a mount or on the backing
  store) and checks every value against state N.

Both exit 0 only when everything passed; a failure prints its traceback and exits 1.
The state is torch2_clients.state_dict (DTensors sharded three ways, uneven, bf16/fp16, a
plain tensor, a bytes item) plus a 2 MiB float32 tensor, all derived from the seed N.
"""
import argparse
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

import torch2_clients

WORLD = 2
TRACKER = "latest_checkpointed_iteration.txt"
BIG = (512, 1024)  # rows x cols of "model.big", float32, Shard(0)


def iter_dir(parent, n):
    return os.path.join(parent, f"iter_{n:07d}")


def state(seed, mesh, zeros=False):
    from torch.distributed.tensor import Shard, distribute_tensor
    sd = torch2_clients.state_dict(seed, mesh, zeros=zeros)
    g = torch.Generator().manual_seed(seed * 7 + 1)
    big = torch.zeros(BIG) if zeros else torch.randn(BIG, generator=g)
    sd["model.big"] = distribute_tensor(big, mesh, [Shard(0)])
    return sd


def check(got, seed, where):
    torch2_clients.check_sd(got, seed, where)
    g = torch.Generator().manual_seed(seed * 7 + 1)
    if not torch.equal(got["model.big"].full_tensor(), torch.randn(BIG, generator=g)):
        raise AssertionError(f"{where}: model.big differs")


class OpLog:
    def __init__(self, path, rank):
        self.f = open(path, "a") if path and rank == 0 else None

    def __call__(self, op, n):
        if self.f:
            self.f.write(json.dumps({"op": op, "iter": n, "t": time.time()}) + "\n")
            self.f.flush()
            os.fsync(self.f.fileno())


def train(rank, a, mesh):
    parent = a.parent[rank % len(a.parent)]
    log = OpLog(a.oplog, rank)
    # The checkpointer's own group: its collectives run on its thread while the main thread
    # goes on (and joins barriers on the default group).
    ckpt_pg = dist.new_group(backend="gloo")
    pending = None

    def finalize():
        n, fut = pending
        fut.result()
        dist.barrier()
        if rank == 0:
            log("saved", n)
            with open(os.path.join(parent, TRACKER), "w") as f:
                f.write(str(n))
            log("tracker", n)
            for k in sorted(int(d[5:]) for d in os.listdir(parent)
                            if d.startswith("iter_") and d[5:].isdigit()):
                if k <= n - a.keep:
                    shutil.rmtree(iter_dir(parent, k))
                    log("rmtree_done", k)
        dist.barrier()

    for n in range(a.start, a.start + a.iters):
        sd = state(n, mesh)
        if pending is not None:
            finalize()
        if rank == 0:
            log("save_begin", n)
        pending = (n, dcp.async_save(sd, checkpoint_id=iter_dir(parent, n),
                                     process_group=ckpt_pg))
        time.sleep(0.2)  # the next steps of training
    finalize()


def check_dirs(rank, a, mesh):
    d = a.dir[rank % len(a.dir)]
    got = state(0, mesh, zeros=True)
    dcp.load(got, checkpoint_id=d)
    check(got, a.seed, d)


def rank_main(rank, a, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      USE_LIBUV="0", WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (WORLD,))
        (train if a.cmd == "train" else check_dirs)(rank, a, mesh)
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    # Not dist.destroy_process_group(): torch's Gloo group destructor can deadlock on the
    # GIL at exit (Python 3.13+), torch's bug (torch2_clients.py).
    os._exit(0)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--parent", action="append", required=True)
    t.add_argument("--start", type=int, required=True)
    t.add_argument("--iters", type=int, required=True)
    t.add_argument("--keep", type=int, default=2)
    t.add_argument("--oplog")
    c = sub.add_parser("check")
    c.add_argument("--dir", action="append", required=True)
    c.add_argument("--seed", type=int, required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(rank_main, args=(a, port), nprocs=WORLD, start_method="spawn")
    print(json.dumps({"ok": True, "torch": torch.__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
