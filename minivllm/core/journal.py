"""StepJournal: the undo log that makes an engine step all-or-nothing.

Owns: the list of undo actions recorded while a step is open. The scheduler opens it before it plans a step and
commits it once the step's tokens are in; if anything raises in between (the plan itself, the model forward, the
sampler, the detokenizer, a Ctrl-C), the scheduler rolls it back: every change the core made since `begin()` is
undone, newest first, and the core is exactly as it was before the step.

Every writer of core state (the scheduler, the KV cache manager, the block pool, the swap space) records, next to
each change it makes, how to undo it:

    block_id = self.clean_free.popleft()
    self.journal.record(lambda: self.clean_free.appendleft(block_id))

Outside a step (add_request, abort_request between steps) `record` does nothing: those changes are final at once.
Undo actions capture values, not loop variables (`lambda b=b: ...`), and each one only restores what its own change
altered, so replaying them in reverse order rebuilds the state piece by piece.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class StepJournal:
    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] | None = None     # None: no step is open

    @property
    def is_open(self) -> bool:
        return self._undo is not None

    def begin(self) -> None:
        assert self._undo is None, "a step is already open (a previous step neither committed nor rolled back)"
        self._undo = []

    def record(self, undo: Callable[[], None]) -> None:
        if self._undo is not None:
            self._undo.append(undo)

    def set(self, obj: Any, attr: str, value: Any) -> None:
        """`obj.attr = value`, undoable."""
        old = getattr(obj, attr)
        setattr(obj, attr, value)
        self.record(lambda: setattr(obj, attr, old))

    def commit(self) -> None:
        assert self._undo is not None, "commit without begin"
        self._undo = None

    def rollback(self) -> int:
        """Undo everything since `begin()`, newest first. Returns how many changes were undone."""
        assert self._undo is not None, "rollback without begin"
        undo, self._undo = self._undo, None       # closed first: undo actions must not record again
        for action in reversed(undo):
            action()
        return len(undo)
