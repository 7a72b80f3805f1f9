#!/usr/bin/env python3
"""torch 2.x DTensor DCP save/load on N gloo ranks, for bench_reads.py (runs inside a torch
2.x Debian root, chroot; needs only torch).

  t2_dcp.py save DIR MB RANKS      16 row-sharded float32 DTensors, MB MiB in all
  t2_dcp.py load DIR MB RANKS      the whole dcp.load timed (state allocated before),
                                   every value checked; prints one JSON line
Values are a cheap function of the global index, so each rank builds only its own shard.
"""
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

N_TENSORS = 16
COLS = 1024


def shard_of(i, rows, rank, ranks):
    per = rows // ranks
    start = rank * per
    base = torch.arange(start * COLS, (start + per) * COLS, dtype=torch.float32)
    return (base * 1e-3 + i).reshape(per, COLS)


def worker(rank, ranks, port, op, path, mb, out):
    # Torch builds without libuv (Debian sid's 2.x) refuse the default TCPStore backend.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), USE_LIBUV="0")
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    mesh = init_device_mesh("cpu", (ranks,))
    rows = (mb << 20) // (4 * COLS * N_TENSORS) // ranks * ranks
    if op == "save":
        state = {f"t{i}": DTensor.from_local(shard_of(i, rows, rank, ranks), mesh, [Shard(0)])
                 for i in range(N_TENSORS)}
        dcp.save(state, checkpoint_id=path)
        dist.barrier()
        out.put((rank, {}))
    else:
        state = {f"t{i}": DTensor.from_local(torch.zeros(rows // ranks, COLS), mesh, [Shard(0)])
                 for i in range(N_TENSORS)}
        dist.barrier()
        t0 = time.monotonic()
        dcp.load(state, checkpoint_id=path)
        dist.barrier()
        load_s = time.monotonic() - t0
        for i in range(N_TENSORS):
            if not torch.equal(state[f"t{i}"].to_local(), shard_of(i, rows, rank, ranks)):
                raise SystemExit(f"rank {rank}: t{i} differs")
        out.put((rank, {"load_s": load_s}))
    dist.destroy_process_group()


def main():
    op, path, mb, ranks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    t0 = time.monotonic()
    procs = [ctx.Process(target=worker, args=(r, ranks, port, op, path, mb, out))
             for r in range(ranks)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a rank exited {p.exitcode}")
    r = {"op": op, "torch": torch.__version__, "wall_s": time.monotonic() - t0}
    if op == "load":
        r["load_s_max"] = max(v["load_s"] for v in results.values())
    print(json.dumps(r))


if __name__ == "__main__":
    main()
