"""File I/O through a real ckptfs mount: reads and writes of every shape, read-your-writes
(G3), publication of rewritten files, and their bytes on the backing store (G1, G2).
Helpers and the per-test mount: posix_common.py. CKPTFS_E2E_PLAIN=1 as in test_posix.py.
"""
import errno
import hashlib
import json
import os
import random
import stat
import subprocess
import sys
import threading
import time
import unittest

from harness import PLAIN, errno_of, sha256_file
from posix_common import MiB, MountedTest, rand_bytes, read_file, write_file, xattr


# ---------------------------------------------------------------- file I/O

class FileIOTest(MountedTest):

    def populate_backing(self, backing):
        write_file(os.path.join(backing, "existing.bin"), rand_bytes(50, MiB + 3))

    def test_o_excl(self):
        fd = os.open(self.p("new"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.write(fd, b"first")
        os.close(fd)
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
        self.assertEqual(errno_of(os.open, self.p("new"), flags), errno.EEXIST)  # staged
        self.wait(self.p("new"))
        self.assertEqual(errno_of(os.open, self.p("new"), flags), errno.EEXIST)  # published
        self.assertEqual(errno_of(os.open, self.p("existing.bin"), flags), errno.EEXIST)
        os.mkdir(self.p("dir"))
        self.assertEqual(errno_of(os.open, self.p("dir"), flags), errno.EEXIST)
        os.symlink("nowhere", self.p("link"))
        self.assertEqual(errno_of(os.open, self.p("link"), flags), errno.EEXIST)
        # After an unlink (possibly not yet applied on the backing store) the name is free.
        os.unlink(self.p("new"))
        fd = os.open(self.p("new"), flags, 0o644)
        os.write(fd, b"second")
        os.close(fd)
        os.unlink(self.p("existing.bin"))
        fd = os.open(self.p("existing.bin"), flags, 0o644)
        os.write(fd, b"recreated")
        os.close(fd)
        self.assertEqual(read_file(self.p("new")), b"second")
        self.drain()
        self.assertEqual(read_file(self.b("new")), b"second")
        self.assertEqual(read_file(self.b("existing.bin")), b"recreated")

    def test_block_size(self):
        """st_blksize: a file of the store shows the store's (a reader buffers as it would
        reading the store directly); a file written through the mount shows 1 MiB (Python's
        buffered writes send large requests), made new or written again in place."""
        if PLAIN:
            self.skipTest("ckptfs's block sizes")
        store = os.stat(self.b("existing.bin")).st_blksize
        self.assertNotEqual(store, MiB, "this test needs a store whose block size is not 1 MiB")
        self.assertEqual(os.stat(self.p("existing.bin")).st_blksize, store)
        with open(self.p("made.bin"), "wb") as f:
            f.write(b"new")
            self.assertEqual(os.fstat(f.fileno()).st_blksize, MiB)
        with open(self.p("existing.bin"), "wb") as f:
            f.write(b"again")
            f.flush()
            self.assertEqual(os.fstat(f.fileno()).st_blksize, MiB)
        self.assertEqual(read_file(self.p("existing.bin")), b"again")

    def test_o_trunc(self):
        big = rand_bytes(51, 3 * MiB)
        write_file(self.p("pub"), big)
        self.wait(self.p("pub"))
        write_file(self.p("stg"), big)
        reader = os.open(self.p("pub"), os.O_RDONLY)
        try:
            names = ("pub", "stg", "existing.bin")
            if not PLAIN and self.m.stats().get("passthrough") == "on":
                # The reader of the published 3 MiB file is served by the kernel from its
                # backing file (FUSE passthrough): it could not see bytes staged by a
                # writer (G3), so the kernel refuses a daemon-served open of the file and
                # O_TRUNC waits (1 s) for the reader, then fails with EBUSY, changing
                # nothing (docs/SEMANTICS.md, "Reads through the kernel"). Once the
                # reader closes, the rewrite below goes on as on any file system.
                self.assertEqual(errno_of(os.open, self.p("pub"), os.O_WRONLY | os.O_TRUNC),
                                 errno.EBUSY)
                self.assertEqual(os.pread(reader, 64, MiB), big[MiB:MiB + 64])
                self.assertEqual(os.stat(self.p("pub")).st_size, len(big))
                os.close(reader)
                # A reader the daemon serves (under --passthrough-min-size) stays open.
                write_file(self.p("small"), b"s" * 1000)
                reader = os.open(self.p("small"), os.O_RDONLY)
            for name in names:
                fd = os.open(self.p(name), os.O_WRONLY | os.O_TRUNC)
                try:
                    self.assertEqual(os.fstat(fd).st_size, 0, name)
                    self.assertEqual(os.stat(self.p(name)).st_size, 0, name)
                    os.write(fd, name.encode() * 3)
                finally:
                    os.close(fd)
                self.assertEqual(read_file(self.p(name)), name.encode() * 3)
            # The shell's '>' truncates too.
            r = subprocess.run(["sh", "-c", f"printf shell > '{self.p('stg')}'"])
            self.assertEqual(r.returncode, 0)
            self.assertEqual(read_file(self.p("stg")), b"shell")
            # O_TRUNC of an empty new file, and O_TRUNC|O_CREAT of a missing one.
            fd = os.open(self.p("fresh"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.close(fd)
            self.assertEqual(os.stat(self.p("fresh")).st_size, 0)
        finally:
            os.close(reader)
        self.drain()
        self.assertEqual(read_file(self.b("pub")), b"pubpubpub")
        self.assertEqual(read_file(self.b("stg")), b"shell")
        self.assertEqual(read_file(self.b("existing.bin")), b"existing.bin" * 3)
        self.assertEqual(read_file(self.b("fresh")), b"")

    def test_o_append(self):
        expected = bytearray(b"A" * 1000)
        write_file(self.p("log"), bytes(expected))
        fd1 = os.open(self.p("log"), os.O_WRONLY | os.O_APPEND)
        fd2 = os.open(self.p("log"), os.O_WRONLY | os.O_APPEND)
        try:
            rng = random.Random(52)
            for i in range(40):
                chunk = rand_bytes(1000 + i, rng.choice([1, 7, 4096, 65537, MiB + 1]))
                os.write(fd1 if i % 2 else fd2, chunk)
                expected += chunk
                if i % 10 == 9:
                    self.assertEqual(read_file(self.p("log")), bytes(expected))
        finally:
            os.close(fd1)
            os.close(fd2)
        self.wait(self.p("log"))
        # Append to a published file, and to one that only exists on the backing store.
        r = subprocess.run(["sh", "-c", f"echo appended >> '{self.p('log')}'"])
        self.assertEqual(r.returncode, 0)
        expected += b"appended\n"
        with open(self.p("existing.bin"), "ab") as f:
            f.write(b"tail")
        self.assertEqual(read_file(self.p("log")), bytes(expected))
        self.assertEqual(read_file(self.p("existing.bin")), rand_bytes(50, MiB + 3) + b"tail")
        self.drain()
        self.assertEqual(read_file(self.b("log")), bytes(expected))
        self.assertEqual(read_file(self.b("existing.bin")), rand_bytes(50, MiB + 3) + b"tail")

    def test_truncate_and_ftruncate(self):
        model = {}

        def resize(name, n):
            if n < len(model[name]):
                del model[name][n:]
            else:
                model[name] += bytes(n - len(model[name]))

        def check(name):
            self.assertEqual(os.stat(self.p(name)).st_size, len(model[name]), name)
            self.assertEqual(read_file(self.p(name)), bytes(model[name]), name)

        for name, publish_first in (("staged", False), ("published", True), ("existing.bin", None)):
            if publish_first is None:
                model[name] = bytearray(rand_bytes(50, MiB + 3))
            else:
                model[name] = bytearray(rand_bytes(53, 3 * MiB))
                write_file(self.p(name), bytes(model[name]))
                if publish_first:
                    self.wait(self.p(name))
            os.truncate(self.p(name), MiB + 5)
            resize(name, MiB + 5)
            check(name)
            os.truncate(self.p(name), 5 * MiB)  # extends with zeros
            resize(name, 5 * MiB)
            check(name)
            fd = os.open(self.p(name), os.O_RDWR)
            try:
                os.pwrite(fd, b"X" * 100, 100)
                model[name][100:200] = b"X" * 100
                os.ftruncate(fd, 2 * MiB)
                resize(name, 2 * MiB)
                self.assertEqual(os.fstat(fd).st_size, 2 * MiB)
                os.pwrite(fd, b"hole-after", 4 * MiB)  # leaves a hole
                model[name] += bytes(4 * MiB - len(model[name])) + b"hole-after"
                os.ftruncate(fd, 4 * MiB + 3)
                resize(name, 4 * MiB + 3)
                self.assertEqual(os.pread(fd, 10, 4 * MiB), b"hol")
            finally:
                os.close(fd)
            check(name)
            r = subprocess.run(["truncate", "-s", "3M", self.p(name)])
            self.assertEqual(r.returncode, 0)
            resize(name, 3 * MiB)
            check(name)
            os.truncate(self.p(name), 0)
            model[name] = bytearray()
            fd = os.open(self.p(name), os.O_WRONLY)
            os.pwrite(fd, b"end", 777)
            os.close(fd)
            model[name] += bytes(777) + b"end"
            check(name)
        self.drain()
        for name, data in model.items():
            self.assertEqual(read_file(self.b(name)), bytes(data), name)

    def test_truncate_racing_the_flush(self):
        """Truncating a large file while its chunks are still being flushed,
        then extending it: the extension reads as zeros, never stale data."""
        data = rand_bytes(56, 160 * MiB)
        write_file(self.p("t"), data)
        os.truncate(self.p("t"), MiB + 1)
        os.truncate(self.p("t"), 160 * MiB)
        expected = data[:MiB + 1] + bytes(160 * MiB - MiB - 1)
        self.assertTrue(read_file(self.p("t")) == expected, "stale bytes after truncate+extend")
        self.drain()
        self.assertTrue(read_file(self.b("t")) == expected,
                        "stale bytes on the backing store after truncate+extend")

    def test_o_append_from_several_processes(self):
        script = ("import os,sys\n"
                  "fd=os.open(sys.argv[1], os.O_WRONLY|os.O_APPEND|os.O_CREAT, 0o644)\n"
                  "for i in range(1000):\n"
                  "    os.write(fd, (sys.argv[2]*99+'\\n').encode())\n"
                  "os.close(fd)\n")
        procs = [subprocess.Popen([sys.executable, "-c", script, self.p("log"), c])
                 for c in "ABCD"]
        for p in procs:
            self.assertEqual(p.wait(timeout=120), 0)

        def check(path):
            lines = read_file(path).decode().split("\n")
            self.assertEqual(lines[-1], "")
            lines = lines[:-1]
            self.assertEqual(len(lines), 4000)
            self.assertTrue(all(len(l) == 99 and len(set(l)) == 1 for l in lines),
                            "appends interleaved or overwrote each other")
            self.assertEqual(sorted(l[0] for l in lines), sorted("ABCD" * 1000))

        check(self.p("log"))
        self.drain()
        check(self.b("log"))

    def test_chmod_and_utime(self):
        mtime_ns, atime_ns = 1_500_000_000_987_654_321, 1_600_000_000_123_456_789
        write_file(self.p("staged"), b"s" * 5000)
        write_file(self.p("published"), b"p" * 5000)
        self.wait(self.p("published"))
        os.mkdir(self.p("dir"))
        for name in ("staged", "published", "existing.bin"):
            os.chmod(self.p(name), 0o600)
            os.utime(self.p(name), ns=(atime_ns, mtime_ns))
            st = os.stat(self.p(name))
            self.assertEqual(stat.S_IMODE(st.st_mode), 0o600, name)
            self.assertEqual(st.st_mtime_ns, mtime_ns, name)
        os.chmod(self.p("dir"), 0o750)
        self.assertEqual(stat.S_IMODE(os.stat(self.p("dir")).st_mode), 0o750)
        # The programs: chmod and touch -d.
        self.assertEqual(subprocess.run(["chmod", "0640", self.p("published")]).returncode, 0)
        self.assertEqual(subprocess.run(["touch", "-m", "-d", "@1234567890",
                                         self.p("published")]).returncode, 0)
        st = os.stat(self.p("published"))
        self.assertEqual(stat.S_IMODE(st.st_mode), 0o640)
        self.assertEqual(st.st_mtime, 1234567890)
        # A file created with an explicit mode.
        fd = os.open(self.p("mode0604"), os.O_CREAT | os.O_WRONLY, 0o604)
        os.close(fd)
        os.chmod(self.p("mode0604"), 0o604)  # independent of the umask
        self.assertEqual(stat.S_IMODE(os.stat(self.p("mode0604")).st_mode), 0o604)
        self.drain()
        for name in ("staged", "existing.bin"):
            st = os.stat(self.b(name))
            self.assertEqual(stat.S_IMODE(st.st_mode), 0o600, name)
            self.assertEqual(st.st_mtime_ns, mtime_ns, f"{name}: mtime on the backing store")
        st = os.stat(self.b("published"))
        self.assertEqual(stat.S_IMODE(st.st_mode), 0o640)
        self.assertEqual(st.st_mtime, 1234567890)
        self.assertEqual(stat.S_IMODE(os.stat(self.b("dir")).st_mode), 0o750)
        self.assertEqual(stat.S_IMODE(os.stat(self.b("mode0604")).st_mode), 0o604)
        self.assertEqual(read_file(self.b("staged")), b"s" * 5000)

    def test_read_your_writes_before_publication(self):
        """G3: every byte is readable through the mount as soon as write()
        returns, from another fd and another process, before publication."""
        size = 48 * MiB
        model = bytearray(size)
        rng = random.Random(54)
        wfd = os.open(self.p("ryw"), os.O_CREAT | os.O_RDWR, 0o644)
        os.ftruncate(wfd, size)
        rfd = os.open(self.p("ryw"), os.O_RDONLY)
        states = set()
        try:
            for i in range(150):
                off = rng.randrange(0, size - 1)
                n = min(rng.choice([1, 13, 4096, 65536 + 3, MiB, 3 * MiB + 1]), size - off)
                data = rand_bytes(2000 + i, n)
                self.assertEqual(os.pwrite(wfd, data, off), n)
                model[off:off + n] = data
                lo = max(0, off - 100)
                self.assertEqual(os.pread(rfd, n + 200, lo), bytes(model[lo:off + n + 100]),
                                 f"op {i}: other fd reads stale data at {off}+{n}")
                if i % 30 == 0:
                    self.assertEqual(os.pread(wfd, size, 0), bytes(model))
                    out = subprocess.run(["dd", f"if={self.p('ryw')}", "bs=1M", "status=none"],
                                         capture_output=True).stdout
                    self.assertEqual(out, bytes(model), f"op {i}: another process reads stale data")
                    if not PLAIN:
                        states.add(xattr(self.p("ryw"), "user.ckptfs.state"))
            self.assertEqual(os.stat(self.p("ryw")).st_size, size)
        finally:
            os.close(rfd)
            os.close(wfd)
        if not PLAIN:
            # The file was open for writing, so it cannot have been published yet.
            self.assertLessEqual(states, {"staged", "durable"}, states)
        self.assertEqual(read_file(self.p("ryw")), bytes(model))
        self.drain()
        self.assertEqual(read_file(self.b("ryw")), bytes(model))

    def test_read_your_writes_through_a_write_only_fd(self):
        """A write-only descriptor bypasses the page cache (direct writes, on from Linux
        6.6): another descriptor that cached the file's pages before must still read every
        new byte at once (the kernel invalidates the range it cached)."""
        size = 16 * MiB
        model = bytearray(rand_bytes(77, size))
        write_file(self.p("wo"), bytes(model))
        rfd = os.open(self.p("wo"), os.O_RDONLY)
        wfd = os.open(self.p("wo"), os.O_WRONLY)
        rng = random.Random(78)
        try:
            self.assertEqual(os.pread(rfd, size, 0), bytes(model))  # now in rfd's page cache
            for i in range(40):
                off = rng.randrange(0, size - 1)
                n = min(rng.choice([1, 4096, 65536 + 3, MiB, 2 * MiB + 5]), size - off)
                data = rand_bytes(3000 + i, n)
                self.assertEqual(os.pwrite(wfd, data, off), n)
                model[off:off + n] = data
                lo = max(0, off - 4096)
                hi = min(size, off + n + 4096)
                self.assertEqual(os.pread(rfd, hi - lo, lo), bytes(model[lo:hi]),
                                 f"op {i}: the caching fd reads stale data at {off}+{n}")
        finally:
            os.close(wfd)
            os.close(rfd)
        self.assertEqual(read_file(self.p("wo")), bytes(model))
        if not PLAIN:  # the log is flushed every second
            deadline = time.monotonic() + 5
            while "direct writes" not in self.m.log_text() and time.monotonic() < deadline:
                time.sleep(0.1)
            major, minor = (int(x) for x in os.uname().release.split(".")[:2])
            want = "on" if (major, minor) >= (6, 6) else "off"
            self.assertIn(f"direct writes {want}", self.m.log_text())

    def test_concurrent_writers_on_different_files(self):
        n_threads, per_file = 8, 24 * MiB
        os.makedirs(self.p("conc", "shared"))
        errors = []

        def content(i):
            return rand_bytes(3000 + i, per_file)

        def path(i):
            return self.p("conc", "shared" if i % 2 else f"own{i}", f"file{i}")

        def writer(i):
            try:
                if i % 2 == 0:
                    os.mkdir(self.p("conc", f"own{i}"))
                data = content(i)
                rng = random.Random(i)
                fd = os.open(path(i), os.O_CREAT | os.O_WRONLY, 0o644)
                try:
                    pos = 0
                    while pos < len(data):
                        n = rng.choice([4096, 65537, MiB, MiB + 1, 2 * MiB - 1])
                        pos += os.write(fd, data[pos:pos + n])
                finally:
                    os.close(fd)
            except Exception as e:  # reported below
                errors.append((i, repr(e)))

        stop = threading.Event()
        peaks = []

        def stats_reader():
            while not stop.is_set() and not PLAIN:
                try:
                    s = self.m.stats()
                    peaks.append((s["staging_used"], s["staging_limit"]))
                except Exception as e:
                    errors.append(("stats", repr(e)))
                    return
                time.sleep(0.05)

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(n_threads)]
        reader = threading.Thread(target=stats_reader)
        reader.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        reader.join()
        self.assertEqual(errors, [])
        for used, limit in peaks:
            self.assertLessEqual(used, limit, "G6: staging_used above staging_limit")
        expected = {i: hashlib.sha256(content(i)).hexdigest() for i in range(n_threads)}
        for i in range(n_threads):
            self.assertEqual(sha256_file(path(i)), expected[i], f"file{i} through the mount")
        self.drain()
        for i in range(n_threads):
            bpath = path(i).replace(self.m.mnt, self.m.backing, 1)
            self.assertEqual(sha256_file(bpath), expected[i], f"file{i} on the backing store")

    def test_statfs_and_df(self):
        vm, vb = os.statvfs(self.m.mnt), os.statvfs(self.m.backing)
        self.assertGreater(vm.f_bsize, 0)
        self.assertGreater(vm.f_blocks, 0)
        self.assertGreater(vm.f_bavail, 0)
        total_m, total_b = vm.f_blocks * vm.f_frsize, vb.f_blocks * vb.f_frsize
        self.assertAlmostEqual(total_m / total_b, 1.0, delta=0.02,
                               msg=f"statfs total {total_m} vs backing {total_b}")
        free_m, free_b = vm.f_bavail * vm.f_frsize, vb.f_bavail * vb.f_frsize
        self.assertLess(abs(free_m - free_b), max(0.05 * total_b, 2 << 30),
                        f"statfs free {free_m} vs backing {free_b}")
        r = subprocess.run(["df", "-P", "-k", self.m.mnt], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        fields = r.stdout.splitlines()[-1].split()
        self.assertGreater(int(fields[1]), 0, r.stdout)
        if not PLAIN:
            self.assertEqual(fields[-1], os.path.realpath(self.m.mnt), r.stdout)
        r = subprocess.run(["df", "-i", self.m.mnt], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.drain()

    def test_xattr_state_and_progress(self):
        self.skip_if_plain()
        write_file(self.p("f"), rand_bytes(55, 20 * MiB))
        s = xattr(self.p("f"), "user.ckptfs.state")
        self.assertIn(s, ("staged", "durable", "published"))
        r = subprocess.run(["getfattr", "-n", "user.ckptfs.state", "--only-values", self.p("f")],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(r.stdout.strip(), ("staged", "durable", "published"))
        progress = json.loads(xattr(self.p("f"), "user.ckptfs.progress"))
        self.assertIsInstance(progress, dict)
        self.wait(self.p("f"))
        self.assertEqual(xattr(self.p("f"), "user.ckptfs.state"), "published")
        json.loads(xattr(self.p("f"), "user.ckptfs.progress"))
        self.assertEqual(xattr(self.p("existing.bin"), "user.ckptfs.state"), "published")
        # A size query (buffer of 0) must agree with the value.
        r = subprocess.run(["getfattr", "-d", "-m", "user.ckptfs", self.p("f")],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.drain()

    def test_a_deleted_file_lets_go_of_its_block_checksums(self):
        # The write path's block CRCs of a published file wait in memory for an index build;
        # a file outside any checkpoint is never indexed, so its unlink must take them (a
        # log written and deleted kept them until a 128 MiB bound evicted them, stop 61).
        self.skip_if_plain()
        maps = lambda: self.m.stats().get("checksum_block_maps_bytes", 0)  # noqa: E731
        self.assertEqual(maps(), 0)
        write_file(self.p("events.log"), rand_bytes(56, 3 * MiB))
        self.wait(self.p("events.log"))
        deadline = time.monotonic() + 10
        while maps() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertGreater(maps(), 0, "the publish kept no block CRCs")
        os.unlink(self.p("events.log"))
        deadline = time.monotonic() + 10
        while (maps() != 0 or os.path.exists(self.b("events.log"))) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertFalse(os.path.exists(self.b("events.log")))
        self.assertEqual(maps(), 0, "block CRCs kept for a deleted file")
        self.drain()


if __name__ == "__main__":
    unittest.main()
