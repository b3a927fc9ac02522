"""What /v1/completions and /v1/chat/completions share (vLLM's entrypoints/openai/serving_engine.py): running a
parsed request on the AsyncLLMEngine and writing its answer.

Owns: turning a ParsedRequest into engine requests (tokenized in the front end, renderer.py; cut as
truncate_prompt_tokens and truncation_side ask; sized on the engine thread, all added in one command, at the
request's priority), and the answer: one JSON body with every choice joined, or server-sent events, one chunk per
new piece. The bodies' shapes are response_shapes.py's. What differs by route is a hook the subclass fills
(serving_completion.py, serving_chat.py): the default max_tokens, how logprobs are written, and chat's opening role
chunk; a chat's tool calls (tool_calls.py) rewrite its choices and stream deltas. It never calls the LLMEngine
except inside an AsyncLLMEngine command.

Logprobs, as vLLM serves them: /v1/completions' `logprobs` (k), `echo` (the prompt in front of the text and, with
logprobs, of the tokens: the engine then computes prompt logprobs too; `max_tokens` 0 with echo returns the prompt
alone) and vLLM's `prompt_logprobs`; /v1/chat/completions' `logprobs`, `top_logprobs`, `prompt_logprobs` and `echo`
(the last message's text in front of each choice). Streamed chunks carry their own tokens' logprobs. vLLM's
`return_token_ids` adds the prompt's ids (a completion's in each choice, a chat's at the top; streamed, in the
first chunk) and each choice's generated ids (streamed, each chunk's own).
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from minivllm.core.sampling_params import SamplingParams
from minivllm.engine.async_llm import AsyncLLMEngine, NewRequest, RequestError
from minivllm.engine.request_stream import RequestStream
from minivllm.entrypoints.protocol import (SAMPLING_FIELDS, APIError, LogprobsLimit, check_json_content_type,
                                           parse_json_body, read_logprobs_request, requested_max_tokens,
                                           sampling_params_from_body, structured_outputs_param)
from minivllm.entrypoints.renderer import Renderer
from minivllm.entrypoints.request_options import OutputOptions
from minivllm.entrypoints.response_shapes import (ChoiceShape, EchoText, ResponseMeta, end_of, make_choice,
                                                  prompt_logprobs_json, running_usage, sse, usage_of, with_echo)
from minivllm.entrypoints.serving_models import OpenAIServingModels
from minivllm.entrypoints.utils import close_all, close_async, merged, request_error, until_disconnect
from minivllm.outputs import RequestOutput


@dataclass(frozen=True)
class ParsedRequest:
    """A request body checked and turned into engine terms; what the completion routes share."""
    prompts: list[str | list[int]]   # /v1/completions takes several; chat has one
    body: dict
    options: OutputOptions         # stream, usage, truncation, priority, token ids (request_options.py)
    prompt_param: str              # where a prompt error points: "prompt" or "messages"
    images: tuple = ()             # chat: the prompt's images (PIL, decoded by the front end), one per placeholder
    tools: object = None           # chat: the tool calls' reader (tool_calls.ToolCallOutput), None for plain text
    chat_echo: str | None = None   # chat's `echo`: the text each choice starts with (the last message's, as vLLM)

    @property
    def stream(self) -> bool:
        return self.options.stream

    @property
    def forced_constraint(self):
        """A forced tool choice's grammar (it stands for the body's constraint fields, which it excludes)."""
        return None if self.tools is None else self.tools.request.constraint


# ---------------------------------------------------------------------- running a request
class OpenAIServing:
    """The base of the completion and chat servers; a subclass sets the class attributes and fills the hooks."""
    is_chat: bool = False
    request_id_prefix: str = "cmpl"

    def __init__(self, async_engine: AsyncLLMEngine, models: OpenAIServingModels, renderer: Renderer,
                 return_tokens_as_token_ids: bool = False):
        self.async_engine = async_engine
        self.models = models
        self.renderer = renderer
        self.tokens_as_token_ids = return_tokens_as_token_ids      # the server's default (vLLM's flag)
        engine = async_engine.engine                                # read once: fixed when the engine was built
        self.logprobs_limit = LogprobsLimit(engine.config.max_logprobs, engine.input_processor.vocab_size)

    async def read_body(self, request: Request) -> dict:
        """What every POST route checks first (after the API key): a JSON body, a JSON object, a model served here."""
        check_json_content_type(request)
        body = parse_json_body(await self.renderer.read_body(request))
        self.models.check_model(body)
        return body

    # ------------------------------------------------------------------ hooks
    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """max_tokens for a request that sets none, capped by the context."""
        raise NotImplementedError

    def create_logprobs(self, shape: ChoiceShape, i: int, token_ids: list[int], entries: list, num_logprobs: int,
                        text_offset: int) -> dict:
        """A choice's logprobs object for these tokens of prompt i, as the route writes it."""
        raise NotImplementedError

    def opening_chunks(self, meta: ResponseMeta, i: int, n: int, out: RequestOutput,
                       options: OutputOptions) -> list[dict]:
        """Chunks streamed for prompt i (whose first output is `out`) before that output's (chat's role chunks);
        none by default."""
        return []

    # ------------------------------------------------------------------ one request
    async def serve(self, request: Request, parsed: ParsedRequest):
        """Add the request's engine requests (one per prompt, as vLLM) and answer: a body or an event stream."""
        chat = self.is_chat
        checked = self.sampling_params(parsed, default_max_tokens=1)   # bad fields: no engine work
        request_id = f"{self.request_id_prefix}-{uuid.uuid4().hex[:16]}"
        if checked.structured_outputs is not None:     # compiled off the engine thread (renderer.py), then cached
            param = parsed.tools.request.constraint_param if parsed.forced_constraint else None
            await self.renderer.compile_grammar(self.async_engine.engine.structured_output_manager,
                                                checked.structured_outputs,
                                                param or structured_outputs_param(parsed.body))
        tokenized = await self.renderer.tokenize(parsed.prompts, parsed.prompt_param)
        echo_texts = await self.echo_texts(parsed, tokenized)

        def build(engine) -> list[NewRequest]:
            prompts, params = self.plan(engine, parsed, tokenized, checked)
            return [NewRequest(prompt, p, request_id if len(prompts) == 1 else f"{request_id}-{i}",
                               parsed.options.priority) for i, (prompt, p) in enumerate(zip(prompts, params))]

        try:
            streams = await self.async_engine.add_requests(build)
        except ValueError as e:                    # the engine's own checks: length, pool size, token ids
            named = (*SAMPLING_FIELDS, "cache_salt", "priority")
            field = next((f for f in named if str(e).startswith(f + " ")), parsed.prompt_param)
            raise APIError(str(e), param=field) from None
        except RequestError as e:
            raise APIError(str(e), status_code=503, type="service_unavailable") from None
        meta = ResponseMeta(request_id, int(time.time()), self.models.name, chat)
        shape = ChoiceShape(checked.n, read_logprobs_request(parsed.body, chat, self.logprobs_limit), echo_texts,
                            parsed.tools, parsed.options)
        if parsed.stream:
            # The background task runs once the response is over, even when the client hung up before the
            # first event (the generator never started, so its `async with` never ran).
            return StreamingResponse(self.stream_events(streams, shape, meta),
                                     media_type="text/event-stream",
                                     background=BackgroundTask(close_async, streams))
        return await until_disconnect(request, self.full_response(streams, shape, meta), streams)

    async def echo_texts(self, parsed: ParsedRequest, tokenized: list[tuple[str | None, list[int]]]) -> list[EchoText]:
        """For echo, each prompt's text (decoded for a prompt of token ids) and its first token's; a chat's echo is
        its last message's text (ParsedRequest.chat_echo)."""
        if parsed.chat_echo is not None:
            return [EchoText(parsed.chat_echo, "")]
        if not read_logprobs_request(parsed.body, self.is_chat, self.logprobs_limit).echo:
            return []
        decoded = await self.renderer.decode_many([ids for _, ids in tokenized] + [ids[:1] for _, ids in tokenized])
        k = len(tokenized)
        return [EchoText(text if text is not None else decoded[i], decoded[k + i])
                for i, (text, _) in enumerate(tokenized)]

    def plan(self, engine, parsed: ParsedRequest, tokenized: list[tuple[str | None, list[int]]],
             checked: SamplingParams) -> tuple[list[dict], list[SamplingParams]]:
        """On the engine thread, in the same command that adds the requests (AsyncLLMEngine.add_requests): each
        prompt (tokenized by the front end, passed on as ids, with a chat's images) and its SamplingParams. An
        explicit max_tokens must fit the context with the prompt, its images' rows counted (400 otherwise, as
        vLLM). Without one, default_max_tokens says."""
        max_tokens_name, max_tokens = requested_max_tokens(parsed.body, self.is_chat)
        prompts, params = [], []
        limit = self.async_engine.max_model_len
        # each image's one placeholder token becomes its encoder rows in the engine (multimodal/processor.py)
        grown = len(parsed.images) * (engine.input_processor.mm_processor.num_image_tokens - 1) if parsed.images else 0
        for text, whole in tokenized:
            ids = parsed.options.truncate(whole, limit)   # the side asked; the engine's own cut (the last k) keeps them
            text = text if len(ids) == len(whole) else None
            n = len(ids) + grown
            if max_tokens is not None and n < limit < n + max_tokens:
                raise APIError(f"prompt ({n} tokens) + '{max_tokens_name}' ({max_tokens}) is "
                               f"{n + max_tokens} tokens; max_model_len is {limit}. Lower "
                               f"'{max_tokens_name}' to at most {limit - n} or shorten the prompt.",
                               param=max_tokens_name)
            default = self.default_max_tokens(n)
            prompt = {"prompt": text, "prompt_token_ids": ids} if text is not None else {"prompt_token_ids": ids}
            if parsed.images:
                prompt["multi_modal_data"] = {"image": list(parsed.images)}
            if parsed.body.get("cache_salt") is not None:     # the engine checks it (InputProcessor)
                prompt["cache_salt"] = parsed.body["cache_salt"]
            prompts.append(prompt)
            params.append(self.sampling_params(parsed, default))
        return prompts, params

    def sampling_params(self, parsed: ParsedRequest, default_max_tokens: int) -> SamplingParams:
        """The body's SamplingParams, with a forced tool choice's grammar as its structured output."""
        params = sampling_params_from_body(parsed.body, self.is_chat, default_max_tokens, self.logprobs_limit)
        forced = parsed.forced_constraint
        return params if forced is None else replace(params, structured_outputs=forced)

    def logprobs_of(self, shape: ChoiceShape, i: int, token_ids: list[int], entries: list,
                    text_offset: int) -> dict | None:
        k = shape.logprobs.num_logprobs
        return None if k is None else self.create_logprobs(shape, i, token_ids, entries, k, text_offset)

    # ------------------------------------------------------------------ the answer
    async def full_response(self, streams: list[RequestStream], shape: ChoiceShape, meta: ResponseMeta) -> dict:
        """The whole answer: each sample's deltas joined into one choice (index prompt_index * n + sample)."""
        n = shape.n
        pieces: dict[int, list[str]] = defaultdict(list)
        token_ids: dict[int, list[int]] = defaultdict(list)
        entries: dict[int, list] = defaultdict(list)
        ends: dict[int, tuple] = {}
        finals: dict[int, RequestOutput] = {}
        prompt_logprobs: dict[int, list] = {}
        num_tokens = 0
        try:
            async for i, out in merged(streams):
                if out.prompt_logprobs is not None:       # complete, in the prompt's first output
                    prompt_logprobs[i] = out.prompt_logprobs
                for o in out.outputs:
                    k = i * n + o.index
                    pieces[k].append(o.text)
                    token_ids[k] += o.token_ids
                    entries[k] += o.logprobs or []
                    num_tokens += 0 if shape.logprobs.echo_only else len(o.token_ids)
                    if o.finished:
                        ends[k] = end_of(shape, o.finish_reason, o.stop_reason)
                finals[i] = out
        finally:
            close_all(streams)                   # no-op for finished requests; aborts the rest
        choices = []
        for k in range(len(streams) * n):
            i = k // n
            text, ids, lps = with_echo(shape, i, finals[i], prompt_logprobs.get(i), "".join(pieces[k]),
                                       token_ids[k], entries[k], first=True)
            choice = make_choice(meta, k, text, *ends.get(k, (None, None)), stream=False,
                                 logprobs=self.logprobs_of(shape, i, ids, lps, 0))
            if shape.tools is not None:
                shape.tools.write_message(choice)
            if shape.options.return_token_ids:                 # vLLM's: the tokens generated; a completion's prompt
                choice["token_ids"] = [] if shape.logprobs.echo_only else token_ids[k]
                if not meta.chat:
                    choice["prompt_token_ids"] = finals[i].prompt_token_ids
            if shape.logprobs.return_prompt_logprobs and not meta.chat:      # vLLM's extra field
                choice["prompt_logprobs"] = (prompt_logprobs_json(prompt_logprobs[i]) if i in prompt_logprobs
                                             else None)
            choices.append(choice)
        body = meta.envelope(choices, stream=False)
        body["usage"] = usage_of([finals[i] for i in range(len(streams))], num_tokens)
        if meta.chat and shape.logprobs.return_prompt_logprobs:          # vLLM: at the top of a chat's answer
            body["prompt_logprobs"] = prompt_logprobs_json(prompt_logprobs[0]) if 0 in prompt_logprobs else None
        if meta.chat and shape.options.return_token_ids:
            body["prompt_token_ids"] = finals[0].prompt_token_ids
        return body

    async def stream_events(self, streams: list[RequestStream], shape: ChoiceShape,
                            meta: ResponseMeta) -> AsyncIterator[str]:
        """Server-sent events: one chunk per new piece of a choice's text (its index says which) and, with
        logprobs, per new tokens, the choice's last with finish_reason, an optional usage chunk (choices: []), then
        `data: [DONE]`. With echo a choice's first chunk starts with the prompt. With continuous_usage_stats every
        chunk carries the usage of its prompt and choice so far (as vLLM); with return_token_ids each chunk its new
        token ids, and a prompt's first chunk its prompt_token_ids. If the client hangs up, Starlette cancels this
        generator and close_all aborts the requests."""
        n, options = shape.n, shape.options
        try:
            num_tokens, finals, prompt_logprobs = 0, {}, {}
            # text_offset counts the text of the tokens before (as in the whole answer), not the text streamed so far,
            # which lags behind while text is held back for a stop string
            token_chars: dict[int, int] = defaultdict(int)
            counts: dict[int, int] = defaultdict(int)          # tokens streamed per choice
            unsent: dict[int, list[int]] = defaultdict(list)   # return_token_ids: ids no chunk has carried yet
            started: set[int] = set()
            async for i, out in merged(streams):          # each output holds only what is new (DELTA)
                if i not in finals:
                    for chunk in self.opening_chunks(meta, i, n, out, options):
                        yield sse(chunk)
                if out.prompt_logprobs is not None:
                    prompt_logprobs[i] = out.prompt_logprobs
                for o in out.outputs:
                    k = i * n + o.index
                    first = k not in started
                    text, ids, lps = with_echo(shape, i, out, prompt_logprobs.get(i), o.text, o.token_ids,
                                               o.logprobs or [], first=first)
                    started.add(k)
                    new_tokens = 0 if shape.logprobs.echo_only else len(o.token_ids)
                    num_tokens, counts[k] = num_tokens + new_tokens, counts[k] + new_tokens
                    unsent[k] += o.token_ids[:new_tokens]      # a tool call's text may be held back a while
                    has_logprobs = shape.logprobs.num_logprobs is not None and ids
                    if not (text or o.finished or has_logprobs or (options.return_token_ids and new_tokens)):
                        continue
                    logprobs = self.logprobs_of(shape, i, ids, lps, token_chars[k]) if has_logprobs else None
                    if logprobs and logprobs.get("text_offset"):
                        token_chars[k] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                    finish_reason, stop_reason = end_of(shape, o.finish_reason, o.stop_reason)
                    choices = ([make_choice(meta, k, text, finish_reason, stop_reason, stream=True, logprobs=logprobs)]
                               if shape.tools is None else
                               shape.tools.stream_choices(meta, k, text, finish_reason, stop_reason, logprobs))
                    for j, choice in enumerate(choices):
                        if options.return_token_ids:
                            choice["token_ids"], unsent[k] = unsent[k], []
                            if first and j == 0 and not meta.chat:
                                choice["prompt_token_ids"] = out.prompt_token_ids
                        chunk = meta.envelope([choice], stream=True)
                        if options.continuous_usage:
                            chunk["usage"] = running_usage(out, counts[k])
                        yield sse(chunk)
                finals[i] = out
            if options.include_usage:
                yield sse({**meta.envelope([], stream=True),
                            "usage": usage_of([finals[i] for i in range(len(streams))], num_tokens)})
        except RequestError as e:                   # a failed step (500) or a shutdown (503), then [DONE]
            yield sse(request_error(e).body())
        finally:
            close_all(streams)
        yield "data: [DONE]\n\n"
