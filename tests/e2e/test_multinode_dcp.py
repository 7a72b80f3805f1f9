"""Issue 12 end to end: one torch DCP checkpoint saved and loaded through several nodes.

K ckptfs daemons, each in its own network namespace (tests/e2e/netns.py), cooperate over
UCX above ONE shared backing dir, as daemons on K nodes above a parallel file system. Four
gloo ranks, separate processes, are spread over the nodes: rank r saves and loads through
mount r % K. So the coordinator's mount makes the checkpoint directory and publishes
`.metadata`, while the other mounts write shards into a directory they did not make.

For each durability mode (async, strict), with one file per rank, and once (K=3, async) with
torch 1.13's default of one file per item:
  * the save through all mounts succeeds, and the directory made through one mount is
    usable (mkdir from every mount too: idempotent, nothing halts publication; a mkdir
    behind a queued 32 MiB publication is visible through the other mounts when it returns);
  * a tracker file written through a node other than the coordinator's, right after the
    save, never appears on the backing store before `.metadata` (G4 across nodes);
  * `ckptfs-admin wait` on every node returns 0 only once the backing store holds
    `.metadata` and every shard (G5 across nodes), and no temporary file is left;
  * loads through all mounts verify every value: own shards, replicated (every rank reads
    everything), reshard (2 ranks);
  * the backing dir alone loads (G2);
  * every node lists the checkpoint as committed, also those that wrote only shards; a
    second save into the same directory (a shard rewritten in place through node 1) is
    not committed on node 1 by the first save's `.metadata`, and is once node 0
    publishes the new one;
  * the coordinator's commit asked the other daemons over UCX (the commit query,
    docs/PEERS.md) instead of polling the backing store: its stats show
    peer_commit_queries > 0 and no commit poll (commit_gate.commit_polls == 0).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import dcp_tool
from harness import ADMIN
from netns import Cluster
from test_peers import built_with_ucx

RANKS = 4
MB = 8
SEED = 77
CKPT = os.path.join("run", "iter_0000001")
TRACKER = os.path.join("run", "latest_checkpointed_iteration.txt")
TMP_MARK = ".ckptfs-tmp."


@unittest.skipUnless(os.geteuid() == 0 and shutil.which("nsenter") and shutil.which("ip"),
                     "needs root, ip and nsenter")
@unittest.skipUnless(built_with_ucx(), "ckptfs was built without the UCX peer transport")
class MultiNodeDcp(unittest.TestCase):
    def cluster(self, k, durability):
        root = tempfile.mkdtemp(prefix="ckptfs-mndcp-")
        self.addCleanup(shutil.rmtree, root, True)
        c = Cluster(k, root=root, daemon_args=["--durability", durability])
        self.addCleanup(c.cleanup)
        c.setup()
        c.start()
        self.assertTrue(c.wait_connected(), [n.log_text(2000) for n in c.nodes])
        return c

    def logs(self, c):
        return "\n".join(f"--- node {n.index} log ---\n{n.log_text(4000)}" for n in c.nodes)

    def watch_tracker(self, backing, stop, violations):
        """Polls the backing store: the tracker must never be there without .metadata."""
        tracker = os.path.join(backing, TRACKER)
        metadata = os.path.join(backing, CKPT, ".metadata")
        while not stop.is_set():
            if os.path.exists(tracker) and not os.path.exists(metadata):
                violations.append(time.monotonic())
                return
            time.sleep(0.002)

    def run_case(self, k, durability, per_rank=True):
        c = self.cluster(k, durability)
        try:
            self._run_case(c, durability, per_rank)
        except BaseException as e:
            raise AssertionError(f"{e}\n{self.logs(c)}") from e

    def _run_case(self, c, durability, per_rank):
        k = c.k
        dirs = [os.path.join(n.mnt, CKPT) for n in c.nodes]
        backing_ckpt = os.path.join(c.backing, CKPT)

        # mkdir of one directory from every mount at once: each mount succeeds or says
        # EEXIST; neither may halt its node's publication.
        errors = []

        def mk(n):
            try:
                os.makedirs(os.path.join(n.mnt, "run", "shared"), exist_ok=True)
                with open(os.path.join(n.mnt, "run", "shared", f"from{n.index}"), "w") as f:
                    f.write(f"node {n.index}\n")
            except OSError as e:
                errors.append((n.index, e))
        ts = [threading.Thread(target=mk, args=(n,)) for n in c.nodes]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        self.assertEqual(errors, [])

        # A directory made through one mount is there for the others once mkdir returns,
        # even behind a large publication queued first (DCP's coordinator makes the
        # checkpoint directory, then ranks on other nodes create their shards in it).
        with open(os.path.join(c.nodes[0].mnt, "run", "big"), "wb") as f:
            f.write(os.urandom(32 << 20))
        os.mkdir(os.path.join(c.nodes[0].mnt, "run", "made_on_0"))
        for n in c.nodes[1:]:
            self.assertTrue(os.path.isdir(os.path.join(n.mnt, "run", "made_on_0")),
                            f"node {n.index} does not see the directory node 0 made")

        t0 = time.monotonic()
        dcp_tool.save(dirs[0], RANKS, MB, per_rank, SEED, timeout=120, dirs=dirs)
        save_s = time.monotonic() - t0

        stop, violations = threading.Event(), []
        watcher = threading.Thread(target=self.watch_tracker,
                                   args=(c.backing, stop, violations))
        watcher.start()
        try:
            # The training loop's tracker, written through the last node, not the one that
            # published .metadata.
            with open(os.path.join(c.nodes[-1].mnt, TRACKER), "w") as f:
                f.write("1")
            if durability == "strict":
                self.assertTrue(os.path.exists(os.path.join(backing_ckpt, ".metadata")),
                                "strict: .metadata must be published when the save returns")

            # wait on every node, the non-coordinators first.
            for n in reversed(c.nodes):
                r = subprocess.run([ADMIN, "wait", os.path.join(n.mnt, CKPT), "--timeout", "60"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   timeout=90)
                self.assertEqual(r.returncode, 0, f"ckptfs-admin wait on node {n.index}: "
                                                  f"{r.stdout}")
                names = set(os.listdir(backing_ckpt))
                want = {".metadata"} | {f"__{i}_0.distcp" for i in range(RANKS)}
                self.assertTrue(want <= names,
                                f"wait on node {n.index} returned, backing holds {sorted(names)}")
            deadline = time.monotonic() + 30
            while not os.path.exists(os.path.join(c.backing, TRACKER)) and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            stop.set()
            watcher.join()
        self.assertEqual(violations, [], "the tracker reached the backing store before "
                                         "the checkpoint's .metadata")
        with open(os.path.join(c.backing, TRACKER)) as f:
            self.assertEqual(f.read(), "1")
        shared = sorted(os.listdir(os.path.join(c.backing, "run", "shared")))
        self.assertEqual(shared, [f"from{i}" for i in range(k)])

        states = {}
        with open(os.path.join(c.nodes[0].mnt, ".ckptfs", "checkpoints")) as f:
            states = {x["path"]: x for x in json.load(f)}
        self.assertEqual(states.get(CKPT, {}).get("state"), "committed", states)

        # The coordinator learned of the other nodes' shards from their daemons: asked
        # (peer_commit_queries), answered durable or pending, no backing-store polling.
        with open(os.path.join(c.nodes[0].mnt, ".ckptfs", "stats")) as f:
            stats = json.load(f)
        gate = stats["commit_gate"]
        print(f"\nK={k} {durability}: node 0 commit gate: {json.dumps(gate)}", file=sys.stderr)
        self.assertGreater(stats["peer_commit_queries"], 0, gate)
        answers = gate["peer_commit_answers"]
        self.assertGreater(answers["durable"] + answers["pending"], 0, gate)
        self.assertEqual(gate["commit_polls"], 0, gate)
        self.assertEqual(stats["remote_polls"], 0, gate)
        self.assertGreaterEqual(gate["peer_confirmed"], 1, gate)

        t1 = time.monotonic()
        own = dcp_tool.load(dirs[0], RANKS, "own", SEED, timeout=120, dirs=dirs)
        rep = dcp_tool.load(dirs[0], RANKS, "replicated", SEED, timeout=120, dirs=dirs)
        res = dcp_tool.load(dirs[0], 2, "reshard", SEED, timeout=120, dirs=dirs)
        load_s = time.monotonic() - t1
        for what, r in (("own", own), ("replicated", rep), ("reshard", res)):
            self.assertGreater(r["bytes_verified"], 0, what)

        leftovers = [os.path.join(d, f) for d, _, fs in os.walk(c.backing) for f in fs
                     if TMP_MARK in f]
        self.assertEqual(leftovers, [])
        # G2: the backing dir alone, one rank reading every chunk.
        dcp_tool.load(backing_ckpt, 1, "own", SEED, timeout=120)
        self.check_resave_states(c, backing_ckpt)
        print(f"\nK={k} {durability}: save {save_s:.1f} s, 3 loads {load_s:.1f} s",
              file=sys.stderr)

    @staticmethod
    def ckpt_state(n):
        with open(os.path.join(n.mnt, ".ckptfs", "checkpoints")) as f:
            return {x["path"]: x for x in json.load(f)}.get(CKPT, {}).get("state")

    @staticmethod
    def progress(n, path):
        return json.loads(os.getxattr(os.path.join(n.mnt, path), "user.ckptfs.progress"))

    def check_resave_states(self, c, backing_ckpt):
        """Every node lists the checkpoint as committed, also those that only wrote shards
        (their daemon never publishes its .metadata). Then a second save into the same
        directory, by hand: node 1 rewrites its shard in place while the first save's
        .metadata is still on the backing store. Node 1 must not call the checkpoint
        committed before node 0 publishes the new .metadata, and must after."""
        for n in c.nodes:
            self.assertEqual(self.ckpt_state(n), "committed", f"node {n.index}")
        n0, n1 = c.nodes[0], c.nodes[1]
        shard = os.path.join(CKPT, "__1_0.distcp")  # rank 1 saves through mount 1
        with open(os.path.join(c.backing, shard), "rb") as f:
            shard_bytes = f.read()
        with open(os.path.join(backing_ckpt, ".metadata"), "rb") as f:
            metadata = f.read()
        with open(os.path.join(n1.mnt, shard), "wb") as f:  # O_TRUNC of an existing shard
            f.write(shard_bytes)
            f.flush()
            self.assertEqual(self.ckpt_state(n1), "writing")
        r = subprocess.run([ADMIN, "wait", os.path.join(n1.mnt, shard), "--timeout", "60"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=90)
        self.assertEqual(r.returncode, 0, r.stdout)
        self.assertEqual(self.ckpt_state(n1), "writing",
                         "the first save's .metadata does not commit the second")
        p = self.progress(n1, CKPT)
        self.assertEqual((p["state"], p.get("waiting_for")),
                         ("pending", ".metadata from another node"), p)
        with open(os.path.join(n0.mnt, CKPT, ".metadata"), "wb") as f:
            f.write(metadata)
        r = subprocess.run([ADMIN, "wait", os.path.join(n1.mnt, CKPT), "--timeout", "60"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=90)
        self.assertEqual(r.returncode, 0, r.stdout)
        self.assertEqual(self.ckpt_state(n1), "committed")
        self.assertEqual(self.progress(n1, CKPT)["state"], "committed")

    def test_tracker_and_delete_wait_for_a_commit_on_another_node(self):
        # Deterministic: node 1 publishes a shard of run/ck, then writes a tracker and
        # deletes an old file; nothing may reach the backing store until node 0 publishes
        # run/ck/.metadata. (In the DCP cases the coordinator usually commits first.)
        c = self.cluster(2, "async")
        m0, m1 = c.nodes[0].mnt, c.nodes[1].mnt
        b = c.backing

        def eventually(cond, what, timeout=20):
            deadline = time.monotonic() + timeout
            while not cond():
                if time.monotonic() > deadline:
                    self.fail(f"{what}\n{self.logs(c)}")
                time.sleep(0.05)

        os.makedirs(os.path.join(m1, "run", "ck"))
        with open(os.path.join(m1, "run", "old.txt"), "w") as f:
            f.write("old")
        eventually(lambda: os.path.exists(os.path.join(b, "run", "old.txt")), "old.txt")
        with open(os.path.join(m1, "run", "ck", "__1_0.distcp"), "wb") as f:
            f.write(os.urandom(1 << 20))
        eventually(lambda: os.path.exists(os.path.join(b, "run", "ck", "__1_0.distcp")),
                   "the shard")
        with open(os.path.join(m1, "run", "latest.txt"), "w") as f:
            f.write("ck")
        os.unlink(os.path.join(m1, "run", "old.txt"))
        r = subprocess.run([ADMIN, "wait", os.path.join(m1, "run", "ck"), "--timeout", "1"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=30)
        self.assertNotEqual(r.returncode, 0, "wait on node 1 before any .metadata: " + r.stdout)
        time.sleep(1.5)
        self.assertFalse(os.path.exists(os.path.join(b, "run", "latest.txt")),
                         "tracker published before the checkpoint was committed")
        self.assertTrue(os.path.exists(os.path.join(b, "run", "old.txt")),
                        "old file deleted before the checkpoint was committed")
        self.assertEqual(os.listdir(os.path.join(m1, "run")).count("old.txt"), 0,
                         "the mount shows the delete at once")
        # Node 0 commits (a .metadata it cannot parse commits by order alone).
        with open(os.path.join(m0, "run", "ck", ".metadata"), "wb") as f:
            f.write(b"not a DCP metadata")
        eventually(lambda: os.path.exists(os.path.join(b, "run", "latest.txt")),
                   "tracker after the commit")
        eventually(lambda: not os.path.exists(os.path.join(b, "run", "old.txt")),
                   "delete after the commit")
        self.assertTrue(os.path.exists(os.path.join(b, "run", "ck", ".metadata")))
        r = subprocess.run([ADMIN, "wait", os.path.join(m1, "run", "ck"), "--timeout", "30"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout)

    def test_a_commit_waits_for_a_pending_shard_by_asking_its_writer(self):
        # Node 1 writes every shard of a checkpoint and keeps the last one open; node 0
        # publishes the `.metadata`. Node 0's gate learns "pending" from node 1's daemon
        # (long-poll), never polls the backing store, and commits right after node 1 closes
        # the shard (its durability ends the held query).
        c = self.cluster(2, "async")
        m0, m1, b = c.nodes[0].mnt, c.nodes[1].mnt, c.backing
        fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures",
                               "dcp", "torch113_4rank_single_file")
        ck = os.path.join("run", "pending")
        os.makedirs(os.path.join(m0, ck))
        deadline = time.monotonic() + 20
        while not os.path.isdir(os.path.join(b, ck)) and time.monotonic() < deadline:
            time.sleep(0.02)

        def shard(i):
            with open(os.path.join(fixture, f"__{i}_0.distcp"), "rb") as f:
                return f.read()
        for i in range(3):
            with open(os.path.join(m1, ck, f"__{i}_0.distcp"), "wb") as f:
                f.write(shard(i))
        last = open(os.path.join(m1, ck, "__3_0.distcp"), "wb")
        try:
            last.write(shard(3))
            last.flush()
            with open(os.path.join(fixture, ".metadata"), "rb") as f:
                md = f.read()
            with open(os.path.join(m0, ck, ".metadata"), "wb") as f:
                f.write(md)
            time.sleep(2.0)
            self.assertFalse(os.path.exists(os.path.join(b, ck, ".metadata")),
                             "G5: .metadata published while a shard is still open elsewhere")
        finally:
            last.close()
        closed = time.monotonic()
        deadline = closed + 30
        while not os.path.exists(os.path.join(b, ck, ".metadata")):
            self.assertLess(time.monotonic(), deadline, self.logs(c))
            time.sleep(0.005)
        latency = time.monotonic() - closed
        with open(os.path.join(m0, ".ckptfs", "stats")) as f:
            gate = json.load(f)["commit_gate"]
        print(f"\npending shard: .metadata on the backing store {latency * 1000:.0f} ms after "
              f"the last shard's close; node 0 commit gate: {json.dumps(gate)}", file=sys.stderr)
        self.assertGreater(gate["peer_commit_answers"]["pending"], 0, (gate, self.logs(c)))
        self.assertEqual(gate["commit_polls"], 0, gate)
        self.assertEqual(gate["peer_confirmed"], 4, gate)
        self.assertLess(latency, 10, gate)

    def test_k2_async(self):
        self.run_case(2, "async")

    def test_k2_strict(self):
        self.run_case(2, "strict")

    def test_k3_async(self):
        self.run_case(3, "async")

    def test_k3_strict(self):
        self.run_case(3, "strict")

    def test_k3_async_per_item(self):
        # torch 1.13's default layout: one file per item (__<rank>_<n>.distcp), so each
        # node publishes many shards and the commit query asks about many paths.
        self.run_case(3, "async", per_rank=False)


if __name__ == "__main__":
    unittest.main()
