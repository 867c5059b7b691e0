"""One failure policy for schedule rules and TE passes.

A rule or pass that raises on a stage must never fail a compilation: the stage keeps the generic schedule
(or the program stays as it was), and a warning names the rule, the stage and the exception, so a failure
is seen rather than hidden as a slower kernel. With SOUFFLE_STRICT=1 (set by `make test`) the failure is
raised instead as a RuleFailedError, so the tests see every one.

What a rule *expects* to fail is not a failure: a TVM schedule primitive that refuses (ScheduleError: it
checks before it changes anything) or a rule that finds part way that it does not fit (RuleDoesNotApply).
`not_applied` tells the two apart; `rule_failed` reports a failure.
"""

from __future__ import annotations

import logging
import os

from souffle_py.errors import SouffleError

STRICT_ENV = "SOUFFLE_STRICT"

log = logging.getLogger("souffle_py.rules")


class RuleDoesNotApply(Exception):
    """Raised by a rule that finds, part way, that it does not fit a stage (no register tile for its shape,
    a block inside a time loop): like TVM's ScheduleError, the rule not applying, not a failure."""


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


def refused(exc: BaseException) -> bool:
    """Whether `exc` says a rule does not apply: TVM refused a schedule primitive (ScheduleError: it checks
    before it changes anything) or the rule found it does not fit (RuleDoesNotApply)."""
    if isinstance(exc, RuleDoesNotApply):
        return True
    from tvm.s_tir import ScheduleError  # here: importing this module must not load TVM

    return isinstance(exc, ScheduleError)


def not_applied(rule: str, subject: str, exc: BaseException, fallback: str = "the generic schedule") -> None:
    """For a rule's `except Exception` around a schedule attempt: a refusal (`refused`) is the rule not
    applying (a debug line); anything else is a failure (`rule_failed`). The caller then falls back."""
    if refused(exc):
        log.debug("%s does not apply to %s (%s); %s", rule, subject, describe_exception(exc), fallback)
        return
    rule_failed(rule, subject, exc, fallback)
