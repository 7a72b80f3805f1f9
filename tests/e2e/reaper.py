"""Undoes what an e2e test process set up when it is killed before its own cleanup runs.

ctest kills a test that passes its TIMEOUT with SIGKILL, and every process of its tree
with it: no finally block, tearDown or context manager runs. The daemons die with it and
leave their mounts dead ("Transport endpoint is not connected"), and network namespaces,
links, cgroups, bind mounts and tmpfs mounts stay behind.

harness.run_e2e_file starts a guardian before the tests run. The guardian lives outside
that tree (forked twice, in its own session, its stdio on /dev/null so ctest does not wait
for it). The helpers that set something up register it here: one line appended to a file
per thing. Once the test process is gone, the guardian undoes every registered thing that
is still there, in phases: processes, by PID and start time, so a reused PID is never hit;
then mounts, newest first; then namespaces, links and cgroups. A test that cleaned up
after itself leaves it nothing to do. What it undid goes to ckptfs-e2e-reaper.log in the
temp dir.

Usage: start_guardian() once per test process; register_pid(PID) for a process it started,
register_mount(PATH) once something is mounted there, register(KIND, NAME) for a netns,
link or cgroup. Registering is a no-op outside a guarded process.

A mount is registered with its mount ID and undone only while that very mount is the top
one at its path: the torch roots are shared, and another run may have mounted the same
path since.
"""
import os
import signal
import subprocess
import sys
import tempfile
import time

ENV = "CKPTFS_E2E_REGISTRY"
KINDS = ("pid", "mount", "netns", "link", "cgroup")
LOG = os.path.join(tempfile.gettempdir(), "ckptfs-e2e-reaper.log")


def register(kind, value):
    """Records that this test process set up `value` (a PID, a path, a name)."""
    path = os.environ.get(ENV)
    if not path:
        return
    if kind not in KINDS or "\n" in str(value):
        raise ValueError(f"reaper: cannot register {kind} {value!r}")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, f"{kind} {value}\n".encode())
    finally:
        os.close(fd)


def register_pid(pid):
    register("pid", f"{pid} {start_time(pid)}")


def register_mount(path):
    """Records the mount now on top at `path` (nothing when nothing is mounted there)."""
    path = os.path.realpath(path)
    top = _top_mounts().get(path)
    if top is not None:
        register("mount", f"{top} {path}")


def start_time(pid):
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or
    None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def start_guardian():
    """Starts the guardian of this process (once; later calls return the same registry)."""
    if os.environ.get(ENV) and os.path.exists(os.environ[ENV]):
        return os.environ[ENV]
    fd, path = tempfile.mkstemp(prefix="ckptfs-e2e-registry-")
    os.close(fd)
    os.environ[ENV] = path
    # The first child forks the guardian and exits at once; the guardian's parent is then
    # init (or a subreaper), not this process, so a kill of this tree misses it.
    subprocess.run([sys.executable, os.path.abspath(__file__), "guard", str(os.getpid()), path],
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=True, timeout=30)
    return path


def _top_mounts():
    """{mount point: the ID of the mount on top there} (later lines stack on earlier)."""
    top = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            top[fields[4].encode().decode("unicode_escape")] = fields[0]  # \040: a space
    return top


def _log(msg):
    with open(LOG, "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n")


def _run(*cmd):
    return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          timeout=60).returncode


def undo(entries, owner):
    """Undoes `entries` [(kind, value)] still present. Returns what it undid, in words."""
    done = []
    for kind, value in entries:
        if kind != "pid":
            continue
        pid, started = value.split()
        if start_time(int(pid)) != started:
            continue  # gone, or the PID now belongs to another process
        os.kill(int(pid), signal.SIGKILL)
        done.append(f"killed {pid}")
    for kind, value in entries:
        if kind == "pid":
            pid, started = value.split()
            for _ in range(100):  # its mount's FUSE connection closes as it exits
                if start_time(int(pid)) != started:
                    break
                time.sleep(0.05)
    mounts = [v.split(" ", 1) for k, v in entries if k == "mount"]
    for mount_id, mp in reversed(mounts):
        if _top_mounts().get(mp) == mount_id:
            if _run("umount", mp) != 0 and _run("umount", "-l", mp) != 0:
                _run("fusermount3", "-u", "-z", mp)  # not root: a FUSE mount of this user
            done.append(f"unmounted {mp}")
    for kind, value in reversed(entries):
        if kind == "netns" and os.path.exists(f"/run/netns/{value}"):
            _run("ip", "netns", "del", value)
            done.append(f"deleted netns {value}")
        elif kind == "link" and os.path.exists(f"/sys/class/net/{value}"):
            _run("ip", "link", "del", value)
            done.append(f"deleted link {value}")
        elif kind == "cgroup" and os.path.isdir(value):
            try:
                os.rmdir(value)
                done.append(f"removed cgroup {value}")
            except OSError as e:
                done.append(f"could not remove cgroup {value}: {e}")
    if done:
        _log(f"test process {owner} died with its setup in place: " + "; ".join(done))
    return done


def read_registry(path):
    entries = []
    with open(path) as f:
        for line in f:
            kind, _, value = line.rstrip("\n").partition(" ")
            if kind in KINDS and value:
                entries.append((kind, value))
    return entries


def guard(owner, path):
    owner_started = start_time(owner)
    try:
        pidfd = os.pidfd_open(owner)
    except ProcessLookupError:
        pidfd = None  # already gone
    except OSError:
        pidfd = -1  # no pidfd_open (a kernel before 5.3): poll /proc instead
    if os.fork() != 0:
        os._exit(0)  # the first child: its exit reparents the guardian
    os.setsid()
    if pidfd == -1:
        while owner_started is not None and start_time(owner) == owner_started:
            time.sleep(0.5)
    elif pidfd is not None:
        import select
        select.select([pidfd], [], [])  # readable once the owner has exited
        os.close(pidfd)
    try:
        undo(read_registry(path), owner)
    except Exception as e:  # a guardian must not die before removing its registry
        _log(f"guardian of {owner}: {e!r}")
    try:
        os.unlink(path)
    except OSError:
        pass
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "guard":
        guard(int(sys.argv[2]), sys.argv[3])
    sys.exit(f"usage: {sys.argv[0]} guard OWNER_PID REGISTRY")
