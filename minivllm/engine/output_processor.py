"""OutputProcessor: from the core's new tokens to RequestOutputs (vLLM v1's `OutputProcessor`).

Owns: each request's front-end state: its prompt text, the detokenizer's offsets, the text handed out so far, the
text held back while it could still become a stop string, what was already streamed, and the request's timings.
It finds stop strings (the core finds EOS, stop tokens and lengths) and builds vLLM's three kinds of output
(`SamplingParams.output_kind`): CUMULATIVE (everything so far), DELTA (only what is new: streaming n tokens costs
O(n) in all) and FINAL_ONLY (one output at the end). It never touches the core's state; the engine finishes the
requests whose stop strings it finds.

A step is two calls, so that a step that fails leaves nothing here to undo:

    update = process_outputs(core_outputs)   pure: detokenizes, finds stop strings, changes nothing
    ... the engine finishes stop-string requests in the core and commits the step ...
    outputs = apply(update)                  assignments only, then builds the RequestOutputs

    text of one request:  [ sent pieces ............ | pending ]      pending: at most (longest stop - 1)
                            handed out in outputs       held back      characters while it runs
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from minivllm.core.request import Request, RequestMetrics, RequestStatus
from minivllm.core.sampling_params import RequestOutputKind, SamplingParams
from minivllm.core.scheduler import EngineCoreOutput
from minivllm.engine.detokenizer import DetokState, detokenize_incrementally, find_stop_string
from minivllm.outputs import CompletionOutput, RequestOutput


@dataclass
class RequestState:
    request: Request                  # the core's request: read only here (token ids, status, stop reason)
    prompt: str | None
    params: SamplingParams
    metrics: RequestMetrics
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


@dataclass
class OutputUpdate:
    changes: list[_Change]

    @property
    def stop_strings(self) -> list[tuple[Request, str]]:
        """Requests a stop string ended: the engine finishes them in the core before it commits."""
        return [(c.state.request, c.stop_string) for c in self.changes if c.stop_string is not None]


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request: Request, prompt: str | None) -> None:
        self.states[request.request_id] = RequestState(request, prompt, request.sampling_params,
                                                       RequestMetrics(arrival_time=request.arrival_time))

    def mark_scheduled(self, requests: list[Request], now: float) -> None:
        for req in requests:
            m = self.states[req.request_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now

    # ------------------------------------------------------------------ a step, in two phases
    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> OutputUpdate:
        changes = []
        for co in core_outputs:
            st = self.states[co.request.request_id]
            sp, req = st.params, co.request
            # A stop token or EOS ends the text without its own text (vLLM), unless asked to keep it.
            stopped_by_token = co.finish_status is RequestStatus.FINISHED_STOPPED
            if stopped_by_token and not sp.include_stop_str_in_output:
                new_text, detok = "", st.detok
            else:
                new_text, detok = detokenize_incrementally(self.tokenizer, req.output_token_ids, st.detok,
                                                           sp.skip_special_tokens)
            window = st.pending + new_text
            stop_string = None
            if sp.stop and new_text and not stopped_by_token:
                hit = find_stop_string(window, len(new_text), sp.stop)
                if hit is not None:
                    stop_string, start = hit
                    window = window[:start + len(stop_string) if sp.include_stop_str_in_output else start]
            finished = co.finish_status is not None or stop_string is not None
            cut = len(window) if finished else max(len(window) - st.max_holdback, 0)
            changes.append(_Change(st, detok, window[:cut], window[cut:], stop_string))
        return OutputUpdate(changes)

    def apply(self, update: OutputUpdate, now: float | None = None) -> list[RequestOutput]:
        """The step committed: keep its text, and build one output per request that has something to say."""
        now = time.time() if now is None else now
        outputs = []
        for c in update.changes:
            st = c.state
            st.detok, st.pending = c.detok, c.pending
            if c.delta_text:
                st.sent_pieces.append(c.delta_text)
            m = st.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            out = self._make_output(st, c.delta_text, now)
            if out is not None:
                outputs.append(out)
        return outputs

    def abort_request(self, request_id: str, now: float | None = None) -> RequestOutput | None:
        """The final output of a request that was aborted (with any text still held back), and forget it."""
        st = self.states.get(request_id)
        if st is None:
            return None
        delta, st.pending = st.pending, ""
        if delta:
            st.sent_pieces.append(delta)
        return self._make_output(st, delta, time.time() if now is None else now)

    # ------------------------------------------------------------------ outputs
    def _make_output(self, st: RequestState, delta_text: str, now: float) -> RequestOutput | None:
        req, kind = st.request, st.params.output_kind
        finished = req.is_finished
        if finished:
            st.metrics.finished_time = now
            del self.states[req.request_id]
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind is RequestOutputKind.DELTA:
            text, token_ids = delta_text, req.output_token_ids[st.num_sent_tokens:]
        else:
            text, token_ids = "".join(st.sent_pieces), list(req.output_token_ids)
        st.num_sent_tokens = req.num_output_tokens
        completion = CompletionOutput(0, text, token_ids, req.status.finish_reason if finished else None,
                                      req.stop_reason if finished else None)
        return RequestOutput(req.request_id, st.prompt, req.prompt_token_ids, [completion], finished,
                             dataclasses.replace(st.metrics), req.num_cached_tokens)
