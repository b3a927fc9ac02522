"""EncoderCacheManager: which images' encoder outputs the worker keeps, in rows (vLLM v1's `EncoderCacheManager`).

Owns: the encoder cache's budget, in tokens (one image's output is as many rows as it has placeholder tokens), and
which requests still need each output. The scheduler asks it, for each request it schedules, how far the request may
run (`fit`): a chunk stops before an image whose output is neither kept nor fits. At the end of `schedule()` the
plan is made real (`schedule_encoder`): the images to encode this step go in `SchedulerOutput.encoder_inputs`, and an
output the worker must drop goes in `free_encoder_hashes`. The worker holds the tensors (worker/encoder_runner.py).

    kept outputs     cached: mm_hash -> the requests that still need it (their prompt has not run past the image)
                     freeable: mm_hash -> rows, needed by nobody now, kept in case an equal image comes (LRU)
    num_free_slots = cache_size - rows of every kept output

An output is encoded once and shared: a second request with the same image (same hash) takes a reference, and a
request preempted and recomputed finds it again unless it was evicted meanwhile. Eviction takes the least recently
freed outputs first, only when a new output needs the room. Evictions reach the worker with the next step
(`free_encoder_hashes`): a step that fails and is rolled back may have evicted, and the worker must not have dropped
what the rolled-back state still counts on. The other way round, a rolled-back step's forward may have run the
encoder for outputs the restored state does not count (`orphans`): those go to the worker with the next step's
frees too, so a failed step leaves no tensor behind. Every change is journaled (core/journal.py).
"""

from __future__ import annotations

from minivllm.core.journal import Journaled, StepJournal
from minivllm.core.request import Request


class EncoderCacheManager(Journaled):
    JOURNALED = frozenset({"num_free_slots", "evicted", "num_encoder_inputs_scheduled"})

    def __init__(self, cache_size: int, journal: StepJournal):
        self.journal = journal
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self.cached: dict[str, set[str]] = {}      # mm_hash -> ids of the requests that still need its output
        self.freeable: dict[str, int] = {}         # mm_hash -> rows: kept, needed by nobody (oldest first)
        self.sizes: dict[str, int] = {}            # every kept output -> its rows
        self.evicted: tuple[str, ...] = ()         # evicted by committed steps, not yet sent to the worker
        self.orphans: list[str] = []               # encoded by steps that were rolled back: the worker may hold them
        self.num_encoder_inputs_scheduled = 0      # images sent to the encoder, over the engine's life

    # ------------------------------------------------------------------ planning (inside schedule())
    def fit(self, req: Request, start: int, num_tokens: int, out) -> int:
        """How many of `num_tokens` from position `start` may run: all, or up to the first image in that range whose
        output is neither kept nor planned nor fits in what is left. Plans the images it lets in
        (`out.encoder_plan`: request_id -> features this step needs), which `schedule_encoder` makes real for the
        requests that end up scheduled; the plans of those that do not are ignored."""
        plan = out.encoder_plan
        plan[req.request_id] = mine = []
        end = start + num_tokens
        for f in req.mm_features:
            if f.offset >= end:
                break
            if f.end <= start:
                continue
            planned = {g.mm_hash: g.length for rid, feats in plan.items()
                       if rid in out.num_scheduled_tokens or rid == req.request_id for g in feats}
            if f.mm_hash not in planned and f.mm_hash not in self.cached:   # new (needs room) or freeable (pinned)
                pinned = planned | {f.mm_hash: f.length}
                new_rows = sum(n for h, n in pinned.items() if h not in self.sizes)
                evictable = sum(n for h, n in self.freeable.items() if h not in pinned)
                if new_rows > self.num_free_slots + evictable:
                    return max(f.offset - start, 0)            # it waits for room; the tokens before it may run
            mine.append(f)
        return num_tokens

    def schedule_encoder(self, scheduled: list[Request], plan: dict[str, list]) -> tuple[list, list[str]]:
        """Take the references the plan needs, for the requests still scheduled: (features to encode this step,
        hashes whose outputs the worker drops first: those evicted by steps before this one)."""
        to_free, self.evicted = list(self.evicted) + self.orphans, ()
        taken, self.orphans = self.orphans, []
        self.journal.record(lambda: self.orphans.extend(taken))     # the step fails: still to be sent
        wanted = [(req.request_id, f) for req in scheduled for f in plan.get(req.request_id, ())]
        for request_id, f in wanted:        # kept outputs first: a reference keeps them from the evictions below
            if f.mm_hash in self.sizes:
                self._acquire(request_id, f.mm_hash, f.length)
        to_encode = [f for request_id, f in wanted if self._acquire(request_id, f.mm_hash, f.length)]
        self.num_encoder_inputs_scheduled += len(to_encode)
        for f in to_encode:        # the step fails after its forward ran the encoder: the worker drops them next step
            self.journal.record(lambda h=f.mm_hash: self.orphans.append(h))
        return to_encode, to_free

    def _acquire(self, request_id: str, mm_hash: str, rows: int) -> bool:
        """Reference an output for a request; True when it must be encoded (it was not kept)."""
        if mm_hash in self.cached:
            self._add_ref(mm_hash, request_id)
            return False
        if mm_hash in self.freeable:
            self._pop_freeable(mm_hash)
            self._set(self.cached, mm_hash, {request_id})
            return False
        while self.num_free_slots < rows:           # fit() promised the freeable outputs cover it
            victim = next(iter(self.freeable))
            self.num_free_slots += self.freeable[victim]
            self._pop_freeable(victim)
            self._pop(self.sizes, victim)
            self.evicted = self.evicted + (victim,)
        self.num_free_slots -= rows
        self._set(self.sizes, mm_hash, rows)
        self._set(self.cached, mm_hash, {request_id})
        return True

    # ------------------------------------------------------------------ releasing
    def release(self, req: Request, consumed_only: bool = False) -> None:
        """The request needs these outputs no more: those of the images its prompt ran past (`consumed_only`), or all
        of them (it finished, or was preempted: a recompute takes them again if they are still kept)."""
        for f in req.mm_features:
            if not consumed_only or f.end <= req.num_computed_tokens:
                self._release(req.request_id, f.mm_hash)

    def _release(self, request_id: str, mm_hash: str) -> None:
        refs = self.cached.get(mm_hash)
        if refs is None or request_id not in refs:
            return
        refs.discard(request_id)
        self.journal.record(lambda: refs.add(request_id))
        if not refs:
            self._pop(self.cached, mm_hash)
            self._set(self.freeable, mm_hash, self.sizes[mm_hash])

    # ------------------------------------------------------------------ journaled container writes
    def _add_ref(self, mm_hash: str, request_id: str) -> None:
        refs = self.cached[mm_hash]
        if request_id not in refs:
            refs.add(request_id)
            self.journal.record(lambda: refs.discard(request_id))

    def _pop_freeable(self, mm_hash: str) -> None:
        """Take an entry out of the LRU; the undo puts it back at the same place in the order."""
        order = list(self.freeable.items())
        del self.freeable[mm_hash]

        def undo() -> None:
            self.freeable.clear()
            self.freeable.update(order)
        self.journal.record(undo)

    def _set(self, d: dict, key: str, value) -> None:
        had, old = key in d, d.get(key)
        d[key] = value
        self.journal.record(lambda: d.__setitem__(key, old) if had else d.pop(key))

    def _pop(self, d: dict, key: str) -> None:
        old = d.pop(key)
        self.journal.record(lambda: d.__setitem__(key, old))

    # ------------------------------------------------------------------ introspection
    @property
    def usage(self) -> float:
        return 1 - self.num_free_slots / self.cache_size if self.cache_size else 0.0

    def check_integrity(self, live_request_ids: set[str]) -> None:
        """Invariants (core/invariants.py): every kept output is cached xor freeable, the rows add up, and only live
        requests hold references."""
        assert set(self.sizes) == set(self.cached) | set(self.freeable), "a kept output is neither cached nor freeable"
        assert not set(self.cached) & set(self.freeable), "an output is both cached and freeable"
        assert self.num_free_slots == self.cache_size - sum(self.sizes.values()) >= 0, "encoder cache rows do not add up"
        for mm_hash, refs in self.cached.items():
            assert refs, f"cached output {mm_hash[:12]} has no reference (should be freeable)"
            assert refs <= live_request_ids, f"output {mm_hash[:12]} is held by finished requests {refs - live_request_ids}"
