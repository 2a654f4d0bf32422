"""One Triton server for the whole pytest session, shared by the integration tests and the notebooks.

It starts once collection shows that something needs it (a test using the `triton` fixture, or a
notebook run by nbmake), and is published through TUTORIAL_TRITON so notebook kernels, which are child
processes, reuse it instead of starting their own (about a minute each on CPU).
"""

from __future__ import annotations

import time

import pytest

from utils import paths
from utils.repository import prepare_run_repository
from utils.server import ServerHandle, TritonServer, shared_server

_session: dict = {}


def _needs_server(item: pytest.Item) -> bool:
    return "triton" in getattr(item, "fixturenames", ()) or item.nodeid.endswith(".ipynb")


def start_session_server() -> ServerHandle:
    existing = shared_server()
    if existing is not None:
        return existing
    run_dir = paths.runs_dir() / f"pytest-{time.strftime('%Y%m%d-%H%M%S')}"
    repository = prepare_run_repository(run_dir / "model_repository")
    server = TritonServer(repository, run_dir=run_dir, free_ports=True)
    started = time.monotonic()
    server.start().wait_ready(timeout=900)
    print(f"\n[session server] ready in {time.monotonic() - started:.0f} s: http {server.http_url} grpc {server.grpc_url}")
    handle = ServerHandle(server.host, server.ports.http, server.ports.grpc, server.ports.metrics, server)
    handle.export()
    return handle


def pytest_collection_finish(session: pytest.Session) -> None:
    if any(_needs_server(item) for item in session.items) and not session.config.option.collectonly:
        _session["server"] = start_session_server()


def pytest_sessionfinish(session: pytest.Session) -> None:
    handle = _session.pop("server", None)
    if handle is not None:
        handle.stop()


@pytest.fixture(scope="session")
def triton() -> ServerHandle:
    """The session's ready server (started by pytest_collection_finish)."""
    handle = _session.get("server")
    if handle is None:
        handle = _session["server"] = start_session_server()
    return handle
