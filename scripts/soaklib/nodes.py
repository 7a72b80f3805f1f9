"""The soak's daemons: one mount (--nodes 1) or two daemons in network namespaces over one
backing dir (--nodes 2, tests/e2e/netns.py's Cluster, as tests/e2e/test_lost_node.py runs
them), each restarted at once after a SIGKILL, each with its own seeded fault layer.

Faults (--faults): every incarnation of every daemon starts with the test-only
`--fault-inject` (store/primitives/fault_injection.h): the rates given, in seeded bursts,
seeded by (soak seed, mode, node, incarnation) so that a failing run can be replayed with the
same seed. The quiet phase (no kills, the leak bound) runs without faults: the killer makes
one last restart without them when it begins."""
import hashlib
import os
import signal
import subprocess
import time

from soaklib.util import now, read_text
from soaklib.util import harness, netns, reaper

# Seeded EIO bursts: 3 s of faults in every 23 s (phase drawn from the seed), at these rates;
# and now and then a full disk for 4 s. An fsync failure is permanent (the bytes may be lost):
# its checkpoint fails and, in async mode, publication halts until the operator aborts it.
DEFAULT_FAULTS = ("eio_write=0.03,eio_fsync=0.003,eio_dirsync=0.01,eio_rename=0.01,partial=1,"
                  "burst_on=3,burst_off=20,enospc_after=384M,enospc_for=4")


class Daemon:
    """One node's daemon: its mount, state dir and logs; start() after every kill."""

    def __init__(self, run, index, mnt, state, ns_node=None):
        self.run = run
        self.index = index
        self.mnt = mnt
        self.state = state
        self.ns_node = ns_node       # a netns.Node (--nodes 2), else None
        self.proc = None
        self.log = None
        self.inc = 0                 # this node's incarnation
        self.faulty = False
        self._count_log, self._count_off, self._count = None, 0, 0
        self._full = False
        # Every incarnation appends to one trace (checks.check_journal_trace).
        self.trace = os.path.join(run.root, f"journal.{index}.trace")
        os.makedirs(mnt, exist_ok=True)

    def fault_spec(self):
        if not self.run.faults_on:
            return None
        key = f"{self.run.seed}/{self.run.mode}/{self.index}/{self.inc}".encode()
        seed = int.from_bytes(hashlib.sha256(key).digest()[:5], "little")
        return f"seed={seed},{self.run.args.faults}"

    def start(self):
        self.inc += 1
        run = self.run
        tag = f"{self.index}.{self.inc}" if run.cluster else f"{self.inc}"
        self.log = os.path.join(run.root, f"ckptfs.{tag}.log")
        cmd = [harness.CKPTFS, "-f", "--staging-mem", "128M", "--state-dir", self.state,
               "--log-file", self.log, "--log-level", "info", "--durability", run.mode,
               "--flush-direct-io", "on"]
        if "--journal-trace" in run.args.daemon_options:
            cmd += ["--journal-trace", self.trace]
        spec = self.fault_spec()
        self.faulty = spec is not None
        if spec:
            cmd += ["--fault-inject", spec]
        env = dict(os.environ)
        wrapper = []
        c = run.cluster
        if c is not None:
            cmd += ["--peers-file", c.peers_file, "--peer-secret-file", c.secret_file,
                    "--peer-timeout", "3000", "--commit-timeout", str(run.args.commit_timeout)]
            env.update(UCX_TLS="tcp", UCX_NET_DEVICES=self.ns_node.veth_ns,
                       UCX_WARN_UNUSED_ENV_VARS="n", NS=self.ns_node.ns)
        # The shell joins the throttle cgroup, then becomes nsenter (two nodes) or the daemon:
        # one PID throughout, so the soak kills exactly that process.
        env["CG"] = run.cgroup or ""
        wrapper = ["sh", "-c", 'if [ -n "$CG" ]; then echo $$ > "$CG/cgroup.procs" || exit 99; '
                   'fi; if [ -n "$NS" ]; then exec nsenter --net=/run/netns/"$NS" "$@"; fi; '
                   'exec "$@"', "sh"]
        if c is None:
            env.pop("NS", None)
        # Diagnosis: CKPTFS_SOAK_HEAPTRACK=DIR records every incarnation's heap with
        # heaptrack's preload library (raw data in DIR/raw.<node>.<incarnation>; read with
        # heaptrack_interpret and heaptrack_print -M for the live heap over time).
        # (Set by env(1) right before the daemon: the preload library forgets them in
        # the processes it traces, and the shell and nsenter come first.)
        ht = os.environ.get("CKPTFS_SOAK_HEAPTRACK")
        if ht:
            os.makedirs(ht, exist_ok=True)
            cmd = ["env", "LD_PRELOAD=/usr/lib/heaptrack/libheaptrack_preload.so",
                   "DUMP_HEAPTRACK_OUTPUT=" + os.path.join(ht, f"raw.{tag}")] + cmd
        cmd += [run.backing, self.mnt]
        with open(self.log[:-4] + ".out", "wb") as out:
            self.proc = subprocess.Popen(wrapper + cmd, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env)
        reaper.register_pid(self.proc.pid)
        deadline = now() + 60
        while now() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node {self.index}: ckptfs exited {self.proc.returncode} at "
                                   f"start:\n{(read_text(self.log) or '')[-3000:]}")
            if harness.is_mounted(self.mnt) and os.path.exists(
                    os.path.join(self.mnt, ".ckptfs", "stats")):
                reaper.register_mount(self.mnt)
                return
            time.sleep(0.02)
        raise RuntimeError(f"node {self.index}: ckptfs did not mount in 60 s:\n"
                           + (read_text(self.log) or "")[-3000:])

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill(self, leave_mount=False):
        p = self.proc
        if p is not None and p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        if not leave_mount:
            harness.unmount(self.mnt)

    def faults_injected(self):
        """Faults this incarnation injected so far (its log's lines, read incrementally)."""
        if not self.faulty or not self.log:
            return 0
        if self._count_log != self.log:
            self._count_log, self._count_off, self._count = self.log, 0, 0
            self._full = False
        try:
            with open(self.log, "rb") as f:
                f.seek(self._count_off)
                data = f.read()
        except OSError:
            return self._count
        end = data.rfind(b"\n") + 1
        for line in data[:end].split(b"\n"):
            if b"fault-inject: " not in line:
                continue
            # "fault-inject: Input/output error into rename #12 (...)"
            if b" into " in line:
                self._count += 1
            # The full-disk window: the daemon answers ENOSPC (a create, a write that finds
            # staging full of refused bytes) without a new injection while it lasts.
            elif b"the disk is full" in line:
                self._count += 1
                self._full = True
            elif b"the full disk clears" in line:
                self._full = False
        self._count_off += end
        return self._count

    def disk_full(self):
        """This incarnation's injected full disk has not been seen to clear (the daemon logs
        the clearing at its next write after the window, so this errs on the full side)."""
        self.faults_injected()
        return getattr(self, "_full", False)


def make_daemons(run):
    """The run's daemons: node 0 is the application's main mount (run.mnt)."""
    if run.nodes == 1:
        return [Daemon(run, 0, os.path.join(run.root, "mnt"), os.path.join(run.root, "state"))]
    run.cluster = netns.Cluster(run.nodes, root=run.root, backing=run.backing)
    run.cluster.setup()
    return [Daemon(run, n.index, n.mnt, n.state, ns_node=n) for n in run.cluster.nodes]
