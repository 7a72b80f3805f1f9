"""Issue 23 across nodes: the retained checkpoint is replicated to a peer (--retain-replicas).

Two ckptfs daemons in network namespaces (tests/e2e/netns.py) over one backing dir, four
gloo ranks placed as a launcher places them (ranks 0-1 on node 0, 2-3 on node 1, the
writer-locality rule of docs/PEERS.md), torch DCP with one file per rank:
  * after the commit, each node's tier holds its own share and, in the background, a
    replica of the other node's share (node n's replica lives on node (n+1) mod 2);
  * a restart of the training job on the same daemons loads exact tensors with no byte
    read from the backing store on any node;
  * node 1's daemon killed and started fresh (empty tier, new state dir: a replaced node)
    loads its share from its replica holder (node 0): exact tensors, its holder counters
    cover the share, and the backing store is read only for what no survivor holds;
  * the replica holder killed too: node 1 still loads exact tensors, from the backing store
    (a fallback, never an error).
"""
import os
import shutil
import signal
import tempfile
import time
import unittest

import dcp_tool
from netns import Cluster

RANKS = 4
MB = 16
SEED = 4242
CKPT = "run/step1"


def retained(n):
    return n.stats().get("retained", {})


@unittest.skipUnless(os.geteuid() == 0, "needs root for network namespaces")
class RetainReplicas(unittest.TestCase):
    def setUp(self):
        root = tempfile.mkdtemp(prefix="ckptfs-retain-")
        self.addCleanup(shutil.rmtree, root, True)
        self.c = Cluster(2, root=root, daemon_args=["--retain-mem", "96M", "--cache-mem", "256M"])
        self.addCleanup(self.c.cleanup)
        self.c.setup()
        self.c.start()
        self.assertTrue(self.c.wait_connected(), self.logs())

    def logs(self):
        return "\n".join(f"--- node {n.index} ---\n{n.log_text(3000)}" for n in self.c.nodes)

    def dirs(self, nodes):
        # rank r on node r * k / RANKS, as torchrun places ranks.
        return [os.path.join(nodes[r * len(nodes) // RANKS].mnt, CKPT) for r in range(RANKS)]

    def eventually(self, cond, what, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if cond():
                return
            time.sleep(0.2)
        self.fail(f"{what}\n{self.logs()}")

    def backing_read(self):
        return [n.stats()["backing_bytes_read"] for n in self.c.nodes]

    def test_restart_same_daemons_fresh_node_and_dead_holder(self):
        n0, n1 = self.c.nodes
        dcp_tool.save(os.path.join(n0.mnt, CKPT), RANKS, MB, True, SEED, timeout=300,
                      dirs=self.dirs(self.c.nodes))
        for n in self.c.nodes:
            self.assertEqual(os.system(f"{os.path.dirname(__file__)}/../../build/bin/ckptfs-admin "
                                       f"wait {n.mnt}/{CKPT}/.metadata --timeout 60 >/dev/null"), 0)
        share = (MB << 20) // 2
        self.eventually(lambda: all(retained(n).get("replica_bytes", 0) >= share * 0.9
                                    for n in self.c.nodes),
                        "replicas not pulled in time")
        for n in self.c.nodes:
            self.assertGreaterEqual(retained(n)["retained_bytes"], share * 0.9)

        # (a) the job restarts on the same daemons.
        before = self.backing_read()
        dcp_tool.load(os.path.join(n0.mnt, CKPT), RANKS, "own", SEED, timeout=300,
                      dirs=self.dirs(self.c.nodes))
        after = self.backing_read()
        self.assertEqual([a - b for a, b in zip(after, before)], [0, 0], self.logs())
        # Every rank reads every tensor: this node's copy and the peer's replica serve it all.
        hits = [retained(n)["hit_bytes"] for n in self.c.nodes]
        dcp_tool.load(os.path.join(n0.mnt, CKPT), RANKS, "replicated", SEED, timeout=300,
                      dirs=self.dirs(self.c.nodes))
        self.assertEqual([a - b for a, b in zip(self.backing_read(), after)], [0, 0],
                         self.logs())
        for n, h in zip(self.c.nodes, hits):
            # At least the other node's share (this node's own may sit in the page cache
            # since the load above).
            self.assertGreaterEqual(retained(n)["hit_bytes"] - h, share * 0.9)
            # A checkpoint held in memory has no plan to wait for: no read waited for one
            # (each such wait held a read for a whole second).
            self.assertEqual(n.stats()["plan_wait_timeouts"], 0, self.logs())

        # (b) node 1 is replaced: a fresh daemon with an empty tier and a new state dir.
        n1.kill(signal.SIGKILL)
        n1.state = n1.state + "-fresh"
        n1.start()
        self.assertTrue(self.c.wait_connected(), self.logs())
        # Connections are made on demand: the fresh node's first cold read connects to its
        # replica holder.
        b1 = n1.stats()["backing_bytes_read"]
        b0 = n0.stats()["backing_bytes_read"]
        dcp_tool.load(os.path.join(n0.mnt, CKPT), RANKS, "own", SEED, timeout=300,
                      dirs=self.dirs(self.c.nodes))
        rep = retained(n1)["replication"]
        self.assertGreaterEqual(rep["holder_bytes"], share * 0.9, rep)
        self.assertTrue(rep["holder_connected"], rep)
        d1 = n1.stats()["backing_bytes_read"] - b1
        d0 = n0.stats()["backing_bytes_read"] - b0
        self.assertLess(d1 + d0, share // 4, (d0, d1, self.logs()))
        # The survivor holds its own share and node 1's replica: it plans nothing from the
        # backing store either (not even `.metadata`) when node 1 asks it for blocks.
        self.assertEqual(d0, 0, self.logs())

        # The replica holder dies as well: node 1 falls back to the backing store.
        n1.kill(signal.SIGKILL)
        n1.state = n1.state + "2"
        n1.start()
        n0.kill(signal.SIGKILL)
        dcp_tool.load(os.path.join(n1.mnt, CKPT), RANKS, "own", SEED, timeout=300,
                      dirs=[os.path.join(n1.mnt, CKPT)] * RANKS)
        self.assertGreaterEqual(n1.stats()["backing_bytes_read"], MB << 20)


if __name__ == "__main__":
    unittest.main()
