"""A fork server for the tests' torch ranks: torch is imported once, each rank is a fork.

Every DCP save or load of the e2e tests starts its ranks as separate processes, and on
Debian's torch 1.13 each start costs about 1.4 s of CPU before the rank does anything
(`import torch` and torch.distributed). The suite makes several hundred such starts; on
a 2-core machine that is minutes of the CI budget spent importing the same modules.

With CKPTFS_DCP_ZYGOTE=1 (the e2e tests' ctest environment sets it), dcp_tool starts one
server per test process instead: an interpreter with the ranks' environment that imports
torch once and then forks a child per rank. A child is still a separate process with its
own pid, environment, cgroups (the caller's, as a child it started would have),
stdout/stderr files, gloo connections and open files through the mount; only the import
is shared. Benchmarks leave the variable unset and start every rank
fresh, as a user's job does.

The server is single-threaded when it forks (torch 1.13 starts no thread at import; the
server checks this and refuses otherwise). It reaps its children and reports their exit
codes; when its stdin closes (the test process ended, however it ended) it SIGKILLs any
child still running and exits. The parent side imitates the part of subprocess.Popen
that dcp_tool uses: poll(), kill(), wait(), returncode, pid.

Wire (one JSON object per line): parent -> server {"args": [...], "env": {...},
"out": path, "err": path}; server -> parent {"pid": N} right after each fork (or
{"error": text}), and {"exit": N, "code": C} when child N ends (C < 0: killed by -C).
"""
import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ENV_FLAG = "CKPTFS_DCP_ZYGOTE"


def enabled():
    return os.environ.get(ENV_FLAG, "0") == "1"


def _cgroups(pid):
    """{hierarchy: path} of a process (/proc/PID/cgroup)."""
    out = {}
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            out[controllers] = path
    return out


def _join_cgroups(want):
    """Moves this process into the cgroups `want` names where they differ from its own, so
    a rank forked by the server sits where a rank the caller started would (a test that
    put itself into a blkio throttle before a load gets throttled ranks)."""
    mine = _cgroups("self")
    for controllers, path in want.items():
        if mine.get(controllers) == path:
            continue
        name = controllers.split("=", 1)[-1] if controllers else "unified"
        top = os.path.join("/sys/fs/cgroup", name)
        if not os.path.isdir(top):
            top = os.path.join("/sys/fs/cgroup", name.split(",")[0])
        with open(os.path.join(top, path.lstrip("/"), "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))


def _code_of(status):
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


class _Server:
    """One fork server (parent side)."""

    def __init__(self, python, env, module_path, entry):
        self.tmp = tempfile.mkdtemp(prefix="rank-zygote-")
        env = dict(env, TMPDIR=self.tmp)
        self.proc = subprocess.Popen(
            [python, os.path.abspath(__file__), "_serve", module_path, entry],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.lock = threading.Lock()
        self.exits = {}
        self.buf = b""

    def alive(self):
        return self.proc.poll() is None

    def _handle(self, line):
        msg = json.loads(line)
        if "exit" in msg:
            self.exits[msg["exit"]] = msg["code"]
        return msg

    def _pump(self, timeout):
        """Reads what the server has written within `timeout` s; returns the messages."""
        fd = self.proc.stdout.fileno()
        out = []
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            return out
        data = os.read(fd, 1 << 16)
        if not data:
            raise RuntimeError(f"rank fork server exited ({self.proc.poll()})")
        self.buf += data
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            out.append(self._handle(line))
        return out

    def spawn(self, args, env, out, err, timeout=60):
        with self.lock:
            req = json.dumps({"args": args, "env": env, "out": out, "err": err,
                              "cgroups": _cgroups("self")}) + "\n"
            self.proc.stdin.write(req.encode())
            self.proc.stdin.flush()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                for msg in self._pump(deadline - time.monotonic()):
                    if "error" in msg:
                        raise RuntimeError(f"rank fork server: {msg['error']}")
                    if "pid" in msg:
                        return _Rank(self, msg["pid"])
            raise RuntimeError("rank fork server did not answer a spawn")

    def returncode(self, pid):
        with self.lock:
            if pid not in self.exits and self.alive():
                self._pump(0)
            if pid not in self.exits and not self.alive():
                # The server is gone; so are its children (it kills them on the way out).
                self.exits[pid] = -signal.SIGKILL
            return self.exits.get(pid)

    def close(self):
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


class _Rank:
    """The part of subprocess.Popen dcp_tool uses, for a child of the fork server."""

    def __init__(self, server, pid):
        self.server = server
        self.pid = pid
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            self.returncode = self.server.returncode(self.pid)
        return self.returncode

    def kill(self):
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode


_servers = {}
_servers_lock = threading.Lock()


def spawn(python, base_env, module_path, entry, args, env, out, err):
    """Forks `module_path`'s `entry`(*args) in a server started with `python` and
    `base_env` (reused while those stay the same); the child gets `env` as its environment
    and `out`/`err` as its stdout/stderr. Returns a Popen-like handle."""
    key = (python, base_env.get("PYTHONPATH", ""), module_path, entry)
    with _servers_lock:
        server = _servers.get(key)
        if server is None or not server.alive():
            server = _servers[key] = _Server(python, base_env, module_path, entry)
    return server.spawn(args, env, out, err)


@atexit.register
def close_all():
    with _servers_lock:
        for server in _servers.values():
            server.close()
        _servers.clear()


# ----------------------------------------------------------------------------------------------
# Server side.

def _serve(module_path, entry):
    import importlib.util
    spec = importlib.util.spec_from_file_location("_zygote_payload", module_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["_zygote_payload"] = module
    spec.loader.exec_module(module)
    preload = getattr(module, "zygote_preload", None)
    if preload:
        preload()
    func = getattr(module, entry)
    threads = len(os.listdir("/proc/self/task"))

    children = set()
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wfd)

    def send(msg):
        os.write(1, (json.dumps(msg) + "\n").encode())

    def reap():
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)
            send({"exit": pid, "code": _code_of(status)})

    def fork_child(req):
        if threads != 1:
            send({"error": f"the server runs {threads} threads; forking it is unsafe"})
            return
        pid = os.fork()
        if pid:
            children.add(pid)
            send({"pid": pid})
            return
        # Child.
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(rfd)
            os.close(wfd)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
            os.dup2(os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
            sys.stdin = open(0, closefd=False)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            _join_cgroups(req.get("cgroups", {}))
            os.environ.clear()
            os.environ.update(req["env"])
            tempfile.tempdir = None
            code = func(*req["args"])
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code if isinstance(code, int) else 1)

    buf = b""
    while True:
        try:
            ready, _, _ = select.select([0, rfd], [], [])
        except InterruptedError:
            ready = []
        if rfd in ready:
            try:
                os.read(rfd, 512)
            except BlockingIOError:
                pass
        reap()
        if 0 not in ready:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            break
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            fork_child(json.loads(line))
    # The parent is gone or done: nothing of ours outlives it.
    for pid in list(children):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for pid in list(children):
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "_serve":
        _serve(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: rank_zygote.py _serve MODULE_PATH ENTRY (started by rank_zygote.spawn)")
