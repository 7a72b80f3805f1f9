#!/usr/bin/env python3
"""Captures the seeds of control_fuzz and peers_fuzz (issue 41) from real mounts, as root:

  tests/fixtures/control/  /.ckptfs/stats, /.ckptfs/checkpoints and user.ckptfs.progress
                           xattrs of a mount after DCP saves (ok-*), of a mount whose fault
                           layer failed them (eio-*: failed checkpoints, their errors), and
                           the stats of a daemon with a peer (peers-stats: the membership);
  tests/fixtures/peers/    the peers file a Slurm prolog writes for two daemons in network
                           namespaces (tests/e2e/netns.py), and the same list moved.

    scripts/capture_fuzz_seeds.py [OUT_DIR]   # default: tests/fixtures
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "e2e"))

import dcp_tool  # noqa: E402
import harness  # noqa: E402
import netns  # noqa: E402
import reaper  # noqa: E402


def copy(src, dst):
    """read() and write(): the control files report size 0, which copyfile trusts."""
    with open(src, "rb") as f:
        data = f.read()
    with open(dst, "wb") as f:
        f.write(data)


def grab(mnt, out, tag, paths):
    for n in ("stats", "checkpoints"):
        copy(os.path.join(mnt, ".ckptfs", n), os.path.join(out, f"{tag}-{n}"))
    for p in paths:
        try:
            v = os.getxattr(os.path.join(mnt, p), "user.ckptfs.progress")
        except OSError:
            continue
        with open(os.path.join(out, f"{tag}-progress-{p.replace('/', '_').replace('.', '')}"),
                  "wb") as f:
            f.write(v)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "tests", "fixtures")
    control, peers = os.path.join(root, "control"), os.path.join(root, "peers")
    os.makedirs(control, exist_ok=True)
    os.makedirs(peers, exist_ok=True)
    reaper.start_guardian()
    paths = ("ck", "ck/.metadata", "ck/__0_0.distcp", "ck2")
    for tag, args in (("ok", []), ("eio", ["--fault-inject", "seed=3,eio_fsync=0.5,eio_rename=0.3"])):
        m = harness.Mount(args=args)
        try:
            m.start()
            for i, d in enumerate(("ck", "ck2")):
                try:
                    dcp_tool.save(os.path.join(m.mnt, d), ranks=2, mb=1, seed=i)
                except dcp_tool.DcpToolError:
                    pass          # the fault layer failed it: its state is what we want
            grab(m.mnt, control, tag, paths)
        finally:
            m.cleanup()
    with netns.Cluster(2) as c:
        c.start()
        c.wait_connected()
        copy(c.peers_file, os.path.join(peers, "slurm-prolog-2"))
        copy(os.path.join(c.nodes[0].mnt, ".ckptfs", "stats"),
             os.path.join(control, "peers-stats"))
    with open(os.path.join(peers, "slurm-prolog-2")) as f:
        lines = f.read().splitlines()
    moved = [x.replace(".2:", ".12:") if ".2:" in x else x for x in lines]
    with open(os.path.join(peers, "moved-rank1"), "w") as f:
        f.write("\n".join(moved) + "\n")
    print(sorted(os.listdir(control)), sorted(os.listdir(peers)))


if __name__ == "__main__":
    main()
