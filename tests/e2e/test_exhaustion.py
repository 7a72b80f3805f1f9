"""Resource exhaustion through a real mount: each condition gives the caller a clear error
(never a hang, never a silent loss), leaves a log line, the daemon stays up, and it works
again once the condition clears.

  * staging full while the backing store is full: a tiny staging pool (4 MiB of 1 MiB
    chunks) over a backing tmpfs with no free space; several writers, each writing far
    more than staging holds. Strict and async: every writer gets ENOSPC (from write,
    fsync or close) within the time limit, none hangs, staging drains to 0; after space
    is freed a new file is written and published byte-exact.
  * the state dir's disk full: the state dir (RocksDB journal) on a small tmpfs that the
    test fills. Files opened before and written while it is full, and namespace
    operations on published files, may succeed; a create (it needs a journal record)
    gets ENOSPC, never another errno. Nothing that succeeded is lost: after the disk is
    freed and the mount drained, every file whose save succeeded (strict: close
    returned 0; async: `ckptfs-admin wait` said published) is on the backing store
    byte-exact, and every rename, unlink and mkdir that returned 0 shows there. New
    work succeeds at once after the disk is freed.
  * too many open files: the running daemon's RLIMIT_NOFILE lowered with prlimit, then
    hundreds of files opened through the mount for writing and for reading. Opens,
    writes and closes fail with EMFILE (or ENFILE) instead of hanging; after the files
    are closed, new files work with the limit still in place, and every file whose
    write and close succeeded is intact.
  * backing dir removed under the mount: its contents deleted, then the directory itself;
    operations get errors (logged), the daemon stays up; when a directory is created at
    the same path again, the daemon switches to it and new work succeeds.
Each test checks the log names the condition and the daemon (its PID) is alive afterwards.
"""
import errno
import faulthandler
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import harness
from harness import errno_of

MiB = 1 << 20
HANG_S = 120


write_file = harness.write_file
read_file = harness.read_file



def fill(path, chunk=MiB):
    """Writes a filler file until the file system holding `path` is full."""
    filler = os.path.join(path, "filler")
    with open(filler, "wb", buffering=0) as f:
        block = b"\xee" * chunk
        while True:
            try:
                f.write(block)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                if len(block) == 4096:
                    break
                block = block[:4096]
    return filler


class ExhaustionBase(harness.MountedTest):
    def make_tmpfs(self, mb, prefix):
        return harness.make_tmpfs(self, mb, prefix)

    def mount(self, args=(), **kw):
        m = super().mount(args, **kw)  # cleaned up before the tmpfs cleanups (LIFO)
        self.m = m
        return m

    def assert_alive(self, what):
        rc = self.m.proc.poll()
        if rc is not None:
            try:
                out = self.m.proc.stdout.read().decode(errors="replace")[-2000:]
            except (AttributeError, ValueError, OSError):
                out = "(not captured)"
            self.fail(f"the daemon exited ({rc}) after {what}\n--- its stderr ---\n{out}\n"
                      f"--- log ---\n{self.m.log_text()[-3000:]}")
        self.assertIsInstance(self.m.stats(), dict)

    def assert_logged(self, pattern, what):
        deadline = time.time() + 10
        while time.time() < deadline:
            if re.search(pattern, self.m.log_text(), re.I):
                return
            time.sleep(0.2)
        self.fail(f"no log line for {what} (/{pattern}/)\n{self.m.log_text()[-3000:]}")

    def run_bounded(self, fns, limit=HANG_S):
        """Runs each fn in a thread; returns their results (an exception counts as a
        result). Fails if any is still blocked after `limit` seconds."""
        results = [None] * len(fns)

        def run(i, fn):
            try:
                results[i] = fn()
            except BaseException as e:   # noqa: B902 - reported as the result
                results[i] = e

        threads = [threading.Thread(target=run, args=(i, fn), daemon=True)
                   for i, fn in enumerate(fns)]
        for t in threads:
            t.start()
        deadline = time.time() + limit
        for t in threads:
            t.join(timeout=max(0.1, deadline - time.time()))
        hung = [i for i, t in enumerate(threads) if t.is_alive()]
        if hung:
            faulthandler.dump_traceback(all_threads=True)
            self.fail(f"{len(hung)} of {len(fns)} callers still blocked after {limit}s: "
                      f"a hang, not an error\n{self.m.log_text()[-3000:]}")
        return results

    def new_work_succeeds(self, name, size=3 * MiB + 5):
        data = os.urandom(size)
        write_file(self.p(name), data, fsync=True)
        self.assertEqual(read_file(self.p(name)), data)
        self.assertEqual(self.m.wait(self.p(name), timeout=60), 0,
                         f"{name} was not published after the condition cleared\n"
                         + self.m.log_text()[-3000:])
        self.assertEqual(read_file(self.b(name)), data)
        return data


class StagingFullTest(ExhaustionBase):
    WRITERS = 4
    EACH_MB = 24

    def run_case(self, durability):
        backing = self.make_tmpfs(24, "ckptfs-exh-backing-")
        m = self.mount(["--durability", durability, "--chunk-size", "1M"], backing=backing,
                       staging="4M")
        filler = fill(backing)
        data = [os.urandom(self.EACH_MB * MiB) for _ in range(self.WRITERS)]

        def writer(i):
            try:
                write_file(self.p(f"big{i}"), data[i], fsync=(i % 2 == 0))
            except OSError as e:
                return e.errno
            return 0

        t0 = time.time()
        rcs = self.run_bounded([lambda i=i: writer(i) for i in range(self.WRITERS)])
        took = time.time() - t0
        sys.stderr.write(f"\n{durability}: writers returned {rcs} in {took:.1f}s\n")
        for i, rc in enumerate(rcs):
            self.assertNotIsInstance(rc, BaseException, f"writer {i}: {rc!r}")
            self.assertEqual(rc, errno.ENOSPC, f"writer {i}: {self.EACH_MB} MiB over a full "
                             f"backing store through {4} MiB of staging returned "
                             f"{errno.errorcode.get(rc, rc)}")
        self.assert_alive("staging full over a full backing store")
        self.assert_logged(r"no space|ENOSPC", "ENOSPC")
        def drained(what):
            deadline = time.time() + 30
            while m.stats().get("staging_used", 0) != 0 and time.time() < deadline:
                time.sleep(0.2)
            self.assertEqual(m.stats().get("staging_used"), 0,
                             f"staging never drained {what}: {m.stats()}")

        if durability == "async":
            # Publication halts at the first failed file and its bytes stay in staging
            # for the retry (G7): nothing is lost if space comes back.
            time.sleep(1)
            self.assertGreater(m.stats().get("staging_used", 0), 0, "the bytes were dropped")
            self.assertTrue(m.stats().get("journal_halted"), f"no halt shown: {m.stats()}")
        else:
            drained("after the writers were told (strict)")
        self.assertTrue(m.stats().get("errors"), f"stats show no error: {m.stats()}")
        # The condition clears: remove the failed files (their pending publishes go with
        # them) and the filler.
        for i in range(self.WRITERS):
            if os.path.exists(self.p(f"big{i}")):
                os.unlink(self.p(f"big{i}"))
        os.unlink(filler)
        drained("after the failed files were deleted")
        self.new_work_succeeds("after")
        self.assert_alive("recovery")
        self.assertIn(m.unmount(), (0, 1))

    def test_strict(self):
        self.run_case("strict")

    def test_async(self):
        self.run_case("async")


class StateDirFullTest(ExhaustionBase):
    OPEN_EARLY = 6

    def run_case(self, durability):
        state_fs = self.make_tmpfs(48, "ckptfs-exh-state-")
        m = self.mount(["--durability", durability], state=os.path.join(state_fs, "state"),
                       staging="64M")
        os.mkdir(self.p("d"))
        # Published before the disk fills: renamed and unlinked while it is full.
        before = {f"p{i}": os.urandom(50_000 + i) for i in range(3)}
        for name, d in before.items():
            write_file(self.p("d", name), d)
        self.assertEqual(m.wait(self.p("d", "p2"), timeout=30), 0)
        # Opened (their temp files registered) before the disk fills, written and closed
        # while it is full.
        early = {}
        for i in range(self.OPEN_EARLY):
            name = f"o{i}"
            early[name] = (os.open(self.p("d", name), os.O_CREAT | os.O_WRONLY | os.O_TRUNC,
                                   0o644), os.urandom(300_000 + i))
            os.write(early[name][0], early[name][1][:100_000])
        filler = fill(state_fs)
        # Work while the state dir's disk is full.
        outcomes = {}    # name -> (errno of the save, data)

        def save(name, size):
            d = os.urandom(size)
            try:
                write_file(self.p("d", name), d, fsync=True)
                outcomes[name] = (0, d)
            except OSError as e:
                outcomes[name] = (e.errno, d)

        def finish_early(name):
            fd, d = early[name]
            try:
                try:
                    os.write(fd, d[100_000:])
                    os.fsync(fd)
                finally:
                    os.close(fd)
                outcomes[name] = (0, d)
            except OSError as e:
                outcomes[name] = (e.errno, d)

        # Large saves and many small ones: each is a few journal records, so the small
        # ones use up the last page of the write-ahead log the large ones may have left.
        results = self.run_bounded([lambda i=i: save(f"f{i}", (i + 1) * 100_000)
                                    for i in range(12)] +
                                   [lambda n=n: finish_early(n) for n in early])
        results += self.run_bounded([lambda: [save(f"s{i}", 1000) for i in range(150)]])
        for r in results:
            self.assertNotIsInstance(r, BaseException, repr(r))
        ns_errs = {"rename": errno_of(os.rename, self.p("d", "p0"), self.p("d", "g0")),
                   "unlink": errno_of(os.unlink, self.p("d", "p1")),
                   "mkdir": errno_of(os.mkdir, self.p("d", "sub"))}
        if ns_errs["rename"] == 0:
            before["g0"] = before.pop("p0")
        if ns_errs["unlink"] == 0:
            before.pop("p1")
        failed = sorted(n for n, (e, _) in outcomes.items() if e)
        by_errno = {}
        for e, _ in outcomes.values():
            if e:
                k = errno.errorcode.get(e, e)
                by_errno[k] = by_errno.get(k, 0) + 1
        sys.stderr.write(f"\n{durability}, state disk full: {len(outcomes) - len(failed)} saves "
                         f"returned 0, {len(failed)} failed {by_errno} (first: {failed[:3]}), "
                         f"namespace ops {ns_errs}\n")
        self.assert_alive("the state dir's disk filled up")
        # A save that needs a new journal record gets a clear ENOSPC, nothing vaguer.
        self.assertTrue(failed, "no save failed on a full state disk: the test did not fill it")
        self.assertEqual(set(by_errno), {"ENOSPC"}, f"saves failed with {by_errno}")
        for op, e in ns_errs.items():
            self.assertIn(e, (0, errno.ENOSPC), f"{op}: {errno.errorcode.get(e, e)}")
        self.assert_logged(r"state db.*no space left", "the full state dir")
        # Async: a save that returned 0 must end published or visibly failed.
        os.unlink(filler)
        published = {}
        for name, (e, d) in sorted(outcomes.items()):
            if e:
                continue
            rc = m.wait(self.p("d", name), timeout=60)
            self.assertIn(rc, (0, 1), f"wait {name}: {rc}")
            if durability == "strict":
                self.assertEqual(rc, 0, f"strict: the save of {name} returned 0 but it is not "
                                 "published")
            if rc == 0:
                published[name] = d
            else:
                self.assertRegex(os.getxattr(self.p("d", name),
                                             "user.ckptfs.progress").decode(), "error",
                                 f"{name}: failed without an error")
        # The condition cleared: new work succeeds, at once.
        self.new_work_succeeds("after-state-full")
        self.assert_alive("recovery")
        rc = m.unmount(timeout=120)
        self.assertIn(rc, (0, 1))
        for name, d in list(published.items()) + list(before.items()):
            self.assertEqual(hashlib.sha256(read_file(self.b("d", name))).hexdigest(),
                             hashlib.sha256(d).hexdigest(), f"{name} on the backing store")
        self.assertEqual(os.path.exists(self.b("d", "p0")), ns_errs["rename"] != 0)
        self.assertEqual(os.path.exists(self.b("d", "p1")), ns_errs["unlink"] != 0)
        self.assertEqual(os.path.isdir(self.b("d", "sub")), ns_errs["mkdir"] == 0)
        sys.stderr.write(f"    {len(published)} saves that returned 0 and {len(before)} files "
                         f"from before verified on the backing store\n")

    def test_strict(self):
        self.run_case("strict")

    def test_async(self):
        self.run_case("async")


class TooManyOpenFilesTest(ExhaustionBase):
    FILES = 300

    def test_strict(self):
        self.run_case("strict")

    def test_async(self):
        # close() returns before publication: the publish of a file whose close returned
        # 0 must not be lost for want of a descriptor either.
        self.run_case("async")

    def run_case(self, durability):
        m = self.mount(["--durability", durability])
        for i in range(40):
            write_file(self.p(f"pub{i}"), f"published {i}\n".encode() * 100)
        self.assertEqual(m.wait(self.p("pub39"), timeout=60), 0)
        pid = m.proc.pid
        in_use = len(os.listdir(f"/proc/{pid}/fd"))
        limit = in_use + 24
        r = subprocess.run(["prlimit", f"--pid={pid}", f"--nofile={limit}:{limit}"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            self.skipTest(f"prlimit failed: {r.stderr.strip()}")
        sys.stderr.write(f"\n{durability}: daemon had {in_use} fds open; RLIMIT_NOFILE set to "
                         f"{limit}\n")
        fds, errs, written = [], {}, {}

        def open_many():
            for i in range(self.FILES):
                name = f"w{i}"
                try:
                    fd = os.open(self.p(name), os.O_CREAT | os.O_WRONLY, 0o644)
                except OSError as e:
                    errs[name] = e.errno
                    continue
                data = os.urandom(200_000)
                try:
                    os.write(fd, data)
                    written[name] = (fd, data)
                except OSError as e:
                    errs[name] = e.errno
                    fds.append(fd)
            for i in range(40):
                try:
                    fds.append(os.open(self.p(f"pub{i}"), os.O_RDONLY))
                    os.read(fds[-1], 10)
                except OSError as e:
                    errs[f"pub{i}"] = e.errno

        self.run_bounded([open_many])
        close_errs = {}

        def close_all():
            for name, (fd, _) in written.items():
                try:
                    os.close(fd)
                except OSError as e:
                    close_errs[name] = e.errno
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

        self.run_bounded([close_all])
        summary = {}
        for e in list(errs.values()) + list(close_errs.values()):
            summary[errno.errorcode.get(e, e)] = summary.get(errno.errorcode.get(e, e), 0) + 1
        sys.stderr.write(f"    {len(written)} files written, errors {summary}\n")
        self.assertTrue(errs or close_errs, f"{self.FILES} files held open through a daemon "
                        f"limited to {limit} fds and no call failed")
        self.assertLessEqual(set(summary), {"EMFILE", "ENFILE"},
                             f"running out of fds must read as EMFILE/ENFILE: {summary}")
        self.assert_alive("running out of file descriptors")
        self.assert_logged(r"too many open files|EMFILE", "EMFILE")
        if durability == "async":
            # close() returned before publication: until its publish is applied, a closed
            # file still holds the daemon's descriptor of its temp file, so the condition
            # clears when those publications are done (they must be, for want of nothing).
            # With close() no longer paying a synced state-db write, new work could
            # otherwise race the publisher for the last descriptors.
            for name in written:
                if name not in close_errs:
                    self.assertEqual(m.wait(self.p(name), timeout=60), 0,
                                     f"{name} was not published after its close")
        # Condition cleared (all closed): new files work again.
        self.new_work_succeeds("after-emfile", size=MiB)
        ok = {n: d for n, (fd, d) in written.items() if n not in close_errs}
        for name, data in ok.items():
            self.assertEqual(read_file(self.p(name)), data, f"{name} through the mount")
        subprocess.run(["prlimit", f"--pid={pid}", "--nofile=65536:65536"], capture_output=True)
        rc = m.unmount(timeout=120)
        self.assertIn(rc, (0, 1) if close_errs else (0,), "drain exit code")
        for name, data in ok.items():
            self.assertEqual(read_file(self.b(name)), data, f"{name} on the backing store")
        sys.stderr.write(f"    {len(ok)} files whose write and close succeeded verified\n")


class BackingRemovedTest(ExhaustionBase):
    def test_backing_contents_and_dir_removed_then_restored(self):
        m = self.mount(["--durability", "strict"])
        os.mkdir(self.p("d"))
        write_file(self.p("d", "a"), b"a" * 100_000)
        write_file(self.p("top"), b"top\n")
        aside = m.backing + ".aside"
        # 1. The contents deleted behind the daemon's back.
        shutil.copytree(m.backing, aside, symlinks=True)
        shutil.rmtree(self.b("d"))
        os.unlink(self.b("top"))
        r1 = {"read d/a": errno_of(read_file, self.p("d", "a")),
              "create d/new": errno_of(write_file, self.p("d", "new"), b"n"),
              "mkdir d/sub": errno_of(os.mkdir, self.p("d", "sub")),
              "rename top": errno_of(os.rename, self.p("top"), self.p("top2"))}
        sys.stderr.write(f"\ncontents removed: {r1}\n")
        for op in ("read d/a", "create d/new", "mkdir d/sub"):
            self.assertNotEqual(r1[op], 0, f"{op} succeeded on a deleted backing dir: {r1}")
        self.assert_alive("the backing contents were removed")
        self.assert_logged(r"no such file|ENOENT|not found", "missing backing files")
        # 2. The backing dir itself gone (moved away, so it can be restored).
        shutil.rmtree(aside)
        os.rename(m.backing, aside)
        # The daemon holds the root by fd; remove the directory for real: empty it and
        # rmdir it, so the fd names a deleted directory.
        for n in os.listdir(aside):
            p = os.path.join(aside, n)
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
        os.rmdir(aside)
        r2 = {"create top3": errno_of(write_file, self.p("top3"), b"x"),
              "mkdir e": errno_of(os.mkdir, self.p("e")),
              "listdir": errno_of(os.listdir, self.p())}
        sys.stderr.write(f"backing dir removed: {r2}\n")
        self.assertNotEqual(r2["create top3"], 0, f"create on a removed backing dir: {r2}")
        self.assertNotEqual(r2["mkdir e"], 0, f"mkdir on a removed backing dir: {r2}")
        self.assert_alive("the backing dir was removed")
        self.assert_logged(r"backing dir .* was removed", "the removed backing dir")
        # 3. Created again at its path: the daemon must switch to it and work again.
        os.mkdir(m.backing)
        self.new_work_succeeds("after-restore", size=100_000)
        os.mkdir(self.p("e2"))
        write_file(self.p("e2", "x"), b"x" * 5000)
        self.assertEqual(m.wait(self.p("e2", "x"), timeout=60), 0)
        self.assertEqual(read_file(self.b("e2", "x")), b"x" * 5000)
        self.assert_alive("the backing dir was restored")
        self.assert_logged(r"backing dir .* created again", "the re-created backing dir")
        self.assertIn(m.unmount(timeout=120), (0, 1))


if __name__ == "__main__":
    unittest.main()
