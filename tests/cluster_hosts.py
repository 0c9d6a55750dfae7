"""A cluster of real hosts on this machine, for the `cluster` tests: each host a Linux network namespace with its
own address on a bridge and its own hostname (a UTS namespace per process tree), an sshd in each for the
launchers that ssh (deepspeed's hostfile, horovodrun, mpirun), and a real SLURM (slurmctld on the bridge, one
slurmd per host, munge). Needs root, iproute2, openssh-server, slurm-wlm, munge and openmpi-bin
(scripts/install_cluster.sh installs them).

Addresses come from 198.18.0.0/24, reserved for benchmarking networks (RFC 2544), which only these namespaces
hold: nothing is sent anywhere else. The hosts share the machine's filesystem, as hosts share an NFS home.
Everything it starts is stopped by pid in `down()`, and everything it adds (bridge, namespaces, /etc/netns
files) is removed; it never touches /sys/fs/cgroup or the machine's own /etc/hosts and ~/.ssh.

By hand:  python tests/cluster_hosts.py up /tmp/cluster   (prints how to use it)   ...   down /tmp/cluster
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

# DALLE_CLUSTER_INSTANCE=N (0-9) builds a cluster of its own beside another one (a developer's beside CI's):
# its own bridge, namespaces, subnet 198.18.N.0/24, ports and munge socket
INSTANCE = int(os.environ.get("DALLE_CLUSTER_INSTANCE", "0"))
SUBNET = f"198.18.{INSTANCE}"
BRIDGE, BRIDGE_IP = f"dallebr{INSTANCE}", f"{SUBNET}.1"
MUNGE = f"/run/dalle-munge-{INSTANCE}"  # a folder the munge user can reach (pytest's are root's alone)
NEEDS = ("ip", "unshare", "sshd", "ssh", "ssh-keygen", "munged", "slurmctld", "slurmd", "srun", "sbatch", "mpirun")


def missing() -> str:
    """Why the cluster cannot be built here ('' when it can)."""
    if os.geteuid() != 0:
        return "the cluster tests need root (network namespaces); CI runs as root"
    absent = [t for t in NEEDS if not shutil.which(t, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")]
    if absent:
        return f"missing {', '.join(absent)}: run `bash scripts/install_cluster.sh`"
    return ""


def _sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class Cluster:
    def __init__(self, root: str, names=("hosta", "hostb")):
        self.root = os.path.abspath(root)
        self.names = list(names)
        self.addr = {n: f"{SUBNET}.{11 + i}" for i, n in enumerate(self.names)}
        self.netns = {n: f"dalle{INSTANCE}-{n}" for n in self.names}
        self.pids: dict[str, int] = {}
        self.bin = os.path.join(self.root, "bin")  # the ssh that knows the test key, first on PATH
        self.slurm_conf = os.path.join(self.root, "slurm", "slurm.conf")
        self.key = os.path.join(self.root, "id_ed25519")

    # ---- running things on a host
    def command(self, host: str, argv: list[str]) -> list[str]:
        """argv run on `host`: in its network namespace (its address, its /etc/hosts) under its hostname."""
        script = 'hostname "$1"; ns="$2"; shift 2; exec ip netns exec "$ns" "$@"'
        return ["unshare", "--uts", "sh", "-c", script, "sh", host, self.netns[host], *argv]

    def env(self, **more) -> dict:
        path = f"{self.bin}:{os.environ['PATH']}"
        return {**os.environ, "PATH": path, "SLURM_CONF": self.slurm_conf, **more}

    def run(self, host, argv, timeout=300, env=None, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(host, argv), env=env or self.env(), capture_output=True, text=True, timeout=timeout, **kw
        )

    def popen(self, host, argv, env=None, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), env=env or self.env(), start_new_session=True, **kw)

    # ---- up and down
    def up(self) -> Cluster:
        os.makedirs(self.root, exist_ok=True)
        try:
            self._network()
            self._ssh()
            self._slurm()
        except BaseException:
            self.down()
            raise
        self._save()
        return self

    def _network(self):
        self.down_network()
        _sh("ip", "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "addr", "add", f"{BRIDGE_IP}/24", "dev", BRIDGE)
        _sh("ip", "link", "set", BRIDGE, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{self.addr[n]} {n}\n" for n in self.names)
        for i, n in enumerate(self.names):
            ns, veth = self.netns[n], f"dalle{INSTANCE}v{i}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "link", "set", veth, "master", BRIDGE, "up")
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.addr[n]}/24", "dev", "eth0")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)  # `ip netns exec` binds it over /etc/hosts
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(hosts)

    def _start(self, name: str, argv: list[str], host: str | None = None, user: str | None = None):
        log = open(os.path.join(self.root, f"{name}.log"), "w")
        argv = self.command(host, argv) if host else argv
        if user:
            argv = ["runuser", "-u", user, "--", *argv]
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True)
        self.pids[name] = p.pid

    def _ssh(self):
        r = self.root
        for key in (self.key, f"{r}/host_ed25519"):
            if not os.path.exists(key):
                _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key)
        shutil.copy(self.key + ".pub", f"{r}/authorized_keys")
        os.chmod(f"{r}/authorized_keys", 0o600)
        with open(f"{r}/sshd_config", "w") as f:
            f.write(
                f"Port 22\nHostKey {r}/host_ed25519\nAuthorizedKeysFile {r}/authorized_keys\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                "UsePAM no\nPidFile none\nStrictModes no\nAcceptEnv *\nMaxStartups 100\n"
            )
        os.makedirs("/run/sshd", exist_ok=True)
        os.makedirs(self.bin, exist_ok=True)
        with open(f"{self.bin}/ssh", "w") as f:  # what pdsh, horovodrun and mpirun call: the key, no host checks
            f.write(
                f"#!/bin/sh\nexec /usr/bin/ssh -i {self.key} -o StrictHostKeyChecking=no"
                ' -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o BatchMode=yes "$@"\n'
            )
        os.chmod(f"{self.bin}/ssh", 0o755)
        for n in self.names:
            self._start_sshd(n)
        self._wait(lambda: all(self.run(n, ["ssh", n, "true"], timeout=20).returncode == 0 for n in self.names), "ssh")

    def _start_sshd(self, host):
        self._start(f"sshd-{host}", ["/usr/sbin/sshd", "-D", "-e", "-f", f"{self.root}/sshd_config"], host=host)

    def _start_slurmd(self, host):
        self._start(f"slurmd-{host}", ["slurmd", "-D", "-N", host], host=host)

    def processes(self, host: str) -> set[int]:
        """Every process running on `host` (in its network namespace)."""
        return {int(p) for p in _sh("ip", "netns", "pids", self.netns[host], check=False).stdout.split()}

    def kill_host(self, host: str) -> None:
        """The host dies: every process in its namespace (sshd, slurmd, the job's tasks) is killed at once."""
        for pid in self.processes(host):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def revive_host(self, host: str) -> None:
        """The host is back: its sshd and slurmd start again and SLURM takes it into service."""
        self.kill_host(host)
        self._start_sshd(host)
        self._start_slurmd(host)
        _sh("scontrol", "update", f"NodeName={host}", "State=RESUME", check=False)
        self._wait(lambda: _sh("sinfo", "-h", "-n", host, "-o", "%T", check=False).stdout.strip() == "idle", host)
        self._save()

    def _slurm(self):
        d = os.path.join(self.root, "slurm")
        os.makedirs(f"{d}/state", exist_ok=True)
        for n in self.names:
            os.makedirs(f"{d}/spool/{n}", exist_ok=True)
        cpus = os.cpu_count()
        nodes = "".join(f"NodeName={n} NodeAddr={self.addr[n]} CPUs={cpus} State=UNKNOWN\n" for n in self.names)
        with open(self.slurm_conf, "w") as f:
            f.write(
                f"ClusterName=dalletest\nSlurmctldHost={os.uname().nodename}({BRIDGE_IP})\n"
                "SlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\n"
                f"StateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool/%n\nSlurmdPidFile={d}/slurmd-%n.pid\n"
                f"SlurmctldPidFile={d}/slurmctld.pid\nSlurmctldLogFile={d}/slurmctld.log\nSlurmdLogFile={d}/slurmd-%n.log\n"
                f"SlurmctldPort={16817 + 10 * INSTANCE}\nSlurmdPort={16818 + 10 * INSTANCE}\n"
                # cred_expire: how long a requeued job waits before it may start again (120 s by default)
                f"AuthInfo=socket={MUNGE}/munge.socket,cred_expire=10\n"
                # the facts found on this machine: linuxproc and no task plugin, as cgroups cannot be used here
                "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSelectType=select/cons_tres\n"
                "SelectTypeParameters=CR_Core\nSchedulerType=sched/backfill\nReturnToService=2\nMpiDefault=none\n"
                "JobAcctGatherType=jobacct_gather/none\nSlurmctldTimeout=30\nSlurmdTimeout=15\nInactiveLimit=0\n"
                "KillWait=30\nMinJobAge=600\nJobRequeue=1\n"
                f"{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n"
            )
        with open(f"{d}/cgroup.conf", "w") as f:  # slurmd reads it even with no cgroup plugin in use
            f.write("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        os.makedirs(MUNGE, exist_ok=True)
        shutil.chown(MUNGE, "munge", "munge")
        munged = ["/usr/sbin/munged", "--foreground", "--force", f"--socket={MUNGE}/munge.socket"]
        munged += [f"--pid-file={MUNGE}/munged.pid", f"--seed-file={MUNGE}/munged.seed"]
        self._start("munged", munged, user="munge")
        self._wait(lambda: os.path.exists(f"{MUNGE}/munge.socket"), "munged")
        self._start("slurmctld", ["slurmctld", "-D", "-i"])
        for n in self.names:
            self._start_slurmd(n)

        def idle():
            states = _sh("sinfo", "-h", "-o", "%T", check=False).stdout.split()
            return bool(states) and all(s == "idle" for s in states)

        os.environ["SLURM_CONF"] = self.slurm_conf  # for sinfo here
        self._wait(idle, "slurm nodes idle")

    def _wait(self, ready, what, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if ready():
                return
            time.sleep(0.5)
        logs = "".join(
            f"--- {f}\n{open(os.path.join(self.root, f)).read()[-1500:]}"
            for f in sorted(os.listdir(self.root))
            if f.endswith(".log")
        )
        raise RuntimeError(f"the test cluster: {what} not ready after {timeout}s\n{logs}")

    def _save(self):
        with open(os.path.join(self.root, "cluster.json"), "w") as f:
            json.dump({"names": self.names, "pids": self.pids}, f)

    def down(self):
        """Stop what up() started (by pid, with the process groups they lead), then remove the network."""
        if os.environ.get("SLURM_CONF") == self.slurm_conf:
            del os.environ["SLURM_CONF"]
        for pid in reversed(list(self.pids.values())):
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        deadline = time.time() + 10
        for pid in self.pids.values():
            while time.time() < deadline:
                try:
                    if os.waitpid(pid, os.WNOHANG)[0]:
                        break
                except ChildProcessError:  # not our child (a `down` from another process): poll its existence
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:
                        break
                time.sleep(0.1)
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.pids = {}
        self.down_network()

    def down_network(self):
        for i, n in enumerate(self.names):
            ns = self.netns[n]
            # a job the test left behind still holds the namespace: end every process in it
            pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _sh("ip", "netns", "del", ns, check=False)
            _sh("ip", "link", "del", f"dalle{INSTANCE}v{i}", check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        _sh("ip", "link", "del", BRIDGE, check=False)
        shutil.rmtree(MUNGE, ignore_errors=True)


def main(argv):
    action, root = argv[0], argv[1]
    if action == "up":
        why = missing()
        if why:
            sys.exit(why)
        c = Cluster(root).up()
        print(f"up: hosts {', '.join(f'{n}={c.addr[n]}' for n in c.names)}; slurm: export SLURM_CONF={c.slurm_conf}")
        print(f"run on a host:  {' '.join(c.command(c.names[0], ['bash']))}   (PATH={c.bin}:$PATH for ssh)")
    elif action == "down":
        c = Cluster(root)
        saved = os.path.join(root, "cluster.json")
        if os.path.exists(saved):
            c.pids = json.load(open(saved))["pids"]
        c.down()
    else:
        sys.exit("usage: cluster_hosts.py up|down DIR")


if __name__ == "__main__":
    main(sys.argv[1:])
