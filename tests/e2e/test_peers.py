"""Issue 12 end to end: ckptfs daemons in separate network namespaces cooperate over UCX.

One torch DCP checkpoint is saved once into a shared backing dir; then every node's ranks
load it through their own node's mount (a replicated load). Checked: every load is
byte-exact (dcp_tool verifies every value), the backing-store bytes summed over all daemons
are about one checkpoint (not K), a peer killed mid-load leaves the other loads to finish
from the backing store, and a daemon with the wrong secret is refused and logged while
its load still succeeds from the backing store.
"""
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import unittest

import dcp_tool
from harness import ADMIN, CKPTFS
from netns import Cluster

MB = 24        # checkpoint payload (dcp_tool --mb), per dtype set below
DTYPES = ("float32", "bfloat16")
SERVER_POOL_MAX = 64 << 20  # the server's buffer pool (peer_server.cc, kBufferCacheBytes)


def ckpt_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.endswith(".distcp"))


def backing_read(node):
    s = node.stats()
    return s.get("backing_bytes_read", 0)


def built_with_ucx():
    r = subprocess.run(["ldd", CKPTFS], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                       text=True)
    return "libucp" in r.stdout


@unittest.skipUnless(os.geteuid() == 0 and shutil.which("nsenter") and shutil.which("ip"),
                     "needs root, ip and nsenter")
@unittest.skipUnless(built_with_ucx(), "ckptfs was built without the UCX peer transport")
class PeersTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # Saved once, straight into what becomes the shared backing dir (plain files, G2).
        import tempfile
        cls.root = tempfile.mkdtemp(prefix="ckptfs-peers-")
        cls.backing = os.path.join(cls.root, "backing")
        cls.ckpt = os.path.join(cls.backing, "run", "iter_0000001")
        os.makedirs(cls.ckpt)
        dcp_tool.save(cls.ckpt, ranks=2, mb=MB, seed=7, dtypes=DTYPES, timeout=300)
        cls.size = ckpt_bytes(cls.ckpt)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.root, ignore_errors=True)

    def cluster(self, k, **kw):
        c = Cluster(k, root=os.path.join(self.root, f"c{self.id().split('.')[-1]}"),
                    backing=self.backing, **kw)
        os.makedirs(c.root, exist_ok=True)
        self.addCleanup(c.cleanup)
        c.setup()
        return c

    def load(self, node, results, key):
        try:
            results[key] = dcp_tool.load(os.path.join(node.mnt, "run", "iter_0000001"),
                                         ranks=1, mode="replicated", seed=7, timeout=240)
        except Exception as e:  # noqa: BLE001 - reported by the caller
            results[key] = e

    def parallel_loads(self, nodes):
        results, threads = {}, []
        for n in nodes:
            t = threading.Thread(target=self.load, args=(n, results, n.index))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        return results

    def assert_loaded(self, result, what):
        if isinstance(result, Exception):
            self.fail(f"{what}: {result}")
        self.assertGreater(result["bytes_verified"], 0, what)

    def test_replicated_load_reads_the_backing_store_once(self):
        c = self.cluster(3)
        c.start()
        self.assertTrue(c.wait_connected(), [n.log_text(2000) for n in c.nodes])
        before = [backing_read(n) for n in c.nodes]
        results = self.parallel_loads(c.nodes)
        for n in c.nodes:
            self.assert_loaded(results[n.index], f"node {n.index}\n{n.log_text(3000)}")
        stats = [n.stats() for n in c.nodes]
        read = [s["backing_bytes_read"] - b for s, b in zip(stats, before)]
        total = sum(read)
        print(f"\ncheckpoint {self.size} B; backing bytes per node {read}, total "
              f"{total / self.size:.2f}x; peer bytes "
              f"{[s['peer_bytes_read'] for s in stats]}", file=sys.stderr)
        # Without peers every node reads it all (3x); with them about once. The slack is
        # .metadata and index reads, and blocks two nodes' prefetches raced for.
        self.assertLess(total, 1.35 * self.size, read)
        self.assertGreater(total, 0.9 * self.size, read)
        for s in stats:
            self.assertEqual(s["peers_connected"], 2)
            self.assertGreater(s["peer_bytes_read"], 0)
            self.assertGreater(s["peer_bytes_served"], 0)
            self.assertEqual(s["peer_fallbacks"], 0, s["peers"])
            # The transport keeps the buffers of its fetches and replies for reuse, within
            # its bounds (64 MiB per open link and the server's own), and reports them.
            self.assertGreater(s["peers_buffer_pool_bytes"], 0, s)
            self.assertLessEqual(s["peers_buffer_pool_bytes"],
                                 s["peers_links_open"] * (64 << 20) + SERVER_POOL_MAX, s)
        self.assertEqual(sum(s["peer_bytes_read"] for s in stats),
                         sum(s["peer_bytes_served"] for s in stats))
        text = subprocess.run([ADMIN, "stats", c.nodes[0].mnt], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=30).stdout
        self.assertIn("2 of 2 connected (this node: rank 0)", text)
        self.assertIn("0 fallbacks to the backing store", text)
        with open(os.path.join(c.nodes[0].mnt, ".ckptfs", "metrics")) as f:
            metrics = f.read()
        self.assertIn("ckptfs_peer_read_bytes_total{", metrics)
        self.assertIn("ckptfs_peers_connected{", metrics)

    def test_a_load_on_one_node_starts_the_owners_prefetch(self):
        c = self.cluster(3)
        c.start()
        self.assertTrue(c.wait_connected())
        before = [backing_read(n) for n in c.nodes]
        results = self.parallel_loads([c.nodes[0]])  # nobody loads on nodes 1 and 2
        self.assert_loaded(results[0], c.nodes[0].log_text(3000))
        stats = [n.stats() for n in c.nodes]
        read = [s["backing_bytes_read"] - b for s, b in zip(stats, before)]
        self.assertLess(sum(read), 1.35 * self.size, read)
        for s in stats[1:]:
            # The first request from node 0 made the owner plan the checkpoint itself and
            # serve its share.
            self.assertGreaterEqual(s["peers"]["plans"], 1, s["peers"])
            self.assertEqual(s["peers"]["last_plan"]["checkpoint"], "run/iter_0000001")
        self.assertGreater(sum(s["peer_bytes_served"] for s in stats[1:]), 0)
        self.assertEqual(stats[0]["peer_bytes_read"],
                         sum(s["peer_bytes_served"] for s in stats[1:]))

    def test_peer_killed_mid_load_falls_back(self):
        # A throttled backing disk keeps the load running long enough to kill a peer in it.
        c = self.cluster(2, throttle_bps=6 << 20)
        c.start()
        self.assertTrue(c.wait_connected())
        survivor, victim = c.nodes
        results = {}
        t = threading.Thread(target=self.load, args=(survivor, results, 0))
        t.start()
        deadline = time.time() + 120
        while time.time() < deadline and survivor.stats()["peer_bytes_read"] == 0:
            time.sleep(0.05)
        self.assertGreater(survivor.stats()["peer_bytes_read"], 0, survivor.log_text())
        self.assertTrue(t.is_alive(), "the load ended before the peer could be killed")
        victim.kill(signal.SIGKILL)
        t.join()
        self.assert_loaded(results[0], "survivor\n" + survivor.log_text(3000))
        s = survivor.stats()
        self.assertGreater(s["peer_fallbacks"], 0, s["peers"])
        self.assertEqual(s["peers_connected"], 0)
        self.assertIn("its blocks go to their stand-ins or the backing store",
                      survivor.log_text(100000))

    def test_link_cut_mid_load_falls_back_on_the_other_nodes(self):
        # Node 2's cable is pulled while nodes 0 and 1 load replicated: its TCP connections
        # neither close nor answer, so the others' fetches from it wait one --peer-timeout
        # (3 s here), then read its share from the backing store.
        c = self.cluster(3, throttle_bps=6 << 20)
        c.start()
        self.assertTrue(c.wait_connected())
        cut = c.nodes[2]
        results, threads = {}, []
        t0 = time.monotonic()
        for n in c.nodes[:2]:
            t = threading.Thread(target=self.load, args=(n, results, n.index))
            t.start()
            threads.append(t)
        deadline = time.time() + 120
        while time.time() < deadline and \
                sum(n.stats()["peer_bytes_read"] for n in c.nodes[:2]) == 0:
            time.sleep(0.05)
        self.assertTrue(any(t.is_alive() for t in threads), "the loads ended before the cut")
        subprocess.run(["ip", "link", "set", cut.veth_host, "down"], check=True)
        for t in threads:
            t.join()
        took = time.monotonic() - t0
        for n in c.nodes[:2]:
            self.assert_loaded(results[n.index], f"node {n.index}\n{n.log_text(3000)}")
        stats = [n.stats() for n in c.nodes[:2]]
        fallbacks = [s["peers"]["fallbacks"] for s in stats]
        print(f"\nlink cut mid-load: loads {took:.1f} s, fallbacks {fallbacks}", file=sys.stderr)
        self.assertGreater(sum(s["peer_fallbacks"] for s in stats), 0, fallbacks)
        self.assertGreater(sum(f.get("timeout", 0) + f.get("connection", 0) for f in fallbacks),
                           0, fallbacks)
        # Node 2's blocks went to their stand-ins: each survivor read its half of them from
        # the backing store and fetched the other half from the other survivor (the same
        # choice on both, with no message), instead of both reading all of them.
        stand_ins = [(s["peers"]["stand_in_blocks"], s["peers"]["stand_in_local"]) for s in stats]
        print(f"stand-in blocks (fetched from the other survivor, read here): {stand_ins}",
              file=sys.stderr)
        self.assertGreater(sum(f for f, _ in stand_ins), 0, stand_ins)
        self.assertGreater(sum(h for _, h in stand_ins), 0, stand_ins)
        self.assertLess(took, 100)

    def test_hung_peer_times_out_and_falls_back(self):
        c = self.cluster(2)
        c.start()  # --peer-timeout 3000 (netns.py)
        self.assertTrue(c.wait_connected())
        survivor, hung = c.nodes
        os.kill(hung.proc.pid, signal.SIGSTOP)  # alive, connected, silent
        try:
            t0 = time.monotonic()
            results = self.parallel_loads([survivor])
            took = time.monotonic() - t0
        finally:
            os.kill(hung.proc.pid, signal.SIGCONT)
        self.assert_loaded(results[0], "survivor\n" + survivor.log_text(3000))
        s = survivor.stats()
        print(f"\nload with a hung peer: {took:.1f} s, fallbacks {s['peers']['fallbacks']}",
              file=sys.stderr)
        # Connections are made on demand: the survivor meets the hung peer at its first
        # read, as a connect that does not authenticate in time (3 s, or,
        # had a link been open, as a request timeout). Either way it is down from then on.
        f = s["peers"]["fallbacks"]
        self.assertGreater(f["timeout"] + f["peer_down"], 0, s["peers"])
        self.assertIn("Timeout", s["peers"]["peers"][0]["last_error"], s["peers"])
        self.assertEqual(s["peers"]["peers"][0]["state"], "down", s["peers"])
        self.assertEqual(s["peer_bytes_read"], 0)
        # One timeout, then the peer is skipped: far below one timeout per block.
        self.assertLess(took, 30)
        log = survivor.log_text(100000)
        self.assertTrue("its blocks go to their stand-ins or the backing store" in log or
                        "cannot connect" in log, log[-3000:])

    def test_wrong_secret_is_refused_and_the_load_uses_the_backing_store(self):
        c = self.cluster(2)
        c.start(secrets={1: c.wrong_secret_file})
        good, bad = c.nodes
        time.sleep(2)  # both connectors have tried by now
        before = backing_read(bad)
        results = self.parallel_loads([bad])
        self.assert_loaded(results[1], "node with the wrong secret\n" + bad.log_text(3000))
        sg, sb = good.stats(), bad.stats()
        self.assertEqual(sg["peers_connected"], 0)
        self.assertEqual(sb["peers_connected"], 0)
        self.assertGreaterEqual(sg["peer_refused"], 1)
        self.assertEqual(sg["peer_bytes_served"], 0)
        self.assertEqual(sb["peer_bytes_read"], 0)
        self.assertIn("wrong shared secret", good.log_text(100000))
        self.assertGreaterEqual(sb["backing_bytes_read"] - before, self.size)

    def test_bad_peer_options_fail_clearly(self):
        mnt = os.path.join(self.root, "badmnt")
        os.makedirs(mnt, exist_ok=True)
        secret = os.path.join(self.root, "s")
        with open(secret, "w") as f:
            f.write("0123456789abcdef0123")
        os.chmod(secret, 0o600)
        cases = [
            (["--peers", "a:1,a:1", "--node-rank", "0", "--peer-secret-file", secret],
             "listed twice"),
            (["--peers", "a:99999", "--node-rank", "0", "--peer-secret-file", secret],
             "bad port"),
            (["--peers", "a:1,b:2", "--node-rank", "5", "--peer-secret-file", secret],
             "out of range"),
            (["--peers", "a:1,b:2", "--node-rank", "0"], "--peer-secret-file"),
            (["--peers", "a:1,b:2", "--node-rank", "0", "--peer-secret-file", "/nonexistent"],
             "--peer-secret-file /nonexistent"),
            (["--peers-file", "/nonexistent", "--node-rank", "0", "--peer-secret-file", secret],
             "--peers-file /nonexistent"),
            (["--node-rank", "1"], "need --peers"),
        ]
        for args, want in cases:
            r = subprocess.run([CKPTFS, "-f"] + args + [self.backing, mnt],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               timeout=30)
            self.assertEqual(r.returncode, 2, (args, r.stdout))
            self.assertIn(want, r.stdout, args)


if __name__ == "__main__":
    unittest.main()
