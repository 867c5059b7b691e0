"""Where tuning measures its candidates: on this machine, or on the servers of a TVM RPC tracker.

With an `RpcTracker`, candidates are still built here (a build host needs nvcc for CUDA, no GPU) and each
is measured on a server that registered with the tracker under the key: as many at once as the key has
servers (counted when tuning starts). The records go into the same database as local measurements.

Faults: a tracker that does not answer raises TrackerUnreachableError, a key without servers
NoRpcServersError, both before anything is built. A measurement whose server goes away (killed, its
session crashed by the candidate, the connection lost) is tried again on another of the key's servers, up
to `attempts` times in all; a candidate that fails them all is recorded as failed, like a local run that
fails, and tuning goes on. If every server of the key has gone, the measurement fails at once with a
NoRpcServersError message and tuning.py stops the tune with that error after the round.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass

from souffle_py.errors import InputError, NoRpcServersError, TrackerUnreachableError

RUN_TIMEOUT_S = 60.0      # one measurement (session) on a server, local or remote
CONNECT_TIMEOUT_S = 10.0  # connecting to the tracker
POLL_S = 2.0              # how often a waiting measurement asks the tracker whether the key has servers left
ATTEMPTS = 3              # servers one candidate is measured on at most before it counts as failed
NO_SERVERS = "NoRpcServersError"  # how a measurement says that the key's servers have all gone
# what a measurement raises when its server, not its candidate, failed (tvm.rpc's messages)
LOST_SERVER = ("connect", "socket", "closed", "broken pipe", "reset by peer", "eof", "cannot request")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RpcTracker:
    """A TVM RPC tracker and the device key whose servers measure candidates (`tvm.exec.rpc_tracker`,
    `tvm.exec.rpc_server --tracker HOST:PORT --key KEY`)."""

    host: str
    port: int
    key: str
    session_timeout_s: float = RUN_TIMEOUT_S
    attempts: int = ATTEMPTS

    @classmethod
    def parse(cls, address: str, key: str, **options) -> "RpcTracker":
        """From "HOST:PORT" (the `--rpc-tracker` flag) and the key."""
        host, _, port = str(address).rpartition(":")
        if not host or not port.isdigit():
            raise InputError(f"an RPC tracker address is HOST:PORT, got {address!r}")
        if not key:
            raise InputError("tuning through an RPC tracker needs the device key its servers registered with "
                             "(--rpc-key KEY)")
        return cls(host, int(port), key, **options)

    def __str__(self) -> str:
        return f"{self.host}:{self.port} key {self.key!r}"

    def connect(self):
        """A session with the tracker; TrackerUnreachableError when none answers in CONNECT_TIMEOUT_S."""
        from tvm import rpc

        try:  # a closed port fails at once; tvm.rpc would retry it for a minute
            socket.create_connection((self.host, self.port), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as exc:
            raise TrackerUnreachableError(f"cannot reach the RPC tracker at {self.host}:{self.port} ({exc}); "
                                          f"start one there with `python -m tvm.exec.rpc_tracker --host "
                                          f"0.0.0.0 --port {self.port}`") from None
        result = {}

        def connect():
            try:
                result["session"] = rpc.connect_tracker(self.host, self.port)
            except Exception as exc:  # tvm.rpc raises RuntimeError or OSError
                result["error"] = exc

        thread = threading.Thread(target=connect, daemon=True)  # connect_tracker retries for a minute
        thread.start()
        thread.join(CONNECT_TIMEOUT_S)
        if "session" not in result:
            why = result.get("error", f"no answer in {CONNECT_TIMEOUT_S:.0f} s")
            raise TrackerUnreachableError(f"cannot reach the RPC tracker at {self.host}:{self.port} ({why}); "
                                          f"start one there with `python -m tvm.exec.rpc_tracker --host "
                                          f"0.0.0.0 --port {self.port}`")
        return result["session"]

    def servers(self) -> int:
        """How many servers are registered under the key now (0 is an answer, not an error)."""
        summary = self.connect().summary()
        return sum(1 for server in summary["server_info"] if server["key"].split(":", 1)[-1] == self.key)

    def require_servers(self) -> int:
        """servers(), raising NoRpcServersError when there is none."""
        count = self.servers()
        if count == 0:
            raise NoRpcServersError(f"the RPC tracker at {self.host}:{self.port} has no server under key "
                                    f"{self.key!r}; start one on each measuring machine with `python -m "
                                    f"tvm.exec.rpc_server --tracker {self.host}:{self.port} --key {self.key}`")
        return count


def metaschedule_runner(tracker: RpcTracker | None):
    """MetaSchedule's runner for `tracker` (None: this machine's LocalRunner) and the number of servers."""
    from tvm.s_tir import meta_schedule as ms

    if tracker is None:
        return ms.runner.LocalRunner(timeout_sec=RUN_TIMEOUT_S), 1
    servers = tracker.require_servers()
    return _tracker_runner_class()(tracker, servers), servers


def check_servers_left(tracker: RpcTracker | None, runner_results) -> None:
    """Raise NoRpcServersError when a round's measurements found that every server of the key is gone."""
    if tracker is None:
        return
    if any(r.error_msg and NO_SERVERS in str(r.error_msg) for r in runner_results):
        raise NoRpcServersError(f"every server under key {tracker.key!r} of the RPC tracker at "
                                f"{tracker.host}:{tracker.port} has gone (or the tracker itself); the records "
                                f"measured so far are kept and a new tune goes on from them")


_RUNNER_CLASS = None


def _tracker_runner_class():
    """The PyRunner subclass (made once, on first use: MetaSchedule is only imported when tuning)."""
    global _RUNNER_CLASS
    if _RUNNER_CLASS is not None:
        return _RUNNER_CLASS
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, PyRunner, RPCConfig
    from tvm.s_tir.meta_schedule.runner.rpc_runner import RPCRunnerFuture
    from tvm.support.popen_pool import PopenPoolExecutor

    @derived_object
    class TrackerRunner(PyRunner):
        """MetaSchedule's RPCRunner measurement, one worker per server, each measurement tried again on
        another server when its server fails (measure_remotely)."""

        def __init__(self, tracker: RpcTracker, servers: int):
            super().__init__()
            self.tracker = tracker
            self.config = RPCConfig(tracker_host=tracker.host, tracker_port=tracker.port, tracker_key=tracker.key,
                                    session_timeout_sec=int(tracker.session_timeout_s))
            self.evaluator = EvaluatorConfig._normalized(None)
            # a worker waiting for a busy server counts against its timeout, so allow a few sessions' worth
            self.timeout_s = tracker.session_timeout_s * (tracker.attempts + 2)
            self.pool = PopenPoolExecutor(max_workers=servers, timeout=self.timeout_s)

        def run(self, runner_inputs):
            return [RPCRunnerFuture(self.pool.submit(measure_remotely, self.config, self.evaluator,
                                                     self.tracker.attempts, str(i.artifact_path),
                                                     str(i.device_type), tuple(a.as_json() for a in i.args_info)),
                                    timeout_sec=self.timeout_s)
                    for i in runner_inputs]

    _RUNNER_CLASS = TrackerRunner
    return TrackerRunner


def measure_remotely(config, evaluator, attempts: int, artifact_path: str, device_type: str, args_info):
    """(In a runner worker) the run seconds of one built candidate on a server of the tracker's key: a
    session from the tracker, upload, random inputs, time_evaluator (MetaSchedule's RPCRunner steps),
    started again on another server when the server fails, not the candidate."""
    from tvm.s_tir.meta_schedule.runner import rpc_runner

    def measure():
        return rpc_runner._worker_func(None, None, None, None, None, config, evaluator, 1, artifact_path,
                                       device_type, args_info)

    for attempt in range(1, attempts + 1):
        try:
            return _while_servers_left(measure, config)
        except Exception as exc:  # noqa: BLE001  (sorted below: the server's fault or the candidate's)
            if not _lost_server(exc):
                raise
            if _servers_of(config) == 0:
                raise RuntimeError(f"{NO_SERVERS}: no server left under key {config.tracker_key!r}") from exc
            if attempt == attempts:
                raise RuntimeError(f"measured on {attempts} servers, each lost during the measurement "
                                   f"(a candidate that crashes its server?): {exc}") from exc
            time.sleep(0.5 * attempt)


def _while_servers_left(work, config):
    """work() in a thread, given up with a NO_SERVERS error when the key has no server left: a session
    request waits at the tracker for a server of its key, forever if none is left."""
    result = {}

    def run():
        try:
            result["value"] = work()
        except BaseException as exc:  # noqa: BLE001  (handed to the caller)
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while True:
        thread.join(POLL_S)
        if not thread.is_alive():
            break
        if _servers_of(config) == 0:
            raise RuntimeError(f"{NO_SERVERS}: no server left under key {config.tracker_key!r}")
    if "error" in result:
        raise result["error"]
    return result["value"]


def _lost_server(exc: Exception) -> bool:
    """Whether `exc` says the server or the connection failed (a timeout or a wrong result is the
    candidate's)."""
    text = f"{type(exc).__name__} {exc}".lower()
    return "timeout" not in text and any(marker in text for marker in LOST_SERVER)


def _servers_of(config) -> int:
    try:
        return RpcTracker(config.tracker_host, config.tracker_port, config.tracker_key).servers()
    except Exception:  # noqa: BLE001  (the tracker gone too: nothing to retry on)
        return 0
