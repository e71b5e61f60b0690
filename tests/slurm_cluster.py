"""A real one-node Slurm cluster on localhost for tests: munged, slurmctld and slurmd from Debian packages.

:func:`start_cluster` installs the packages with apt when they are missing, writes ``slurm.conf`` (and a
``gres.conf`` declaring GPUs the CPU test runs never touch, so the shipped sbatch scripts' ``--gpus-per-node``
lines schedule) under a temporary folder, starts its own ``munged`` on a private socket and the two Slurm
daemons on free ports, and waits for the node to be idle. Clients find the cluster through ``SLURM_CONF`` in
:attr:`SlurmCluster.env`; jobs inherit it. :meth:`SlurmCluster.stop` ends only the daemons it started, by pid.
Nothing under ``/etc`` is changed, so it runs beside anything else on the machine.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from conftest import free_port
from launch_helpers import apt_install

SLURM_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
_BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "munged")


class SlurmUnavailable(RuntimeError):
    """The daemons cannot run here (packages missing and not installable, or a daemon would not start)."""




def _which(name: str) -> str | None:
    return shutil.which(name) or next((str(p) for d in ("/usr/sbin", "/sbin") if (p := Path(d) / name).exists()),
                                      None)


@dataclass
class SlurmCluster:
    """A running local cluster: its folder, the client environment, and the daemons' pids."""

    root: Path
    node: str
    env: dict
    pids: dict = field(default_factory=dict)
    gpus: int = 0
    """GPUs the node advertises (0 where no device files could be made: then submit with --gpus-per-node=0)."""
    prefix: list = field(default_factory=list)
    """Put before every client command (two-node cluster: ``ip netns exec <first node's namespace>``)."""
    namespaces: list = field(default_factory=list)
    """Network namespaces this cluster made (deleted by :meth:`stop`)."""
    nodes: dict = field(default_factory=dict)
    """Node name -> address (two-node cluster)."""

    def run(self, *args: str, check: bool = True, timeout: int = 60) -> subprocess.CompletedProcess:
        """Run a Slurm client command (``sbatch``, ``scontrol``, ...) against this cluster."""
        return subprocess.run([*self.prefix, *args], env=self.env, capture_output=True, text=True, check=check,
                              timeout=timeout)

    def sbatch(self, script: str | Path | None, *args: str, options: list[str] = (), env: dict | None = None,
               cwd: str | Path | None = None) -> int:
        """Submit ``script args...`` (None: ``--wrap`` in ``options``) with sbatch ``options``; returns the job id."""
        cmd = [*self.prefix, "sbatch", "--parsable", *options] + ([str(script), *args] if script is not None else [])
        out = subprocess.run(cmd, env=env or self.env,
                             capture_output=True, text=True, timeout=60, cwd=cwd)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch failed ({out.returncode}): {out.stderr}{out.stdout}")
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (``JobState``, ``Restarts``, ``ExitCode``, ...); {} once forgotten."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        if out.returncode != 0:
            return {}
        fields = {}
        for tok in re.findall(r"(\w[\w:/]*)=(\S*)", out.stdout):
            fields.setdefault(tok[0], tok[1])
        return fields

    def wait(self, job_id: int, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                                        "BOOT_FAIL", "DEADLINE", "PREEMPTED"), timeout: float = 300) -> dict:
        """Poll until the job is in one of ``states``; returns its fields (raises TimeoutError)."""
        deadline = time.time() + timeout
        info: dict = {}
        while time.time() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout}s: {info}\n{self.logs_tail()}")

    def logs_tail(self, n: int = 30) -> str:
        """The last lines of both daemons' logs (for assertion messages)."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log", *(f"slurmd-{n}.log" for n in self.nodes)):
            p = self.root / name
            if p.exists():
                parts.append(f"--- {name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-n:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Stop the daemons this cluster started (by pid): SIGTERM to each, SIGKILL after 10 s."""
        import psutil

        procs = []
        for name in sorted(self.pids, key=lambda n: ("slurmd", "slurmctld", "munged").index(n.split("-")[0])):
            pid = self.pids.pop(name, None)
            try:
                p = psutil.Process(pid) if pid else None
                if p is not None:
                    p.terminate()
                    procs.append(p)
            except psutil.NoSuchProcess:
                pass
        def running(p) -> bool:  # an exited daemon stays a zombie until init reaps it
            try:
                return p.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False
        deadline = time.time() + 10
        while any(map(running, procs)) and time.time() < deadline:
            time.sleep(0.1)
        for p in filter(running, procs):
            p.kill()
        for ns in self.namespaces:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces = []


def ensure_slurm() -> None:
    """Install Slurm and MUNGE with apt when their binaries are missing (raises :class:`SlurmUnavailable`)."""
    if all(_which(b) for b in _BINARIES):
        return
    try:
        apt_install(SLURM_PACKAGES)
    except RuntimeError as e:
        raise SlurmUnavailable(str(e)) from e
    missing = [b for b in _BINARIES if not _which(b)]
    if missing:
        raise SlurmUnavailable(f"{', '.join(missing)} still missing after apt-get install {' '.join(SLURM_PACKAGES)}")


def _read_pid(path: Path, timeout: float = 20) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and path.read_text().strip().isdigit():
            return int(path.read_text().strip())
        time.sleep(0.1)
    raise SlurmUnavailable(f"no pid file {path} after {timeout}s")


def _daemon(cmd: list[str], pid_file: Path, log: Path) -> int:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        raise SlurmUnavailable(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr}{out.stdout}\n{tail}")
    return _read_pid(pid_file)


def _fake_gpus(root: Path, count: int) -> int:
    """Character devices standing in for GPUs (Slurm wants a device file per GPU); 0 when mknod is refused."""
    try:
        for i in range(count):
            p = root / f"gpu{i}"
            if not p.exists():
                os.mknod(p, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # same device as /dev/null
        return count
    except OSError:
        return 0


def _start_munge(root: Path, cluster: SlurmCluster) -> Path:
    """Start this cluster's own ``munged`` on a private socket under ``root/munge``; returns the socket path."""
    key = root / "munge" / "munge.key"
    if Path("/etc/munge/munge.key").exists():
        shutil.copyfile("/etc/munge/munge.key", key)
    else:
        key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    sock = root / "munge" / "munge.socket"
    mungectl = [_which("munged"), "--force", f"--socket={sock}", f"--key-file={key}",
                f"--pid-file={root / 'munge' / 'munged.pid'}", f"--log-file={root / 'munge' / 'munged.log'}",
                f"--seed-file={root / 'munge' / 'munged.seed'}"]
    cluster.pids["munged"] = _daemon(mungectl, root / "munge" / "munged.pid", root / "munge" / "munged.log")
    return sock


def _common_settings(sock: Path) -> list[str]:
    """slurm.conf lines both test clusters share: MUNGE on this cluster's socket, no cgroups, fast scheduling."""
    return [
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire also sets how long a requeued job waits before it may start again (default 120 s)
        f"AuthInfo=socket={sock},cred_expire=8",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/builtin",
        "SchedulerParameters=sched_interval=2",  # look at pending jobs (a requeued one) every 2 s, not 60
        "SlurmUser=root",
        "SlurmdUser=root",
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "MpiDefault=none",
        "JobRequeue=1",
        "KillWait=30",
        "MinJobAge=600",
        "MessageTimeout=30",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
    ]


def start_cluster(root: Path, cpus: int = 8, gpus: int = 2) -> SlurmCluster:
    """Install when needed, configure under ``root`` and start a one-node cluster; wait until the node is idle.

    Args:
        root: empty folder for the config, spool, state, logs and the MUNGE socket.
        cpus: CPUs the node advertises (more than the machine has is fine: ``config_overrides``).
        gpus: GPUs the node advertises through ``gres.conf`` (no devices behind them).

    Raises:
        SlurmUnavailable: the packages or the daemons cannot run here.
    """
    ensure_slurm()
    root.mkdir(parents=True, exist_ok=True)
    for d in ("state", "spool", "munge"):
        (root / d).mkdir(exist_ok=True)
    node = socket.gethostname()
    cluster = SlurmCluster(root=root, node=node, env={})
    try:
        sock = _start_munge(root, cluster)

        conf = root / "slurm.conf"
        gpus = _fake_gpus(root, gpus)
        cluster.gpus = gpus
        (root / "gres.conf").write_text(f"NodeName={node} Name=gpu File={root}/gpu[0-{gpus - 1}]\n" if gpus else "")
        conf.write_text("\n".join([
            f"ClusterName=ft{os.getpid()}",
            # job ids (and so the sbatch scripts' MASTER_PORT) unlike those of another test cluster beside it
            f"FirstJobId={random.randrange(1000, 60000)}",
            f"SlurmctldHost={node}(127.0.0.1)",  # no name resolution needed for the daemons
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            *_common_settings(sock),
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'slurmd.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "GresTypes=gpu",
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=20000 {f'Gres=gpu:{gpus} ' if gpus else ''}State=UNKNOWN",
            f"PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        cluster.env = {**os.environ, "SLURM_CONF": str(conf)}
        for name in ("slurmctld", "slurmd"):
            cmd = [_which(name), "-f", str(conf)] + (["-c", "-i"] if name == "slurmctld" else [])
            env_cmd = ["env", f"SLURM_CONF={conf}"] + cmd
            cluster.pids[name] = _daemon(env_cmd, root / f"{name}.pid", root / f"{name}.log")
        deadline = time.time() + 60
        state = ""
        while time.time() < deadline:
            out = cluster.run("sinfo", "-h", "-N", "-o", "%t", check=False, timeout=30)
            state = out.stdout.strip()
            if out.returncode == 0 and state.startswith("idle"):
                return cluster
            time.sleep(0.5)
        raise SlurmUnavailable(f"node not idle after 60 s (sinfo: {state!r})\n{cluster.logs_tail()}")
    except BaseException:
        cluster.stop()
        raise


def start_two_node_cluster(root: Path, cpus: int = 4) -> SlurmCluster:
    """A two-node cluster on this machine: ``slurmctld`` plus one ``slurmd`` per node, each node in its own network
    namespace (and UTS namespace: its own host name, ``ftnode1``/``ftnode2``), joined by a veth pair named ``ft0``
    on both sides, with one CPU "GPU" slot per node. The file system is shared, as a cluster's shared storage.

    The controller and the clients (``sbatch``, ``scontrol``: :attr:`SlurmCluster.prefix`, ``nsenter --net=...``) run in the first node's
    namespace, which plays the login node; jobs reach each other only over the veth pair (``GLOO_SOCKET_IFNAME=ft0``,
    ``MASTER_ADDR`` = the first node's address: the node names resolve nowhere). By hand, for debugging::

        python -c "import sys; sys.path.insert(0, 'tests'); from slurm_cluster import *; from pathlib import Path; \
                   c = start_two_node_cluster(Path('/tmp/slurm2')); print(c.prefix, c.env['SLURM_CONF'])"
        nsenter --net=/run/netns/<namespace of ftnode1> env SLURM_CONF=/tmp/slurm2/slurm.conf sinfo -N
        # stop: kill the pids in /tmp/slurm2/*.pid and munge/munged.pid; ip netns del <both namespaces>

    Raises:
        SlurmUnavailable: packages, namespaces or daemons cannot run here.
    """
    ensure_slurm()
    if os.geteuid() != 0 or not all(_which(b) for b in ("ip", "unshare", "nsenter")):
        raise SlurmUnavailable("network namespaces need root, ip (iproute2), unshare and nsenter")
    root.mkdir(parents=True, exist_ok=True)
    for d in ("state", "spool", "munge"):
        (root / d).mkdir(exist_ok=True)
    tag, net = f"{os.getpid() % 100000}", f"10.{random.randrange(200, 250)}.{random.randrange(1, 250)}"
    names = ["ftnode1", "ftnode2"]
    cluster = SlurmCluster(root=root, node=names[0], env={}, gpus=1)
    cluster.nodes = {names[0]: f"{net}.1", names[1]: f"{net}.2"}
    try:
        ns = [f"ftsa{tag}", f"ftsb{tag}"]
        cmds = [["ip", "netns", "add", ns[0]], ["ip", "netns", "add", ns[1]],
                ["ip", "link", "add", f"fta{tag}", "type", "veth", "peer", "name", f"ftb{tag}"]]
        for n, link, addr in zip(ns, (f"fta{tag}", f"ftb{tag}"), cluster.nodes.values()):
            cmds += [["ip", "link", "set", link, "netns", n], ["ip", "-n", n, "link", "set", link, "name", "ft0"],
                     ["ip", "-n", n, "addr", "add", f"{addr}/24", "dev", "ft0"],
                     ["ip", "-n", n, "link", "set", "ft0", "up"], ["ip", "-n", n, "link", "set", "lo", "up"]]
        for i, c in enumerate(cmds):
            out = subprocess.run(c, capture_output=True, text=True)
            if i < 2 and out.returncode == 0:
                cluster.namespaces.append(c[-1])
            if out.returncode != 0:
                raise SlurmUnavailable(f"cannot build the namespaces: {' '.join(c)}: {out.stderr.strip()}")
        # nsenter, not `ip netns exec`: that one remounts /sys for the namespace, hiding the cgroup mounts slurmd needs
        cluster.prefix = [_which("nsenter"), f"--net=/run/netns/{ns[0]}"]
        sock = _start_munge(root, cluster)
        gpus = _fake_gpus(root, 1)
        cluster.gpus = gpus
        (root / "gres.conf").write_text(f"NodeName=ftnode[1-2] Name=gpu File={root}/gpu0\n" if gpus else "")
        conf = root / "slurm.conf"
        conf.write_text("\n".join([
            f"ClusterName=ft2n{os.getpid()}",
            f"FirstJobId={random.randrange(1000, 60000)}",
            f"SlurmctldHost={socket.gethostname()}({cluster.nodes[names[0]]})",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            *_common_settings(sock),
            "SlurmdTimeout=10",  # a node that stops answering is DOWN after 10 s (node-loss test)
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}/%n",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root}/slurmd-%n.pid",
            f"SlurmctldLogFile={root / 'slurmctld.log'}",
            f"SlurmdLogFile={root}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "GresTypes=gpu",
            *(f"NodeName={n} NodeAddr={a} CPUs={cpus} RealMemory=10000 {'Gres=gpu:1 ' if gpus else ''}State=UNKNOWN"
              for n, a in cluster.nodes.items()),
            "PartitionName=test Nodes=ftnode[1-2] Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        cluster.env = {**os.environ, "SLURM_CONF": str(conf)}
        ctld = [*cluster.prefix, "env", f"SLURM_CONF={conf}", _which("slurmctld"), "-f", str(conf),
                "-c", "-i"]
        cluster.pids["slurmctld"] = _daemon(ctld, root / "slurmctld.pid", root / "slurmctld.log")
        for n, name in zip(ns, names):
            (root / "spool" / name).mkdir(exist_ok=True)
            cmd = [_which("nsenter"), f"--net=/run/netns/{n}", _which("unshare"), "--uts", "sh", "-c",
                   f"hostname {name} && exec env SLURM_CONF={conf} {_which('slurmd')} -f {conf}"]
            cluster.pids[f"slurmd-{name}"] = _daemon(cmd, root / f"slurmd-{name}.pid", root / f"slurmd-{name}.log")
        deadline = time.time() + 90
        state = ""
        while time.time() < deadline:
            out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=30)
            state = out.stdout.strip()
            if out.returncode == 0 and [line.split()[1] for line in state.splitlines()] == ["idle", "idle"]:
                return cluster
            time.sleep(0.5)
        raise SlurmUnavailable(f"nodes not idle after 90 s (sinfo: {state!r})\n{cluster.logs_tail()}")
    except BaseException:
        cluster.stop()
        raise
