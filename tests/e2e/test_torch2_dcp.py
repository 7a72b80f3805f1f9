"""PyTorch 2.x's own DCP tests pass with their TMPDIR on a ckptfs mount (issue 19).

scripts/bench/torch_dcp_suite.py runs test/distributed/checkpoint/
test_file_system_checkpoint_cpu.py of the torch 2.6 release (8 of its 12 tests: see
SELECT), unmodified, inside a cached Debian trixie root (scripts/torch_root.sh: debootstrap
once, then python3-torch from the archive; the tests from the release's source tarball),
2 rounds each against a mount in
--durability async and in --durability strict (the two modes at the same time, each with
its own daemon and mount inside the root). Every round must pass (no failure, no
timeout), after each round the daemon must be up and its journal drained within 60 s
(not halted, nothing pending: on the daemon before the G10 gate fix a second save into
test_load_with_different_shard_plan_thread_count_2's directory stayed pending forever), and
`ckptfs-admin unmount` must end it with exit code 0.

A hang (no test started or finished for 150 s) fails the test with the test that was
running, the native stacks of the ranks and the daemon's pending/halted state and gate
log lines, except when the stacks show torch's own deadlock (the Gloo process group's
destructor joining a worker that waits for the GIL, seen with torch 2.6 on Python 3.13)
while the daemon had nothing pending: that file is run once more, and must pass then.

Measured on 2 shared cores: 226 s with the root cached (2 rounds of about 110 s, the two
modes at once), plus about 3 min to build the root on a fresh machine. Bounded: building
the root up to 600 s, the suite 900 s. Skips, saying why, when not root, or when the Debian
archive cannot be reached to build the root.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

from harness import BIN_DIR
import torch_roots  # noqa: E402  (builds the cached torch 2.x roots)

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SUITE = os.path.join(REPO, "scripts", "bench", "torch_dcp_suite.py")
FILE = "test_file_system_checkpoint_cpu.py"
# FILE's tests but test_load_rowwise_to_colwise_* and test_save_load_bytes_*, which hang in
# torch itself (about every other run of the first, often twice in a row for the second),
# on a plain directory too: the Gloo process group's destructor joins a worker that waits
# for the GIL. The benchmark (torch_dcp_suite.py) still runs them, with that deadlock
# recognised from the ranks' stacks and retried.
SELECT = ["test_load_with_different_shard_plan",
          "test_switch_between_sharded_tensor_to_tensor", "test_read_write_only_tensor",
          "test_read_write_shard_tensor"]
ROUNDS = 2


class Torch2DcpTest(unittest.TestCase):
    def setUp(self):
        torch_roots.build_root(self, "trixie")  # skips, saying why, where it cannot be built
        self.tmp = tempfile.mkdtemp(prefix="ckptfs-e2e-torch2-", dir="/var/tmp")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

    def test_pytorch_dcp_tests_pass_on_the_mount_in_both_durability_modes(self):
        out = os.path.join(self.tmp, "out")
        env = dict(os.environ, CKPTFS_BIN_DIR=os.path.realpath(BIN_DIR))
        log = os.path.join(self.tmp, "suite.log")
        with open(log, "w") as logf:
            p = subprocess.Popen(
                [sys.executable, SUITE, "--torch", "trixie", "--modes", "async,strict",
                 "--rounds", str(ROUNDS), "--files", FILE, "--timeout", "600", "--stall", "150",
                 "--parallel", "--retry-torch-deadlock", *[f"-k{k}" for k in SELECT],
                 "--work", os.path.join(self.tmp, "work"), "--out", out],
                stdout=logf, stderr=subprocess.STDOUT, text=True, env=env)
            try:
                p.wait(timeout=900)
            finally:
                if p.poll() is None:  # SIGTERM: the suite stops its daemons and unmounts
                    p.terminate()
                    try:
                        p.wait(timeout=120)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
        with open(log, errors="replace") as f:
            suite_out = f.read()
        sys.stderr.write(suite_out[-4000:])
        report = os.path.join(out, "torch_dcp_suite.json")
        self.assertTrue(os.path.exists(report), f"no report\n{suite_out[-4000:]}")
        with open(report) as f:
            res = json.load(f)
        problems = []
        for m in res["modes"]:
            fo = m["files"][FILE]
            if fo["passed"] != ROUNDS:
                for rnd in fo["rounds"]:
                    if rnd["status"] != "passed":
                        problems.append(
                            f"{m['mode']} round {rnd['round']}: {rnd['status']} "
                            f"failed={rnd['failed_tests']} "
                            f"running={rnd.get('running_at_timeout')} "
                            f"hang={json.dumps(rnd.get('hang'))[:3000]}\n"
                            f"{rnd.get('tail', '')[-1500:]}")
            if m["stopped_early"]:
                problems.append(f"{m['mode']}: {m['stopped_early']}")
            rc = m.get("unmount", {}).get("daemon_rc")
            if rc != 0:
                problems.append(f"{m['mode']}: daemon exit code {rc} after ckptfs-admin unmount "
                                f"{m.get('unmount')}")
            if problems and m.get("daemon_log_lines"):
                problems.append(f"{m['mode']} daemon log:\n" +
                                "\n".join(m["daemon_log_lines"][-20:]))
        self.assertEqual(problems, [], "\n".join(problems))
        self.assertEqual(p.returncode, 0, suite_out[-3000:])
        self.assertEqual([m["mode"] for m in res["modes"]], ["async", "strict"])


if __name__ == "__main__":
    unittest.main()
