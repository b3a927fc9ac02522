"""AsyncLLMEngine: one LLMEngine shared by many concurrent clients (vLLM's AsyncLLMEngine / AsyncLLM).

Owns: the one thread that calls the engine, the command queue through which every other thread reaches
it, one output stream per request, pause / single-step controls, and a snapshot of the latest step,
stats and latency histograms for the dashboard and /metrics (kept by a StatsRecorder, stats.py). It never
decides what runs: that is the engine's scheduler. It never lets an exception out of the engine thread:
whatever goes wrong ends the requests concerned with an error and the loop goes on.

LLMEngine is not thread-safe, so nothing but the engine thread ever calls it:

    asyncio loop (HTTP handlers, the Gradio UI)        engine thread
    add_request() ── command ──> command queue ──────> engine.add_request(...)
    stream <── RequestOutput ── loop.call_soon_threadsafe <── engine.step() outputs
    client gone: stream closed ── command ─────────────> engine.abort_request(id)
    dashboard timer <── snapshot(), live <── lock ─── a StepTrace per step, stats after every change

A command is a function of the engine, run between two steps; its result (or exception) comes back through a
concurrent.futures.Future. The loop runs commands, then one step, and sleeps when there is nothing to step.
At shutdown every open request ends with an EngineShutdownError (the API answers 503) before the loop stops.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from minivllm.config import EngineConfig
from minivllm.core.sampling_params import RequestOutputKind, SamplingParams
from minivllm.engine.live_view import LiveView
from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.engine.request_stream import RequestStream
from minivllm.engine.stats import EngineSnapshot, StatsRecorder
from minivllm.outputs import RequestOutput

logger = logging.getLogger(__name__)


class RequestError(RuntimeError):
    """The engine could not finish a request (a failed step, a shutdown). Bad input raises ValueError."""


class EngineShutdownError(RequestError):
    """The engine is shutting down (or has): the request was ended, not failed."""


@dataclass
class NewRequest:
    """One request for add_requests: what LLMEngine.add_request takes."""
    prompt: PromptType
    params: SamplingParams
    request_id: str | None = None
    priority: int = 0


@dataclass
class _Command:
    fn: Callable[[], Any]
    future: concurrent.futures.Future


@dataclass
class _Tracked:
    """The engine thread's record of a request it streams: its stream and its timing so far."""
    stream: RequestStream
    delta: bool                                       # its outputs carry only the new tokens
    last_token_time: float | None = None


class AsyncLLMEngine:
    """Serve one LLMEngine to many asyncio clients; see the module docstring for the threads.

    Every public method may be called from any thread. The coroutines (`add_request`, `generate`, `call_async`)
    must be awaited on a running asyncio loop; their outputs are delivered to that loop.
    """

    def __init__(self, engine: LLMEngine, trace_history: int = 120, event_history: int = 300):
        self.engine = engine
        self._commands: collections.deque[_Command] = collections.deque()
        self._wakeup = threading.Condition()          # guards _commands; the engine thread sleeps on it
        # Engine-thread state: only _run_loop and the commands it runs touch these.
        self._tracked: dict[str, _Tracked] = {}
        self._paused, self._steps_allowed = False, 0  # and the single steps granted while paused
        self._stopping, self._shutdown_engine = False, True
        self._step_started: float | None = None       # time.monotonic() when the step under way began
        # What snapshot() copies, written only by the engine thread (and the trace listener it runs).
        self._recorder = StatsRecorder(engine.get_stats(), engine.get_queues(), trace_history, event_history)
        engine.add_trace_listener(self._recorder.on_trace)
        self.live = LiveView(engine)                  # what a live page reads without waiting for a step
        self._thread = threading.Thread(target=self._run_loop, name="minivllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, **kwargs) -> AsyncLLMEngine:
        """`AsyncLLMEngine.from_engine_args(model=None, num_kv_blocks=256, ...)`: every EngineConfig field."""
        return cls(LLMEngine(EngineConfig.from_kwargs(**kwargs)))

    # ------------------------------------------------------------------ facts that never change
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_request_tokens(self) -> int:
        """The longest a request (prompt + output) can get: the context or the whole KV pool, the smaller."""
        pool_tokens = self._recorder.stats.num_kv_blocks * self.engine.config.block_size
        return min(self.max_model_len, pool_tokens + 1)   # the last token's KV is never stored

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template applied to messages, as text (as LLM.chat does): any thread may call it."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    # ------------------------------------------------------------------ talking to the engine thread
    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between two steps; the future gets its result or exception."""
        return self._submit(lambda: fn(self.engine))

    async def call_async(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wakeup:
            if self._stopping or not self._thread.is_alive():
                future.set_exception(EngineShutdownError("the server is shutting down (or has shut down)."))
                return future
            self._commands.append(_Command(fn, future))
            self._wakeup.notify()
        return future

    async def add_request(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                          request_id: str | None = None, priority: int = 0) -> RequestStream:
        """Validate and queue a request; returns its stream. Raises ValueError (bad input) before anything runs."""
        params = sampling_params or SamplingParams()
        streams = await self.add_requests(lambda engine: [NewRequest(prompt, params, request_id, priority)])
        return streams[0]

    async def add_requests(self, build: Callable[[LLMEngine], list[NewRequest]]) -> list[RequestStream]:
        """Run `build(engine)` on the engine thread and add the requests it returns, all in one command: one trip
        to the engine thread, so they join the next step together. `build` may tokenize (engine.tokenize) and
        size each request from its prompt; what it raises comes back here. All or none: if `build` or any add
        raises, none of them stays in the engine.

        One trip instead of a tokenize and then an add matters under load: each trip waits for the step in
        flight, so a request that needed two would join the batch one whole step later."""
        loop = asyncio.get_running_loop()

        def add_all() -> list[RequestStream]:
            streams: list[RequestStream] = []
            num_prompt_tokens = 0
            news = build(self.engine)
            # every request checked once, all before the first is added (so adds rarely need undoing)
            processed = [self.engine.input_processor.process_inputs(new.prompt, new.params, new.priority)
                         for new in news]
            try:
                for new, request in zip(news, processed):
                    req = self.engine.add_request(request, request_id=new.request_id)
                    delta = new.params.output_kind is RequestOutputKind.DELTA
                    streams.append(RequestStream(req.request_id, loop, self.abort, delta=delta))
                    self._tracked[req.request_id] = _Tracked(streams[-1], delta)
                    num_prompt_tokens += req.num_prompt_tokens
            except BaseException:
                for stream in streams:                   # the ones added before the failure: gone again
                    del self._tracked[stream.request_id]
                    self.engine.abort_request(stream.request_id)
                raise
            self._recorder.add_prompt_tokens(num_prompt_tokens)
            return streams

        future = self._submit(add_all)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The caller went away while the engine thread was adding the requests: nobody will read
            # their streams, so abort them as soon as they exist.
            future.add_done_callback(lambda f: f.cancelled() or f.exception() or [s.close() for s in f.result()])
            raise

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """`async for out in engine.generate(...)`: the request's outputs as `params.output_kind` says (DELTA: only
        what is new; CUMULATIVE: everything so far; FINAL_ONLY: the last), the last with `finished=True`. A reader
        that lags gets the unread outputs merged into one. Closing or cancelling the iteration aborts the request."""
        stream = await self.add_request(prompt, sampling_params, request_id, priority)
        async with stream:
            async for out in stream:
                yield out

    def abort(self, request_id: str, reason: str = "client disconnected") -> None:
        """Abort a request wherever it is (waiting, running, preempted); unknown or finished ids are ignored.
        Does not wait: the engine thread frees its blocks before its next step."""
        self._submit(lambda: self._abort(request_id, reason))

    # ------------------------------------------------------------------ teaching controls
    def pause(self) -> None:
        """Stop stepping after the current step. Requests can still be added and aborted while paused.
        A batch still in flight (async scheduling, pipeline stages) is finished first, and single steps run one
        batch all the way (LLMEngine.step(ahead=False)): while paused, what the dashboard shows is all there is."""
        self._submit(lambda: self._set_paused(True))

    def resume(self) -> None:
        self._submit(lambda: self._set_paused(False))

    def step_once(self) -> None:
        """Pause (if running) and run exactly one engine step, if there is anything to run."""
        def grant() -> None:
            self._set_paused(True)
            if self.engine.has_unfinished_requests():
                self._steps_allowed += 1
        self._submit(grant)

    def _set_paused(self, paused: bool) -> None:
        """Pausing an engine that is already paused keeps the single steps granted so far."""
        if paused != self._paused:
            self._recorder.log("paused" if paused else "resumed")
            self._paused, self._steps_allowed = paused, 0

    # ------------------------------------------------------------------ what the UI and /metrics read
    def snapshot(self, with_pool: bool = False, timeout: float = 10.0) -> EngineSnapshot:
        """A consistent copy of what the dashboard and /metrics show. with_pool=True adds the KV pool's picture as
        the engine thread last published it (self.live, after each step while watched): it never waits for a step."""
        pool = self.live.watch() if with_pool else None
        if with_pool and pool is None and threading.current_thread() is not self._thread:
            with contextlib.suppress(RequestError, concurrent.futures.TimeoutError):    # shut down, or a long step
                pool = self.call(self.live.publish_pool).result(timeout)             # none yet: ask for one
        return self._recorder.snapshot(self._paused, self._thread.is_alive(), len(self._tracked), pool)

    def finish_reason_of(self, request_id: str) -> str | None:
        """How a recently finished request ended ("stop", "length", "abort", "error"), or None if unknown."""
        return self._recorder.finish_reason_of(request_id)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def seconds_in_step(self) -> float:
        """How long the engine thread has been in the step under way; 0 between steps (/health's stall check)."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def shutdown(self, timeout: float = 30.0, shutdown_engine: bool = True) -> None:
        """Finish every open request with a RequestError, stop the loop, and (unless shutdown_engine=False,
        to wrap the engine again later) shut the engine down."""
        with self._wakeup:
            self._stopping, self._shutdown_engine = True, shutdown_engine
            self._wakeup.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the engine thread
    def _run_loop(self) -> None:
        while True:
            try:
                self._run_commands(wait=not self._can_step())
                if self._stopping:
                    break
                if self._can_step():
                    self._step()
            except Exception:                    # a bug of ours: log it, keep serving
                logger.exception("unexpected error in the engine loop")
        for request_id in list(self._tracked):      # each open request ends: the API answers it a 503
            self._fail(request_id, "the server is shutting down.", EngineShutdownError)
        self._cancel_commands()
        self.engine.remove_trace_listener(self._recorder.on_trace)
        self.live.close()
        shutdown = getattr(self.engine, "shutdown", None)   # tensor-parallel workers, where there are any
        if shutdown is not None and self._shutdown_engine:
            try:
                shutdown()
            except Exception:
                logger.exception("engine.shutdown() failed")

    def _cancel_commands(self) -> None:
        """At shutdown: every command still queued fails, so no caller awaits a future that never resolves."""
        with self._wakeup:
            commands, self._commands = list(self._commands), collections.deque()
        for cmd in commands:
            if cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(EngineShutdownError("the server is shutting down (or has shut down)."))

    def _can_step(self) -> bool:
        if self._paused and self._steps_allowed == 0:
            return bool(self.engine.batch_queue)         # finish what was in flight when it paused
        return self.engine.has_unfinished_requests()

    def _run_commands(self, wait: bool) -> None:
        """Run every queued command; with wait=True, first sleep until there is one (or a shutdown)."""
        with self._wakeup:
            while wait and not self._commands and not self._stopping:
                self._wakeup.wait()
            commands, self._commands = list(self._commands), collections.deque()
        done = []
        for cmd in commands:
            if not cmd.future.set_running_or_notify_cancel():   # the caller gave up waiting before it ran
                continue
            try:
                done.append((cmd.future, cmd.fn(), None))
            except Exception as e:                   # e.g. ValueError for a bad request: the caller's business
                done.append((cmd.future, None, e))
        if commands:
            # An add or an abort changes the queues and free blocks: publish before anyone hears it is done, so
            # a snapshot taken after `await add_request(...)` lists the request.
            self._publish_stats()
        for future, result, error in done:
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    def _step(self) -> None:
        if self._steps_allowed:
            self._steps_allowed -= 1
        self._step_started = time.monotonic()
        try:
            outputs = self.engine.step(ahead=False) if self._paused else self.engine.step()
        except Exception as e:
            # The engine rolled the step back: nothing it did remains. Only the requests it had scheduled end,
            # with the error (the API answers them with a 500 body); every other request keeps its place.
            logger.exception("engine step failed")
            self._recorder.step_failed()
            message = f"engine step failed: {type(e).__name__}: {e}"
            for request_id in self.engine.failed_request_ids:
                self._fail(request_id, message)
            self._recorder.log(message)
            try:
                self.engine.check_integrity()
            except Exception:
                logger.exception("KV cache integrity check failed after a failed step")
            self._publish_stats()
            return
        finally:
            self._step_started = None
        self._publish_stats()                        # before any reader hears of the step
        now = time.time()
        ended = False
        for out in outputs:
            try:
                ended |= self._deliver(out, now)
            except Exception as e:               # only this request fails; the others get their outputs
                logger.exception("delivering the output of %r failed", out.request_id)
                self._fail(out.request_id, f"delivering its output failed: {type(e).__name__}: {e}")
                ended = True
        if ended:
            self._publish_stats()                    # requests nobody reads were aborted: their blocks are free

    def _deliver(self, out: RequestOutput, now: float) -> bool:
        """Hand one output to its stream. True if that aborted the request (its reader's loop is gone)."""
        tracked = self._tracked.get(out.request_id)
        if tracked is None:                          # added behind our back (engine used directly): not ours
            return False
        tracked.last_token_time = self._recorder.observe_latency(tracked.last_token_time, out, now)
        self.live.observe(out, tracked.delta)
        if out.finished:
            del self._tracked[out.request_id]
            self._recorder.record_finish(out.request_id, out.outputs[0].finish_reason)
        try:
            tracked.stream.put(out)
        except RuntimeError:                         # the consumer's event loop is closed: nobody will read
            if not out.finished:
                self._abort(out.request_id, "its event loop is gone")
                return True
        return False

    def _abort(self, request_id: str, reason: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        out = self.engine.abort_request(request_id)
        if out is None:                              # unknown or already finished
            return
        self._recorder.record_finish(request_id, "abort")
        self._recorder.log(f"abort {request_id} ({reason})")
        if tracked is not None:
            with contextlib.suppress(RuntimeError):
                tracked.stream.put(out)              # a consumer still reading sees finish_reason "abort"

    def _fail(self, request_id: str, message: str, error: type[RequestError] = RequestError) -> None:
        """End one request with a RequestError: abort it in the engine (freeing its blocks), tell its reader."""
        tracked = self._tracked.pop(request_id, None)
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("abort_request(%r) failed", request_id)
        self._recorder.record_finish(request_id, "error")
        if tracked is not None:                  # (its event loop may be closed, or its stream broken)
            with contextlib.suppress(Exception):
                tracked.stream.put(error(f"request {request_id}: {message}"))

    def _publish_stats(self) -> None:
        """After every step and every batch of commands: the pool's picture (if watched), the counts and the queues."""
        self.live.publish_pool(self.engine)
        self._recorder.publish(self.engine.get_stats(), self.engine.get_queues())
