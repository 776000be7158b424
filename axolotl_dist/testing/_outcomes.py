"""What a run of the harness reports: each rank's outcome, and the error for a failed run."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["DistributedTestError", "RankOutcome", "STORE_PLACEMENTS"]


class DistributedTestError(AssertionError):
    """A rank raised, died or did not finish in time under :func:`._harness.run_distributed`."""


@dataclasses.dataclass
class RankOutcome:
    """What one rank did: its return value, or the exception it raised, or how it died."""

    rank: int
    value: Any = None
    #: The exception object if it could be pickled back, else None.
    exception: Optional[BaseException] = None
    #: ``"TypeName: message"`` of the exception, if one was raised.
    error: Optional[str] = None
    traceback: Optional[str] = None
    #: Process exit code; negative for a signal (-9 = SIGKILL); None if killed on timeout.
    exitcode: Optional[int] = None
    #: Seconds from the start of the run until this rank reported or died.
    elapsed: float = 0.0
    timed_out: bool = False
    #: Where a rank killed on ``timeout`` (or ``grace``) was then, as the kit's where report
    #: says (``barrier at test_x.py:12 (waiting 9 s for rank(s) [0])``); else None.
    where: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out and self.exitcode == 0

    def describe(self) -> str:
        if self.timed_out:
            where = f": {self.where}" if self.where else ""
            return f"rank {self.rank}: did not finish in time (killed){where}"
        if self.error is not None:
            return f"rank {self.rank}: raised {self.error}\n{self.traceback or ''}".rstrip()
        if self.exitcode != 0:
            how = (f"killed by signal {-self.exitcode}" if self.exitcode and self.exitcode < 0
                   else f"exited with code {self.exitcode} before returning")
            return f"rank {self.rank}: {how}"
        return f"rank {self.rank}: ok"


#: Where :func:`._harness.run_distributed` puts the c10d store: the test process, or rank 0's
#: process.
STORE_PLACEMENTS = ("parent", "rank0")


