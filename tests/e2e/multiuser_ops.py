"""Runs a list of file-system operations under one directory and reports each errno.

Used by test_multiuser.py, started as another uid with setpriv. Reads a JSON list of
ops on stdin; writes a JSON list of results (0 or an errno name) on stdout. Every path
is relative to argv[1]. Kept free of test logic: it only performs the calls.
"""
import ctypes
import errno
import json
import os
import socket
import stat
import sys

_libc = ctypes.CDLL(None, use_errno=True)
FALLOC_FL_KEEP_SIZE = 1
FALLOC_FL_PUNCH_HOLE = 2


def fallocate(fd, mode, offset, length):
    if _libc.fallocate(fd, mode, ctypes.c_long(offset), ctypes.c_long(length)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def run(root, op):
    P = lambda rel: os.path.join(root, rel)  # noqa: E731
    kind, args = op[0], op[1:]
    if kind == "create":  # path, mode, data
        fd = os.open(P(args[0]), os.O_CREAT | os.O_EXCL | os.O_WRONLY, args[1])
        try:
            os.write(fd, args[2].encode())
        finally:
            os.close(fd)
    elif kind == "write":  # path, data: open O_WRONLY|O_APPEND
        fd = os.open(P(args[0]), os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, args[1].encode())
        finally:
            os.close(fd)
    elif kind == "otrunc":
        os.close(os.open(P(args[0]), os.O_WRONLY | os.O_TRUNC))
    elif kind == "read":
        with open(P(args[0]), "rb") as f:
            f.read()
    elif kind == "truncate":
        os.truncate(P(args[0]), args[1])
    elif kind == "mkdir":
        os.mkdir(P(args[0]), args[1])
    elif kind == "rmdir":
        os.rmdir(P(args[0]))
    elif kind == "unlink":
        os.unlink(P(args[0]))
    elif kind == "rename":
        os.rename(P(args[0]), P(args[1]))
    elif kind == "symlink":
        os.symlink(args[0], P(args[1]))
    elif kind == "chmod":
        os.chmod(P(args[0]), args[1])
    elif kind == "chown":  # path, uid, gid (-1 keeps), follow
        if args[3]:
            os.chown(P(args[0]), args[1], args[2])
        else:
            os.lchown(P(args[0]), args[1], args[2])
    elif kind == "utime_now":
        os.utime(P(args[0]), None)
    elif kind == "utime":  # explicit (atime, mtime) in ns
        os.utime(P(args[0]), ns=(args[1], args[2]))
    elif kind == "link":
        os.link(P(args[0]), P(args[1]), follow_symlinks=False)
    elif kind == "mkfifo":
        os.mkfifo(P(args[0]), args[1])
    elif kind == "mknod":  # path, mode with type bits
        os.mknod(P(args[0]), args[1])
    elif kind == "bind":  # a unix socket bound at path (a socket file)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(P(args[0]))
        finally:
            s.close()
    elif kind == "fallocate":  # path, mode, offset, length
        fd = os.open(P(args[0]), os.O_WRONLY)
        try:
            fallocate(fd, args[1], args[2], args[3])
        finally:
            os.close(fd)
    elif kind == "access":  # path, mode bits (R_OK 4, W_OK 2, X_OK 1)
        if not os.access(P(args[0]), args[1]):
            raise OSError(errno.EACCES, "access")
    elif kind == "listdir":
        os.listdir(P(args[0]))
    elif kind == "fifo_roundtrip":  # a FIFO carries bytes between two opens
        fd = os.open(P(args[0]), os.O_RDWR)
        try:
            os.write(fd, b"ping")
            if os.read(fd, 4) != b"ping":
                raise OSError(errno.EIO, "fifo lost bytes")
        finally:
            os.close(fd)
    else:
        raise ValueError(f"unknown op {kind}")


def main():
    root = sys.argv[1]
    os.umask(0o022)
    out = []
    for op in json.load(sys.stdin):
        try:
            run(root, op)
            out.append("0")
        except OSError as e:
            out.append(errno.errorcode.get(e.errno, str(e.errno)))
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
