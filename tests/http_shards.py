"""Real servers for the tests that stream WebDataset shards over HTTP: Debian's nginx serving a folder (Range
requests, Content-Length, a restart on the same port), and a proxy in front of it that cuts the first response
of each path mid-body, the way a flaky object store or CDN drops a long transfer.

Both bind 127.0.0.1 only. Processes are ended by the pid we started, never by name: other nginx may run here."""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from urllib.parse import quote

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.2):
            return True
    except OSError:
        return False


_CONF = """\
daemon off;
master_process on;
worker_processes 1;
{user}pid {prefix}/nginx.pid;
error_log {prefix}/error.log info;
events {{ worker_connections 64; }}
http {{
    access_log {prefix}/access.log;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    types {{ application/x-tar tar; application/json json; text/plain txt; }}
    default_type application/octet-stream;
    sendfile off;  # plain read/write: the bytes a client sees are paced like any other server's
    keepalive_timeout 0;  # one request per connection (Connection: close)
    server {{
        listen {host}:{port};
        root "{root}";
        location / {{ }}
    }}
}}
"""


class Nginx:
    """nginx serving `root` on 127.0.0.1:`port` (a free one when 0, chosen once and kept across restarts)."""

    def __init__(self, root: str, port: int = 0):
        self.root = os.path.abspath(root)
        self.port = port
        self.proc: subprocess.Popen | None = None
        self.prefix: str | None = None

    @staticmethod
    def binary() -> str | None:
        return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)

    @staticmethod
    def available() -> bool:
        return Nginx.binary() is not None

    @property
    def address(self) -> tuple[str, int]:
        return HOST, self.port

    def url(self, relpath: str = "") -> str:
        return f"http://{HOST}:{self.port}/{quote(relpath.lstrip('/'))}"

    def error_log(self, lines: int = 20) -> str:
        try:
            with open(os.path.join(self.prefix, "error.log")) as f:
                return "".join(f.readlines()[-lines:])
        except (OSError, TypeError):
            return ""

    def start(self, timeout: float = 10.0) -> "Nginx":
        if self.proc is not None:
            return self
        binary = self.binary()
        if binary is None:
            raise FileNotFoundError("no nginx binary: run `apt-get install nginx` (scripts/install_cluster.sh does)")
        self.port = self.port or free_port()
        if _answers(self.port):  # else the wait below would take another server for ours
            raise RuntimeError(f"{HOST}:{self.port} is taken by another server: pick another port for nginx")
        self.prefix = tempfile.mkdtemp(prefix="dalle-nginx-")
        # Pytest's tmp dirs are 0700: as root, workers would otherwise run as nobody and get 403 on every file
        user = "user root;\n" if os.geteuid() == 0 else ""
        conf = os.path.join(self.prefix, "nginx.conf")
        with open(conf, "w") as f:
            f.write(_CONF.format(user=user, prefix=self.prefix, host=HOST, port=self.port, root=self.root))
        # -e: errors before the config is read go to our prefix too, not /var/log/nginx
        cmd = [binary, "-p", self.prefix + "/", "-c", conf, "-e", os.path.join(self.prefix, "error.log")]
        with open(os.path.join(self.prefix, "stderr.log"), "wb") as err:
            # A session of its own: the SIGKILL fallback in stop() reaches the workers through the group id
            self.proc = subprocess.Popen(cmd, stdout=err, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not _answers(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with {self.proc.returncode}" if self.proc.poll() is not None else f"silent {timeout} s"
                with open(os.path.join(self.prefix, "stderr.log")) as f:
                    tail = f.read()[-2000:] + self.error_log()
                self.stop()
                raise RuntimeError(f"nginx on {HOST}:{self.port} did not start ({why}):\n{tail}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # nginx's fast shutdown: the master ends its workers, then itself
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # our own session: the master and its workers only
                except ProcessLookupError:
                    pass
                proc.wait(timeout=timeout)
        if self.prefix is not None:
            shutil.rmtree(self.prefix, ignore_errors=True)
            self.prefix = None

    def restart(self) -> "Nginx":
        self.stop()
        return self.start()

    def __enter__(self) -> "Nginx":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _read_head(sock: socket.socket, limit: int = 65536) -> tuple[bytes, bytes]:
    """(the head up to and including the blank line, whatever bytes came after it)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed inside the head ({len(buf)} bytes)")
        buf += chunk
        if len(buf) > limit:
            raise ConnectionError(f"head longer than {limit} bytes")
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", rest


def _headers(head: bytes) -> dict[str, str]:
    lines = head.decode("latin-1").split("\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if ":" in line)}


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class CuttingProxy:
    """A TCP proxy on 127.0.0.1 in front of `upstream` (host, port): the first `cut_first_n` 2xx responses with a
    body for each path come with their headers and `fraction` of their body, then the connection closes (a
    FIN mid-body: http.client raises IncompleteRead); later ones, e.g. a retry with `Range: bytes=N-`, pass whole.

    `latency` (s) delays every response, `rate` (bytes/s, 0: unlimited) paces each connection's body: a distant
    store (bench/shard_cache.py).

    `requests`: every request as (path, its Range header or None); `cuts`: path -> responses cut. Paths are as
    on the wire, with the leading slash: `proxy.cuts["/shard-000000.tar"]`."""

    def __init__(self, upstream: tuple[str, int], fraction: float = 0.4, cut_first_n: int = 1, timeout: float = 10,
                 latency: float = 0.0, rate: float = 0.0):  # fmt: skip
        if not 0 <= fraction < 1:
            raise ValueError(f"fraction must be in [0, 1) (got {fraction})")
        self.upstream, self.fraction, self.cut_first_n, self.timeout = tuple(upstream), fraction, cut_first_n, timeout
        self.latency, self.rate = latency, rate
        self.port = 0
        self.cuts: dict[str, int] = {}
        self.requests: list[tuple[str, str | None]] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def address(self) -> tuple[str, int]:
        return HOST, self.port

    def url(self, relpath: str = "") -> str:
        return f"http://{HOST}:{self.port}/{quote(relpath.lstrip('/'))}"

    def start(self) -> "CuttingProxy":
        if self._listener is not None:
            return self
        self._stopping.clear()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((HOST, self.port))
        self._listener.listen(64)
        self._listener.settimeout(0.1)  # the accept loop looks at _stopping this often
        self.port = self._listener.getsockname()[1]
        self._spawn(self._accept_loop, self._listener)
        return self

    def stop(self) -> None:
        self._stopping.set()
        listener, self._listener = self._listener, None
        for thread in list(self._threads):
            thread.join(timeout=self.timeout + 1)
        self._threads.clear()
        if listener is not None:
            listener.close()

    def __enter__(self) -> "CuttingProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads[:] = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(self.timeout)
            self._spawn(self._serve, client)

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        try:
            head, rest = _read_head(client)
            path = head.split(b"\r\n", 1)[0].split(b" ")[1].decode("latin-1")
            with self._lock:
                self.requests.append((path, _headers(head).get("range")))
            # One request per connection: Connection: close upstream, so the response ends when upstream closes
            lines = [ln for ln in head[:-4].split(b"\r\n") if not ln.lower().startswith(b"connection:")]
            upstream = socket.create_connection(self.upstream, timeout=self.timeout)
            upstream.sendall(b"\r\n".join([*lines, b"Connection: close", b"", b""]) + rest)
            resp_head, body = _read_head(upstream)
            status = int(resp_head.split(b" ", 2)[1])
            length = int(_headers(resp_head).get("content-length", -1))
            with self._lock:
                cut = 200 <= status < 300 and length > 0 and self.cuts.get(path, 0) < self.cut_first_n
                if cut:
                    self.cuts[path] = self.cuts.get(path, 0) + 1
            time.sleep(self.latency)
            client.sendall(resp_head)
            budget = int(length * self.fraction) if cut else None
            sent, start = 0, time.perf_counter()
            while True:
                if budget is not None:
                    body = body[:budget]
                    budget -= len(body)
                if body:
                    client.sendall(body)
                    sent += len(body)
                    if self.rate:
                        time.sleep(max(0.0, sent / self.rate - (time.perf_counter() - start)))
                if budget == 0 or self._stopping.is_set():
                    break
                body = upstream.recv(65536)
                if not body:
                    break
        except (OSError, ValueError, IndexError):
            pass  # a client or upstream that went away, or a malformed head: drop this connection only
        finally:
            if upstream is not None:
                upstream.close()
            _close(client)  # shutdown, then close: after a cut, the client sees EOF before Content-Length bytes
