"""The daemon's heap gives back what its transient buffers held (issue 41's RSS bound).

The daemon frees blocks of 1-4 MiB all the time: each commit's key index build reads the
shards through 4 MiB windows, each readdir replied from a buffer of the kernel's size (up
to 1 MiB), and libfuse's idle workers end and new ones allocate their 1 MiB request
buffer. glibc raises its mmap threshold to the size of every mapped block freed, so after
the first free such blocks came from the heaps of up to 8 arenas per core and stayed there,
free but resident: in the soak (stop 47) live allocations stayed flat while RSS less the
budgets grew about 17 KiB a save; here the heap held 15-17 MiB free after 40 saves. The
daemon now fixes the threshold at start (common/heap.h), and a readdir reply is as large
as its entries (docs/RELIABILITY.md, "Findings of stop 48").

  * 2 x 40 saves with rotation (2 gloo ranks, 2 MiB) into an async mount while 4 threads
    list a directory of 300 files with long names (each listing whole and exact, over
    several readdir replies): after each half, publication caught up, the free memory the
    heap holds (`heap_free_held`) is under 8 MiB (15-17 MiB before), and RSS less staging,
    the retained tier, the cache and the heap in use grew by under 3 MiB from the first
    half to the second.
"""
import os
import threading
import time
import unittest

import dcp_tool
import harness

MiB = 1 << 20


def rss_less_budgets(m):
    s = m.stats()
    held = sum(s.get(k) or 0 for k in ("staging_resident", "retained_used", "cache_used",
                                       "cache_index"))
    return harness.proc_status_bytes(m.proc.pid, "VmRSS") - held, s


class DaemonHeapTest(unittest.TestCase):
    def test_saves_and_listings_leave_no_growing_free_heap(self):
        m = harness.Mount(args=["--durability", "async"], staging="128M")
        self.addCleanup(m.cleanup)
        m.start()
        harness.arm_watchdog(self, m, 300)
        listed = os.path.join(m.mnt, "listed")
        os.makedirs(listed)
        # Long names: a listing (glibc reads 32 KiB at a time) takes several readdir
        # replies, each continuing at the previous one's offset.
        names = {f"{i:04d}_" + "n" * 195 for i in range(300)}
        for name in names:
            harness.write_file(os.path.join(listed, name), b"x")
        parent = os.path.join(m.mnt, "run")
        os.makedirs(parent)
        stop = threading.Event()
        listings, bad = [0], []

        def lister():
            while not stop.is_set():
                got = os.listdir(listed)
                if len(got) != len(names) or set(got) != names:
                    bad.append(len(got))
                listings[0] += 1
                time.sleep(0.005)

        points = []
        for half in range(2):
            threads = [threading.Thread(target=lister, daemon=True) for _ in range(4)]
            for t in threads:
                t.start()
            try:
                dcp_tool.train(parent, ranks=2, mb=2, start=1 + 40 * half, iters=40, keep=3,
                               single_file_per_rank=half == 0, timeout=600)
            finally:
                stop.set()
                for t in threads:
                    t.join(60)
                stop.clear()
            self.assertEqual(m.wait(m.mnt, timeout=180), 0)
            self.assertEqual(bad, [], "a listing missed entries")
            other, s = rss_less_budgets(m)
            points.append((other, s))
            print(f"after {40 * (half + 1)} saves, {listings[0]} listings: RSS less budgets "
                  f"{other / MiB:.1f} MiB, heap in use {s['heap_in_use'] / MiB:.1f} MiB, "
                  f"free {s['heap_free_held'] / MiB:.1f} MiB", flush=True)
            self.assertGreater(s["heap_in_use"], 1 * MiB, "heap_in_use missing from the stats")
            self.assertLess(s["heap_free_held"], 8 * MiB,
                            f"after {40 * (half + 1)} saves and {listings[0]} listings the "
                            f"heap holds {s['heap_free_held'] / MiB:.1f} MiB free "
                            f"({s['heap_in_use'] / MiB:.1f} MiB in use)")
        # Less the heap's live allocations too, which move between two such points (the
        # state DB's memtables fill up to 2 MiB each between flushes): what is left must
        # not grow.
        (a, sa), (b, sb) = points
        a_rest, b_rest = a - sa["heap_in_use"], b - sb["heap_in_use"]
        self.assertLess(b_rest - a_rest, 3 * MiB,
                        f"RSS less budgets {a / MiB:.1f} -> {b / MiB:.1f} MiB, less the heap in "
                        f"use {a_rest / MiB:.1f} -> {b_rest / MiB:.1f} MiB")
        self.assertEqual(m.unmount(), 0)


if __name__ == "__main__":
    unittest.main()
