#!/usr/bin/env python3
"""Megatron-LM's megatron/core dist_checkpointing, run as Megatron's training loop drives it,
on the CPU with 4 gloo ranks (see test_megatron_dcp.py; megatron_cpu_shim/ answers the
few torch.cuda calls). Under each --base, in ITER dirs of BASE/megatron with Megatron's
tracker BASE/megatron/latest_checkpointed_iteration.txt:

  iter_0000010  sync save, torch_dist format, FullyParallelSaveStrategyWrapper over the
                default TorchDistSaveShardedStrategy (FileSystemWriterAsync, 2 threads);
                the tracker is written by rank 0 after the save and a barrier
  iter_0000020, iter_0000030
                async saves (async_sharded_save=True) run by a persistent checkpoint worker
                process per rank (AsyncCallsQueue(persistent=True)); the tracker is written
                in the request's finalize function, as Megatron's training does
  loads         iter_0000010 with the layout it was saved with, and iter_0000030 resharded
                (other TP splits), both through FullyParallelLoadStrategyWrapper; every
                tensor, sharded object and the common state checked exactly

The layout: TP=2 x DP=2 (replicas over DP, which the fully parallel wrapper spreads), a
tensor sharded over all 4 ranks, a replicated one, a per-rank ShardedObject, bf16 and fp32.
Writes --out (JSON, rank 0): per base the checkpoint directories, the tracker's final value,
and the versions. Any mismatch raises in its rank (nonzero exit).
"""
import argparse
import json
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4
TRACKER = "latest_checkpointed_iteration.txt"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def full_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "decoder.layer.w": torch.randn(16, 12, generator=g),
        "decoder.layer.b": torch.randn(8, 20, generator=g).to(torch.float64),
        "embedding.word": torch.randn(32, 4, generator=g),
        "final_norm.weight": torch.randn(10, generator=g),
    }


def sharded_sd(rank, seed, reshard=False, zeros=False):
    """Megatron's ShardedTensors of full_tensors(seed) for this rank. Saved as TP=2 x DP=2;
    reshard=True describes other splits (TP=4 for the layer, 2 for the embedding)."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    t = full_tensors(seed)
    if zeros:
        t = {k: torch.zeros_like(v) for k, v in t.items()}
    tp, dp = rank % 2, rank // 2

    def part(x, axis, i, n):
        return x.chunk(n, dim=axis)[i].clone()

    sd = {}
    if not reshard:
        sd["w"] = ShardedTensor.from_rank_offsets(
            "decoder.layer.w", part(t["decoder.layer.w"], 0, tp, 2), (0, tp, 2), replica_id=dp)
        sd["b"] = ShardedTensor.from_rank_offsets(
            "decoder.layer.b", part(t["decoder.layer.b"], 1, tp, 2), (1, tp, 2), replica_id=dp)
        sd["emb"] = ShardedTensor.from_rank_offsets(
            "embedding.word", part(t["embedding.word"], 0, rank, 4), (0, rank, 4), replica_id=0)
    else:
        sd["w"] = ShardedTensor.from_rank_offsets(
            "decoder.layer.w", part(t["decoder.layer.w"], 0, rank, 4), (0, rank, 4),
            replica_id=0)
        sd["b"] = ShardedTensor.from_rank_offsets(
            "decoder.layer.b", part(t["decoder.layer.b"], 1, rank, 4), (1, rank, 4),
            replica_id=0)
        sd["emb"] = ShardedTensor.from_rank_offsets(
            "embedding.word", part(t["embedding.word"], 0, dp, 2), (0, dp, 2), replica_id=tp)
    sd["norm"] = ShardedTensor.from_rank_offsets("final_norm.weight", t["final_norm.weight"],
                                                 replica_id=rank)
    sd["rng"] = ShardedObject("rng_state", {"rank": rank, "seed": -1 if zeros else seed},
                              (WORLD,), (rank,), replica_id=0)
    sd["iteration"] = -1 if zeros else seed  # common state (common.pt)
    return sd


def check_loaded(got, rank, seed, reshard, where):
    want = sharded_sd(rank, seed, reshard)
    for k in ("w", "b", "emb", "norm"):
        a, b = got[k], want[k].data
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            raise AssertionError(f"{where}: rank {rank} {want[k].key} differs "
                                 f"({a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)})")
    if got["rng"] != {"rank": rank, "seed": seed}:
        raise AssertionError(f"{where}: rank {rank} rng_state {got['rng']}")
    if got["iteration"] != seed:
        raise AssertionError(f"{where}: rank {rank} iteration {got['iteration']}")


def write_tracker(root, iteration):
    # As megatron/training/checkpointing.py does: a plain write of the number.
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write(str(iteration))


def run_base(rank, base, rec):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy, get_default_save_sharded_strategy)
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper)
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    root = os.path.join(base, "megatron")
    group = dist.group.WORLD

    def ckpt_dir(it):
        d = os.path.join(root, f"iter_{it:07d}")
        if rank == 0:
            os.makedirs(d, exist_ok=True)
        dist.barrier()
        return d

    def save_strategy():
        base_strategy = get_default_save_sharded_strategy("torch_dist")
        if not isinstance(base_strategy, TorchDistSaveShardedStrategy):
            raise AssertionError(f"default torch_dist strategy is {type(base_strategy)}")
        return FullyParallelSaveStrategyWrapper(base_strategy, group)

    # Sync save, then the tracker.
    t0 = time.monotonic()
    d = ckpt_dir(10)
    dist_checkpointing.save(sharded_sd(rank, 10), d, sharded_strategy=save_strategy())
    dist.barrier()
    if rank == 0:
        write_tracker(root, 10)
    rec["times"]["sync_save"] = round(time.monotonic() - t0, 2)

    # Async saves by the persistent worker; the tracker in the finalize function.
    queue = AsyncCallsQueue(persistent=True)
    try:
        for it in (20, 30):
            t0 = time.monotonic()
            d = ckpt_dir(it)
            req = dist_checkpointing.save(sharded_sd(rank, it), d,
                                          sharded_strategy=save_strategy(),
                                          async_sharded_save=True)
            if rank == 0:
                req.add_finalize_fn(lambda it=it: write_tracker(root, it))
            else:
                req.add_finalize_fn(lambda: None)
            queue.schedule_async_request(req)
            rec["times"][f"async_schedule_{it}"] = round(time.monotonic() - t0, 2)
            queue.maybe_finalize_async_calls(blocking=True)
            rec["times"][f"async_done_{it}"] = round(time.monotonic() - t0, 2)
    finally:
        queue.close()

    # Loads, through the fully parallel wrapper, as saved and resharded.
    for it, reshard in ((10, False), (30, True), (20, False)):
        d = os.path.join(root, f"iter_{it:07d}")
        strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(d), group)
        got = dist_checkpointing.load(sharded_sd(rank, it, reshard, zeros=True), d,
                                      sharded_strategy=strategy)
        check_loaded(got, rank, it, reshard, f"{d} (reshard={reshard})")
    dist.barrier()
    if rank == 0:
        with open(os.path.join(root, TRACKER)) as f:
            rec["tracker"] = f.read().strip()
        rec["checkpoints"] = [f"megatron/iter_{it:07d}" for it in (10, 20, 30)]
        rec["files"] = {c: sorted(os.listdir(os.path.join(base, c))) for c in rec["checkpoints"]}


def rank_main(rank, a, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), USE_LIBUV="0")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import megatron.core
    results = {"torch": torch.__version__, "megatron_core": megatron.core.__version__,
               "python": sys.version.split()[0], "bases": {}}
    try:
        for base in a.base:
            rec = {"times": {}}
            results["bases"][base] = rec
            if rank == 0:
                os.makedirs(os.path.join(base, "megatron"), exist_ok=True)
            dist.barrier()
            run_base(rank, base, rec)
            print(f"[rank {rank}] {base}: ok {rec['times']}", flush=True)
        dist.barrier()
        if rank == 0:
            with open(a.out + ".part", "w") as f:
                json.dump(results, f, indent=1)
            os.rename(a.out + ".part", a.out)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        exit_now(1)
    sys.stdout.flush()
    sys.stderr.flush()
    exit_now(0)


def exit_now(code):
    """os._exit, not the Gloo group's destructor (see torch2_clients.py), after
    multiprocessing's exit work: FileSystemWriterAsync keeps a Manager process per rank
    (its results queue), which would outlive the rank."""
    import multiprocessing.util
    try:
        multiprocessing.util._exit_function()
    finally:
        os._exit(code)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", action="append", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    mp.start_processes(rank_main, args=(a, free_port()), nprocs=WORLD, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
