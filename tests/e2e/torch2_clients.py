#!/usr/bin/env python3
"""The clients of today, run with a torch 2.x (inside a Debian root, see
test_torch2_clients.py): 4 gloo ranks save and load DTensor state dicts with DCP under every
directory given by --base (one per mount), and check every tensor they load exactly.

  python3 torch2_clients.py --base /mnt/a/run --base /mnt/b/run --out results.json

Cases (each skipped, with the reason, where this torch lacks the API):
  sync        dcp.save of DTensors (Shard(0), Shard(1), uneven, Replicate) + a plain tensor and
              a bytes item; then a second dcp.save over the same directory (other values)
  async_thread   dcp.async_save, the thread checkpointer (the default)
  async_process  dcp.async_save(async_checkpointer_type=PROCESS): a checkpoint process per
              rank writes, with its own gloo group
  reshard     the sync checkpoint loaded into other placements (Shard(1), a 2x2 mesh)
  hf          HuggingFaceStorageWriter(save_distributed, enable_consolidation): sharded
              files, then consolidated model-0000k-of-00002.safetensors + index, loaded back
              with HuggingFaceStorageReader
  per_rank    dcp.save(use_collectives=False): every rank writes __{rank}_0.distcp and
              __{rank}.metadata in one directory (no .metadata); loaded back per rank
  no_dist     dcp.save(no_dist=True) by every rank alone into its own directory
  to_torch_save  dcp_to_torch_save of the sync checkpoint, checked with torch.load
  tensor_view ckptfs's /.ckptfs/tensors view of the sync (overwritten) and async_thread
              checkpoints, once the daemon is idle: every chunk's bytes, read with torch

Writes --out (JSON, by rank 0): per base the checkpoint directories that must be committed,
the cases run and skipped (with reasons), and the torch version. Exit 0 when every check
passed; a failed check raises in its rank, and the exit code is nonzero.
"""
import argparse
import inspect
import json
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

WORLD = 4


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def global_tensors(seed):
    """name -> (full tensor, placement kind). Deterministic on every rank."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed.weight": (torch.randn(64, 48, generator=g), "shard0"),
        "model.layers.0.w": (torch.randn(40, 36, generator=g).to(torch.bfloat16), "shard1"),
        "model.layers.0.b": (torch.randn(30, generator=g).to(torch.float16), "shard0"),  # uneven
        "model.norm": (torch.randn(48, generator=g), "replicate"),
    }


def placements_for(kind, mesh_ndim, reshard):
    from torch.distributed.tensor import Replicate, Shard
    if mesh_ndim == 2:
        return {"shard0": [Shard(0), Replicate()], "shard1": [Replicate(), Shard(1)],
                "replicate": [Replicate(), Shard(0)]}[kind]
    if reshard:  # the other way round
        return {"shard0": [Replicate()], "shard1": [Shard(0)], "replicate": [Shard(0)]}[kind]
    return {"shard0": [Shard(0)], "shard1": [Shard(1)], "replicate": [Replicate()]}[kind]


def state_dict(seed, mesh, reshard=False, extras=True, zeros=False):
    from torch.distributed.tensor import distribute_tensor
    sd = {}
    for name, (t, kind) in global_tensors(seed).items():
        src = torch.zeros_like(t) if zeros else t
        # Distributed as float32 and converted locally: gloo's scatter and all_gather have
        # no bfloat16 ("Invalid scalar type"); the conversions are exact.
        sd[name] = distribute_tensor(src.float(), mesh,
                                     placements_for(kind, mesh.ndim, reshard)).to(t.dtype)
    if extras:
        sd["optim.step"] = torch.tensor(0 if zeros else 1000 + seed, dtype=torch.int64)
        sd["extra"] = {"epoch": 0 if zeros else seed, "name": "" if zeros else f"run-{seed}"}
    return sd


def check_sd(got, seed, where, extras=True):
    from torch.distributed.tensor import DTensor
    for name, (t, _) in global_tensors(seed).items():
        v = got[name]
        if v.dtype != t.dtype:
            raise AssertionError(f"{where}: {name} is {v.dtype}, saved as {t.dtype}")
        full = v.float().full_tensor() if isinstance(v, DTensor) else v.float()
        if not torch.equal(full, t.float()):  # bf16/fp16 -> fp32 is exact
            raise AssertionError(f"{where}: {name} differs")
    if extras:
        if int(got["optim.step"]) != 1000 + seed:
            raise AssertionError(f"{where}: optim.step {got['optim.step']}")
        if got["extra"] != {"epoch": seed, "name": f"run-{seed}"}:
            raise AssertionError(f"{where}: extra {got['extra']}")


class Case:
    def __init__(self, rank, base, record):
        self.rank, self.base, self.record = rank, base, record

    def run(self, name, fn, *ckpts):
        """Runs case `name`; `fn` returns None or a skip reason. Every rank runs every case."""
        t0 = time.monotonic()
        why = fn()
        dist.barrier()
        if self.rank == 0:
            if why:
                self.record["skipped"][name] = why
            else:
                self.record["cases"][name] = round(time.monotonic() - t0, 2)
                self.record["checkpoints"] += [c for c in ckpts if c]
        print(f"[rank {self.rank}] {self.base}: {name}: {why or 'ok'}", flush=True)


def run_base(rank, base, record):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (WORLD,))
    mesh2 = init_device_mesh("cpu", (2, 2))
    p = lambda *a: os.path.join(base, *a)
    save_params = inspect.signature(dcp.save).parameters
    async_params = inspect.signature(dcp.async_save).parameters
    c = Case(rank, base, record)

    def load_check(path, seed, m, reshard=False, **kw):
        got = state_dict(0, m, reshard=reshard, zeros=True)
        dcp.load(got, checkpoint_id=path, **kw)
        check_sd(got, seed, f"{path} (mesh {tuple(m.shape)}, reshard={reshard})")

    def sync():
        dcp.save(state_dict(1, mesh), checkpoint_id=p("sync"))
        load_check(p("sync"), 1, mesh)
        # A second save over the same directory: torch >= 2.x unlinks .metadata, then
        # renames .metadata.tmp onto it.
        dcp.save(state_dict(2, mesh), checkpoint_id=p("sync"))
        load_check(p("sync"), 2, mesh)
    c.run("sync", sync, "sync")

    def async_thread():
        fut = dcp.async_save(state_dict(3, mesh), checkpoint_id=p("async_thread"))
        fut.result()
        load_check(p("async_thread"), 3, mesh)
    c.run("async_thread", async_thread, "async_thread")

    def async_process():
        try:
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        except ImportError:
            return f"torch {torch.__version__} has no AsyncCheckpointerType.PROCESS"
        fut = dcp.async_save(state_dict(4, mesh), checkpoint_id=p("async_process"),
                             async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        fut.result()
        # The same checkpoint process writes a second one.
        fut = dcp.async_save(state_dict(5, mesh), checkpoint_id=p("async_process2"),
                             async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        fut.result()
        load_check(p("async_process"), 4, mesh)
        load_check(p("async_process2"), 5, mesh)
    c.run("async_process", async_process, "async_process", "async_process2")

    def reshard():
        load_check(p("sync"), 2, mesh, reshard=True)
        load_check(p("sync"), 2, mesh2)
    c.run("reshard", reshard)

    def hf():
        if not hasattr(dcp, "HuggingFaceStorageWriter"):
            return f"torch {torch.__version__} has no HuggingFaceStorageWriter"
        sd = state_dict(6, mesh, extras=False)
        mapping = {"model.embed.weight": 1, "model.layers.0.w": 1, "model.layers.0.b": 2,
                   "model.norm": 2}
        w = dcp.HuggingFaceStorageWriter(p("hf"), save_distributed=True,
                                         enable_consolidation=True,
                                         fqn_to_index_mapping=mapping)
        dcp.save(sd, storage_writer=w)
        if rank == 0:
            names = sorted(os.listdir(p("hf")))
            want = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                    "model.safetensors.index.json"]
            missing = [n for n in want if n not in names]
            if missing:
                raise AssertionError(f"hf: missing {missing} in {names}")
            from safetensors.torch import load_file
            got = {}
            for n in want[:2]:
                got.update(load_file(p("hf", n)))
            check_sd(got, 6, "hf via safetensors.load_file", extras=False)
            with open(p("hf", "model.safetensors.index.json")) as f:
                wm = json.load(f)["weight_map"]
            if wm != {k: f"model-0000{v}-of-00002.safetensors" for k, v in mapping.items()}:
                raise AssertionError(f"hf index weight_map {wm}")
        dist.barrier()
        # Loaded back by torch's reader into other placements.
        got = state_dict(0, mesh, reshard=True, extras=False, zeros=True)
        dcp.load(got, storage_reader=dcp.HuggingFaceStorageReader(p("hf")))
        check_sd(got, 6, "hf via HuggingFaceStorageReader", extras=False)
    c.run("hf", hf, "hf")

    def per_rank():
        if "use_collectives" not in save_params:
            return f"torch {torch.__version__}: dcp.save has no use_collectives"
        g = torch.Generator().manual_seed(100 + rank)
        mine = {"w": torch.randn(33, 17, generator=g), "step": torch.tensor(rank)}
        dcp.save(mine, checkpoint_id=p("per_rank"), use_collectives=False)
        dist.barrier()
        if rank == 0:
            names = sorted(os.listdir(p("per_rank")))
            want = sorted([f"__{r}.metadata" for r in range(WORLD)] +
                          [f"__{r}_0.distcp" for r in range(WORLD)])
            if names != want:
                raise AssertionError(f"per_rank: {names} != {want}")
        got = {"w": torch.zeros(33, 17), "step": torch.tensor(-1)}
        dcp.load(got, checkpoint_id=p("per_rank"))
        if not torch.equal(got["w"], mine["w"]) or int(got["step"]) != rank:
            raise AssertionError(f"per_rank: rank {rank} loaded other values")
    c.run("per_rank", per_rank, "per_rank")

    def no_dist():
        d = p("no_dist", f"rank{rank}")
        g = torch.Generator().manual_seed(200 + rank)
        mine = {"w": torch.randn(21, 5, generator=g).to(torch.float64), "r": rank}
        if "no_dist" in save_params:
            dcp.save(mine, checkpoint_id=d, no_dist=True)
        else:  # torch 2.6: dcp.save has no no_dist; the older entry point does
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save_state_dict(mine, storage_writer=dcp.FileSystemWriter(d), no_dist=True)
        got = {"w": torch.zeros(21, 5, dtype=torch.float64), "r": -1}
        dcp.load(got, checkpoint_id=d, no_dist=True) if "no_dist" in inspect.signature(
            dcp.load).parameters else dcp.load_state_dict(got, dcp.FileSystemReader(d),
                                                          no_dist=True)
        if not torch.equal(got["w"], mine["w"]) or got["r"] != rank:
            raise AssertionError(f"no_dist: rank {rank} loaded other values")
    c.run("no_dist", no_dist, *[f"no_dist/rank{r}" for r in range(WORLD)])

    def to_torch_save():
        if rank == 0:
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
            dcp_to_torch_save(p("sync"), p("sync.pt"))
            got = torch.load(p("sync.pt"), weights_only=False)
            check_sd(got, 2, "dcp_to_torch_save")
    c.run("to_torch_save", to_torch_save)

    def tensor_view():
        """ckptfs's /.ckptfs/tensors view of two checkpoints, read by torch: every chunk of
        every tensor in .metadata has a file there whose bytes are that chunk."""
        mnt = os.path.dirname(base)
        control = os.path.join(mnt, ".ckptfs")
        if not os.path.isdir(control):
            return "not a ckptfs mount"
        if rank != 0:
            return None
        deadline = time.monotonic() + 120  # everything published, the overwrite included
        while True:
            with open(os.path.join(control, "stats")) as f:
                st = json.load(f)
            if not st.get("journal_pending") and not st.get("files_pending"):
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"daemon never idle: {st}")
            time.sleep(0.05)
        rel = os.path.relpath(base, mnt)
        for ckpt, seed in (("sync", 2), ("async_thread", 3)):
            md = dcp.FileSystemReader(p(ckpt)).read_metadata()
            view = os.path.join(control, "tensors", rel, ckpt)
            full = {k: v for k, (v, _) in global_tensors(seed).items()}
            full["optim.step"] = torch.tensor(1000 + seed, dtype=torch.int64)
            for fqn, want in full.items():
                with open(os.path.join(view, fqn, "meta.json")) as f:
                    meta = json.load(f)
                chunks = {tuple(ch["offsets"]): ch for ch in meta["chunks"]}
                if meta["dtype"] != str(want.dtype).replace("torch.", ""):
                    raise AssertionError(f"view {ckpt}/{fqn}: dtype {meta['dtype']}")
                if set(chunks) != {tuple(c.offsets) for c in md.state_dict_metadata[fqn].chunks}:
                    raise AssertionError(f"view {ckpt}/{fqn}: chunks {sorted(chunks)}")
                for off, ch in chunks.items():
                    with open(os.path.join(view, fqn, ch["file"]), "rb") as f:
                        raw = f.read()
                    got = torch.frombuffer(bytearray(raw), dtype=want.dtype).as_strided(
                        ch["sizes"], ch["stride"], ch["storage_offset"])
                    exp = want[tuple(slice(o, o + n) for o, n in zip(off, ch["sizes"]))]
                    if not torch.equal(got.float(), exp.float()):
                        raise AssertionError(f"view {ckpt}/{fqn} chunk {off} differs")
        return None
    c.run("tensor_view", tensor_view)


def stop_checkpoint_process():
    """The PROCESS checkpointer's process outlives the save; end it before the rank exits."""
    try:
        import torch.distributed.checkpoint._async_process_executor as ape
    except ImportError:
        return
    proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
    if proc is not None:
        proc.__del__()
        ape._CHECKPOINT_PROCESS = None


def rank_main(rank, a, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), USE_LIBUV="0",
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results = {"torch": torch.__version__, "python": sys.version.split()[0], "bases": {}}
    try:
        for base in a.base:
            rec = {"checkpoints": [], "cases": {}, "skipped": {}}
            results["bases"][base] = rec
            if rank == 0:
                os.makedirs(base, exist_ok=True)
            dist.barrier()
            run_base(rank, base, rec)
        stop_checkpoint_process()
        dist.barrier()
        if rank == 0:
            with open(a.out + ".part", "w") as f:
                json.dump(results, f, indent=1)
            os.rename(a.out + ".part", a.out)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        stop_checkpoint_process()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Not dist.destroy_process_group(): torch's Gloo group destructor can deadlock on the
    # GIL at exit (Python 3.13+), which is torch's bug, not the checkpoint's.
    os._exit(0)


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
