"""Checkpoint formats besides one DCP `.metadata` (issue 22), through a real mount, in
async and strict modes:

* Hugging Face safetensors: shards `model-0000k-of-0000N.safetensors` and
  `model.safetensors.index.json` (as transformers and torch's HuggingFaceStorageWriter
  write them), in save order (shards, then index) and in `cp` order (index first), and a
  single `model.safetensors`. Written with plain Python (the format is an u64
  little-endian header length, a JSON header, the data). The index must never reach the
  backing store ahead of its shards, a tracker written after it must follow it, and
  `ckptfs-admin checkpoints` must say committed.
* A no-collectives DCP save (torch 2.x `use_collectives=False`): every rank writes its own
  `__{rank}_0.distcp` and `__{rank}.metadata` (`__{rank}.metadata.tmp`, renamed), and no
  `.metadata`. torch 1.13 (this host's) cannot write one (its `no_dist=True` writes a
  `.metadata` per process), so the per-rank files are made from the 4-rank fixture: each
  `__{rank}.metadata` is the fixture's Metadata with the storage_data of that rank's file
  only, as torch 2.x writes it.
"""
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
import unittest

import harness
from harness import ADMIN

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "fixtures", "dcp", "torch113_4rank_single_file")
KiB = 1 << 10


def safetensors_bytes(tensors):
    """tensors: name -> (dtype, shape, raw bytes). The header is padded with spaces to a
    multiple of 8, as the safetensors library does."""
    header, data, off = {}, b"", 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    return {k: blob[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]
            for k, v in header.items()}


def hf_checkpoint(seed):
    """Two shards and their index: name -> bytes, and tensor -> raw bytes."""
    r = lambda k, n: hashlib.sha256(f"{seed}/{k}".encode()).digest() * (n // 32)
    shards = {
        "model-00001-of-00002.safetensors": {
            "embed.weight": ("F32", [64, 32], r("e", 64 * 32 * 4)),
            "layers.0.w": ("BF16", [128, 64], r("w0", 128 * 64 * 2)),
        },
        "model-00002-of-00002.safetensors": {
            "layers.1.w": ("BF16", [128, 64], r("w1", 128 * 64 * 2)),
            "head.bias": ("F16", [32], r("hb", 64)),
        },
    }
    files = {name: safetensors_bytes(t) for name, t in shards.items()}
    index = {"metadata": {"total_size": sum(len(v[2]) for t in shards.values()
                                            for v in t.values())},
             "weight_map": {k: name for name, t in shards.items() for k in t}}
    files["model.safetensors.index.json"] = json.dumps(index, indent=2).encode()
    tensors = {k: v[2] for t in shards.values() for k, v in t.items()}
    return files, tensors


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def per_rank_metadata():
    """rank -> the bytes of its `__{rank}.metadata`, made with this host's torch 1.13."""
    prog = r"""
import copy, pickle, sys
import torch  # the fixture's classes (torch.distributed._shard.checkpoint in 1.13)
md = pickle.load(open(sys.argv[1], "rb"))
out = {}
for rank in range(4):
    mine = {k: v for k, v in md.storage_data.items()
            if v.relative_path == f"__{rank}_0.distcp"}
    assert mine, rank
    part = copy.copy(md)
    part.storage_data = mine
    # Only this rank's items, as a rank that saves alone describes them: a tensor keeps
    # the chunks stored here, a bytes item is kept if stored here.
    held = {(k.fqn, tuple(k.offset) if k.offset is not None else None) for k in mine}
    items = {}
    for fqn, item in md.state_dict_metadata.items():
        chunks = getattr(item, "chunks", None)
        if chunks is None:
            if any(f == fqn for f, _ in held):
                items[fqn] = item
            continue
        kept = [c for c in chunks if (fqn, tuple(c.offsets)) in held]
        if kept:
            item = copy.copy(item)
            item.chunks = kept
            items[fqn] = item
    part.state_dict_metadata = items
    out[rank] = pickle.dumps(part)
sys.stdout.buffer.write(pickle.dumps(out))
"""
    env = dict(os.environ, PYTHONPATH=os.path.join(HERE, "sitecustomize_dcp"))
    out = subprocess.run(["/usr/bin/python3", "-c", prog, os.path.join(FIXTURE, ".metadata")],
                         capture_output=True, env=env, timeout=300)
    if out.returncode != 0:
        raise unittest.SkipTest("torch 1.13 cannot read the fixture: " +
                                out.stderr.decode(errors="replace")[-500:])
    import pickle
    return pickle.loads(out.stdout)


def settle(m, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = m.stats()
        if s["journal_pending"] == 0 and s["files_pending"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"journal not drained: {m.stats()}")


class Formats(harness.MountedTest):
    def state_of(self, m, ckpt):
        states = {c["path"]: c["state"] for c in m.checkpoints()}
        return states.get(ckpt)

    def assert_committed(self, m, ckpt):
        self.assertEqual(m.wait(os.path.join(m.mnt, ckpt)), 0, m.log_text())
        settle(m)
        self.assertEqual(self.state_of(m, ckpt), "committed", m.checkpoints())
        out = subprocess.run([ADMIN, "checkpoints", m.mnt], capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        line = [l for l in out.stdout.splitlines() if ckpt in l.split()]
        self.assertTrue(line and "committed" in line[0], out.stdout)

    def assert_files(self, m, ckpt, files):
        for name, data in files.items():
            for root in (m.mnt, m.backing):
                with open(os.path.join(root, ckpt, name), "rb") as f:
                    self.assertEqual(f.read(), data, f"{root}/{ckpt}/{name}")

    # ------------------------------------------------------------------ safetensors
    def run_safetensors(self, durability):
        m = self.mount(["--durability", durability])
        # Save order: shards, then the index, then the tracker.
        files, tensors = hf_checkpoint("a")
        os.mkdir(os.path.join(m.mnt, "hf-a"))
        for name in sorted(files, key=lambda n: n.endswith(".json")):
            write(os.path.join(m.mnt, "hf-a", name), files[name])
        write(os.path.join(m.mnt, "latest.txt"), b"hf-a")
        self.assert_committed(m, "hf-a")
        self.assert_files(m, "hf-a", files)
        got = {}
        for name in files:
            if name.endswith(".safetensors"):
                got.update(read_safetensors(os.path.join(m.mnt, "hf-a", name)))
        self.assertEqual(got, tensors)

        # cp order: the index sorts first; the tracker is written before the shards. Neither
        # may reach the backing store before the last shard does.
        files, _ = hf_checkpoint("b")
        src = os.path.join(self.tmp, "hf-b")
        os.mkdir(src)
        for name, data in files.items():
            write(os.path.join(src, name), data)
        dst = os.path.join(m.mnt, "hf-b")
        os.mkdir(dst)
        shutil.copyfile(os.path.join(src, "model.safetensors.index.json"),
                        os.path.join(dst, "model.safetensors.index.json"))
        write(os.path.join(m.mnt, "latest.txt"), b"hf-b")
        time.sleep(0.5)
        self.assertFalse(os.path.exists(os.path.join(m.backing, "hf-b",
                                                     "model.safetensors.index.json")))
        with open(os.path.join(m.backing, "latest.txt"), "rb") as f:
            self.assertEqual(f.read(), b"hf-a", "the tracker went ahead of its checkpoint")
        self.assertNotEqual(self.state_of(m, "hf-b"), "committed")
        first = "model-00001-of-00002.safetensors"
        shutil.copyfile(os.path.join(src, first), os.path.join(dst, first))
        time.sleep(0.5)
        self.assertFalse(os.path.exists(os.path.join(m.backing, "hf-b",
                                                     "model.safetensors.index.json")))
        self.assertNotEqual(self.state_of(m, "hf-b"), "committed")
        last = "model-00002-of-00002.safetensors"
        shutil.copyfile(os.path.join(src, last), os.path.join(dst, last))
        self.assert_committed(m, "hf-b")
        self.assert_files(m, "hf-b", files)
        self.assertEqual(harness.sha256_file(os.path.join(m.backing, "latest.txt")),
                         hashlib.sha256(b"hf-b").hexdigest())

        # A single model.safetensors commits on its own publish.
        os.mkdir(os.path.join(m.mnt, "single"))
        one = safetensors_bytes({"w": ("I64", [8], bytes(range(64)))})
        write(os.path.join(m.mnt, "single", "model.safetensors"), one)
        self.assert_committed(m, "single")
        self.assert_files(m, "single", {"model.safetensors": one})

        # A malformed index commits by order alone, and breaks nothing.
        os.mkdir(os.path.join(m.mnt, "bad"))
        write(os.path.join(m.mnt, "bad", "model.safetensors.index.json"), b"{not json")
        self.assert_committed(m, "bad")
        self.assertEqual(self.state_of(m, "hf-b"), "committed")
        self.assertEqual(m.unmount(), 0, m.log_text())

    def test_safetensors_async(self):
        self.run_safetensors("async")

    def test_safetensors_strict(self):
        self.run_safetensors("strict")

    # ------------------------------------------------------------------ no_dist DCP
    def run_no_dist(self, durability):
        metas = per_rank_metadata()
        m = self.mount(["--durability", durability])
        ck = os.path.join(m.mnt, "nodist")
        os.mkdir(ck)
        shards = {}
        for rank in range(4):
            with open(os.path.join(FIXTURE, f"__{rank}_0.distcp"), "rb") as f:
                shards[rank] = f.read()

        def rank_save(rank, metadata_first):
            shard = os.path.join(ck, f"__{rank}_0.distcp")
            md = os.path.join(ck, f"__{rank}.metadata")
            if metadata_first:  # as a copy in sorted order would
                write(md + ".tmp", metas[rank])
                os.rename(md + ".tmp", md)
                write(shard, shards[rank])
            else:  # as DCP saves: data, then its own metadata
                write(shard, shards[rank])
                write(md + ".tmp", metas[rank])
                os.rename(md + ".tmp", md)

        threads = [threading.Thread(target=rank_save, args=(r, r % 2 == 1)) for r in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assert_committed(m, "nodist")
        # Each rank's metadata was judged on its shards, not committed by order alone.
        self.assertNotIn("not understood", m.log_text())
        files = {f"__{r}_0.distcp": shards[r] for r in range(4)}
        files.update({f"__{r}.metadata": metas[r] for r in range(4)})
        self.assert_files(m, "nodist", files)
        self.assertFalse(os.path.exists(os.path.join(m.backing, "nodist", ".metadata")))
        self.assertEqual(m.unmount(), 0, m.log_text())

    def test_no_dist_async(self):
        self.run_no_dist("async")

    def test_no_dist_strict(self):
        self.run_no_dist("strict")

    def setUp(self):
        super().setUp()
        import tempfile
        self.tmp = tempfile.mkdtemp(prefix="ckptfs-formats-")
        self.addCleanup(shutil.rmtree, self.tmp, True)


if __name__ == "__main__":
    unittest.main()
