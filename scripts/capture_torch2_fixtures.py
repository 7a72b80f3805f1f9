#!/usr/bin/env python3
"""Captures real torch 2.x (and Megatron-core) DCP checkpoints as test fixtures, each with a
manifest: the index a correct parser must produce, read here with the torch that wrote it
(pickle.load of the metadata, torch.load and zipfile of every item). Runs inside a Debian
torch root (scripts/torch_root.sh); scripts/capture_torch2_fixtures.sh drives it.

  python3 capture_torch2_fixtures.py --out DIR [--megatron]

Writes into DIR, for torch VV (e.g. 26, 214):
  torchVV_dtensor_4rank/      4 gloo ranks, DTensors (fp32 Shard(0), bf16 Shard(1), fp16
                              uneven Shard(0), a Replicate), a plain int64 tensor and a bytes
                              item; dcp.save with the default FileSystemWriter
  torchVV_per_rank/           (torch with use_collectives) dcp.save(use_collectives=False):
                              __{rank}.metadata + __{rank}_0.distcp, no .metadata
  torchVV_zstd/               (torch with the ZStandard extension and zstandard/pyzstd)
                              FileSystemWriter(_extensions=[ZStandard()])
  megatron0NN_torch_dist/     (--megatron) Megatron-core's torch_dist sync save via
                              FullyParallelSaveStrategyWrapper (TP=2 x DP=2 on 4 ranks)
  safetensors/torchVV_hf/     (torch with HuggingFaceStorageWriter) the consolidated
                              model-0000k-of-00002.safetensors + model.safetensors.index.json
Manifests: DIR/<name>.manifest.json for .metadata, <name>/<file>.manifest.json for
per-rank metadata and for transformed (zstd) checkpoints, whose items are opaque.
Every checkpoint is saved with checkpoint_id /ckpt/<name> (storage_meta records it).
"""
import argparse
import hashlib
import io
import json
import os
import pickle
import pickletools
import shutil
import socket
import struct
import sys
import traceback
import zipfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

WORLD = 4
CKPT = "/ckpt"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tag():
    major, minor = torch.__version__.split(".")[:2]
    return f"torch{major}{minor}"


def dtensor_sd(mesh, seed=7):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    g = torch.Generator().manual_seed(seed)

    def dt(t, placement):  # gloo scatters no bfloat16: distribute as float32, convert locally
        return distribute_tensor(t.float(), mesh, [placement]).to(t.dtype)
    return {
        "model.embed.weight": dt(torch.randn(16, 8, generator=g), Shard(0)),
        "model.layers.0.attn.w": dt(torch.randn(8, 12, generator=g).to(torch.bfloat16),
                                    Shard(1)),
        "model.layers.0.attn.b": dt(torch.randn(10, generator=g).to(torch.float16), Shard(0)),
        "model.norm.weight": dt(torch.randn(8, generator=g), Replicate()),
        "optim.step": torch.tensor(100, dtype=torch.int64),
        "extra": {"epoch": 3, "lr": 0.01},
    }


# ---- manifests --------------------------------------------------------------------------
def item_archive_fields(blob, item_offset):
    """raw_offset (file-absolute), raw_nbytes, stride, storage_offset of a torch.save item."""
    zf = zipfile.ZipFile(io.BytesIO(blob))
    data = [z for z in zf.infolist() if "/data/" in z.filename and
            not z.filename.endswith("/data/serialization_id") and
            z.filename.split("/data/")[1].isdigit()]
    assert len(data) == 1, [z.filename for z in zf.infolist()]
    z = data[0]
    name_len, extra_len = struct.unpack("<HH", blob[z.header_offset + 26:z.header_offset + 30])
    raw = z.header_offset + 30 + name_len + extra_len
    t = torch.load(io.BytesIO(blob), weights_only=False)
    return {"raw_offset": item_offset + raw, "raw_nbytes": z.file_size,
            "stride": list(t.stride()), "storage_offset": t.storage_offset()}


def manifest(ckpt_dir, meta_name):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    path = os.path.join(ckpt_dir, meta_name)
    with open(path, "rb") as f:
        raw = f.read()
    md = pickle.loads(raw)
    items = []
    files = {}
    for idx, si in md.storage_data.items():
        smd = md.state_dict_metadata[idx.fqn]
        transforms = list(getattr(si, "transform_descriptors", None) or [])
        it = {"fqn": idx.fqn, "file": si.relative_path, "offset": si.offset,
              "length": si.length}
        if isinstance(smd, BytesStorageMetadata):
            it["kind"] = "opaque" if transforms else "bytes"
        else:
            chunk = [c for c in smd.chunks if tuple(c.offsets) == tuple(idx.offset)]
            assert len(chunk) == 1, (idx, smd.chunks)
            it.update(kind="opaque" if transforms else "tensor",
                      chunk_offsets=list(idx.offset), chunk_sizes=list(chunk[0].sizes),
                      global_size=list(smd.size),
                      dtype=str(smd.properties.dtype).replace("torch.", ""))
            if not transforms:
                with open(os.path.join(ckpt_dir, si.relative_path), "rb") as f:
                    f.seek(si.offset)
                    blob = f.read(si.length)
                it.update(item_archive_fields(blob, si.offset))
        if transforms:
            it["transforms"] = transforms
        items.append(it)
        files.setdefault(si.relative_path, None)
    out = {
        "captured_with": f"torch {torch.__version__}, Python {sys.version.split()[0]}",
        "flavor": "mcore" if type(md).__name__ == "MCoreMetadata" else "torch2",
        "metadata_class": f"{type(md).__module__}.{type(md).__name__}",
        "version": getattr(md, "version", None) or "",
        "checkpoint_id": str(getattr(getattr(md, "storage_meta", None), "checkpoint_id", "")
                             or ""),
        "other_fields": sorted(k for k, v in vars(md).items()
                               if k not in ("state_dict_metadata", "storage_data")
                               and v is not None),
        "pickle_protocol": raw[1] if raw[:1] == b"\x80" else None,
        "pickle_opcodes": sorted({op.name for op, _, _ in pickletools.genops(raw)}),
        "items": items,
    }
    for name in [meta_name] + sorted(files):
        with open(os.path.join(ckpt_dir, name), "rb") as f:
            b = f.read()
        out.setdefault("files", {})[name] = {"size": len(b),
                                             "sha256": hashlib.sha256(b).hexdigest()}
    return out


def safetensors_manifest(d):
    out = {"captured_with": f"torch {torch.__version__}", "files": {}, "tensors": {}}
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        if not os.path.isfile(p):
            continue
        with open(p, "rb") as f:
            b = f.read()
        out["files"][name] = {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()}
        if name.endswith(".safetensors"):
            (n,) = struct.unpack("<Q", b[:8])
            header = json.loads(b[8:8 + n])
            out.setdefault("metadata", {})[name] = header.pop("__metadata__", None)
            for k, v in header.items():
                out["tensors"][k] = {"file": name, "dtype": v["dtype"], "shape": v["shape"],
                                     "data_offsets": v["data_offsets"],
                                     "file_offset": 8 + n + v["data_offsets"][0]}
    return out


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


# ---- the saves ---------------------------------------------------------------------------
def rank_main(rank, a, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), USE_LIBUV="0")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    code = 0
    try:
        run(rank, a)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    # os._exit: not the Gloo group's destructor (torch's GIL deadlock at exit); first
    # multiprocessing's exit work, which ends the Manager process Megatron's
    # FileSystemWriterAsync starts per rank.
    import multiprocessing.util
    try:
        multiprocessing.util._exit_function()
    finally:
        os._exit(code)


def run(rank, a):
    import inspect
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (WORLD,))
    t = tag()
    made = []

    def fresh(name):
        d = os.path.join(CKPT, name)
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
        dist.barrier()
        return d

    d = fresh(f"{t}_dtensor_4rank")
    dcp.save(dtensor_sd(mesh), checkpoint_id=d)
    made.append((d, [".metadata"]))

    if "use_collectives" in inspect.signature(dcp.save).parameters:
        d = fresh(f"{t}_per_rank")
        g = torch.Generator().manual_seed(100 + rank)
        dcp.save({"w": torch.randn(6, 5, generator=g), "rank": rank, "step": torch.tensor(rank)},
                 checkpoint_id=d, use_collectives=False)
        made.append((d, [f"__{r}.metadata" for r in range(WORLD)]))

    try:
        from torch.distributed.checkpoint._extension import ZStandard
        have_zstd = ZStandard.is_available()
    except ImportError:
        have_zstd = False
    if have_zstd:
        d = fresh(f"{t}_zstd")
        dcp.save(dtensor_sd(mesh), storage_writer=dcp.FileSystemWriter(
            d, _extensions=[ZStandard()]))
        made.append((d, [".metadata"]))
    elif rank == 0:
        print("no zstd fixture: ZStandard needs the zstandard or pyzstd module", flush=True)

    if hasattr(dcp, "HuggingFaceStorageWriter"):
        d = fresh(f"{t}_hf")
        sd = {k: v for k, v in dtensor_sd(mesh).items() if k.startswith("model.")}
        mapping = {k: 1 + (i % 2) for i, k in enumerate(sd)}
        dcp.save(sd, storage_writer=dcp.HuggingFaceStorageWriter(
            d, save_distributed=True, enable_consolidation=True, fqn_to_index_mapping=mapping))
        made.append((d, None))

    if a.megatron:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from megatron.core import dist_checkpointing, __version__ as mv
        from megatron.core.dist_checkpointing.serialization import (
            get_default_save_sharded_strategy)
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper)
        import megatron_clients
        major, minor = mv.split(".")[:2]
        d = fresh(f"megatron{major}{int(minor):02d}_torch_dist")
        dist_checkpointing.save(
            megatron_clients.sharded_sd(rank, 10), d,
            sharded_strategy=FullyParallelSaveStrategyWrapper(
                get_default_save_sharded_strategy("torch_dist"), dist.group.WORLD))
        made.append((d, [".metadata"]))
    dist.barrier()

    if rank != 0:
        return
    for d, metas in made:
        name = os.path.basename(d)
        if metas is None:  # safetensors
            dst = os.path.join(a.out, "safetensors", name)
            shutil.copytree(d, dst, ignore=shutil.ignore_patterns("sharded"))
            write_json(dst + ".manifest.json", safetensors_manifest(dst))
            print(f"captured safetensors/{name}", flush=True)
            continue
        dst = os.path.join(a.out, name)
        shutil.copytree(d, dst)
        for m in metas:
            man = manifest(dst, m)
            if m == ".metadata" and all(i["kind"] != "opaque" for i in man["items"]):
                write_json(dst + ".manifest.json", man)
            else:
                write_json(os.path.join(dst, m + ".manifest.json"), man)
        print(f"captured {name}: {sorted(os.listdir(dst))}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--megatron", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    mp.start_processes(rank_main, args=(a, free_port()), nprocs=WORLD, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
