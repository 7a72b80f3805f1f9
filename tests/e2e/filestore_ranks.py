"""Two ranks sharing a torch c10d FileStore on one file (what `init_method=file://` does):
every set/get/add opens, flocks, reads, appends and closes that file. Rank r sets key
r_i and then waits for the other rank's key i, so the two take turns; the shared counter
must end at 2 * rounds. Exit 0 on success; any exception (OSError EIO...) fails.

    filestore_ranks.py PATH ROUNDS
"""
import os
import sys
import time

import torch.distributed as dist


def rank_main(path, rank, rounds):
    store = dist.FileStore(path, 2)
    store.set_timeout(__import__("datetime").timedelta(seconds=60))
    for i in range(rounds):
        store.set(f"{rank}_{i}", f"value {rank} {i}")
        other = store.get(f"{1 - rank}_{i}").decode()
        if other != f"value {1 - rank} {i}":
            raise AssertionError(f"rank {rank} round {i}: got {other!r}")
        store.add("counter", 1)
    store.set(f"done_{rank}", "1")
    store.get(f"done_{1 - rank}")
    total = store.add("counter", 0)
    if total != 2 * rounds:
        raise AssertionError(f"rank {rank}: counter {total}, expected {2 * rounds}")


def main():
    path, rounds = sys.argv[1], int(sys.argv[2])
    t0 = time.time()
    pids = []
    for rank in (0, 1):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                rank_main(path, rank, rounds)
            except Exception as e:  # reported, then the exit code says it
                print(f"FAIL rank {rank}: {type(e).__name__}: {e}", flush=True)
                code = 1
            os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    print(f"filestore ranks: exit codes {codes}, {rounds} rounds in {time.time() - t0:.1f} s",
          flush=True)
    sys.exit(0 if codes == [0, 0] else 1)


if __name__ == "__main__":
    main()
