"""Time budgets (``--budget 90s``, ``10m``, ``1h``): how long `bitparity fuzz` searches, and when `bitparity verify`
stops starting runs, so that a case run under an outside time limit (a CI job, a device call) still ends with the
verdicts of the runs that finished instead of being killed with none.
"""
from __future__ import annotations

import math
import time

from .errors import UsageError

MAX_BUDGET_S = 7 * 86_400.0
_clock = time.monotonic         # the clock every Deadline reads (tests move it forward)


def parse_budget(text: str) -> float:
    """'90s', '10m', '1h' or plain seconds -> seconds.

    Raises:
        UsageError: unparsable, or not in (0, MAX_BUDGET_S] (so 'nan', 'inf', '1e400' never mean "forever").
    """
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        value = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        raise UsageError(f"--budget {text!r}: expected e.g. 90s, 10m, 1h") from None
    if not (0 < value <= MAX_BUDGET_S):      # written so that nan fails too
        raise UsageError(f"--budget {text!r} must be positive and at most {MAX_BUDGET_S // 3600:.0f}h")
    return value


class Deadline:
    """A budget counted from when it is made.  ``Deadline(None)``: no budget (never spent; `cap` leaves every
    timeout as it is).

    Raises:
        UsageError: `text` is not a valid budget (`parse_budget`).
    """

    def __init__(self, text: "str | None"):
        self.text = text
        self.seconds = math.inf if text is None else parse_budget(text)
        self._end = _clock() + self.seconds

    def left(self) -> float:
        """Seconds until the budget is spent (<= 0 once it is; inf without a budget)."""
        return self._end - _clock()

    def spent(self) -> bool:
        return self.left() <= 0

    def cap(self, timeout_s: float) -> float:
        """`timeout_s`, or the seconds left if fewer: a run started now cannot outlast the budget."""
        return min(timeout_s, max(self.left(), 0.0))

    def words(self) -> str:
        """'the --budget of 9m' (for reasons and progress lines)."""
        return f"the --budget of {self.text}"
