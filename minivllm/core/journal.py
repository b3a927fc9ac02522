"""StepJournal: the undo log that makes an engine step all-or-nothing.

Owns: the list of undo actions recorded while a step is open. The scheduler opens it before it plans a step and
commits it once the step's tokens are in; if anything raises in between (the plan itself, the model forward, the
sampler, the detokenizer, a Ctrl-C), the scheduler rolls it back: every change the core made since `begin()` is
undone, newest first, and the core is exactly as it was before the step.

Attributes of core objects are journaled by their class (`Journaled` below): a write is a plain assignment,
and the object records its undo itself, so a search for `status =` finds every writer of a request's status:

    req.status = RequestStatus.RUNNING            # a journaled field of Request: undone on rollback

Changes to containers (queues, free lists, hash maps) record, next to the change, how to undo it:

    block_id = self.clean_free.popleft()
    self.journal.record(lambda: self.clean_free.appendleft(block_id))

Outside a step (add_request, abort_request between steps) `record` does nothing: those changes are final at once.
Undo actions capture values, not loop variables (`lambda b=b: ...`), and each one only restores what its own change
altered, so replaying them in reverse order rebuilds the state piece by piece.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar


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


def journaled(default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    """A dataclass field of a `Journaled` class whose assignments the journal undoes (see `journaled_fields`)."""
    return dataclasses.field(default=default, metadata={"journaled": True}, **kw)


def journaled_fields(cls: type) -> frozenset[str]:
    """The names of a dataclass's `journaled()` fields: its JOURNALED set."""
    return frozenset(f.name for f in dataclasses.fields(cls) if f.metadata.get("journaled"))


class Journaled:
    """A core object whose attributes named in `JOURNALED` are undo-logged when assigned while a step is open.

    `journal` is the core's StepJournal, given by the object's owner (the scheduler for requests, the block pool
    for blocks); with none, or outside a step, an assignment is just an assignment. Reads cost nothing extra:
    only `__setattr__` is involved, and the value lives in the instance's `__dict__` as usual."""
    JOURNALED: ClassVar[frozenset[str]] = frozenset()
    journal: StepJournal | None = None

    def __setattr__(self, name: str, value: object) -> None:
        if name in self.JOURNALED:
            journal = self.journal
            if journal is not None and journal.is_open and name in self.__dict__:
                old = self.__dict__[name]
                journal.record(lambda: object.__setattr__(self, name, old))
        object.__setattr__(self, name, value)
