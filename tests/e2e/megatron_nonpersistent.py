#!/usr/bin/env python3
"""Megatron-LM's non-persistent global checkpoints (--non-persistent-ckpt-type global,
--non-persistent-global-ckpt-dir) through ckptfs, on the CPU with 4 gloo ranks, with
megatron/core's own dist_checkpointing (see test_megatron_nonpersistent.py).

megatron/training is not in the pinned source (only megatron/core is), so the few lines of
megatron/training/checkpointing.py that decide where a checkpoint goes and which one a
restart loads are followed here as that file has them at core_v0.16.1:
  * a persistent save goes to --save/iter_N, its tracker --save/latest_checkpointed_iteration.txt;
  * a non-persistent global save goes to NP/iter_N with its own tracker NP/latest_...txt,
    then cleanup_old_non_persistent_checkpoint keeps only the newest NP/iter_* (rmtree of
    the older ones, rank 0);
  * a restart reads both trackers (a missing one is -1) and loads the non-persistent
    checkpoint when its iteration is >= the persistent one's (_load_base_checkpoint).

  --phase save    persistent iter 10, non-persistent iters 15 and 20 (each with its tracker
                  and the cleanup); then, with --enospc-mb M, a non-persistent iter 25 with
                  an extra tensor of M MiB that must fail (the memory budget), after which
                  the non-persistent tracker still says 20
  --phase resume  Megatron's choice between the two trackers, then the load, checked exactly
                  against the state saved at that iteration
Writes --out (JSON, rank 0): per phase what it saw.
"""
import argparse
import json
import os
import shutil
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_clients import WORLD, check_loaded, exit_now, free_port, sharded_sd

TRACKER = "latest_checkpointed_iteration.txt"


def iter_dir(base, it):
    return os.path.join(base, f"iter_{it:07d}")


def read_tracker(base):
    # read_metadata: the number in the tracker, the max over ranks (they must agree).
    path = os.path.join(base, TRACKER)
    it = -1
    if os.path.isfile(path):
        with open(path) as f:
            it = int(f.read().strip())
    t = torch.tensor([it], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def save(rank, base, it, extra_mb=0, non_persistent=False):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import \
        FullyParallelSaveStrategyWrapper
    d = iter_dir(base, it)
    if rank == 0:
        os.makedirs(d, exist_ok=True)
    dist.barrier()
    sd = sharded_sd(rank, it)
    if extra_mb:
        rows = (extra_mb << 20) // (4 * 256 * WORLD)
        sd["big"] = ShardedTensor.from_rank_offsets(
            "big.weight", torch.full((rows, 256), float(rank)), (0, rank, WORLD), replica_id=0)
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"),
                                                dist.group.WORLD)
    dist_checkpointing.save(sd, d, sharded_strategy=strategy)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(base, TRACKER), "w") as f:
            f.write(str(it))
        if non_persistent:
            # cleanup_old_non_persistent_checkpoint(save_dir, leave_ckpt_num=1)
            ckpts = sorted(Path(base).rglob("iter_*"), key=lambda p: int(p.name[len("iter_"):]))
            for old in ckpts[:-1]:
                shutil.rmtree(old)
    dist.barrier()


def phase_save(rank, a, rec):
    save(rank, a.persistent, 10)
    for it in (15, 20):
        save(rank, a.nonpersistent, it, non_persistent=True)
    rec["nonpersistent_dirs"] = sorted(os.listdir(a.nonpersistent))
    if a.enospc_mb:
        try:
            save(rank, a.nonpersistent, 25, extra_mb=a.enospc_mb, non_persistent=True)
            rec["enospc_error"] = None
        except BaseException as e:  # DCP raises CheckpointException, a BaseException
            rec["enospc_error"] = f"{type(e).__name__}: {str(e)[:3000]}"
        # The ranks do not agree on whether the failed save left a half-made directory;
        # the next barrier keeps them together.
        dist.barrier()
        rec["tracker_after_enospc"] = read_tracker(a.nonpersistent)


def phase_resume(rank, a, rec):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import \
        FullyParallelLoadStrategyWrapper
    np_it = read_tracker(a.nonpersistent)
    p_it = read_tracker(a.persistent)
    # _load_base_checkpoint: the non-persistent one when it exists and is not older.
    if np_it != -1 and np_it >= p_it:
        kind, base, it = "non-persistent", a.nonpersistent, np_it
    else:
        kind, base, it = "persistent", a.persistent, p_it
    d = iter_dir(base, it)
    strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(d),
                                                dist.group.WORLD)
    got = dist_checkpointing.load(sharded_sd(rank, it, zeros=True), d, sharded_strategy=strategy)
    check_loaded(got, rank, it, False, d)
    rec.update(nonpersistent_tracker=np_it, persistent_tracker=p_it, loaded=kind, iteration=it)


def rank_main(rank, a, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), USE_LIBUV="0")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    rec = {"torch": torch.__version__, "phase": a.phase}
    try:
        if rank == 0:
            os.makedirs(a.persistent, exist_ok=True)
        dist.barrier()
        (phase_save if a.phase == "save" else phase_resume)(rank, a, rec)
        dist.barrier()
        if rank == 0:
            with open(a.out + ".part", "w") as f:
                json.dump(rec, f, indent=1)
            os.rename(a.out + ".part", a.out)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        exit_now(1)
    sys.stdout.flush()
    sys.stderr.flush()
    exit_now(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("save", "resume"), required=True)
    ap.add_argument("--persistent", required=True)
    ap.add_argument("--nonpersistent", required=True)
    ap.add_argument("--enospc-mb", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    mp.start_processes(rank_main, args=(a, free_port()), nprocs=WORLD, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
