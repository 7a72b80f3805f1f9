"""--metrics-listen: a Prometheus server can scrape http://ADDR:PORT/metrics.

The exposition is fetched with curl, as an operator would, and parsed with
python3-prometheus-client's parser, which rejects malformed text. After a real torch DCP
save through the mount has committed, the new series must be there with sane values:
ckptfs_build_info, ckptfs_last_commit_timestamp_seconds, the save-to-commit, staging-wait
and FUSE-op histograms (cumulative buckets, +Inf == _count), the mountpoint label on every
sample, and counters named with _total and units. A second daemon asking for the same port
fails to start with a clear message and leaves nothing mounted.
"""
import os
import socket
import subprocess
import time
import unittest

import dcp_tool
import harness
from harness import is_mounted

dcp_tool._apply_sitecustomize()
import torch  # noqa: E402
import torch.distributed._shard.checkpoint as dcp  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port):
    r = subprocess.run(["curl", "-sSf", "--max-time", "10", f"http://127.0.0.1:{port}/metrics"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise AssertionError(f"curl failed: {r.stderr}")
    return r.stdout


def families(text):
    return {f.name: f for f in text_string_to_metric_families(text)}


class MetricsHttpTest(harness.MountedTest):
    # The mount's watchdog (harness.MountedTest) only catches a hang: longer than any run.
    WATCHDOG_S = 1800
    def test_scrape_parses_and_has_the_operator_series(self):
        port = free_port()
        m = self.mount(args=["--metrics-listen", f"127.0.0.1:{port}"])
        start = time.time()
        ckpt = os.path.join(m.mnt, "run", "step10")
        state = {"w": torch.randn(256, 256), "b": torch.arange(1000)}
        dcp.save_state_dict(state, dcp.FileSystemWriter(ckpt), no_dist=True)
        self.assertEqual(m.wait(ckpt, timeout=60), 0)
        text = scrape(port)
        fam = families(text)
        for name in ("ckptfs_build_info", "ckptfs_written_bytes",
                     "ckptfs_published_bytes", "ckptfs_last_commit_timestamp_seconds",
                     "ckptfs_save_to_commit_seconds", "ckptfs_staging_wait_seconds",
                     "ckptfs_fuse_op_duration_seconds", "ckptfs_checkpoints",
                     "ckptfs_staging_limit_bytes", "ckptfs_errors"):
            self.assertIn(name, fam, sorted(fam))
        self.assertEqual(fam["ckptfs_written_bytes"].type, "counter")
        self.assertEqual(fam["ckptfs_save_to_commit_seconds"].type, "histogram")
        # Every sample carries the mountpoint.
        for f in fam.values():
            for s in f.samples:
                self.assertEqual(s.labels.get("mountpoint"), m.mnt, s)
        info = fam["ckptfs_build_info"].samples[0]
        self.assertEqual(info.value, 1)
        self.assertRegex(info.labels["version"], r"^\d+\.\d+\.\d+$")
        written = fam["ckptfs_written_bytes"].samples[0].value
        self.assertGreaterEqual(written, 256 * 256 * 4)
        last = fam["ckptfs_last_commit_timestamp_seconds"].samples[0].value
        self.assertGreaterEqual(last, start - 1)
        self.assertLessEqual(last, time.time() + 1)
        committed = [s for s in fam["ckptfs_checkpoints"].samples
                     if s.labels["state"] == "committed"]
        self.assertEqual(committed[0].value, 1)

        def histogram(name, **labels):
            samples = [s for s in fam[name].samples
                       if all(s.labels.get(k) == v for k, v in labels.items())]
            buckets = [s for s in samples if s.name.endswith("_bucket")]
            count = [s.value for s in samples if s.name.endswith("_count")][0]
            values = [b.value for b in buckets]
            self.assertEqual(values, sorted(values), f"{name} buckets not cumulative")
            self.assertEqual(buckets[-1].labels["le"], "+Inf")
            self.assertEqual(buckets[-1].value, count)
            return count

        self.assertEqual(histogram("ckptfs_save_to_commit_seconds"), 1)
        self.assertGreater(histogram("ckptfs_fuse_op_duration_seconds", op="write"), 0)
        self.assertGreater(histogram("ckptfs_fuse_op_duration_seconds", op="create"), 0)
        histogram("ckptfs_staging_wait_seconds")
        # The file in the mount is the same exposition, and parses too.
        with open(os.path.join(m.mnt, ".ckptfs", "metrics")) as f:
            self.assertIn("ckptfs_build_info", families(f.read()))
        # Counters only grow between scrapes.
        with open(os.path.join(m.mnt, "more"), "wb") as f:
            f.write(b"z" * 4096)
        again = families(scrape(port))
        self.assertGreaterEqual(again["ckptfs_written_bytes"].samples[0].value, written + 4096)
        fam = again  # a checkpoint is observed once, however often it is scraped
        self.assertEqual(histogram("ckptfs_save_to_commit_seconds"), 1)
        self.assertEqual(m.unmount(), 0, m.log_text())

    def test_port_in_use_fails_clearly(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            m = self.mount(args=["--metrics-listen", f"127.0.0.1:{port}"], start=False)
            with self.assertRaises(RuntimeError) as ctx:
                m.start(timeout=20)
            self.assertIn(f"127.0.0.1:{port}", str(ctx.exception))
            self.assertFalse(is_mounted(m.mnt))


if __name__ == "__main__":
    unittest.main()
