"""One failure policy for schedule rules and TE passes.

A rule or pass that raises on a stage must never fail a compilation: the stage keeps the generic schedule
(or the program stays as it was), and a warning names the rule, the stage and the exception, so a failure
is seen rather than hidden as a slower kernel. With SOUFFLE_STRICT=1 (set by `make test`) the failure is
raised instead as a RuleFailedError, so the tests see every one.

What a rule *expects* to fail (a TVM schedule primitive probing whether it applies, which raises
ScheduleError and changes nothing) is not a failure: catch that narrowly where it is expected and send
everything else here.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

from souffle_py.errors import SouffleError

STRICT_ENV = "SOUFFLE_STRICT"

log = logging.getLogger("souffle_py.rules")


class RuleFailedError(SouffleError):
    """A schedule rule or TE pass raised (raised only in strict mode; otherwise a warning)."""

    def __init__(self, rule: str, subject: str, exc: BaseException):
        self.rule, self.subject, self.cause = rule, subject, exc
        super().__init__(f"{rule} failed on {subject}: {describe_exception(exc)}")


def strict() -> bool:
    """Whether failing rules raise (SOUFFLE_STRICT set and not 0): the test suite's mode."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def describe_exception(exc: BaseException) -> str:
    """The exception's type and the last line of its message (TVM's messages end with the useful line)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[-1][:300]}" if lines else type(exc).__name__


def rule_failed(rule: str, subject: str, exc: BaseException, fallback: str = "the generic schedule") -> None:
    """Report that `rule` raised `exc` on `subject` (a stage, kernel or program), which gets `fallback`:
    a warning, or RuleFailedError in strict mode. Call it from an `except` block, then fall back."""
    if isinstance(exc, RuleFailedError):  # a nested rule already reported (strict mode): keep its name
        raise exc
    if strict():
        raise RuleFailedError(rule, subject, exc) from exc
    log.warning("%s failed on %s (%s); %s instead", rule, subject, describe_exception(exc), fallback)


@contextmanager
def rule_guard(rule: str, subject: str, fallback: str = "the generic schedule", expected: tuple = ()):
    """`with rule_guard(...)`: an exception in the block is reported by rule_failed and swallowed (the
    caller's state must then be the fallback's); exceptions of the `expected` types pass through to the
    caller, which handles them as a rule that does not apply."""
    try:
        yield
    except expected:
        raise
    except SouffleError:
        raise  # raised on purpose (a user-facing error, or a failure already reported in strict mode)
    except Exception as exc:  # noqa: BLE001  (the policy: every failure of a rule is reported here)
        rule_failed(rule, subject, exc, fallback)
