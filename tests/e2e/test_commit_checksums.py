"""Issue 39, checksums with the commit: no node reads another node's data back after a save.

K = 4 ckptfs daemons in network namespaces (tests/e2e/netns.py) over ONE backing dir, one
gloo rank per node (rank r saves through mount r), a 256 MiB torch DCP checkpoint. Node 0
publishes `.metadata` and indexes the checkpoint; the other nodes' shards come with their
writers' block CRCs over the commit query (docs/PEERS.md, "Checksums with the commit"), so:
  * after the save and once every daemon's backing reads have stopped growing (the index
    build has settled), no node has read more than 2 % of the checkpoint's bytes from the
    backing store (`backing_bytes_read` in each `/.ckptfs/stats`), the coordinator included;
  * node 0's commit gate got block CRCs with the other nodes' durable answers
    (`commit_gate.peer_checksums`), and >= 99 % of the checkpoint's items carry a checksum
    at commit (`ckptfs-admin verify --json` on node 0: items, unchecked);
  * those checksums are right: the same verify (a full re-read, after the measurement)
    finds no bad key, and every rank loads every value back.
Before issue 39 the coordinator read 0.97x the checkpoint here (every other node's shards).
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import dcp_tool
from harness import ADMIN
from netns import Cluster
from test_peers import built_with_ucx

K = 4
MB = int(os.environ.get("CKPTFS_COMMIT_CRC_MB", "256"))
SEED = 39
CKPT = os.path.join("run", "iter_0000001")


@unittest.skipUnless(os.geteuid() == 0 and shutil.which("nsenter") and shutil.which("ip"),
                     "needs root, ip and nsenter")
@unittest.skipUnless(built_with_ucx(), "ckptfs was built without the UCX peer transport")
class CommitChecksums(unittest.TestCase):
    def run_case(self, per_rank):
        root = tempfile.mkdtemp(prefix="ckptfs-crc-")
        self.addCleanup(shutil.rmtree, root, True)
        c = Cluster(K, root=root)
        self.addCleanup(c.cleanup)
        c.setup()
        c.start()
        self.assertTrue(c.wait_connected(), [n.log_text(2000) for n in c.nodes])
        try:
            self._run_case(c, per_rank)
        except BaseException as e:
            logs = "\n".join(f"--- node {n.index} log ---\n{n.log_text(4000)}" for n in c.nodes)
            raise AssertionError(f"{e}\n{logs}") from e

    @staticmethod
    def backing_reads(c):
        return [n.stats()["backing_bytes_read"] for n in c.nodes]

    def settle(self, c, quiet_s=3.0, timeout=120):
        """Backing reads of every node, once none has grown for quiet_s."""
        last, since = self.backing_reads(c), time.monotonic()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = self.backing_reads(c)
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return now
        self.fail(f"backing reads still growing after {timeout} s: {last}")

    def _run_case(self, c, per_rank):
        dirs = [os.path.join(n.mnt, CKPT) for n in c.nodes]
        os.makedirs(os.path.join(c.nodes[0].mnt, "run"))
        before = self.settle(c, quiet_s=1.0)
        t0 = time.monotonic()
        dcp_tool.save(dirs[0], K, MB, per_rank, SEED, timeout=600, dirs=dirs)
        save_s = time.monotonic() - t0
        r = subprocess.run([ADMIN, "wait", dirs[0], "--timeout", "120"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=150)
        self.assertEqual(r.returncode, 0, r.stdout)
        # The index build on node 0 is logged once done; then nothing more may be read.
        deadline = time.monotonic() + 120
        indexed = None
        while indexed is None and time.monotonic() < deadline:
            with open(c.nodes[0].log) as f:
                indexed = re.search(r"key index: indexed '" + re.escape(CKPT) +
                                    r"': (\d+) items.*checksums: (\d+) from write-path blocks, "
                                    r"(\d+) read \((\d+) bytes\), (\d+) none", f.read())
            time.sleep(0.2)
        self.assertIsNotNone(indexed, "node 0 never indexed the checkpoint")
        after = self.settle(c)

        backing = os.path.join(c.backing, CKPT)
        ckpt_bytes = sum(os.path.getsize(os.path.join(backing, f)) for f in os.listdir(backing))
        read = [a - b for a, b in zip(after, before)]
        gate = c.nodes[0].stats()["commit_gate"]
        items, from_blocks, read_items, read_bytes, none = map(int, indexed.groups())
        layout = "file per rank" if per_rank else "file per item"
        print(f"\nK={K} {MB} MiB {layout}: save {save_s:.1f} s, checkpoint {ckpt_bytes} B; "
              f"backing bytes read per node after the save: {read} "
              f"({', '.join(f'{x / ckpt_bytes:.4f}x' for x in read)}); node 0 index: {items} "
              f"items, {from_blocks} from block CRCs, {read_items} read ({read_bytes} B), "
              f"{none} without; peer_checksums {gate['peer_checksums']}", file=sys.stderr)
        for i, x in enumerate(read):
            self.assertLessEqual(x, 0.02 * ckpt_bytes,
                                 f"node {i} read {x} B of a {ckpt_bytes} B checkpoint back")
        self.assertGreaterEqual(gate["peer_checksums"], K - 1, gate)
        self.assertEqual(read_items, 0)

        r = subprocess.run([ADMIN, "verify", dirs[0], "--json"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=300)
        report = json.loads(r.stdout)
        self.assertEqual(report["bad_count"], 0, report)
        checked = report["items"] - report["unchecked"]
        print(f"verify on node 0: {report['items']} items, {report['unchecked']} unchecked",
              file=sys.stderr)
        self.assertGreaterEqual(checked, 0.99 * report["items"], report)
        dcp_tool.load(dirs[0], K, "own", SEED, timeout=300, dirs=dirs)

    def test_k4_file_per_rank(self):
        self.run_case(per_rank=True)

    def test_k4_file_per_item(self):
        self.run_case(per_rank=False)


if __name__ == "__main__":
    unittest.main()
