"""Data-parallel serving: N `dscale-serve` replicas behind sglang-router, and the supervisor that restarts them.

`dscale-serve --data-parallel-size N` runs `serve`: N replica processes (replica i on port --port + 1 + i; on
CUDA its GPU chosen through CUDA_VISIBLE_DEVICES, shared when --data-parallel-gpus repeats one), each waited for
until /health answers, then sglang-router (`python -m sglang_router.launch_router`, the Rust router on PyPI) on
--host/--port in front of them and of any --worker-urls. The router health-checks every replica, takes one that
stops answering out of rotation and retries its requests on the others; the supervisor (a thread here) restarts
any child, replica or router, that exits, and the router routes to a restarted replica once /health answers.

Metrics: each replica's /metrics on its own port; all of them merged, labelled `worker_addr`, at the router's
GET /engine_metrics; the router's own (`smg_*`: requests per replica, retries, health) on --router-metrics-port.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, TextIO

import httpx

from dscale_runtime.server.config import ServeConfig

log = logging.getLogger("dscale.serve")

ROUTER_HEALTH_FLAGS = ("--health-check-interval-secs", "2", "--health-failure-threshold", "2",
                       "--health-success-threshold", "1", "--cb-timeout-duration-secs", "5")
"""A dead replica leaves rotation within about 4 s and a restarted one rejoins within 2 s of answering /health
(sglang-router's defaults: a check every 60 s, 3 failures, a circuit open for 60 s); meanwhile the router retries
its requests on the other replicas (up to 5 tries). `--router-args` overrides any of these."""
LAUNCHER_FIELDS = frozenset({"data_parallel_size", "data_parallel_gpus", "worker_urls", "router", "router_policy",
                             "router_metrics_port", "router_args"})
"""`ServeConfig` fields of the launcher; a replica gets every other option."""
ROUTER_LOG_LEVELS = {"critical": "error", "error": "error", "warning": "warn", "info": "info", "debug": "debug",
                     "trace": "debug"}
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
START_TIMEOUT = 1800.0
"""Seconds a replica may take to answer its first /health (sglang-router's own worker start-up limit)."""


def replica_command(config: ServeConfig, port: int, device: str) -> list[str]:
    """The `dscale-serve` command of one replica: every option of `config` that differs from its default, but the
    launcher's, with the replica's port and device."""
    command = [sys.executable, "-m", "dscale_runtime.server.main", "--port", str(port), "--device", device]
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name in LAUNCHER_FIELDS or field.name in ("port", "device") or value == field.default:
            continue
        command += ["--" + field.name.replace("_", "-"), str(value).lower() if isinstance(value, bool) else str(value)]
    return command


def replica_devices(config: ServeConfig) -> list[tuple[str, dict[str, str]]]:
    """(--device, environment) of each replica: its GPU through CUDA_VISIBLE_DEVICES, or on CPUs a share of the
    cores (OMP_NUM_THREADS, unless set already)."""
    n = config.data_parallel_size
    if not config.device.startswith("cuda"):
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // max(n, 1)))
        return [(config.device, {"OMP_NUM_THREADS": threads})] * n
    if config.device != "cuda":
        raise ValueError(f"--device {config.device} with --data-parallel-size: give --device cuda and each replica's "
                         "GPU with --data-parallel-gpus (e.g. '0,1')")
    if config.data_parallel_gpus is not None:
        gpus = [int(g) for g in config.data_parallel_gpus.split(",")]
    else:
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            raise ValueError("--device cuda: no CUDA device is visible (check CUDA_VISIBLE_DEVICES)")
        gpus = [i % count for i in range(n)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [name.strip() for name in visible.split(",")] if visible else None
    if names is not None and max(gpus, default=0) >= len(names):
        raise ValueError(f"--data-parallel-gpus {config.data_parallel_gpus}: CUDA_VISIBLE_DEVICES={visible} shows "
                         f"{len(names)} GPUs (numbered from 0)")
    return [("cuda", {"CUDA_VISIBLE_DEVICES": names[g] if names else str(g)}) for g in gpus]


def router_command(config: ServeConfig, worker_urls: list[str], port: int, metrics_port: int) -> list[str]:
    """The sglang-router command: `worker_urls` behind --host:`port`, its Prometheus metrics on `metrics_port`."""
    command = [sys.executable, "-m", "sglang_router.launch_router", "--host", config.host, "--port", str(port),
               "--worker-urls", *worker_urls, "--policy", config.router_policy, "--prometheus-host", config.host,
               "--prometheus-port", str(metrics_port), "--log-level", ROUTER_LOG_LEVELS.get(config.log_level, "info"),
               *ROUTER_HEALTH_FLAGS]
    if config.api_key is not None:
        command += ["--api-key", config.api_key]
    return command + shlex.split(config.router_args or "")


def free_ports(count: int, host: str) -> list[int]:
    """`count` distinct ports free on `host` now (held together while they are picked)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def connect_host(host: str) -> str:
    """The address to reach a server listening on `host` from this machine."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(host, f"[{host}]" if ":" in host else host)


class Child:
    """One supervised process (a replica or the router); its output is copied onto `output`, each line prefixed
    with its name, and its last lines kept for error messages."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], url: str, ready: Callable[[], bool],
                 output: TextIO) -> None:
        self.name, self.command, self.env, self.url, self.ready, self.output = name, command, env, url, ready, output
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self.started_at = 0.0
        self.backoff = 1.0
        self.restart_at: float | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self._copier: threading.Thread | None = None

    def start(self) -> None:
        # NOTE: its own session, so a Ctrl-C reaches only the launcher, which stops the children in order.
        self.process = subprocess.Popen(self.command, env={**os.environ, **self.env}, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        errors="replace", start_new_session=True)
        self.started_at = time.monotonic()
        self._copier = threading.Thread(target=self._copy_output, args=(self.process.stdout,),
                                        name=f"{self.name} output", daemon=True)
        self._copier.start()

    def _copy_output(self, stream) -> None:
        for line in stream:
            line = ANSI_ESCAPE.sub("", line)  # the router colours its log even into a pipe
            self.tail.append(line)
            self.output.write(f"{self.name} | {line}")
            self.output.flush()
        stream.close()

    def wait_ready(self, deadline: float) -> None:
        while not self.ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.process.returncode} while starting; its last "
                                   f"lines:\n{''.join(self.tail)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} at {self.url} was not ready in time; its last lines:\n"
                                   f"{''.join(self.tail)}")
            time.sleep(0.25)

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def wait_stopped(self, grace: float = 30.0) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self._copier is not None:
            self._copier.join(5)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class DataParallelServer:
    """Replicas, router and supervisor: `with DataParallelServer(config) as server:` serves at `server.url`.

    `--port 0` picks free ports for the router, every replica and the router's metrics."""

    def __init__(self, config: ServeConfig, output: TextIO | None = None) -> None:
        if config.router and importlib.util.find_spec("sglang_router") is None:
            raise ValueError("data-parallel serving needs sglang-router: pip install -e '.[distributed]' (or pip "
                             "install sglang-router)")
        self.config, n = config, config.data_parallel_size
        output = output or sys.stdout
        if config.port == 0:
            router_port, *replica_ports, metrics_port = free_ports(n + 2, config.host or "0.0.0.0")
        else:
            router_port, metrics_port = config.port, config.port + n + 1
            replica_ports = [config.port + 1 + i for i in range(n)]
        if config.router_metrics_port is not None:
            metrics_port = config.router_metrics_port or free_ports(1, config.host or "0.0.0.0")[0]
        host = connect_host(config.host)
        self.replicas = []
        for i, (port, (device, env)) in enumerate(zip(replica_ports, replica_devices(config))):
            url = f"http://{host}:{port}"
            self.replicas.append(Child(f"replica {i}", replica_command(config, port, device), env, url,
                                       lambda url=url: answers(url + "/health"), output))
        self.worker_urls = [replica.url for replica in self.replicas] + config.worker_url_list
        self.url = f"http://{host}:{router_port}" if config.router else None
        self.metrics_url = f"http://{host}:{metrics_port}/metrics" if config.router else None
        self.router = None
        if config.router:
            command = router_command(config, self.worker_urls, router_port, metrics_port)
            self.router = Child("router", command, {}, self.url, self._router_ready, output)
        self.children = [*([self.router] if self.router else []), *self.replicas]
        self._stopping = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="dscale-serve supervisor", daemon=True)

    def _router_ready(self) -> bool:
        """Whether the router lists every local replica as healthy (without local ones: any worker)."""
        try:
            workers = httpx.get(self.url + "/workers", timeout=2, headers=self._auth()).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return False
        healthy = {w.get("url") for w in workers if w.get("is_healthy")}
        return all(replica.url in healthy for replica in self.replicas) and bool(healthy)

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    def __enter__(self) -> "DataParallelServer":
        deadline = time.monotonic() + START_TIMEOUT
        try:
            for replica in self.replicas:
                replica.start()
            for replica in self.replicas:
                replica.wait_ready(deadline)
            if self.router is not None:
                self.router.start()
                self.router.wait_ready(deadline)
        except BaseException:
            self._stop_children()
            raise
        self._supervisor.start()
        return self

    def _supervise(self) -> None:
        """Restart every child that exits, after 1 s, or longer (doubling to 60 s) while it keeps dying young."""
        while not self._stopping.wait(0.5):
            now = time.monotonic()
            for child in self.children:
                if child.process.poll() is None:
                    continue
                if child.restart_at is None:
                    lived = now - child.started_at
                    child.backoff = 1.0 if lived > 60 else min(2 * child.backoff, 60.0)
                    child.restart_at = now + child.backoff
                    log.warning("%s exited with code %s after %.0f s; restarting it in %.0f s", child.name,
                                child.process.returncode, lived, child.backoff)
                elif now >= child.restart_at:
                    child.restart_at, child.restarts = None, child.restarts + 1
                    child.start()

    def _stop_children(self) -> None:
        for child in self.children:  # the router first: it stops sending before the replicas go
            child.terminate()
        for child in self.children:
            child.wait_stopped()

    def __exit__(self, *exc) -> None:
        self._stopping.set()
        if self._supervisor.is_alive():
            self._supervisor.join()
        self._stop_children()


def serve(config: ServeConfig) -> None:
    """`dscale-serve --data-parallel-size N`: serve until SIGINT or SIGTERM, then stop the router and replicas."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with DataParallelServer(config) as server:
        remote = len(config.worker_url_list)
        if server.router is not None:
            log.info("serving %d replicas%s of '%s' at %s/v1; router metrics at %s, the replicas' merged at "
                     "%s/engine_metrics", len(server.replicas), f" (+{remote} remote)" if remote else "",
                     config.model_name, server.url, server.metrics_url, server.url)
        else:
            log.info("serving %d replicas of '%s' without a router: %s", len(server.replicas), config.model_name,
                     ", ".join(replica.url for replica in server.replicas))
        while not stop.wait(1.0):
            pass
