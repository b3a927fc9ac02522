"""OutputProcessor: from the core's new tokens to RequestOutputs (vLLM v1's `OutputProcessor`), through the incremental
detokenizer (`detokenize_incrementally`, vLLM v1's `v1/engine/detokenizer.py`), which is the first part of this file.

Owns: each request's front-end state: its prompt text, the detokenizer's offsets, the text handed out so far, the
text held back while it could still become a stop string, what was already streamed, and the request's timings.
It finds stop strings (the core finds EOS, stop tokens and lengths) and builds vLLM's three kinds of output
(`SamplingParams.output_kind`): CUMULATIVE (everything so far), DELTA (only what is new: streaming n tokens costs
O(n) in all) and FINAL_ONLY (one output at the end). It never touches the core's state; the engine finishes the
requests whose stop strings it finds.

A step is two calls, so that a step that fails leaves nothing here to undo:

    update = process_outputs(core_outputs, logprobs)   pure: detokenizes, finds stop strings, changes nothing
    ... the engine finishes stop-string requests in the core and commits the step ...
    outputs = apply(update)                  assignments only, then builds the RequestOutputs

    text of one request:  [ sent pieces ............ | pending ]      pending: at most (longest stop - 1)
                            handed out in outputs       held back      characters while it runs

Prompt logprobs (SamplingParams.prompt_logprobs) arrive chunk by chunk with the prefill, in steps that may have no
output token yet; they are kept from step to step here and handed out complete with the first output token. A
chunk that covers prompt tokens already kept (a recompute after preemption) adds only what is new.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from minivllm.core.request import Request, RequestMetrics, RequestStatus
from minivllm.core.sampling_params import RequestOutputKind, SamplingParams
from minivllm.core.scheduler import EngineCoreOutput
from minivllm.engine.parallel_sampling import ParentRequest
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.worker.logprobs import SampleLogprobs, StepLogprobs


# ------------------------------------------------------------------ incremental detokenization
# (vLLM v1 keeps this part in v1/engine/detokenizer.py.) Turning a request's output token ids into text as they
# arrive. Decoding one token at a time is wrong for byte-level BPE (a character can span tokens) and for
# tokenizers that merge spaces, so we decode a short window twice, with and without the new tokens, and emit
# only the difference, holding text back while it ends in an incomplete character (U+FFFD).
#
#     output ids: [ ......... | prefix_offset ... read_offset | new ... ]
#                                \_ context already emitted _/ \_ to emit _/

class RustDecoder:
    """`tokenizer.decode` without transformers' Python around it: the Rust tokenizer's own decode.

    A step detokenizes every running request twice, so at batch 256 transformers' wrapper (its input checks
    and keyword handling: about 2.5 us of a 3.4 us call here, the Rust decode 0.8 us) costs milliseconds per
    step, which on a GPU is time the GPU waits. `fast_decoder` hands this out only where the text is the same (see there).
    """

    def __init__(self, tokenizer):
        self._decode = tokenizer.backend_tokenizer.decode

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._decode(token_ids, skip_special_tokens=skip_special_tokens)


def fast_decoder(tokenizer):
    """A RustDecoder for a transformers fast tokenizer whose decode is exactly the Rust one's, else `tokenizer`.

    Exactly: the class keeps the fast base class's decode (no model-specific override) and does not clean up
    spaces after decoding (clean_up_tokenization_spaces, a Python pass over the text)."""
    cls = type(tokenizer)
    base = next((c for c in cls.__mro__ if "backend_tokenizer" in c.__dict__), None)   # the fast base class
    if (base is None or getattr(tokenizer, "clean_up_tokenization_spaces", True)
            or getattr(cls, "decode", None) is not getattr(base, "decode", None)
            or getattr(cls, "_decode", None) is not getattr(base, "_decode", None)):
        return tokenizer
    return RustDecoder(tokenizer)


@dataclass(frozen=True)
class DetokState:
    prefix_offset: int = 0
    read_offset: int = 0


def detokenize_incrementally(tokenizer, token_ids: list[int], state: DetokState,
                             skip_special_tokens: bool = True) -> tuple[str, DetokState]:
    """New text for the tokens appended since `state` (may be "" while a character is incomplete), and the
    state after them. Pure: `state` is not changed, so a step that fails later leaves nothing to undo."""
    prefix = tokenizer.decode(token_ids[state.prefix_offset:state.read_offset],
                              skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(token_ids[state.prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        return full[len(prefix):], DetokState(state.read_offset, len(token_ids))
    return "", state


def find_stop_string(text: str, new_text_len: int, stop: list[str]) -> tuple[str, int] | None:
    """The first stop string that the latest text completed, and where it starts; None if none did.

    Only the tail that could contain a stop string touching the new text is searched.
    """
    best: tuple[str, int] | None = None
    for s in stop:
        start = max(0, len(text) - new_text_len - len(s) + 1)
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[1]):
            best = (s, i)
    return best


# ------------------------------------------------------------------ the output processor


@dataclass
class RequestState:
    request: Request                  # the core's request: read only here (token ids, status, stop reason)
    prompt: str | None
    params: SamplingParams
    metrics: RequestMetrics
    parent: ParentRequest | None = None   # n > 1: the request this one is sample `index` of
    index: int = 0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)   # per output token, when asked
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # [None, then one per prompt token kept so far]
    prompt_logprobs_sent: bool = False   # DELTA: they went out (once, with the first output token)
    detok: DetokState = field(default_factory=DetokState)
    sent_pieces: list[str] = field(default_factory=list)   # text handed out, in the pieces it went out in
    pending: str = ""                 # text not handed out yet (held back in case it starts a stop string)
    num_sent_tokens: int = 0          # output token ids handed out (DELTA)

    @property
    def max_holdback(self) -> int:
        return max((len(s) for s in self.params.stop), default=1) - 1


@dataclass
class _Change:
    """One request's part of a step, computed by process_outputs and applied by apply."""
    state: RequestState
    detok: DetokState
    delta_text: str                   # handed out now
    pending: str
    stop_string: str | None           # the stop string that ended it, if one did
    logprobs: list[dict[int, Logprob]] | None = None   # the new tokens', when the request asked for logprobs
    sampled_logprob: float = 0.0                       # their sum
    num_dropped: int = 0              # tokens of this step after the one that completed the stop string


@dataclass
class OutputUpdate:
    changes: list[_Change]
    # (request, prompt logprobs to append): this step's new prompt logprobs, also for requests with no token yet
    prompt_logprobs: list[tuple[RequestState, list[dict[int, Logprob]]]] = field(default_factory=list)

    @property
    def stop_strings(self) -> list[tuple[Request, str, int]]:
        """Requests a stop string ended, with how many of the step's last tokens came after it: the engine drops
        those and finishes the requests in the core before it commits."""
        return [(c.state.request, c.stop_string, c.num_dropped) for c in self.changes if c.stop_string is not None]


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoder = fast_decoder(tokenizer)             # tokenizer.decode's text, at less host time per call
        self.states: dict[str, RequestState] = {}          # core request id -> its state
        self.parents: dict[str, ParentRequest] = {}        # n > 1: parent id -> the parent
        # n > 1 with prompt_logprobs: parent id -> [the first finished prompt's logprobs, whether DELTA sent them]
        self.parent_prompt_logprobs: dict[str, list] = {}
        self._token_text: dict[int, str] = {}              # token id -> its text, for Logprob.decoded_token

    def add_request(self, request: Request, prompt: str | None, parent: ParentRequest | None = None,
                    index: int = 0) -> None:
        st = RequestState(request, prompt, request.sampling_params, RequestMetrics(arrival_time=request.arrival_time),
                          parent, index)
        if st.params.prompt_logprobs is not None:
            st.prompt_logprobs = [None]                    # the first prompt token has no logprob
        self.states[request.request_id] = st
        if parent is not None:
            self.parents[parent.request_id] = parent

    def external_id(self, request_id: str) -> str:
        """The id the caller knows: a child's parent id, or the request's own."""
        st = self.states.get(request_id)
        return st.parent.request_id if st is not None and st.parent is not None else request_id

    def mark_scheduled(self, requests: list[Request], now: float) -> None:
        for req in requests:
            m = self.states[req.request_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now

    # ------------------------------------------------------------------ a step, in two phases
    def process_outputs(self, core_outputs: list[EngineCoreOutput],
                        logprobs: StepLogprobs | None = None) -> OutputUpdate:
        changes = []
        for co in core_outputs:
            st = self.states[co.request.request_id]
            sp, req = st.params, co.request
            # A stop token or EOS ends the text without its own text (vLLM), unless asked to keep it.
            stopped_by_token = co.finish_status is RequestStatus.FINISHED_STOPPED
            ids = req.output_token_ids
            if stopped_by_token and not sp.include_stop_str_in_output:
                ids = ids[:-1]           # the step's other tokens (speculative decoding) keep their text
            keep = len(co.new_token_ids)
            if sp.stop and not stopped_by_token and keep > 1:
                # Speculative decoding gave several tokens: end at the one that completes a stop string, as steps
                # of one token would, so the output is the same token for token.
                keep = self._tokens_until_stop(st, ids, keep)
                ids = ids[:len(ids) - (len(co.new_token_ids) - keep)]
            new_text, detok = detokenize_incrementally(self.decoder, ids, st.detok, sp.skip_special_tokens)
            window = st.pending + new_text
            stop_string = None
            searchable = self._searchable_chars(st, ids, keep, new_text) if sp.stop and not stopped_by_token else 0
            if searchable:
                hit = find_stop_string(window, searchable, sp.stop)
                if hit is not None:
                    stop_string, start = hit
                    window = window[:start + len(stop_string) if sp.include_stop_str_in_output else start]
            finished = co.finish_status is not None or stop_string is not None
            cut = len(window) if finished else max(len(window) - st.max_holdback, 0)
            sample = logprobs.sample.get(req.request_id) if logprobs else None
            if sample is not None:
                sample = sample[:keep]                       # tokens after a stop are dropped, their logprobs too
            changes.append(_Change(st, detok, window[:cut], window[cut:], stop_string,
                                   [self._logprob_dict(row) for row in sample] if sample is not None else None,
                                   sum(row.logprobs[0] for row in sample) if sample is not None else 0.0,
                                   len(co.new_token_ids) - keep))
        update = OutputUpdate(changes)
        for request_id, chunk in (logprobs.prompt.items() if logprobs else ()):
            st = self.states.get(request_id)
            if st is None:                                 # aborted while its batch was in flight (pipeline)
                continue
            have = len(st.prompt_logprobs)                 # prompt tokens 0 .. have - 1 are kept already
            assert chunk.first_token <= have, (request_id, chunk.first_token, have)
            new = chunk.rows[have - chunk.first_token:]
            if new:
                update.prompt_logprobs.append((st, [self._logprob_dict(row) for row in new]))
        return update

    def _tokens_until_stop(self, st: RequestState, ids: list[int], num_new: int) -> int:
        """Of the last `num_new` tokens of `ids`, how many up to and including the one whose text completes a stop
        string (all of them when none does)."""
        sp, detok, window = st.params, st.detok, st.pending
        skip = sp.min_tokens - (len(ids) - num_new)          # tokens not yet past min_tokens: not searched
        for i in range(num_new):
            text, detok = detokenize_incrementally(self.decoder, ids[:len(ids) - num_new + i + 1], detok,
                                                   sp.skip_special_tokens)
            window += text
            if text and i >= skip and find_stop_string(window, len(text), sp.stop) is not None:
                return i + 1
        return num_new

    def _searchable_chars(self, st: RequestState, ids: list[int], num_new: int, new_text: str) -> int:
        """How many of new_text's last characters stop strings are looked for in: as vLLM, only the text of tokens
        after the first min_tokens (a stop string may still begin just before it)."""
        before = len(ids) - num_new                          # output tokens before this step's
        skip = min(max(st.params.min_tokens - before, 0), num_new)
        if skip == 0 or not new_text:
            return len(new_text)
        if skip == num_new:
            return 0
        text, _ = detokenize_incrementally(self.decoder, ids[:before + skip], st.detok, st.params.skip_special_tokens)
        return len(new_text) - len(text)

    def _logprob_dict(self, row: SampleLogprobs) -> dict[int, Logprob]:
        """{token id: Logprob}: the actual token first, then the top k (a token in both keeps its first entry)."""
        entry: dict[int, Logprob] = {}
        for tid, lp, rank in zip(row.token_ids, row.logprobs, row.ranks):
            if tid not in entry:
                text = self._token_text.get(tid)
                if text is None:
                    text = self._token_text[tid] = self.tokenizer.decode([tid])
                entry[tid] = Logprob(lp, rank, text)
        return entry

    def apply(self, update: OutputUpdate, now: float | None = None) -> list[RequestOutput]:
        """The step committed: keep its text, and build one output per request that has something to say."""
        now = time.time() if now is None else now
        outputs, samples = [], {}
        for st, entries in update.prompt_logprobs:
            st.prompt_logprobs.extend(entries)
        for c in update.changes:
            st = c.state
            st.detok, st.pending = c.detok, c.pending
            if c.delta_text:
                st.sent_pieces.append(c.delta_text)
            if c.logprobs is not None:
                st.logprobs.extend(c.logprobs)
                st.cumulative_logprob += c.sampled_logprob
            for m in (st.metrics,) if st.parent is None else (st.metrics, st.parent.metrics):
                if m.first_token_time is None:
                    m.first_token_time = now
                m.last_token_time = now
            if st.parent is not None and st.index == 0:     # the prompt's cache hits, counted once per parent
                st.parent.num_cached_tokens = st.request.num_cached_tokens
            if st.parent is not None and st.prompt_logprobs is not None:   # complete: this sample has a token
                self.parent_prompt_logprobs.setdefault(st.parent.request_id, [st.prompt_logprobs, False])
            completion = self._completion(st, c.delta_text, now)
            if st.parent is not None:
                samples.setdefault(st.parent.request_id, []).append(completion)
            elif completion is not None:
                outputs.append(self._request_output(st, [completion]))
        for parent_id, completions in samples.items():
            out = self._parent_output(self.parents[parent_id], completions, now)
            if out is not None:
                outputs.append(out)
        return outputs

    def abort_request(self, request_id: str, now: float | None = None) -> RequestOutput | None:
        """The final output of a request (or of all the samples of a parent) that was aborted, with any text still
        held back, and forget it. The core has finished the request(s) already."""
        now = time.time() if now is None else now
        parent = self.parents.get(request_id)
        ids = [request_id] if parent is None else parent.child_ids
        completions = []
        for rid in ids:
            st = self.states.get(rid)
            if st is None:
                continue
            delta, st.pending = st.pending, ""
            if delta:
                st.sent_pieces.append(delta)
            completions.append(self._completion(st, delta, now, final=True))
        if parent is not None:
            return self._parent_output(parent, completions, now)
        return self._request_output(st, completions) if completions else None

    # ------------------------------------------------------------------ outputs
    def _completion(self, st: RequestState, delta_text: str, now: float, final: bool = False) -> CompletionOutput | None:
        """What one sample hands out now, by its output kind (None: nothing, FINAL_ONLY before the end)."""
        req, kind = st.request, st.params.output_kind
        finished = req.is_finished or final
        if finished:
            st.metrics.finished_time = now
            del self.states[req.request_id]
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        asked = st.params.logprobs is not None
        if kind is RequestOutputKind.DELTA:
            text, token_ids = delta_text, req.output_token_ids[st.num_sent_tokens:]
            logprobs = st.logprobs[st.num_sent_tokens:] if asked else None
        else:
            text, token_ids = "".join(st.sent_pieces), list(req.output_token_ids)
            logprobs = list(st.logprobs) if asked else None
        st.num_sent_tokens = req.num_output_tokens
        return CompletionOutput(st.index, text, token_ids, req.status.finish_reason if finished else None,
                                req.stop_reason if finished else None, logprobs,
                                st.cumulative_logprob if asked else None)

    def _request_output(self, st: RequestState, completions: list[CompletionOutput]) -> RequestOutput:
        req = st.request
        prompt_logprobs = st.prompt_logprobs
        if st.params.output_kind is RequestOutputKind.DELTA:          # once, with the first output
            prompt_logprobs, st.prompt_logprobs_sent = (None if st.prompt_logprobs_sent else prompt_logprobs), True
        return RequestOutput(req.request_id, st.prompt, req.prompt_token_ids, completions,
                             completions[0].finish_reason is not None, dataclasses.replace(st.metrics),
                             req.num_cached_tokens, prompt_logprobs)

    def _parent_output(self, parent: ParentRequest, completions: list[CompletionOutput | None],
                       now: float) -> RequestOutput | None:
        """One output for the n samples: DELTA carries the samples that changed, CUMULATIVE and FINAL_ONLY all of
        them (FINAL_ONLY once, when the last sample finishes)."""
        completions = [c for c in completions if c is not None]
        for c in completions:
            if c.finish_reason is not None:
                parent.finished.add(c.index)
        kind = parent.sampling_params.output_kind
        if kind is not RequestOutputKind.DELTA:
            parent.latest.update((c.index, c) for c in completions)
        done = parent.is_finished
        kept = self.parent_prompt_logprobs.get(parent.request_id)
        if done:
            parent.metrics.finished_time = now
            del self.parents[parent.request_id]
            self.parent_prompt_logprobs.pop(parent.request_id, None)
        if kind is RequestOutputKind.FINAL_ONLY and not done:
            return None
        shown = completions if kind is RequestOutputKind.DELTA else list(parent.latest.values())
        if not shown:
            return None
        prompt_logprobs = None
        if kept is not None and not (kind is RequestOutputKind.DELTA and kept[1]):   # DELTA: once
            prompt_logprobs, kept[1] = kept[0], True
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                             sorted(shown, key=lambda c: c.index), done, dataclasses.replace(parent.metrics),
                             parent.num_cached_tokens, prompt_logprobs)
