"""The first device error of a run, named: which kernel call failed, raised as a DeviceError.

Kernels launch asynchronously, so a fault inside one (an illegal address, a grid barrier without a
cooperative launch) is reported by CUDA at some later call, and from then on every allocation and launch
of the process fails: without care the user sees an unrelated error several kernels later. A
LaunchChecker runs a model's kernel calls and synchronizes after each one in a checked run (the first run
of a model, every run with SOUFFLE_CHECK_LAUNCHES=1): a failure is then pinned to the call that caused it.
In an unchecked run a failure names the call at which it surfaced and says so. Once a run has failed the
checker refuses further runs with the same error instead of launching into a poisoned context.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Sequence

from souffle_py.errors import DeviceError, SouffleError

ENV = "SOUFFLE_CHECK_LAUNCHES"


def check_every_run() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


class LaunchChecker:
    """Runs (name, function, args) kernel calls; `sync` waits for the device (and raises its errors)."""

    def __init__(self, names: Sequence[str], sync: Callable[[], None], device: str):
        self.names = tuple(names)
        self.sync = sync
        self.device = device
        self.checked_runs = 0
        self.failure: DeviceError | None = None

    def run(self, calls: Sequence[tuple]) -> None:
        """One inference's calls in order; synchronized after each call in a checked run."""
        if self.failure is not None:
            self._refuse_if_failed()
        if self.checked_runs and not check_every_run():
            index = 0
            try:
                for func, args in calls:
                    func(*args)
                    index += 1
            except SouffleError:
                raise
            except Exception as exc:
                raise self._failed(self.names[index], exc, pinned=False) from exc
            return
        for name, (func, args) in zip(self.names, calls):
            try:
                func(*args)
                self.sync()
            except SouffleError:
                raise
            except Exception as exc:
                raise self._failed(name, exc, pinned=True) from exc
        self.checked_runs += 1

    @contextmanager
    def guard(self, what: str):
        """Device work outside the kernel calls (copies, synchronizations): an error there surfaced from
        an earlier kernel of an unchecked run."""
        self._refuse_if_failed()
        try:
            yield
        except SouffleError:
            raise
        except Exception as exc:
            raise self._failed(None, exc, pinned=False, what=what) from exc

    def _failed(self, name, exc, pinned: bool, what: str = "") -> DeviceError:
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:300]
        if pinned:
            message = f"kernel call '{name}' failed on the {self.device} device: {detail}"
        else:
            where = f"kernel call '{name}'" if name else what
            message = (f"a {self.device} device error surfaced at {where}: {detail}. Kernels run asynchronously, "
                       f"so the failing kernel is this one or one launched before it; set {ENV}=1 to "
                       "synchronize after every kernel call and name it")
        self.failure = DeviceError(message, kernel=name if pinned else None)
        return self.failure

    def _refuse_if_failed(self) -> None:
        if self.failure is not None:
            raise DeviceError(f"{self.failure} (an earlier run failed; the process's {self.device} context "
                              "cannot be trusted after a device error: run the model in a fresh process)",
                              kernel=self.failure.kernel)
