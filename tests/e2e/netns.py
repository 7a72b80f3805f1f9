"""Several ckptfs daemons on one machine, each in its own network namespace (issue 12).

Cluster(k) makes a bridge, one network namespace per node (`ip netns add`) joined to the
bridge by a veth pair, and optionally a blkio cgroup whose read throttle on the backing
disk stands in for a shared parallel file system. Daemons run in the foreground under
`nsenter --net=/run/netns/NAME` (never `ip netns exec`, whose private mount namespace
would hide the FUSE mount from the test), so each has its own addresses while every mount
stays visible here. UCX is pinned to TCP on the node's veth.

cleanup() (also run by __exit__, and meant for unittest's addCleanup) kills by PID every
daemon it started, lazily unmounts every mountpoint, deletes every namespace, veth,
the bridge and the cgroup, whatever state a failed test left them in.

ClusterTest gives a unittest.TestCase a fresh cluster per test, set up, started and serving
its peers, with what its assertions print (logs) and wait for (eventually, no_backing_reads).
"""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

import reaper
from harness import CKPTFS, is_mounted, unmount

SECRET = "ckptfs-e2e shared secret 0123456789"
PORT = 7470


def _run(*cmd, check=True):
    r = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stdout.strip()}")
    return r


def backing_disk(path):
    """MAJ:MIN of the whole disk holding `path` (blkio throttles whole disks)."""
    st = os.stat(path)
    majmin = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sys_dir = os.path.realpath(f"/sys/dev/block/{majmin}")
    if os.path.exists(os.path.join(sys_dir, "partition")):
        with open(os.path.join(os.path.dirname(sys_dir), "dev")) as f:
            majmin = f.read().strip()
    return majmin


def throttle_writes(test, pid, path, bps, name):
    """Puts process `pid` (every thread) into a new blkio cgroup that throttles its writes to
    the disk holding `path` to `bps` bytes/s: a slow store for a daemon's direct flushes.
    The cgroup is removed by a cleanup registered on `test` (once its process has left)."""
    cgroup = f"/sys/fs/cgroup/blkio/{name}-{os.getpid()}-{pid}"
    reaper.register("cgroup", cgroup)
    os.makedirs(cgroup, exist_ok=True)
    test.addCleanup(remove_cgroup, cgroup)
    with open(os.path.join(cgroup, "blkio.throttle.write_bps_device"), "w") as f:
        f.write(f"{backing_disk(path)} {bps}\n")
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(pid))
    return cgroup


def remove_cgroup(cgroup):
    """Removes a cgroup, waiting (up to 10 s) for its processes to leave it."""
    for _ in range(100):
        try:
            os.rmdir(cgroup)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


class Node:
    def __init__(self, cluster, index):
        self.cluster = cluster
        self.index = index
        tag = cluster.tag
        self.ns = f"ckns{tag}{index}"
        self.veth_host = f"ckh{tag}{index}"
        self.veth_ns = f"ckn{tag}{index}"
        self.ip = f"{cluster.subnet}.{index + 1}"
        self.address = f"{self.ip}:{PORT}"
        self.mnt = os.path.join(cluster.root, f"mnt{index}")
        self.state = os.path.join(cluster.root, f"state{index}")
        self.log = os.path.join(cluster.root, f"ckptfs{index}.log")
        self.proc = None
        os.makedirs(self.mnt, exist_ok=True)

    def start(self, extra_args=(), secret_file=None, timeout=30):
        c = self.cluster
        cmd = [CKPTFS, "-f", "--staging-mem", c.staging, "--state-dir", self.state,
               "--log-file", self.log, "--log-level", "debug",
               "--peers-file", c.peers_file,
               "--peer-secret-file", secret_file or c.secret_file,
               "--peer-timeout", "3000"] + list(c.daemon_args) + list(extra_args) + [
                   c.backing, self.mnt]
        env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES=self.veth_ns,
                   UCX_WARN_UNUSED_ENV_VARS="n")
        # The shell puts itself into the cgroup, then becomes nsenter, which becomes
        # ckptfs: one PID throughout, so the test can kill exactly that process.
        wrapper = ['sh', '-c', 'if [ -n "$CG" ]; then echo $$ > "$CG/cgroup.procs" || exit 99; fi; '
                   'exec nsenter --net=/run/netns/"$NS" "$@"', 'sh']
        env["CG"] = c.cgroup or ""
        env["NS"] = self.ns
        self.proc = subprocess.Popen(wrapper + cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        reaper.register_pid(self.proc.pid)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode(errors="replace")
                raise RuntimeError(f"node {self.index}: ckptfs exited {self.proc.returncode}: "
                                   f"{out}\n{self.log_text()}")
            if is_mounted(self.mnt) and os.path.exists(os.path.join(self.mnt, ".ckptfs", "stats")):
                reaper.register_mount(self.mnt)
                return self
            time.sleep(0.05)
        raise RuntimeError(f"node {self.index}: no mount in time\n" + self.log_text())

    def stats(self):
        with open(os.path.join(self.mnt, ".ckptfs", "stats")) as f:
            return json.load(f)

    def log_text(self, tail=6000):
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-tail:]
        except OSError:
            return ""

    def wait_log(self, text, timeout=10):
        """The whole log once it holds `text` (info lines are flushed every second), or as
        it is after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            out = self.log_text(1 << 30)
            if text in out or time.monotonic() > deadline:
                return out
            time.sleep(0.1)

    def kill(self, sig=signal.SIGKILL):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=60 if sig == signal.SIGTERM else 10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        unmount(self.mnt)

    def stop(self):
        """Clean stop: SIGTERM (the daemon drains and unmounts), else SIGKILL."""
        self.kill(signal.SIGTERM)


class Cluster:
    """k nodes over one backing dir. Use as a context manager or call cleanup()."""

    def __init__(self, k, root=None, backing=None, throttle_bps=None, daemon_args=(),
                 write_throttle_bps=None, staging="64M"):
        self.k = k
        self.root = root or tempfile.mkdtemp(prefix="ckptfs-peers-")
        os.makedirs(self.root, exist_ok=True)
        self.backing = backing or os.path.join(self.root, "backing")
        os.makedirs(self.backing, exist_ok=True)
        pid = os.getpid()
        self.tag = f"{pid % 4096:x}"
        self.subnet = f"10.{200 + pid % 50}.{(pid // 50) % 250}"
        self.bridge = f"ckbr{self.tag}"
        self.daemon_args = list(daemon_args)
        self.throttle_bps = throttle_bps
        self.write_throttle_bps = write_throttle_bps
        self.staging = staging
        self.cgroup = None
        self.nodes = []
        self._made_ns, self._made_veth, self._made_bridge = [], [], False
        self.peers_file = os.path.join(self.root, "peers")
        self.secret_file = os.path.join(self.root, "secret")
        self.wrong_secret_file = os.path.join(self.root, "wrong-secret")
        for path, text in ((self.secret_file, SECRET),
                           (self.wrong_secret_file, "not the cluster's secret, but long")):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.write(fd, text.encode())
            os.close(fd)

    def setup(self):
        try:
            reaper.register("link", self.bridge)
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            self._made_bridge = True
            _run("ip", "link", "set", self.bridge, "up")
            for i in range(self.k):
                node = Node(self, i)
                self.nodes.append(node)
                reaper.register("netns", node.ns)
                _run("ip", "netns", "add", node.ns)
                self._made_ns.append(node.ns)
                reaper.register("link", node.veth_host)
                _run("ip", "link", "add", node.veth_host, "type", "veth", "peer", "name",
                     node.veth_ns)
                self._made_veth.append(node.veth_host)
                _run("ip", "link", "set", node.veth_ns, "netns", node.ns)
                # UCX lists TCP devices from /sys/class/net, which (the mount namespace being
                # the host's) shows the host's interfaces, and then checks each in the
                # daemon's own network namespace. So the namespace's end takes the name of
                # the host's end: UCX finds the name in sysfs and uses the namespace's device.
                _run("ip", "-n", node.ns, "link", "set", node.veth_ns, "name", node.veth_host)
                node.veth_ns = node.veth_host
                _run("ip", "link", "set", node.veth_host, "master", self.bridge, "up")
                _run("ip", "-n", node.ns, "addr", "add", f"{node.ip}/24", "dev", node.veth_ns)
                _run("ip", "-n", node.ns, "link", "set", node.veth_ns, "up")
                _run("ip", "-n", node.ns, "link", "set", "lo", "up")
            with open(self.peers_file, "w") as f:
                f.write("# written as a Slurm prolog would\n")
                for n in self.nodes:
                    f.write(n.address + "\n")
            if self.throttle_bps or self.write_throttle_bps:
                # One cgroup for every daemon: the throttles are the whole store's bandwidth.
                self.cgroup = f"/sys/fs/cgroup/blkio/ckptfs-peers-{os.getpid()}"
                reaper.register("cgroup", self.cgroup)
                os.makedirs(self.cgroup, exist_ok=True)
                for name, bps in (("read", self.throttle_bps), ("write", self.write_throttle_bps)):
                    if bps:
                        with open(os.path.join(self.cgroup, f"blkio.throttle.{name}_bps_device"),
                                  "w") as f:
                            f.write(f"{backing_disk(self.backing)} {int(bps)}\n")
        except Exception:
            self.cleanup()
            raise
        return self

    def start(self, secrets=None, extra_args=None):
        """Starts every node; secrets[i] / extra_args[i] override the secret file / add args."""
        for i, node in enumerate(self.nodes):
            node.start(extra_args=(extra_args or {}).get(i, ()),
                       secret_file=(secrets or {}).get(i))
        return self

    def wait_connected(self, want=None, timeout=20):
        """Waits until every live node serves its peers (its server listens). Connections
        are made on demand (docs/PEERS.md, "Connections"), so nothing is connected before
        the first read or commit query; `want` > 0 also waits for that many open links on
        every node (after traffic made them)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            ready = True
            for n in self.nodes:
                if not n.proc or n.proc.poll() is not None:
                    continue
                try:
                    s = n.stats()
                except OSError:
                    ready = False
                    break
                # The peer server starts before the mount answers: a node whose stats
                # show its peers object serves them.
                if not s.get("peers"):
                    ready = False
                elif want and s.get("peers_connected", 0) < want:
                    ready = False
            if ready:
                return True
            time.sleep(0.1)
        return False

    def cleanup(self):
        for node in self.nodes:
            try:
                node.kill(signal.SIGKILL)
            except Exception:
                pass
            unmount(node.mnt)
        for ns in self._made_ns:
            _run("ip", "netns", "del", ns, check=False)
        self._made_ns = []
        for veth in self._made_veth:
            # Deleting the namespace took its end of the pair; the host end may remain.
            _run("ip", "link", "del", veth, check=False)
        self._made_veth = []
        if self._made_bridge:
            _run("ip", "link", "del", self.bridge, check=False)
            self._made_bridge = False
        if self.cgroup:
            for _ in range(50):
                try:
                    os.rmdir(self.cgroup)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
            self.cgroup = None

    def __enter__(self):
        return self.setup()

    def __exit__(self, *exc):
        self.cleanup()


class ClusterTest:
    """A mix-in for unittest.TestCase, named before it: each test runs on its own Cluster
    (self.c) of NODES nodes, made in a temporary root (ROOT_PREFIX), with THROTTLE_BPS and
    DAEMON_ARGS, started, and serving its peers before the test begins; cleaned up after."""
    NODES = 2
    ROOT_PREFIX = "ckptfs-cluster-"
    THROTTLE_BPS = None
    DAEMON_ARGS = ()

    def setUp(self):
        root = tempfile.mkdtemp(prefix=self.ROOT_PREFIX)
        self.addCleanup(shutil.rmtree, root, True)
        self.c = Cluster(self.NODES, root=root, throttle_bps=self.THROTTLE_BPS,
                         daemon_args=list(self.DAEMON_ARGS))
        self.addCleanup(self.c.cleanup)
        self.c.setup()
        self.c.start()
        self.assertTrue(self.c.wait_connected(), self.logs())

    def logs(self):
        """The tail of every node's log, for a failure message."""
        return "\n".join(f"--- node {n.index} ---\n{n.log_text(12000)}" for n in self.c.nodes)

    def eventually(self, cond, what, timeout=30, poll=0.1):
        """Waits until cond() holds; fails with `what` and the logs after `timeout` s."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if cond():
                return
            time.sleep(poll)
        self.fail(f"{what}\n{self.logs()}")

    @contextlib.contextmanager
    def no_backing_reads(self, *nodes):
        """The block (loads served from memory) reads nothing from the backing store
        through any of `nodes`."""
        before = [n.stats()["backing_bytes_read"] for n in nodes]
        yield
        self.assertEqual([n.stats()["backing_bytes_read"] for n in nodes], before, self.logs())
