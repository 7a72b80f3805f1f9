#!/usr/bin/env python3
"""torch DCP saves and loads of CUDA tensors, through ckptfs and to a plain directory.

For a machine with a GPU (scripts/gpu_check.sh runs it there). RANKS gloo processes share
GPU 0; each holds MIB MiB of its own CUDA tensors (own-shard layout: every rank writes its
own items). Per round, in an order that alternates between rounds:
  plain        dcp.save to a directory on the same disk as the backing store, then sync(1)
  plain_async  dcp.async_save (thread checkpointer) there, then sync(1)
  ckptfs       dcp.save through an async-durability mount, then `ckptfs-admin wait`
  strict       dcp.save through a strict mount (close returns once durable)
  NAME         (--mount NAME=ARG,ARG) another ckptfs mount with these daemon arguments
stall = until every rank's save call returned (training resumes); durable = until the bytes
are on the backing disk (sync finished / the checkpoint committed). Each checkpoint is loaded
back at once from the same daemons with caches kept (load_warm: a job restarted in place, which
ckptfs serves from its retained tier), then again into CUDA tensors with caches dropped and
fresh daemons (cold); every load is compared exactly. Prints one JSON object (medians and ratios to plain), writes it and a PNG.
"""
import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
from benchlib import log, median, ratio  # noqa: E402


def rank_main(rank, world, init_file, mib, device, cmd_qs, res_q):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    pieces = 8
    numel = mib * (1 << 20) // 4 // pieces
    state = {f"rank{rank}.layer{i}.weight": torch.randn(numel, device=device, generator=gen)
             for i in range(pieces)}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    res_q.put(("ready", rank, name, torch.__version__))
    while True:
        cmd = cmd_qs[rank].get()
        if cmd[0] == "exit":
            break
        path = cmd[1]
        dist.barrier()
        t0 = time.perf_counter()
        if cmd[0] == "save":
            if cmd[2] == "async":
                fut = dcp.async_save(state, checkpoint_id=path)
                stall = time.perf_counter() - t0
                fut.result()
            else:
                dcp.save(state, checkpoint_id=path)
                stall = time.perf_counter() - t0
            done = time.perf_counter() - t0
            dist.barrier()
            res_q.put(("save", rank, stall, done))
        elif cmd[0] == "load":
            target = {k: torch.empty_like(v) for k, v in state.items()}
            dcp.load(target, checkpoint_id=path)
            sync()
            took = time.perf_counter() - t0
            exact = all(torch.equal(target[k], state[k]) for k in state)
            dist.barrier()
            res_q.put(("load", rank, took, exact))
    dist.destroy_process_group()


class Ranks:
    def __init__(self, world, mib, device, root):
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.world = world
        init_file = os.path.join(root, "pg-init")
        if os.path.exists(init_file):
            os.unlink(init_file)
        self.cmd_qs = [ctx.Queue() for _ in range(world)]
        self.res_q = ctx.Queue()
        self.procs = [ctx.Process(target=rank_main,
                                  args=(r, world, init_file, mib, device, self.cmd_qs,
                                        self.res_q))
                      for r in range(world)]
        for p in self.procs:
            p.start()
        ready = self.collect("ready", timeout=300)
        self.device, self.torch_version = ready[0][2], ready[0][3]

    def collect(self, kind, timeout=600):
        got = []
        deadline = time.time() + timeout
        while len(got) < self.world:
            try:
                msg = self.res_q.get(timeout=max(1, deadline - time.time()))
            except queue.Empty:
                raise RuntimeError(f"ranks did not answer {kind} in {timeout} s")
            if msg[0] != kind:
                raise RuntimeError(f"expected {kind}, got {msg}")
            got.append(msg)
        return got

    def do(self, *cmd):
        for q in self.cmd_qs:
            q.put(cmd)
        return self.collect(cmd[0])

    def close(self):
        for q in self.cmd_qs:
            q.put(("exit",))
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def sync_seconds():
    t0 = time.perf_counter()
    benchlib.sync()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mib", type=int, default=512, help="MiB of CUDA tensors per rank")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="where the tensors live (cpu: a dry run on a machine without a GPU)")
    ap.add_argument("--root", default="/var/tmp/ckptfs-gpu-dcp")
    ap.add_argument("--staging", default="4G")
    ap.add_argument("--out", default=None, help="JSON path (default ROOT/gpu_dcp.json)")
    ap.add_argument("--png", default=None, help="PNG path (default ROOT/gpu_dcp.png)")
    ap.add_argument("--mount", action="append", default=[], metavar="NAME=ARG,ARG",
                    help="one more ckptfs case with these daemon arguments, e.g. "
                         "noretain=--durability,async,--retain-mem,0 (repeatable)")
    args = ap.parse_args()

    shutil.rmtree(args.root, ignore_errors=True)
    os.makedirs(args.root)
    plain_dir = os.path.join(args.root, "plain")
    os.makedirs(plain_dir)
    mounts = {"ckptfs": ["--durability", "async"], "strict": ["--durability", "strict"]}
    for spec in args.mount:
        name, _, extra = spec.partition("=")
        if not name or name in mounts or name.startswith("plain"):
            ap.error(f"--mount {spec}: give a new case name, NAME=ARG,ARG")
        mounts[name] = [a for a in extra.split(",") if a]

    def start_daemons():
        ds = {}
        for name, extra in mounts.items():
            ds[name] = benchlib.Daemon(os.path.join(args.root, name), staging=args.staging,
                                       args=extra).start()
        return ds

    cases = ["plain", "plain_async"] + list(mounts)
    saves = {c: {"stall": [], "durable": []} for c in cases}
    loads = {c: [] for c in cases}
    warm_loads = {c: [] for c in cases}
    exact = True
    staging_backend = None
    transports = {}  # how each mount's requests arrive (fuse_transport)
    ranks = Ranks(args.ranks, args.mib, args.device, args.root)
    daemons = {}

    def timed_load(label, path, times):
        res = ranks.do("load", path)
        times.append(max(r[2] for r in res))
        ok = all(r[3] for r in res)
        log(f"{label}: {times[-1]:.2f} s exact={ok}")
        return ok

    try:
        log(f"{args.ranks} ranks on {ranks.device}, torch {ranks.torch_version}, "
            f"{args.mib} MiB each")
        for rnd in range(args.rounds):
            order = cases if rnd % 2 == 0 else list(reversed(cases))
            daemons = start_daemons()
            staging_backend = daemons["ckptfs"].stats().get("staging_backend")
            transports = {name: d.stats().get("fuse_transport") for name, d in daemons.items()}
            paths = {}
            for case in order:
                if case.startswith("plain"):
                    path = os.path.join(plain_dir, f"{case}-{rnd}")
                else:
                    path = os.path.join(daemons[case].mnt, f"ckpt-{rnd}")
                paths[case] = path
                res = ranks.do("save", path, "async" if case == "plain_async" else "sync")
                stall = max(r[2] for r in res)
                done = max(r[3] for r in res)
                if case.startswith("plain"):
                    durable = done + sync_seconds()
                else:
                    ok, waited = daemons[case].wait(path)
                    if not ok:
                        raise RuntimeError(f"{case}: {path} did not commit")
                    durable = done + waited
                saves[case]["stall"].append(stall)
                saves[case]["durable"].append(durable)
                log(f"round {rnd} save {case}: stall {stall:.2f} s, durable {durable:.2f} s")
            for case in order:  # a job restarted in place: same daemons, caches kept
                exact &= timed_load(f"round {rnd} warm load {case}", paths[case],
                                    warm_loads[case])
            for d in daemons.values():  # drain, then cold loads from fresh daemons
                d.unmount()
            benchlib.drop_caches()
            daemons = start_daemons()
            for case in order:
                path = paths[case]
                if not case.startswith("plain"):
                    path = os.path.join(daemons[case].mnt, f"ckpt-{rnd}")
                exact &= timed_load(f"round {rnd} load {case}", path, loads[case])
            for d in daemons.values():
                d.unmount()
            daemons = {}
            shutil.rmtree(plain_dir, ignore_errors=True)
            os.makedirs(plain_dir)
    finally:
        for d in daemons.values():
            d.stop()
        ranks.close()

    gib = args.ranks * args.mib / 1024
    result = {
        "bench": "gpu_dcp", "device": ranks.device, "torch": ranks.torch_version,
        "ranks": args.ranks, "gib": gib, "rounds": args.rounds,
        "staging_backend": staging_backend, "fuse_transport": transports, "exact": exact,
        "save": {c: {k: round(median(v), 3) for k, v in saves[c].items()} for c in cases},
        "load": {c: round(median(loads[c]), 3) for c in cases},
        "load_warm": {c: round(median(warm_loads[c]), 3) for c in cases},
        "raw": {"save": saves, "load": loads, "load_warm": warm_loads},
    }
    base = result["save"]["plain"]
    result["ratios"] = {
        c: {"stall": ratio(result["save"][c]["stall"], base["stall"]),
            "durable": ratio(result["save"][c]["durable"], base["durable"]),
            "load": ratio(result["load"][c], result["load"]["plain"]),
            "load_warm": ratio(result["load_warm"][c], result["load_warm"]["plain"])}
        for c in cases}
    out = args.out or os.path.join(args.root, "gpu_dcp.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "raw"}))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.2
        for i, metric in enumerate(["stall", "durable", "load", "load_warm"]):
            vals = [result[metric][c] if metric.startswith("load") else result["save"][c][metric]
                    for c in cases]
            ax.bar([x + i * width for x in range(len(cases))], vals, width, label=metric)
        ax.set_xticks([x + 1.5 * width for x in range(len(cases))], cases)
        ax.set_ylabel("seconds (median)")
        ax.set_title(f"DCP, {args.ranks} ranks x {args.mib} MiB CUDA tensors, {ranks.device}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png or os.path.join(args.root, "gpu_dcp.png"))
    except ImportError:
        log("matplotlib missing: no PNG")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
