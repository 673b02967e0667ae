"""A test-only executor wrapper that injects faults into model execution on demand."""
from __future__ import annotations

import threading


class FatalFault(BaseException):
    """Stands for a fault Engine.step cannot contain (a scheduler bug, a lost device): it is not an
    Exception, so it escapes step() and kills the engine loop."""


class FaultyExecutor:
    """Wraps an executor; `fail(k)` makes the next k execute() calls raise RuntimeError (a per-step
    fault: Engine.step fails only that step's requests), `kill()` makes the next one raise
    FatalFault. Everything else is the wrapped executor's. Armed from the test thread."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self._failures = 0
        self._fatal = False
        self.num_faults = 0
        self.faulted_ids: list[list[str]] = []  # the request ids of each failed step

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def fail(self, steps: int = 1) -> None:
        with self._lock:
            self._failures += steps

    def kill(self) -> None:
        with self._lock:
            self._fatal = True

    def execute(self, plan):
        with self._lock:
            fatal, fail = self._fatal, self._failures > 0
            self._failures -= fail
        if fatal or fail:
            self.num_faults += 1
            self.faulted_ids.append([s.request_id for s in plan.scheduled])
            raise FatalFault("injected fatal fault") if fatal else RuntimeError("injected fault in model execution")
        return self.inner.execute(plan)
