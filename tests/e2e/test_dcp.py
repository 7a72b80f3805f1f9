"""Real 4-rank torch DCP (gloo, row-sharded ShardedTensors) saved through a ckptfs mount.

For each durability mode (async, strict) and each FileSystemWriter layout
(single_file_per_rank True / False):
  * the save succeeds through the mount;
  * strict: as soon as save_state_dict returns, the backing directory already
    holds exactly the checkpoint (fsync/close/rename return only once published);
  * a load through the mount returns the expected tensors (async: right after
    the save, before anything need be published, G3), and every file read
    through the mount is byte-identical to a direct save (G1);
  * `ckptfs-admin wait` returns 0, /.ckptfs/checkpoints says committed, the
    .metadata xattr says published, and the backing directory then holds
    exactly the files of a direct save of the same state into a plain
    directory, byte for byte (G1, G5);
  * the async per-item case runs with 8 MiB of staging for a 16 MiB save, so
    the ranks' writes wait for the flush (G6) and must still be byte-exact;
  * after a clean unmount, a load straight from the backing directory (no
    ckptfs, one rank reading all chunks) returns the expected tensors (G2).

The reference is a direct dcp_tool save of the same state (same seed) into a
plain directory. .metadata is compared too: torch 1.13 pickles Metadata built
from the gathered plans in rank order, with relative file names only and no
paths, times or random ids, so it is a pure function of the state and the rank
count. test_direct_saves_are_deterministic checks that premise, so a failure
there points at the reference, not at ckptfs.
"""
import os
import shutil
import tempfile
import unittest

import dcp_tool
import harness

RANKS = 4
MB = 16
SEED = 1234
TMP_MARK = ".ckptfs-tmp."


class DcpThroughMount(harness.MountedTest):
    # The mount's watchdog (harness.MountedTest) only catches a hang: longer than any run.
    WATCHDOG_S = 1800
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="ckptfs-dcp-ref-")
        cls.refs = {}

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def reference(self, single_file_per_rank):
        """{file name: sha256} of a direct save of the test state, made once per layout."""
        if single_file_per_rank not in self.refs:
            d = os.path.join(self.tmp, f"ref_sfpr{int(single_file_per_rank)}")
            dcp_tool.save(d, RANKS, MB, single_file_per_rank, SEED, timeout=300)
            self.refs[single_file_per_rank] = dcp_tool.sha256_tree(d)
        return self.refs[single_file_per_rank]

    def test_direct_saves_are_deterministic(self):
        d = os.path.join(self.tmp, "again")
        dcp_tool.save(d, RANKS, MB, True, SEED, timeout=300)
        self.assertEqual(dcp_tool.sha256_tree(d), self.reference(True))
        self.assertIn(".metadata", self.reference(True))

    def run_case(self, durability, single_file_per_rank, mount_load_mode, staging="256M"):
        ref = self.reference(single_file_per_rank)
        ref_backing = {os.path.join("ckpt", k): v for k, v in ref.items()}
        m = self.mount(args=["--durability", durability], staging=staging)
        try:
            ckpt = os.path.join(m.mnt, "ckpt")
            dcp_tool.save(ckpt, RANKS, MB, single_file_per_rank, SEED, timeout=300)
            if durability == "strict":
                self.assertEqual(dcp_tool.sha256_tree(m.backing), ref_backing,
                                 "strict: backing must hold the checkpoint when save returns")

            dcp_tool.load(ckpt, RANKS, mount_load_mode, SEED, timeout=300)
            self.assertEqual(dcp_tool.sha256_tree(ckpt), ref, "bytes read through the mount")

            self.assertEqual(m.wait(ckpt, timeout=120), 0, "ckptfs-admin wait")
            states = {c["path"]: c for c in m.checkpoints()}
            self.assertIn("ckpt", states, f"/.ckptfs/checkpoints: {states}")
            self.assertEqual(states["ckpt"]["state"], "committed", states["ckpt"])
            xattr = os.getxattr(os.path.join(ckpt, ".metadata"), "user.ckptfs.state")
            self.assertEqual(xattr.rstrip(b"\0"), b"published")
            self.assertEqual(dcp_tool.sha256_tree(m.backing), ref_backing,
                             "backing after commit")

            self.assertEqual(m.unmount(), 0, "daemon exit code after a clean unmount")
            self.assertEqual(dcp_tool.sha256_tree(m.backing), ref_backing,
                             "backing after unmount")
            # One rank reading every chunk checks every value and starts 3 fewer torches.
            dcp_tool.load(os.path.join(m.backing, "ckpt"), 1, "own", SEED, timeout=300)
        except BaseException as e:
            raise AssertionError(f"{e}\n--- ckptfs log tail ---\n{m.log_text()}") from e

    def test_async_single_file_per_rank(self):
        self.run_case("async", True, "own")

    def test_async_file_per_item_under_staging_backpressure(self):
        # 8 MiB of staging for a 16 MiB save: writers wait for the flush (G6), bytes stay exact.
        self.run_case("async", False, "replicated", staging="8M")

    def test_strict_single_file_per_rank(self):
        self.run_case("strict", True, "reshard")

    def test_strict_file_per_item(self):
        self.run_case("strict", False, "own")


if __name__ == "__main__":
    unittest.main()
