"""A TVM RPC tracker and CPU rpc_servers on 127.0.0.1, started with TVM's own modules in subprocesses, for
the tests of tuning through a tracker (and scripts/bench_rpc_tuning.py). Every process is stopped by its id."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def tracker_available() -> str | None:
    """None when TVM's tracker can start here, else why not (it needs tornado)."""
    try:
        import tornado  # noqa: F401
    except ImportError:
        return "TVM's RPC tracker needs tornado (pip install 'souffle-py[rpc]')"
    return None


class LocalPool:
    """A tracker and `servers` rpc_servers under `key`, each with `threads` TVM threads; logs in `folder`."""

    def __init__(self, folder: Path, servers: int = 2, key: str = "cpu", threads: int = 1):
        self.folder, self.key, self.threads = Path(folder), key, threads
        self.port = free_port()
        self.processes: list[subprocess.Popen] = []
        self.killed: list[subprocess.Popen] = []
        self.tracker = self._start("tracker", ["tvm.exec.rpc_tracker", "--host", HOST, "--port", str(self.port),
                                               "--port-end", str(self.port + 1)])
        self._wait(lambda: self._connect() is not None, "the tracker to listen")
        self.servers = [self.add_server() for _ in range(servers)]
        self.wait_for_servers(servers)

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def add_server(self, key: str | None = None) -> subprocess.Popen:
        port = free_port()
        return self._start(f"server{len(self.processes) - 1}",
                           ["tvm.exec.rpc_server", "--host", HOST, "--port", str(port), "--port-end", str(port + 1),
                            "--tracker", self.address, "--key", key or self.key])

    def add_server_under(self, key: str) -> subprocess.Popen:
        """A server under another key, once registered."""
        server = self.add_server(key)
        self._wait(lambda: self.registered(key) == 1, f"a server under {key!r} to register")
        return server

    def log(self, process: subprocess.Popen) -> str:
        return Path(process.args_log).read_text()

    def measured(self, process: subprocess.Popen) -> int:
        """Candidates the server loaded (one `load_module` line per measurement session)."""
        return self.log(process).count("load_module")

    def registered(self, key: str | None = None) -> int:
        tracker = self._connect()
        if tracker is None:
            return 0
        return sum(1 for s in tracker.summary()["server_info"] if s["key"].split(":", 1)[-1] == (key or self.key))

    def wait_for_servers(self, count: int, timeout: float = 60.0) -> None:
        self._wait(lambda: self.registered() == count, f"{count} servers to register", timeout)

    def kill(self, process: subprocess.Popen) -> None:
        """Kill a server and the session processes it forked (as a machine that goes away)."""
        self.killed.append(process)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(5)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = self.folder / f"{name}.log"
        # TMPDIR in the pool's folder: a killed server cannot remove the temporary directory it kept its
        # uploaded candidates in (two were left in /tmp by each `make test`)
        env = dict(os.environ, TVM_NUM_THREADS=str(self.threads), PYTHONUNBUFFERED="1", TMPDIR=str(self.folder))
        with open(log, "w") as out:
            # a process group of its own: stopping it stops the session processes a server forks
            process = subprocess.Popen([sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
        process.args_log = str(log)
        self.processes.append(process)
        return process

    def _connect(self):
        from tvm import rpc

        try:
            with socket.create_connection((HOST, self.port), timeout=1):
                pass
            return rpc.connect_tracker(HOST, self.port)
        except (OSError, RuntimeError):
            return None

    def _wait(self, ready, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p for p in self.processes if p.poll() is not None and p not in self.killed]
            if dead or time.monotonic() > deadline:
                self.stop()
                logs = "\n".join(f"--- {p.args_log}\n{Path(p.args_log).read_text()[-2000:]}" for p in self.processes)
                raise RuntimeError(f"timed out waiting for {what}" if not dead else f"a process exited: {logs}")
            time.sleep(0.2)
