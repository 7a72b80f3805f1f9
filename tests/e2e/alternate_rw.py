"""Two processes taking turns on one file, the way torch's c10d FileStore and an in-place
DCP re-save followed by another rank's load do. Every read is checked against what the
other side wrote; the first mismatch or error (EIO...) ends the run with exit 1 and a line
saying what was expected, what came back, and the round.

    alternate_rw.py filestore PATH --rounds N    # open/flock/read/append/close, lockstep
    alternate_rw.py freerun PATH --seconds S     # the same ops, no lockstep, both processes
    alternate_rw.py rewrite PATH --rounds N      # O_TRUNC rewrite by one, read by the other

--settle (on a ckptfs mount): before the reads that follow the other side's close, wait
until the file's `user.ckptfs.state` xattr says `published`, so each round also reads
after the publication has been applied, whatever the timing.

The turns are forced with pipes, so each round makes the same sequence of system calls
whatever the timing:

filestore: a reader opens O_RDONLY and reads, the writer opens O_RDWR, the reader closes,
    the writer reads, checks and appends a record, the reader opens again, the writer
    closes, the reader reads the new record. Roles swap every round. (Handles of the
    reader are opened and closed while the writer's is open, and the other way round.)
rewrite: the reader opens the file before the writer rewrites it in place (O_TRUNC and new
    contents of another size), reads after the writer's close through that descriptor,
    and then through a fresh one. Both must show the new contents (POSIX: a descriptor
    names the file, not the bytes it had at open).

Only the standard library; runs under any python3.
"""
import argparse
import errno
import fcntl
import hashlib
import os
import struct
import sys
import time

RECORD = 64  # bytes per FileStore-like record


def record(proc, i):
    body = f"p{proc}:r{i}:".encode()
    body += hashlib.sha256(body).hexdigest().encode()
    return body[:RECORD - 1].ljust(RECORD - 1, b".") + b"\n"


def read_all(fd):
    """Everything from offset 0 to EOF through `fd` (pread, so the offset is irrelevant).
    The kernel's page cache of the file is dropped first, so the reads reach the daemon."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    out = bytearray()
    while True:
        b = os.pread(fd, 1 << 20, len(out))
        if not b:
            return bytes(out)
        out += b


def check_records(data, expect_count, where):
    if len(data) != expect_count * RECORD:
        raise AssertionError(f"{where}: {len(data)} bytes, expected {expect_count} records "
                             f"({expect_count * RECORD} bytes)")
    for k in range(expect_count):
        rec = data[k * RECORD:(k + 1) * RECORD]
        # Records alternate between the two processes: round k was written by k % 2.
        if rec != record(k % 2, k):
            raise AssertionError(f"{where}: record {k} is {rec[:40]!r}, expected "
                                 f"{record(k % 2, k)[:40]!r}")


SETTLE = False


def settle(path):
    """Waits until ckptfs says `path` is published (no-op unless --settle)."""
    if not SETTLE:
        return
    deadline = time.time() + 30
    while os.getxattr(path, "user.ckptfs.state") != b"published":
        if time.time() > deadline:
            raise AssertionError(f"{path} not published within 30 s")
        time.sleep(0.001)


def payload(i):
    # Sizes vary around 4 KiB pages and 1 MiB blocks, so short and long files alternate.
    size = [5000, 300, (1 << 20) + 17, 70000, 1][i % 5] + i % 7
    seed = hashlib.sha256(f"round {i}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


class Turns:
    """A pair of pipes: one side says `go`, the other waits for it."""

    def __init__(self):
        self.a_r, self.a_w = os.pipe()  # a -> b
        self.b_r, self.b_w = os.pipe()  # b -> a

    def side(self, me):
        return (self.a_w, self.b_r) if me == 0 else (self.b_w, self.a_r)


def send(fd, tag):
    os.write(fd, struct.pack("<i", tag))


def recv(fd):
    b = os.read(fd, 4)
    if len(b) != 4:
        raise EOFError("the other process ended")
    (tag,) = struct.unpack("<i", b)
    if tag < 0:
        raise EOFError("the other process failed")
    return tag


def run_filestore(me, path, rounds, out, inp):
    # Round i: process i % 2 appends record i; the other reads around it.
    for i in range(rounds):
        if i % 2 == me:  # writer
            recv(inp)  # the reader has read through its handle
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            send(out, i)
            recv(inp)  # the reader closed that handle while this one is open
            fcntl.flock(fd, fcntl.LOCK_EX)
            check_records(read_all(fd), i, f"round {i} writer p{me} before append")
            os.pwrite(fd, record(me, i), i * RECORD)
            check_records(read_all(fd), i + 1, f"round {i} writer p{me} after append")
            fcntl.flock(fd, fcntl.LOCK_UN)
            send(out, i)
            recv(inp)  # the reader opened a new handle before this close
            os.close(fd)
            send(out, i)
            recv(inp)  # the reader is done: no handle is open when the next round starts
        else:  # reader
            # Like FileStore's get(): O_RDONLY, no O_CREAT (which makes the open a create).
            fd = os.open(path, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_SH)
            check_records(read_all(fd), i, f"round {i} reader p{me}")
            fcntl.flock(fd, fcntl.LOCK_UN)
            send(out, i)
            recv(inp)  # the writer has opened
            os.close(fd)
            send(out, i)
            recv(inp)  # the writer appended, still open
            fd = os.open(path, os.O_RDONLY)
            send(out, i)
            recv(inp)  # the writer closed: its publication is queued
            settle(path)
            check_records(read_all(fd), i + 1, f"round {i} reader p{me} after the append")
            os.close(fd)
            send(out, i)


def run_rewrite(me, path, rounds, out, inp):
    # Round i (from 1): process i % 2 rewrites the file in place with payload(i).
    for i in range(1, rounds + 1):
        if i % 2 == me:  # writer: rewrites in place once the reader holds a descriptor
            recv(inp)
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
            data = payload(i)
            for off in range(0, len(data), 1 << 20):
                os.pwrite(fd, data[off:off + (1 << 20)], off)
            os.close(fd)
            send(out, i)
            recv(inp)
        else:
            fd = os.open(path, os.O_RDONLY)
            if read_all(fd) != payload(i - 1):
                raise AssertionError(f"round {i} reader p{me}: before the rewrite, not round "
                                     f"{i - 1}'s contents")
            send(out, i)
            recv(inp)  # rewritten and closed
            settle(path)
            for how, rfd in (("the descriptor opened before", fd),
                             ("a fresh descriptor", os.open(path, os.O_RDONLY))):
                got = read_all(rfd)
                if got != payload(i):
                    raise AssertionError(f"round {i} reader p{me} through {how}: {len(got)} "
                                         f"bytes, expected {len(payload(i))} (round {i})")
                os.close(rfd)
            send(out, i)


def run_freerun(me, path, seconds, out, inp):
    """FileStore without lockstep: `add` (EX lock, read, append) and `get` (SH lock, read)
    in a loop; every read must parse as whole records, each process's own in order."""
    rec_len = RECORD
    deadline = time.time() + seconds
    mine = 0
    ops = 0
    while time.time() < deadline:
        if ops % 3 != 2:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            data = read_all(fd)
            if len(data) % rec_len:
                raise AssertionError(f"p{me} op {ops}: torn file of {len(data)} bytes")
            os.pwrite(fd, f"p{me}:{mine}:".encode().ljust(rec_len - 1, b".") + b"\n", len(data))
            mine += 1
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        else:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            fcntl.flock(fd, fcntl.LOCK_SH)
            data = read_all(fd)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            if len(data) % rec_len:
                raise AssertionError(f"p{me} op {ops}: torn file of {len(data)} bytes")
            seen = [int(r.split(b":")[1]) for r in data.split(b"\n")[:-1]
                    if r.startswith(f"p{me}:".encode())]
            if seen != list(range(mine)):
                raise AssertionError(f"p{me} op {ops}: own records {seen[-3:]} of {mine}")
        ops += 1
    return ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["filestore", "rewrite", "freerun"])
    ap.add_argument("path")
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--settle", action="store_true")
    args = ap.parse_args()
    global SETTLE
    SETTLE = args.settle
    # The file exists before the two processes start (payload 0 for rewrite, empty for the
    # others), so neither's open is a create.
    with open(args.path, "wb") as f:
        f.write(payload(0) if args.mode == "rewrite" else b"")
    turns = Turns()
    started = time.time()
    pids = []
    for me in (0, 1):
        pid = os.fork()
        if pid == 0:
            out, inp = turns.side(me)
            code = 0
            try:
                if args.mode == "filestore":
                    run_filestore(me, args.path, args.rounds, out, inp)
                elif args.mode == "rewrite":
                    run_rewrite(me, args.path, args.rounds, out, inp)
                else:
                    ops = run_freerun(me, args.path, args.seconds, out, inp)
                    print(f"p{me}: {ops} ops", flush=True)
            except EOFError:
                code = 3  # the other side failed and said why
            except (AssertionError, OSError) as e:
                name = errno.errorcode.get(getattr(e, "errno", None) or 0, "")
                print(f"FAIL p{me} ({name or type(e).__name__}): {e}", flush=True)
                code = 1
            if code:
                try:
                    send(out, -1)
                except OSError:
                    pass
            os._exit(code)
        pids.append(pid)
    for fd in (turns.a_r, turns.a_w, turns.b_r, turns.b_w):
        os.close(fd)
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    secs = time.time() - started
    if any(c == 1 for c in codes) or any(c not in (0, 1, 3) for c in codes):
        print(f"{args.mode}: FAILED after {secs:.1f} s (exit codes {codes})", flush=True)
        sys.exit(1)
    if any(codes):
        print(f"{args.mode}: FAILED, exit codes {codes}", flush=True)
        sys.exit(1)
    print(f"{args.mode}: ok, {args.rounds if args.mode != 'freerun' else ''} "
          f"in {secs:.1f} s", flush=True)


if __name__ == "__main__":
    main()
