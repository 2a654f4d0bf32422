"""Run the real ``tritonserver`` binary (bundled in the nvidia-pytriton wheel) without a container.

`TritonServer` assembles what the NGC container would provide: a backend directory holding Triton's
Python backend, the stub built for *this* Python, and our ``backend/vllm``; an environment in which the
stub (an embedded, isolated Python) finds this virtual environment; a run folder for logs, caches,
sockets and temporary files; and ports on 127.0.0.1. It refuses to start over a server that already
holds its ports, waits for readiness with a progress bar that shows what the log says, and on stop
leaves no process and no shared-memory region behind.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
from tqdm.auto import tqdm

from utils import paths

DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
FIRST_PICKED_PORT = 20000  # free_port picks from here up to the kernel's ephemeral range
SOCKET_PATH_BYTES = 107  # a Unix socket path (sockaddr_un.sun_path), as ZMQ checks it
_picked_ports: set[int] = set()
# log lines after which the server will never become ready: fail at once instead of at the timeout
FATAL_LOG_MARKERS = (
    "error while loading shared libraries",
    "failed to load",
    "Stub process failed",
    "Failed to initialize Python stub",
    "Traceback (most recent call last)",
)
_instance_counter = itertools.count()


class ServerError(RuntimeError):
    """The server could not be started, or stopped working; the message carries the log's tail."""


class PortInUseError(ServerError):
    """Something already listens on one of the ports this server was asked to use."""


def tritonserver_root() -> Path:
    """The ``tritonserver`` folder inside the installed nvidia-pytriton wheel (found without importing pytriton)."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError(
            "nvidia-pytriton is not installed: it carries the tritonserver binary. "
            "Run `make setup` (or `pip install --no-deps nvidia-pytriton==0.7.0`)."
        )
    return Path(spec.submodule_search_locations[0]) / "tritonserver"


def docker_command(version: str = "24.10", model_repository: str = "$PWD/model_repository") -> str:
    """The NGC command that serves the same repository for those who use containers.

    24.10 is the container release of Triton 2.51, the server this project runs without Docker.
    """
    return (
        "docker run --gpus all -it --net=host --rm -p 8001:8001 --shm-size=1G --ulimit memlock=-1 "
        f"--ulimit stack=67108864 -v {model_repository}:/work/model_repository -w /work "
        f"nvcr.io/nvidia/tritonserver:{version}-vllm-python-py3 "
        "tritonserver --model-repository ./model_repository"
    )


def engine_environment(tmp_dir: Path) -> dict[str, str]:
    """What any vLLM engine we start needs (in Triton, vLLM's own server, or in-process): caches shared
    between runs under runs/cache (the compile caches are worth keeping), temporary files and IPC sockets
    in ``tmp_dir`` (keep it short: a socket path holds 107 bytes), no usage reporting.

    FlashInfer's top-k/top-p sampler is off unless asked for: its kernels are compiled on first use, which
    took 88 of the 142 s of a first start on a fresh H200 (vLLM 0.26); PyTorch's sampler needs no compile,
    and greedy decoding uses neither.

    The engine's process is spawned, as vLLM's own server does (its CLI sets this; as a library vLLM forks):
    forking would copy Triton's stub, threads and all, into the engine process, and the benchmark would
    compare engines started two ways. On CPU the start takes as long either way (32-35 s)."""
    cache = paths.runs_dir() / "cache"
    return {
        "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0"),
        "VLLM_WORKER_MULTIPROC_METHOD": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "spawn"),
        "TMPDIR": str(tmp_dir),
        "VLLM_RPC_BASE_PATH": str(tmp_dir),
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "FLASHINFER_WORKSPACE_BASE": str(cache),  # FlashInfer's kernels, compiled on first use
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    }


def socket_dir(preferred: Path) -> Path:
    """``preferred`` (made) when vLLM's IPC sockets fit under it, else a new short folder in the system's temporary
    directory: a socket's path holds 107 bytes, vLLM names each socket with a 36-character UUID, and a deep run
    folder (pytest's, a benchmark's ``--out``) would stop the engine at its start with ZMQ's "ipc path ... is
    longer than 107 characters"."""
    if len(os.fsencode(preferred)) + 1 + 36 <= SOCKET_PATH_BYTES:
        preferred.mkdir(parents=True, exist_ok=True)
        return preferred
    return Path(tempfile.mkdtemp(prefix="tvt-"))


def port_is_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands out by itself: to ``bind`` on port 0 and to outgoing connections."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(attempts: int = 200) -> int:
    """A port free now, below the kernel's ephemeral range, and not picked before by this process.

    Triton binds its ports only once the model is loaded (40 s on a CPU), and meanwhile vLLM's engine binds
    port 0 for its own sockets: a port picked with ``bind(0)`` is a number the kernel may hand out again
    right then (in CI vLLM once got the port picked for Triton's gRPC). Below that range it never does.
    """
    low, _ = ephemeral_port_range()
    for _ in range(attempts):
        port = random.randrange(FIRST_PICKED_PORT, low) if low > FIRST_PICKED_PORT + 1000 else 0
        if port in _picked_ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = sock.getsockname()[1]
        _picked_ports.add(port)
        return port
    raise ServerError(f"no free port found in {attempts} attempts below {low}")


def python_runtime(python: str | Path) -> dict[str, str]:
    """Version, library folder and prefix of the interpreter whose environment the stub will embed."""
    code = (
        "import sys, sysconfig, json; print(json.dumps({'version': f'{sys.version_info[0]}.{sys.version_info[1]}',"
        " 'libdir': sysconfig.get_config_var('LIBDIR'), 'prefix': sys.prefix}))"
    )
    out = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def replace_file(source: Path, target: Path) -> None:
    """Copy ``source`` over ``target`` through a file renamed into place: a process still running from the old
    ``target`` keeps it, where writing into it fails ('Text file busy' from a stub left running by a killed
    benchmark, 2026-12-06) or changes a loaded library under the process."""
    partial = target.with_name(f".{target.name}.partial")
    shutil.copy2(source, partial)
    os.replace(partial, target)


def assemble_backends(dest: Path, python_version: str, vllm_backend: Path | None = None) -> Path:
    """Build the ``--backend-directory``: the Python backend with the stub for this Python, plus ``vllm``.

    The wheel ships one stub per Python version; Triton starts ``backends/python/triton_python_backend_stub``,
    so the matching one is copied there. ``backend: "vllm"`` then runs ``backends/vllm/model.py``, copied from
    ``vllm_backend`` (default `paths.backend_source`): two versions of the backend can serve side by side.
    """
    root = tritonserver_root()
    stub = root / "python_backend_stubs" / python_version / "triton_python_backend_stub"
    if not stub.exists():
        raise ServerError(f"the Triton wheel has no Python backend stub for Python {python_version}")
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for item in (root / "backends" / "python").iterdir():
        if item.is_file():
            replace_file(item, python_dir / item.name)
    replace_file(stub, python_dir / stub.name)
    for binary in (python_dir / stub.name, root / "bin" / "tritonserver"):
        binary.chmod(0o755)
    source = vllm_backend or paths.backend_source()
    shutil.copytree(source, dest / "vllm", dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


@dataclass
class Ports:
    http: int
    grpc: int
    metrics: int

    @classmethod
    def resolve(cls, http: int | None, grpc: int | None, metrics: int | None, pick_free: bool) -> "Ports":
        """Given ports, or the defaults 8000/8001/8002, or free ones when ``pick_free``."""
        chosen = {}
        for name, given in (("http", http), ("grpc", grpc), ("metrics", metrics)):
            chosen[name] = given if given is not None else (free_port() if pick_free else DEFAULT_PORTS[name])
        return cls(**chosen)


class TritonServer:
    """One ``tritonserver`` process serving a model repository; a context manager.

    >>> with TritonServer("runs/x/model_repository") as server:   # doctest: +SKIP
    ...     server.wait_ready()
    """

    def __init__(
        self,
        model_repository: str | Path,
        *,
        run_dir: str | Path | None = None,
        host: str = "127.0.0.1",
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        free_ports: bool = False,
        python: str | Path | None = None,
        explicit_model_control: bool = True,
        log_verbose: int = 0,
        extra_env: dict[str, str] | None = None,
        vllm_backend: str | Path | None = None,
    ) -> None:
        self.model_repository = Path(model_repository).resolve()
        if not self.model_repository.is_dir():
            raise ServerError(f"model repository {self.model_repository} does not exist")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(run_dir or paths.runs_dir() / f"server-{stamp}-{os.getpid()}").resolve()
        self.host = host
        self.ports = Ports.resolve(http_port, grpc_port, metrics_port, free_ports)
        self.python = Path(python or sys.executable)
        self.explicit_model_control = explicit_model_control
        self.log_verbose = log_verbose
        self.extra_env = dict(extra_env or {})
        self.vllm_backend = Path(vllm_backend).resolve() if vllm_backend is not None else None
        self.shm_prefix = f"tvt{os.getpid()}x{next(_instance_counter)}_"
        self.process: subprocess.Popen | None = None
        self._sockets: Path | None = None  # vLLM's temporary files and IPC sockets (`socket_dir`)
        self._log_handle = None
        self._log_offset = 0

    # ---- addresses -------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.ports.metrics}/metrics"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "server.log"

    # ---- lifecycle -------------------------------------------------------------------------------
    def command(self) -> list[str]:
        """The exact command line, worth showing to learners."""
        cmd = [
            str(tritonserver_root() / "bin" / "tritonserver"),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={self.run_dir / 'backends'}",
            f"--http-address={self.host}",
            f"--http-port={self.ports.http}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.ports.grpc}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.ports.metrics}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            "--exit-timeout-secs=20",
            f"--log-verbose={self.log_verbose}",
        ]
        if self.explicit_model_control:
            cmd += ["--model-control-mode=explicit", "--load-model=*"]
        return cmd

    def environment(self) -> dict[str, str]:
        """The environment the stub needs: this venv first on PATH, libpython on the library path, caches here.

        The stub embeds Python in isolated mode (PYTHONPATH is ignored) and finds its packages through the
        first ``python3`` on PATH. vLLM's caches, IPC sockets and temporary files go into the run folder so
        that parallel servers do not collide and `make clean` removes them.
        """
        runtime = python_runtime(self.python)
        env = dict(os.environ)
        env["PATH"] = f"{Path(runtime['prefix']) / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        # the stub and libtriton_python.so find their bundled libraries (libcudart...) through an RPATH
        # relative to the wheel; copied into the backend directory they need the folder named explicitly
        bundled_libs = tritonserver_root().parents[1] / "nvidia_pytriton.libs"
        library_path = [runtime["libdir"], str(bundled_libs), env.get("LD_LIBRARY_PATH", "")]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in library_path if p)
        self._sockets = socket_dir(self.run_dir / "tmp")
        env.update(engine_environment(self._sockets), TUTORIAL_PROJECT_ROOT=str(paths.PROJECT_ROOT))
        env.update(self.extra_env)
        return env

    def _refuse_busy_ports(self) -> None:
        busy = [f"{name} {port}" for name, port in vars(self.ports).items() if port_is_open(port, self.host)]
        if busy:
            raise PortInUseError(
                f"cannot start Triton: port(s) {', '.join(busy)} on {self.host} already in use "
                "(another Triton server? stop it with `make stop` or `python -m utils.server stop`, "
                "or pass other ports)"
            )

    def start(self) -> "TritonServer":
        """Start the process in its own session (so stop() can end every child it spawns)."""
        if self.process is not None and self.process.poll() is None:
            raise ServerError("this server is already running")
        self._refuse_busy_ports()
        version = python_runtime(self.python)["version"]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        assemble_backends(self.run_dir / "backends", version, self.vllm_backend)
        workdir = self.run_dir / "work"  # the stub puts its cwd on sys.path: no folder named `triton` here
        workdir.mkdir(exist_ok=True)
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._log_handle = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            self.command(),
            cwd=workdir,
            env=self.environment(),
            stdout=self._log_handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        (self.run_dir / "server.json").write_text(json.dumps(self.describe(), indent=2))
        return self

    def describe(self) -> dict:
        return {
            "pid": self.process.pid if self.process else None,
            "host": self.host,
            "http": self.ports.http,
            "grpc": self.ports.grpc,
            "metrics": self.ports.metrics,
            "run_dir": str(self.run_dir),
            "model_repository": str(self.model_repository),
            "shm_prefix": self.shm_prefix,
        }

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def _fatal_log_line(self) -> str | None:
        """A line of *this* start's log that means the server will never be ready (earlier runs ignored)."""
        with open(self.log_path, "rb") as log:
            log.seek(self._log_offset)
            text = log.read().decode(errors="replace")
        for line in text.splitlines()[-200:]:
            if any(marker in line for marker in FATAL_LOG_MARKERS):
                return line.strip()
        return None

    def is_ready(self) -> bool:
        return http_ready(self.http_url)

    def wait_ready(self, timeout: float = 600, progress: bool = True) -> "TritonServer":
        """Block until ``/v2/health/ready``; show elapsed time and the log's latest line meanwhile."""
        if self.process is None:
            raise ServerError("start() the server first")
        deadline = time.monotonic() + timeout
        with tqdm(total=None, desc="Triton starting", unit="s", disable=not progress, leave=False) as bar:
            started = time.monotonic()
            while True:
                if self.process.poll() is not None:
                    self.stop()  # its stub and vLLM's engine outlive it, re-parented: end them too
                    raise ServerError(
                        f"tritonserver exited with code {self.process.returncode} before it was ready.\n"
                        f"Last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                if self.is_ready():
                    bar.set_description("Triton ready")
                    return self
                fatal = self._fatal_log_line()
                if fatal:
                    tail = self.log_tail(60)
                    self.stop()
                    raise ServerError(f"Triton cannot get ready: {fatal}\nLast lines of {self.log_path}:\n{tail}")
                if time.monotonic() > deadline:
                    tail = self.log_tail()
                    self.stop()
                    raise ServerError(f"Triton not ready after {timeout:.0f} s.\nLast lines of {self.log_path}:\n{tail}")
                last = self.log_tail(1).strip()
                bar.set_postfix_str(last[-80:], refresh=False)
                bar.update(round(time.monotonic() - started) - bar.n)
                time.sleep(0.5)

    def stop(self, timeout: float = 60) -> int | None:
        """Unload the models, SIGTERM the server, SIGKILL what is left after ``timeout``; clean /dev/shm."""
        if self.process is None:
            return None
        if self.process.poll() is None and self.explicit_model_control:
            unload_all(self.http_url, timeout / 2)
        stop_process_tree(self.process.pid, timeout, tag=self.shm_prefix)
        code = self.process.wait()
        self._close_log()
        remove_shm_regions(self.shm_prefix)
        if self._sockets is not None and not self._sockets.is_relative_to(self.run_dir):  # a short folder of /tmp
            shutil.rmtree(self._sockets, ignore_errors=True)
        return code

    def _close_log(self) -> None:
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _post(url: str, timeout: float) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, data=b"{}", method="POST"), timeout=timeout) as reply:
        return reply.read()


def unload_all(http_url: str, timeout: float) -> None:
    """Unload every loaded model through the repository API and wait for it (bounded).

    Stopping models this way, before SIGTERM, lets our backend stop its streams and engine in order:
    during Triton's own shutdown the Python stub cannot ask the server anything without crashing.
    """
    deadline = time.monotonic() + timeout
    try:
        index = json.loads(_post(f"http://{http_url}/v2/repository/index", timeout))
        for entry in index:
            if entry.get("state") == "READY":
                _post(f"http://{http_url}/v2/repository/models/{entry['name']}/unload", timeout)
        while time.monotonic() < deadline:
            states = {e.get("state") for e in json.loads(_post(f"http://{http_url}/v2/repository/index", timeout))}
            if not states & {"READY", "UNLOADING", "LOADING"}:
                return
            time.sleep(0.25)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
        return  # the server is not answering: the signals below will do


def http_ready(http_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=timeout) as reply:
            return reply.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def processes_tagged(tag: str) -> list[psutil.Process]:
    """Processes whose command line holds ``tag`` (a stub carries its shm prefix), with their children.

    A stub whose server died is re-parented away from the server's tree; this still finds it.
    """
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if tag in " ".join(proc.info["cmdline"] or []):
            try:
                found += [proc, *proc.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
    return found


def stop_process_tree(pid: int, timeout: float, tag: str | None = None) -> None:
    """End a server and every descendant (the stub, vLLM's engine core, its workers).

    Only tritonserver gets SIGTERM: it unloads its models, so our backend's finalize stops the engine in
    order. Signalling the whole group instead would kill the engine under a stub that is still using it.
    Whatever is still alive after ``timeout`` (or was left behind, found by ``tag``) is killed.
    """
    family = processes_tagged(tag) if tag else []
    try:
        root = psutil.Process(pid)
        family += [root, *root.children(recursive=True)]
        root.terminate()
        psutil.wait_procs([root], timeout=timeout)
        family += root.children(recursive=True)
    except psutil.NoSuchProcess:
        pass
    if tag:
        family += processes_tagged(tag)
    _, alive = psutil.wait_procs(list(set(family)), timeout=5)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def remove_shm_regions(prefix: str) -> list[str]:
    """Delete ``/dev/shm`` regions named with our prefix (the Python backend's, if a kill left them)."""
    removed = []
    for region in Path("/dev/shm").glob(f"{prefix}*"):
        region.unlink(missing_ok=True)
        removed.append(region.name)
    return removed


# ---- one server shared by a session: tests, notebooks, make tutorial -------------------------------------
SHARED_SERVER_ENV = "TUTORIAL_TRITON"  # JSON {"host", "http", "grpc", "metrics"} of a server already up


@dataclass
class ServerHandle:
    """Where a server listens, and whether the caller started it (and so must stop it)."""

    host: str
    http: int
    grpc: int
    metrics: int
    server: TritonServer | None = None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics}/metrics"

    @property
    def owned(self) -> bool:
        return self.server is not None

    def stop(self) -> None:
        """Stop the server if this handle started it; a shared one is left to its owner."""
        if self.server is not None:
            self.server.stop()
            self.server = None

    def export(self) -> None:
        """Publish this server to child processes (notebook kernels) through the environment."""
        os.environ[SHARED_SERVER_ENV] = json.dumps({"host": self.host, "http": self.http, "grpc": self.grpc, "metrics": self.metrics})


def shared_server() -> ServerHandle | None:
    """The server named by ``TUTORIAL_TRITON``, if it is up and ready."""
    raw = os.environ.get(SHARED_SERVER_ENV)
    if not raw:
        return None
    info = json.loads(raw)
    handle = ServerHandle(info["host"], int(info["http"]), int(info["grpc"]), int(info["metrics"]))
    return handle if http_ready(handle.http_url) else None


def ensure_server(
    *,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    engine_overrides: dict | None = None,
    timeout: float = 900,
) -> ServerHandle:
    """A ready server: the session's shared one, one already on the given ports, or a new one we own.

    Notebooks call this first, so each runs on its own (starting what it needs) and, under `make test`
    or `make tutorial`, all of them share one server (a start costs about a minute on CPU).
    """
    shared = shared_server()
    if shared is not None:
        return shared
    if http_ready(f"127.0.0.1:{http_port}"):
        return ServerHandle("127.0.0.1", http_port, grpc_port, metrics_port)
    from utils.repository import prepare_run_repository

    run_dir = paths.runs_dir() / f"server-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    repository = prepare_run_repository(run_dir / "model_repository", engine_overrides=engine_overrides)
    server = TritonServer(repository, run_dir=run_dir, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port)
    server.start().wait_ready(timeout=timeout)
    return ServerHandle(server.host, server.ports.http, server.ports.grpc, server.ports.metrics, server)


# ---- the background server of `make serve` / `make stop` ----------------------------------------------
def state_file() -> Path:
    return paths.runs_dir() / "serve.json"


def serve_in_background(repository: Path | None = None, timeout: float = 900) -> TritonServer:
    """Start the tutorial's server and leave it running; its address is written to ``runs/serve.json``."""
    from utils.repository import prepare_run_repository

    run_dir = paths.runs_dir() / f"serve-{time.strftime('%Y%m%d-%H%M%S')}"
    repo = prepare_run_repository(run_dir / "model_repository", source=repository)
    server = TritonServer(repo, run_dir=run_dir)
    server.start()
    try:
        server.wait_ready(timeout=timeout)
    except ServerError:
        server.stop()
        raise
    server._close_log()
    state_file().write_text(json.dumps(server.describe(), indent=2))
    return server


def stop_background() -> str:
    state = state_file()
    if not state.exists():
        return "no background server recorded in runs/serve.json"
    info = json.loads(state.read_text())
    stop_process_tree(info["pid"], timeout=60, tag=info["shm_prefix"])
    remove_shm_regions(info["shm_prefix"])
    state.unlink()
    return f"stopped the server with pid {info['pid']}"


def status() -> str:
    state = state_file()
    if not state.exists():
        return "no background server (start one with `make serve`)"
    info = json.loads(state.read_text())
    ready = http_ready(f"{info['host']}:{info['http']}")
    alive = psutil.pid_exists(info["pid"])
    return (
        f"pid {info['pid']} {'alive' if alive else 'gone'}, {'ready' if ready else 'not ready'}: "
        f"http {info['host']}:{info['http']}, grpc {info['grpc']}, metrics {info['metrics']}, log {info['run_dir']}/server.log"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.server", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["start", "stop", "status"])
    args = parser.parse_args(argv)
    if args.action == "start":
        server = serve_in_background()
        print(f"Triton is ready: http {server.http_url}, grpc {server.grpc_url}, metrics {server.metrics_url}")
        print(f"log: {server.log_path}   stop it with `make stop`")
    elif args.action == "stop":
        print(stop_background())
    else:
        print(status())
    return 0


if __name__ == "__main__":
    sys.exit(main())
