"""Time budgets (``--budget 90s``, ``10m``, ``1h``): how long `bitparity fuzz` searches, and when `bitparity verify`
stops starting runs, so that a case run under an outside time limit (a CI job, a device call) still ends with the
verdicts of the runs that finished instead of being killed with none.
"""
from __future__ import annotations

import math
import re
import time

from ..errors import UsageError

MAX_BUDGET_S = 7 * 86_400.0
_clock = time.monotonic         # the clock every Deadline reads (tests move it forward)


_BUDGET = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([smh]?)")     # ASCII digits, no sign, space, _ or exponent


def parse_budget(text: str) -> float:
    """'90s', '10m', '1.5h' or plain seconds ('120') -> seconds.

    Raises:
        UsageError: not of that form, or not in (0, MAX_BUDGET_S] (so '0s' and '1e400' never mean "now" or
            "forever").
    """
    match = _BUDGET.fullmatch(text)
    if match is None:
        raise UsageError(f"--budget {text!r}: expected e.g. 90s, 10m, 1h")
    value = float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]
    if not (0 < value <= MAX_BUDGET_S):      # written so that nan fails too
        raise UsageError(f"--budget {text!r} must be positive and at most {MAX_BUDGET_S // 3600:.0f}h")
    return value


# how long a run cut by its watchdog takes to end: 1 s for its ranks' stacks, then up to 5 s for them to exit
# (`harness.running.runner`); a run is given the budget's remaining time less this, so that it has ended by the deadline
STOP_S = 6.0


class Deadline:
    """A budget counted from `start` (this module's clock; default: now).  ``Deadline(None)``: no budget (never
    spent; `cap` leaves every timeout as it is).  A run started under it is given the time left less `STOP_S`,
    so it has ended, stopped or not, when the budget is spent; the report comes after.

    Raises:
        UsageError: `text` is not a valid budget (`parse_budget`).
    """

    def __init__(self, text: "str | None", start: "float | None" = None):
        self.text = text
        self.seconds = math.inf if text is None else parse_budget(text)
        self._end = (_clock() if start is None else start) + self.seconds

    def left(self) -> float:
        """Seconds a run started now may take (the time left less `STOP_S`; <= 0: no run may start)."""
        return self._end - STOP_S - _clock()

    def spent(self) -> bool:
        return self.left() <= 0

    def cap(self, timeout_s: float) -> float:
        """`timeout_s`, or the seconds a run may still take if fewer (`left`)."""
        return min(timeout_s, max(self.left(), 0.0))

    def words(self) -> str:
        """'the --budget of 9m' (for reasons and progress lines)."""
        return f"the --budget of {self.text}"

    def not_started(self):
        """The `harness.running.runner.RunOutcome` of a run this budget left no time to start (error ``not run: ...``)."""
        from ..running.runner import RunOutcome
        return RunOutcome(False, f"not run: {self.words()} was spent before it could start", 0.0)

    @staticmethod
    def undone(outcome) -> bool:
        """Whether a failed run's `outcome` is the budget's doing (``not run: ...`` / ``stopped: ...``, `run`)."""
        return not outcome.ok and outcome.error.startswith(("not run: ", "stopped: "))

    def run(self, run_ranks, cfg, run_dir, timeout_s: float, launcher: str):
        """``run_ranks(cfg, run_dir, timeout, launcher)`` (`harness.running.runner.run_ranks`) under this budget: not
        started once it is spent (`not_started`), else with its watchdog capped (`cap`); a run the cap stopped
        says so (``stopped: ...``, the watchdog's own message below), any other failure is its own."""
        from ..running.runner import RunOutcome
        if self.spent():
            return self.not_started()
        given = self.cap(timeout_s)
        out = run_ranks(cfg, run_dir, given, launcher)
        if not out.ok and given < timeout_s and out.error.startswith("timeout after"):
            out = RunOutcome(False, f"stopped: {self.words()} ran out; the run had been given {given:.1f} s of it"
                                    f"\n{out.error}", out.elapsed_s)
        return out
