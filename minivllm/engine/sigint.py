"""SigintGuard: Ctrl-C waits for a point where the engine's state is consistent.

Owns: Python's SIGINT handler while an engine step runs, on the main thread only (signals reach no other thread).
A Ctrl-C is a KeyboardInterrupt raised at whatever line runs when it arrives. Inside the model forward that is
fine: nothing in the core changes there, and the step rolls back. Inside the core's bookkeeping it is not: between
a change and the record of its undo (journal.py), or halfway through a rollback, an interrupt would leave a
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

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class SigintGuard:
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
