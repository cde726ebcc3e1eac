"""Real servers for integration tests, each on 127.0.0.1 on a free port, stopped by PID.

Fault tests use :meth:`RedisServer.kill` and :meth:`RedisServer.restart` (same port, fresh data).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pytest

REDIS_SERVER = "/usr/bin/redis-server"


class ServerUnavailable(RuntimeError):
    """The server's binary or package is missing here; the fixture skips with this reason."""


@contextlib.contextmanager
def running(start: Callable[[], Any]) -> Iterator[Any]:
    """A server from ``start()`` for the ``with`` block, stopped after it; the test skips if unavailable."""
    try:
        server = start()
    except ServerUnavailable as why:
        pytest.skip(str(why))
    try:
        yield server
    finally:
        server.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s}s")


def stop_process(proc: subprocess.Popen | None, grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL if it is still alive after ``grace_s`` (mooncake_master may ignore TERM)."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@dataclass
class RedisServer:
    """A redis-server without persistence in its own temp dir."""

    port: int
    password: str | None = None
    extra_args: tuple[str, ...] = ()
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="tierkv-redis-"))
    proc: subprocess.Popen | None = None

    @classmethod
    def start(cls, password: str | None = None, extra_args: tuple[str, ...] = ()) -> "RedisServer":
        """``extra_args`` go to redis-server as they are (e.g. ``("--maxmemory", "8mb")``)."""
        binary = REDIS_SERVER if os.path.exists(REDIS_SERVER) else shutil.which("redis-server")
        if not binary:
            raise ServerUnavailable("redis-server is not installed (scripts/setup_env.sh installs it)")
        server = cls(port=free_port(), password=password, extra_args=tuple(extra_args))
        server.binary = binary
        server.restart()
        return server

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def restart(self) -> None:
        """Start (again) on the same port, with an empty dataset."""
        self.kill()
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.workdir, "--daemonize", "no", "--loglevel", "warning"]
        if self.password:
            args += ["--requirepass", self.password]
        args += list(self.extra_args)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)
        wait_for_port(self.port, self.proc, 10.0, "redis-server")

    def kill(self) -> None:
        """SIGKILL the server (a crash, as fault tests want it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        stop_process(self.proc)
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class RedisClusterServers:
    """Three redis-server masters (no replicas) joined into one cluster with ``redis-cli --cluster create``.

    ``cluster-require-full-coverage no``: when a master dies, the others keep serving their slots.
    """

    nodes: list[RedisServer]

    @classmethod
    def start(cls, num_masters: int = 3) -> "RedisClusterServers":
        cli = shutil.which("redis-cli")
        if not cli:
            raise ServerUnavailable("redis-cli is not installed (scripts/setup_env.sh installs it)")
        flags = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no")
        cluster = cls([])
        try:
            for _ in range(num_masters):
                # The bus port would default to port + 10000, which may be taken or past 65535.
                cluster.nodes.append(RedisServer.start(extra_args=(*flags, "--cluster-port", str(free_port()))))
            addresses = [f"127.0.0.1:{node.port}" for node in cluster.nodes]
            subprocess.run([cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
            cluster.wait_ok(cli)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def wait_ok(self, cli: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            while True:
                info = subprocess.run([cli, "-p", str(node.port), "cluster", "info"], capture_output=True,
                                      text=True, timeout=10).stdout
                if "cluster_state:ok" in info:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis cluster not ok after {timeout_s}s: {info}")
                time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@dataclass
class MooncakeMaster:
    """A mooncake_master with its built-in HTTP metadata server; clients talk TCP on 127.0.0.1."""

    rpc_port: int
    metadata_port: int
    metrics_port: int
    binary: str
    proc: subprocess.Popen | None = None

    @classmethod
    def start(cls) -> "MooncakeMaster":
        binary = shutil.which("mooncake_master", path=os.path.dirname(sys.executable) + os.pathsep
                              + os.environ.get("PATH", ""))
        if not binary:
            raise ServerUnavailable("mooncake_master not found: "
                                    "pip install mooncake-transfer-engine-non-cuda")
        probe = subprocess.run([sys.executable, "-c", "import mooncake.store"], capture_output=True,
                               text=True, timeout=60)
        if probe.returncode != 0:
            raise ServerUnavailable("mooncake.store does not import (apt-get install libibverbs1?): "
                                    + probe.stderr.strip().splitlines()[-1])
        server = cls(free_port(), free_port(), free_port(), binary)
        args = [binary, f"--rpc_port={server.rpc_port}", "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={server.metadata_port}",
                f"--metrics_port={server.metrics_port}", "--metrics_host=127.0.0.1"]
        server.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       start_new_session=True)
        try:
            wait_for_port(server.rpc_port, server.proc, 20.0, "mooncake_master")
            wait_for_port(server.metadata_port, server.proc, 20.0, "mooncake_master metadata")
        except RuntimeError:
            server.stop()
            raise
        return server

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.rpc_port}"

    def client_config(self) -> dict:
        """The extra_config keys a MooncakeStore needs to reach this master."""
        return {"metadata_server": f"http://127.0.0.1:{self.metadata_port}/metadata",
                "local_hostname": "127.0.0.1", "protocol": "tcp",
                "global_segment_size": 64 << 20, "local_buffer_size": 64 << 20}

    def stop(self) -> None:
        stop_process(self.proc)
