"""Safetensors as a first-class checkpoint format (issue 22), as a user sees it through a
real mount:

* Hugging Face shards and their index (written in HuggingFaceStorageWriter's order, with
  plain Python here): `ckptfs-admin checkpoints` says committed, `ckptfs-admin ls` lists
  every tensor with its dtype and shape (read from the safetensors headers: no data read),
  the tensor view `/.ckptfs/tensors/<ckpt>/<fqn>/0_0` holds each tensor's bytes, `verify`
  passes with checksums taken on the write path and catches one flipped byte in a backing
  shard. A malformed shard header gives a clear error and the daemon goes on.
* A no-collectives DCP save (`__{rank}.metadata` per rank, no `.metadata`) is indexed from
  its per-rank files: ls and verify (needs this host's torch 1.13 to make the files).
* Crash: the index written right after its shards, the daemon SIGKILLed while the shards
  are still being flushed (writes throttled): the backing store never has the index
  without every shard it names, also after a restart.
* torch 2.14's own DCP HuggingFaceStorageWriter, in the cached Debian sid root
  (scripts/torch_root.sh sid), saving through a mount made inside the root: committed,
  `ls` lists every tensor with dtype and shape, the tensor view's bytes equal the
  tensors, HuggingFaceStorageReader loads them back, a save with consolidation
  (`consolidate_safetensors_files`: reads the sharded files, appends to its outputs)
  works through the mount and its output is indexed too, and `verify` catches a flipped
  byte. Skips, saying why, when the root cannot be built or this is not root.
"""
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest

import harness
from harness import ADMIN, Mount
from test_formats import hf_checkpoint, per_rank_metadata, safetensors_bytes, settle, write
from torch_roots import RootMounts, root_tmpdir  # the cached roots' mounts and TMPDIRs

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
FIXTURE = os.path.join(HERE, "..", "fixtures", "dcp", "torch113_4rank_single_file")
MiB = 1 << 20
DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I64": "int64"}


def admin(*args):
    return subprocess.run([ADMIN, *args], capture_output=True, text=True, timeout=120)


def view_dir(m, ckpt, fqn=None):
    d = os.path.join(m.mnt, ".ckptfs", "tensors", ckpt)
    return d if fqn is None else os.path.join(d, fqn)


class SafetensorsCheckpoint(harness.MountedTest):
    def committed(self, m, ckpt):
        self.assertEqual(m.wait(os.path.join(m.mnt, ckpt)), 0, m.log_text())
        settle(m)
        out = admin("checkpoints", m.mnt)
        self.assertEqual(out.returncode, 0, out.stderr)
        line = [l for l in out.stdout.splitlines() if ckpt in l.split()]
        self.assertTrue(line and "committed" in line[0], out.stdout)
        return out.stdout

    def ls_json(self, m, ckpt):
        out = admin("ls", "--json", os.path.join(m.mnt, ckpt))
        self.assertEqual(out.returncode, 0, out.stderr + m.log_text())
        return {e["fqn"]: e for e in json.loads(out.stdout)}

    def test_hf_checkpoint_is_listed_viewed_and_verified(self):
        m = self.mount(["--durability", "async"])
        files, tensors = hf_checkpoint("st")
        os.mkdir(os.path.join(m.mnt, "hf"))
        for name in sorted(files, key=lambda n: n.endswith(".json")):  # shards, then index
            write(os.path.join(m.mnt, "hf", name), files[name])
        self.committed(m, "hf")

        # ls: every tensor, with dtype and shape from the headers.
        out = admin("ls", os.path.join(m.mnt, "hf"))
        self.assertEqual(out.returncode, 0, out.stderr)
        sys.stderr.write("\n$ ckptfs-admin ls MNT/hf\n" + out.stdout)
        self.assertIn(f"{len(tensors)} entries", out.stdout)
        listed = self.ls_json(m, "hf")
        want = {}
        for name in files:
            if name.endswith(".safetensors"):
                blob = files[name]
                n = int.from_bytes(blob[:8], "little")
                for k, v in json.loads(blob[8:8 + n]).items():
                    if k != "__metadata__":
                        want[k] = (DTYPES[v["dtype"]], v["shape"])
        self.assertEqual({k: (e["dtype"], e["shape"]) for k, e in listed.items()}, want)
        self.assertTrue(all(e["kind"] == "tensor" and e["chunks"] == 1 for e in listed.values()))

        # The tensor view: each tensor's bytes, and its meta.json.
        for fqn, raw in tensors.items():
            with open(os.path.join(view_dir(m, "hf", fqn), "meta.json")) as f:
                meta = json.load(f)
            chunk = meta["chunks"][0]["file"]  # "0_0" for a 2-d tensor, "0" for 1-d
            self.assertEqual(chunk, "_".join("0" * len(want[fqn][1])))
            with open(os.path.join(view_dir(m, "hf", fqn), chunk), "rb") as f:
                self.assertEqual(f.read(), raw, fqn)
            self.assertEqual(meta["dtype"], want[fqn][0])
            self.assertIsNotNone(meta["chunks"][0]["checksum"], "checksummed on the write path")

        # diff against a later save that changed one tensor and added one.
        files2, _ = hf_checkpoint("st")
        blob = bytearray(files2["model-00001-of-00002.safetensors"])
        blob[-1] ^= 0xff  # the last byte of shard 1's last tensor
        files2["model-00001-of-00002.safetensors"] = bytes(blob)
        n = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8:8 + n])
        last = max((k for k in header if k != "__metadata__"),
                   key=lambda k: header[k]["data_offsets"][1])
        files2["model-00003-of-00003.safetensors"] = safetensors_bytes(
            {"extra": ("F32", [4], bytes(16))})
        index2 = json.loads(files2["model.safetensors.index.json"])
        index2["weight_map"]["extra"] = "model-00003-of-00003.safetensors"
        files2["model.safetensors.index.json"] = json.dumps(index2).encode()
        os.mkdir(os.path.join(m.mnt, "hf2"))
        for name in sorted(files2, key=lambda n: n.endswith(".json")):
            write(os.path.join(m.mnt, "hf2", name), files2[name])
        self.committed(m, "hf2")
        out = admin("diff", os.path.join(m.mnt, "hf"), os.path.join(m.mnt, "hf2"))
        sys.stderr.write("$ ckptfs-admin diff MNT/hf MNT/hf2\n" + out.stdout + out.stderr)
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertEqual(sorted(out.stdout.splitlines()[:-1]), sorted([f"M {last}", "+ extra"]))
        self.assertIn("2 of 5 entries differ", out.stdout)

        # verify: clean, every item checked, then one flipped byte in a backing shard.
        out = admin("verify", os.path.join(m.mnt, "hf"))
        sys.stderr.write("$ ckptfs-admin verify MNT/hf\n" + out.stdout + out.stderr)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn(f"{len(tensors)} items", out.stdout)
        self.assertIn("0 bad, 0 unchecked", out.stdout)
        shard = os.path.join(m.backing, "hf", "model-00002-of-00002.safetensors")
        with open(shard, "r+b") as f:
            blob = f.read()
            n = int.from_bytes(blob[:8], "little")
            begin = json.loads(blob[8:8 + n])["layers.1.w"]["data_offsets"][0]
            f.seek(8 + n + begin + 77)
            f.write(bytes([blob[8 + n + begin + 77] ^ 0x10]))
        out = admin("verify", os.path.join(m.mnt, "hf"))
        sys.stderr.write("$ ckptfs-admin verify MNT/hf   # one byte flipped\n" + out.stdout)
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertIn("BAD layers.1.w@0_0: checksum mismatch", out.stdout)
        self.assertIn("1 bad", out.stdout)

        # A single model.safetensors is a checkpoint too.
        os.mkdir(os.path.join(m.mnt, "single"))
        write(os.path.join(m.mnt, "single", "model.safetensors"),
              safetensors_bytes({"w": ("I64", [8], bytes(range(64)))}))
        self.committed(m, "single")
        self.assertEqual({k: (e["dtype"], e["shape"]) for k, e in
                          self.ls_json(m, "single").items()}, {"w": ("int64", [8])})

        # A malformed shard header: committed by its index, a clear index error, no crash.
        os.mkdir(os.path.join(m.mnt, "bad"))
        write(os.path.join(m.mnt, "bad", "model-00001-of-00001.safetensors"),
              (1 << 40).to_bytes(8, "little") + b"{}")
        write(os.path.join(m.mnt, "bad", "model.safetensors.index.json"),
              json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}).encode())
        self.committed(m, "bad")
        out = admin("ls", os.path.join(m.mnt, "bad"))
        self.assertNotEqual(out.returncode, 0)
        out = admin("checkpoints", "--json", m.mnt)
        bad = [c for c in json.loads(out.stdout) if c["path"] == "bad"]
        self.assertTrue(bad and "over the" in json.dumps(bad), out.stdout)
        self.assertIsNone(m.proc.poll(), "the daemon is still up")
        self.assertEqual(m.unmount(), 0, m.log_text())

    def test_no_dist_dcp_is_indexed_from_per_rank_metadata(self):
        metas = per_rank_metadata()  # skips without this host's torch 1.13
        m = self.mount(["--durability", "async"])
        ck = os.path.join(m.mnt, "nodist")
        os.mkdir(ck)
        # As ranks saving at once do: every shard and metadata temp first, then the renames.
        for rank in range(4):
            with open(os.path.join(FIXTURE, f"__{rank}_0.distcp"), "rb") as f:
                write(os.path.join(ck, f"__{rank}_0.distcp"), f.read())
            write(os.path.join(ck, f"__{rank}.metadata.tmp"), metas[rank])
        for rank in range(4):
            os.rename(os.path.join(ck, f"__{rank}.metadata.tmp"),
                      os.path.join(ck, f"__{rank}.metadata"))
        self.committed(m, "nodist")
        with open(os.path.join(FIXTURE, "..", "torch113_4rank_single_file.manifest.json")) as f:
            manifest = json.load(f)
        items = manifest["items"] if isinstance(manifest, dict) else manifest
        want = {i["fqn"] for i in items}
        self.assertEqual(set(self.ls_json(m, "nodist")), want)
        out = admin("verify", ck)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn(f"{len(items)} items", out.stdout)
        self.assertIn("0 bad, 0 unchecked", out.stdout)
        self.assertEqual(m.unmount(), 0, m.log_text())
        # Indexed when a rank's metadata committed the directory with no other rank's
        # pending, never once per rank; the last build is the whole one. (A rank
        # whose metadata lands after the others were applied is a new commit: ckptfs cannot
        # know how many ranks a no-collectives save has, so on a loaded machine this can be
        # two builds.) The log is complete once the daemon has exited.
        with open(m.log, errors="replace") as f:
            log = f.read()
        builds = re.findall(r"key index: indexed 'nodist': (\d+) items", log)
        self.assertTrue(1 <= len(builds) < 4, log[-3000:])
        self.assertEqual(int(builds[-1]), max(int(b) for b in builds), log[-3000:])

    @unittest.skipUnless(os.geteuid() == 0 and os.path.isdir("/sys/fs/cgroup/blkio"),
                         "needs root and the cgroup v1 blkio controller")
    def test_index_never_reaches_the_backing_store_ahead_of_its_shards_across_a_kill(self):
        from netns import throttle_writes
        m = self.mount(["--durability", "async", "--flush-direct-io", "on"], staging="128M")
        throttle_writes(self, m.proc.pid, m.backing, 2 * MiB, "ckptfs-st-crash")
        ck = os.path.join(m.mnt, "hf")
        os.mkdir(ck)
        shards = {f"model-0000{i}-of-00002.safetensors":
                  safetensors_bytes({f"w{i}": ("U8", [12 * MiB], os.urandom(12 * MiB))})
                  for i in (1, 2)}
        for name, blob in shards.items():  # as HuggingFaceStorageWriter: shards, then index
            write(os.path.join(ck, name), blob)
        index = {"metadata": {"total_size": 24 * MiB},
                 "weight_map": {"w1": "model-00001-of-00002.safetensors",
                                "w2": "model-00002-of-00002.safetensors"}}
        write(os.path.join(ck, "model.safetensors.index.json"), json.dumps(index).encode())
        # The index's write returned: kill the daemon while the shards are still flushing.
        backing = os.path.join(m.backing, "hf")
        complete = [n for n, b in shards.items()
                    if os.path.exists(os.path.join(backing, n))
                    and os.path.getsize(os.path.join(backing, n)) == len(b)]
        m.kill(signal.SIGKILL)
        self.assertLess(len(complete), 2, "the shards were durable before the kill: no test")
        names = os.listdir(backing)
        sys.stderr.write(f"\nbacking dir after SIGKILL: {sorted(names)}\n")
        self.assertNotIn("model.safetensors.index.json", names,
                         "the index reached the backing store ahead of its shards")

        # Restart on the same backing and state: still no index, no temp files, the
        # checkpoint not committed.
        m2 = Mount(args=["--durability", "async"], root=m.root, backing=m.backing,
                   state=m.state)
        self.addCleanup(m2.cleanup)
        m2.start()
        settle(m2)
        names = os.listdir(backing)
        self.assertNotIn("model.safetensors.index.json", names)
        self.assertEqual([n for n in names if n.startswith(harness.TMP_PREFIX)], [])
        states = {c["path"]: c["state"] for c in m2.checkpoints()}
        self.assertNotEqual(states.get("hf"), "committed", states)
        self.assertEqual(m2.unmount(), 0, m2.log_text())


# ---------------------------------------------------------------------------- torch 2.14

SAVE = r"""
import os, sys, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter

def state_dict():
    g = torch.Generator().manual_seed(14)
    return {
        "embed.weight": torch.randn(256, 64, generator=g),
        "layers.0.attn.w": torch.randn(128, 64, generator=g).to(torch.bfloat16),
        "layers.0.mlp.w": torch.randn(64, 96, generator=g).to(torch.float16),
        "layers.1.attn.w": torch.randn(128, 64, generator=g).to(torch.bfloat16),
        "head.bias": torch.arange(32, dtype=torch.int64),
    }

if __name__ == "__main__":
    path = sys.argv[1]
    sd = state_dict()
    mapping = {k: (1 if i < 3 else 2) for i, k in enumerate(sd)}
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(path=path, fqn_to_index_mapping=mapping))
    print("saved", sorted(os.listdir(path)))
"""

CHECK = r"""
import json, os, sys, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from safetensors.torch import load_file
sys.path.insert(0, os.path.dirname(__file__))
from st_save import state_dict

mnt, ckpt, cons = sys.argv[1], sys.argv[2], sys.argv[3]
sd = state_dict()

def raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

# The tensor view's bytes equal the tensors.
view = os.path.join(mnt, ".ckptfs", "tensors", os.path.relpath(ckpt, mnt))
for fqn, t in sd.items():
    meta = json.load(open(os.path.join(view, fqn, "meta.json")))
    assert meta["dtype"] == str(t.dtype).removeprefix("torch."), (fqn, meta["dtype"])
    assert meta["global_shape"] == list(t.shape), (fqn, meta["global_shape"])
    data = open(os.path.join(view, fqn, meta["chunks"][0]["file"]), "rb").read()
    assert data == raw(t), fqn
print("tensor view: %d tensors equal" % len(sd))

# torch loads it back through the mount.
back = {k: torch.empty_like(v) for k, v in sd.items()}
dcp.load(back, storage_reader=HuggingFaceStorageReader(path=ckpt))
for k in sd:
    assert torch.equal(back[k], sd[k]), k
print("HuggingFaceStorageReader: equal")

# A distributed-style save with consolidation: sharded files under cons/sharded, then
# consolidate_safetensors_files writes cons/model-*.safetensors (header, then appends).
# Floating-point tensors only: torch 2.14's consolidation sizes dtypes with torch.finfo,
# which raises on int64 (a torch bug, on a plain directory too).
sd = {k: v for k, v in sd.items() if v.is_floating_point()}
mapping = {k: (1 if i < 3 else 2) for i, k in enumerate(sd)}
dcp.save(sd, storage_writer=HuggingFaceStorageWriter(
    path=cons, fqn_to_index_mapping=mapping, save_distributed=True, enable_consolidation=True))
out = {}
for name in sorted(os.listdir(cons)):
    if name.endswith(".safetensors"):
        out.update(load_file(os.path.join(cons, name)))
assert sorted(out) == sorted(sd), sorted(out)
for k in sd:
    assert torch.equal(out[k], sd[k]), k
print("consolidated:", sorted(os.listdir(cons)))
"""


class TorchHfWriter(unittest.TestCase):
    def setUp(self):
        if os.geteuid() != 0:
            self.skipTest("chroot and mount need root")
        p = subprocess.run([os.path.join(REPO, "scripts", "torch_root.sh"), "sid"],
                           capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            self.skipTest(f"cannot build the torch sid root: {p.stderr.strip()[-300:]}")
        self.root = p.stdout.strip()
        # One user of the root's proc/sys/dev mounts at a time (as torch_dcp_suite.py).
        self.lock = open(self.root + ".use.lock", "w")
        self.addCleanup(self.lock.close)
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        mounts = RootMounts(self.root).__enter__()
        self.addCleanup(mounts.__exit__)
        self.tmp = tempfile.mkdtemp(prefix="ckptfs-e2e-st-", dir="/var/tmp")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        with open(os.path.join(self.root, "opt", "st_save.py"), "w") as f:
            f.write(SAVE)
        with open(os.path.join(self.root, "opt", "st_check.py"), "w") as f:
            f.write(CHECK)

    def chroot(self, *argv, timeout=300):
        with root_tmpdir(self.root) as tmp:
            env = ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "LANG=C.UTF-8",
                   "OMP_NUM_THREADS=1", "PYTHONDONTWRITEBYTECODE=1", f"TMPDIR={tmp}"]
            return subprocess.run(["chroot", self.root, "env", "-i", *env, *argv],
                                  capture_output=True, text=True, timeout=timeout)

    def test_hf_storage_writer_checkpoint_through_the_mount(self):
        m = Mount(args=["--durability", "async"], root=self.tmp)
        rel_mnt = f"mnt/ckptfs-st-{os.getpid()}"
        m.mnt = os.path.join(self.root, rel_mnt)
        os.makedirs(m.mnt, exist_ok=True)
        self.addCleanup(os.rmdir, m.mnt)
        self.addCleanup(m.stop)
        m.start()
        in_root = "/" + rel_mnt
        r = self.chroot("python3", "/opt/st_save.py", in_root + "/hf")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr[-3000:])
        sys.stderr.write("\n" + r.stdout)
        self.assertEqual(m.wait(os.path.join(m.mnt, "hf")), 0, m.log_text())
        settle(m)
        out = admin("checkpoints", m.mnt)
        sys.stderr.write("$ ckptfs-admin checkpoints MNT\n" + out.stdout)
        line = [l for l in out.stdout.splitlines() if "hf" in l.split()]
        self.assertTrue(line and "committed" in line[0], out.stdout)
        out = admin("ls", os.path.join(m.mnt, "hf"))
        sys.stderr.write("$ ckptfs-admin ls MNT/hf\n" + out.stdout)
        self.assertEqual(out.returncode, 0, out.stderr)
        out = admin("ls", "--json", os.path.join(m.mnt, "hf"))
        listed = {e["fqn"]: (e["dtype"], e["shape"]) for e in json.loads(out.stdout)}
        self.assertEqual(listed, {
            "embed.weight": ("float32", [256, 64]),
            "layers.0.attn.w": ("bfloat16", [128, 64]),
            "layers.0.mlp.w": ("float16", [64, 96]),
            "layers.1.attn.w": ("bfloat16", [128, 64]),
            "head.bias": ("int64", [32]),
        })

        r = self.chroot("python3", "/opt/st_check.py", in_root, in_root + "/hf",
                        in_root + "/cons")
        sys.stderr.write(r.stdout)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr[-3000:] + m.log_text())
        self.assertEqual(m.wait(os.path.join(m.mnt, "cons")), 0, m.log_text())
        settle(m)
        states = {c["path"]: c["state"] for c in m.checkpoints()}
        self.assertEqual(states.get("cons"), "committed", states)
        self.assertEqual(len(json.loads(admin("ls", "--json", os.path.join(m.mnt, "cons"))
                                        .stdout)), 4)

        out = admin("verify", os.path.join(m.mnt, "hf"))
        sys.stderr.write("$ ckptfs-admin verify MNT/hf\n" + out.stdout)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        shard = os.path.join(m.backing, "hf", "model-00002-of-00002.safetensors")
        with open(shard, "r+b") as f:
            blob = f.read()
            n = int.from_bytes(blob[:8], "little")
            at = 8 + n + json.loads(blob[8:8 + n])["head.bias"]["data_offsets"][0] + 9
            f.seek(at)
            f.write(bytes([blob[at] ^ 0xff]))
        out = admin("verify", os.path.join(m.mnt, "hf"))
        sys.stderr.write("$ ckptfs-admin verify MNT/hf   # one byte flipped\n" + out.stdout)
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertIn("BAD head.bias@0: checksum mismatch", out.stdout)
        self.assertEqual(m.unmount(), 0, m.log_text())


if __name__ == "__main__":
    unittest.main()
