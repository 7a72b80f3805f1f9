"""The clients of today (issue 22): real torch 2.x programs over real ckptfs mounts.

For each cached Debian root (scripts/torch_root.sh: trixie = torch 2.6, sid = the newest, 2.14
at the time of writing), two daemons are started on the host, one --durability async and one
--durability strict, each mounted inside the root; then torch2_clients.py runs in the root
(chroot), 4 gloo ranks, and does under each mount: dcp.save of DTensor state dicts and a
second save over the same directory, dcp.async_save with the thread checkpointer and with the
process checkpointer, resharded loads (other placements, a 2x2 mesh), a Hugging Face save
and load (HuggingFaceStorageWriter with consolidation, HuggingFaceStorageReader), a
collective-less save (use_collectives=False: __{rank}.metadata per rank, no .metadata),
no_dist saves (every rank alone), dcp_to_torch_save, and the tensor view (/.ckptfs/tensors)
of the overwritten and the async checkpoints. Every tensor loaded is checked
exactly in the ranks. What a torch lacks is skipped by the program and must be exactly
what that torch is known to lack (EXPECTED_SKIPS), so that a new failure cannot hide as a
skip.

On the host, every checkpoint directory the program reports must then be `committed` in
/.ckptfs/checkpoints and in `ckptfs-admin checkpoints`; every file read through the mount
must equal the backing store's copy after a clean unmount (exit 0, no temporary names
left).

On the daemon of 6f2c1b5 (before per-rank metadata commits) the sid case fails: `ckptfs-admin
wait run/per_rank` never succeeds in the async mount.

Skips, saying why, when not root, without debootstrap, or when a root cannot be built (the
Debian archive is unreachable). About 1 min per root once the roots are cached (torch
imports dominate), plus a few minutes to build a root on a fresh machine.
"""
import json
import os
import sys
import unittest

import harness
import torch_roots as tr

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "torch2_clients.py")
MODES = ("async", "strict")
# What each torch lacks (the program skips these with a reason): nothing else may skip.
EXPECTED_SKIPS = {
    "trixie": {"async_process", "hf", "per_rank"},  # torch 2.6
    "sid": set(),
}
ALL_CASES = {"sync", "async_thread", "async_process", "reshard", "hf", "per_rank", "no_dist",
             "to_torch_save", "tensor_view"}


class Torch2Clients(harness.MountedTest):
    WATCHDOG_S = 900

    def run_clients(self, suite):
        root = tr.enter_root(self, suite)
        daemons = {mode: tr.mount_in_root(self, root, mode, "ckptfs-clients") for mode in MODES}
        prog, prog_in_root = tr.program_dir(self, root, DRIVER)
        bases = {mode: f"{mir}/run" for mode, (_, mir) in daemons.items()}
        argv = ["python3", f"{prog_in_root}/torch2_clients.py",
                "--out", f"{prog_in_root}/results.json"]
        for mode in MODES:
            argv += ["--base", bases[mode]]
        _, wall = tr.run_in_root(self, root, argv, timeout=600)
        with open(os.path.join(prog, "results.json")) as f:
            res = json.load(f)
        sys.stderr.write(f"\n{suite}: torch {res['torch']} (Python {res['python']}), "
                         f"{wall:.0f} s\n")
        for mode in MODES:
            m, _ = daemons[mode]
            rec = res["bases"][bases[mode]]
            sys.stderr.write(f"  {mode}: cases {rec['cases']} skipped {rec['skipped']}\n")
            self.assertEqual(set(rec["skipped"]), EXPECTED_SKIPS[suite], rec["skipped"])
            self.assertEqual(set(rec["cases"]) | set(rec["skipped"]), ALL_CASES)
            tr.assert_committed(self, m, ["run/" + c for c in rec["checkpoints"]], mode)
        # Every byte read through the mount is on the backing store after a clean unmount.
        for mode in MODES:
            m, _ = daemons[mode]
            seen = tr.drain_and_compare(self, m, mode)
            self.assertIn("run/sync/.metadata", seen)

    def test_torch26_trixie(self):
        self.run_clients("trixie")

    def test_torch_newest_sid(self):
        self.run_clients("sid")


if __name__ == "__main__":
    unittest.main()
