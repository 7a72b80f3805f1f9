#!/usr/bin/env python3
"""torch 2.x DTensor DCP save/load on N gloo ranks, for bench_reads.py (runs inside a torch
2.x Debian root, chroot; needs only torch).

  t2_dcp.py save DIR MB RANKS [per_item]
                                   16 row-sharded float32 DTensors, MB MiB in all;
                                   per_item: FileSystemWriter(single_file_per_rank=False)
  t2_dcp.py load DIR MB RANKS [MODE]
                                   the whole dcp.load timed (state allocated before),
                                   every value checked; prints one JSON line. MODE:
                                   own (default): the saved row shards, Shard(0);
                                   replicated: every rank loads every tensor whole (plain
                                   tensors); reshard: column shards, Shard(1), so every
                                   rank reads a slice of every saved shard
Values are a cheap function of the global index, so each rank builds only what it loads.
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


def value(i, rows, cols):
    """Rows `rows` (a range) and columns `cols` (a range) of tensor i."""
    r = torch.arange(rows.start, rows.stop, dtype=torch.float64).reshape(-1, 1)
    c = torch.arange(cols.start, cols.stop, dtype=torch.float64).reshape(1, -1)
    return ((r * COLS + c).to(torch.float32) * 1e-3 + i)


def load_target(mode, i, rows, rank, ranks, mesh):
    """(state entry to load into, the values it must hold after the load)."""
    if mode == "own":
        return (DTensor.from_local(torch.zeros(rows // ranks, COLS), mesh, [Shard(0)]),
                shard_of(i, rows, rank, ranks))
    if mode == "replicated":
        return torch.zeros(rows, COLS), value(i, range(0, rows), range(0, COLS))
    if mode == "reshard":
        per = COLS // ranks
        return (DTensor.from_local(torch.zeros(rows, per), mesh, [Shard(1)]),
                value(i, range(0, rows), range(rank * per, (rank + 1) * per)))
    raise SystemExit(f"unknown mode {mode}")


def machine_idle_s():
    """Idle and iowait seconds of all CPUs since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


def worker(rank, ranks, port, op, path, mb, out, arg):
    # Torch builds without libuv (Debian sid's 2.x) refuse the default TCPStore backend.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), USE_LIBUV="0")
    # One intra-op thread per rank, as torchrun starts ranks (OMP_NUM_THREADS=1 when it runs
    # more than one per node) and as the torch 1.13 side of this benchmark runs them. With
    # torch's default (a thread per core), 4 ranks on 2 cores spent half the CPU in libgomp's
    # spinning workers, and both sides timed that rather than the reads.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    mesh = init_device_mesh("cpu", (ranks,))
    rows = (mb << 20) // (4 * COLS * N_TENSORS) // ranks * ranks
    if op == "save":
        state = {f"t{i}": DTensor.from_local(shard_of(i, rows, rank, ranks), mesh, [Shard(0)])
                 for i in range(N_TENSORS)}
        writer = dcp.FileSystemWriter(path, single_file_per_rank=(arg != "per_item"))
        dcp.save(state, storage_writer=writer)
        dist.barrier()
        out.put((rank, {}))
    else:
        mode = arg or "own"
        state = {f"t{i}": load_target(mode, i, rows, rank, ranks, mesh)[0]
                 for i in range(N_TENSORS)}
        dist.barrier()
        t0 = time.monotonic()
        cpu0, idle0 = os.times(), machine_idle_s()
        dcp.load(state, checkpoint_id=path)
        dist.barrier()
        load_s = time.monotonic() - t0
        cpu1, idle1 = os.times(), machine_idle_s()
        for i in range(N_TENSORS):
            got = state[f"t{i}"]
            got = got.to_local() if isinstance(got, DTensor) else got
            if not torch.equal(got, load_target(mode, i, rows, rank, ranks, mesh)[1]):
                raise SystemExit(f"rank {rank}: t{i} differs ({mode})")
        out.put((rank, {"load_s": load_s,
                        "cpu_s": cpu1.user + cpu1.system - cpu0.user - cpu0.system,
                        "idle_s": idle1 - idle0}))
    dist.destroy_process_group()


def main():
    op, path, mb, ranks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    arg = sys.argv[5] if len(sys.argv) > 5 else ""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    t0 = time.monotonic()
    procs = [ctx.Process(target=worker, args=(r, ranks, port, op, path, mb, out, arg))
             for r in range(ranks)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a rank exited {p.exitcode}")
    r = {"op": op, "torch": torch.__version__, "wall_s": time.monotonic() - t0, "mode": arg}
    if op == "load":
        r["load_s_max"] = max(v["load_s"] for v in results.values())
        # The ranks' own CPU during load_state_dict, and the machine's idle CPU-seconds in
        # rank 0's window (idle and iowait of every CPU): whether the load waited for the
        # CPUs or for the disk.
        r["ranks_cpu_s"] = round(sum(v["cpu_s"] for v in results.values()), 3)
        r["idle_cpu_s"] = round(results[0]["idle_s"], 3)
    print(json.dumps(r))


if __name__ == "__main__":
    main()
