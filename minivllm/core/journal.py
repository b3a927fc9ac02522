"""StepJournal and SigintGuard: what makes an engine step all-or-nothing.

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

The other half of the transaction is `SigintGuard` (below): the undo log can undo only a change whose undo was
recorded, so a Ctrl-C must not land between the two.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
from collections.abc import Callable, Iterator
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


class SigintGuard:
    """Ctrl-C waits for a point where the engine's state is consistent.

    Owns: Python's SIGINT handler while an engine step runs, on the main thread only (signals reach no other thread).
    A Ctrl-C is a KeyboardInterrupt raised at whatever line runs when it arrives. Inside the model forward that is
    fine: nothing in the core changes there, and the step rolls back. Inside the core's bookkeeping it is not: between
    a change and the record of its undo (above), or halfway through a rollback, an interrupt would leave a
    half-done change that no rollback can see. So a step holds Ctrl-C for its bookkeeping and lets it through only
    around the forward:

        with guard:                         # a Ctrl-C here is held ...
            ... bookkeeping ...
            with guard.open():              # ... delivered at once here (and a held one is raised on entry)
                forward
            guard.raise_if_held()           # ... or raised here, at a point the step can roll back from
            ... commit / rollback ...
                                            # a Ctrl-C held during commit or rollback is raised on leaving

    Elsewhere (another thread, or a program that installed its own SIGINT handler) it does nothing.
    """

    def __init__(self) -> None:
        self._held = False
        self._previous = None             # the handler to restore; None while not guarding

    def _hold(self, signum, frame) -> None:
        self._held = True

    def _active(self) -> bool:
        return (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler)

    def __enter__(self) -> SigintGuard:
        self._held = False
        if self._active():
            self._previous = signal.signal(signal.SIGINT, self._hold)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        if self._held and exc_type is None:
            self._held = False
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def open(self) -> Iterator[None]:
        """Let Ctrl-C through (a held one is raised right away)."""
        self.raise_if_held()
        if self._previous is None:
            yield
            return
        signal.signal(signal.SIGINT, self._previous)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, self._hold)

    def raise_if_held(self) -> None:
        if self._held:
            self._held = False
            raise KeyboardInterrupt
