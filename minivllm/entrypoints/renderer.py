"""The server's front end: bodies read, chat templates rendered and prompts tokenized off the event loop and off
the engine thread, within limits that keep one request from stalling the others (vLLM's API server tokenizes in
its own process, in a one-thread executor: `OpenAIServing._tokenizer_executor`).

Owns: the request-body size limit (413), the character cap on a prompt's text, the trust rule for a request's own
chat template, and the one worker thread that renders and tokenizes. The engine thread never tokenizes a server
request: it gets token ids. The event loop only measures lengths; the work runs in the worker thread, which
holds the GIL a few milliseconds at a time, so /health and other streams go on.

    body        more than `max_body_bytes` (Content-Length, or counted as it arrives)      -> 413
    images      a chat's image parts are decoded here too (chat_utils.load_images), each within
                limit_mm_per_prompt and the processor's size limits                        -> 400 naming the part
    prompt      more characters than `max_model_len` tokens can hold (`char_cap`: no token of
                the tokenizer decodes to more than `max_token_chars` characters), refused
                before it is tokenized                                                     -> 400 naming the field
    template    a request's `chat_template` is refused unless the server trusts them (`--trust-request-chat-
                template`, vLLM's flag: a template is a program); a trusted one must render within
                `RENDER_TIME_LIMIT_S` seconds (checked between the template's Python lines) and to at most
                `char_cap` characters                                                      -> 400 naming the field
    grammar     a constraint (JSON schema, regex, grammar, choices) of more than MAX_CONSTRAINT_CHARS, or a
                schema nested deeper than MAX_SCHEMA_DEPTH, is refused before it is compiled; the compile runs in
                a thread of its own (xgrammar releases the GIL) and must end within GRAMMAR_TIME_LIMIT_S, else
                the request is refused while the compile finishes on its own (its daemon thread never holds up
                a shutdown). The engine thread then finds it in the compiled-grammar cache -> 400 naming the field

A trusted template still runs in this process: one Python operation (a string repeated a billion times) is not
interrupted. Trust only templates from clients you trust, as with vLLM.
"""

from __future__ import annotations

import asyncio
import copy
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from minivllm.entrypoints.chat_utils import ImagePart, apply_chat_template, load_images
from minivllm.entrypoints.protocol import APIError

MAX_BODY_BYTES = 8 << 20          # a body of max_model_len-token prompts is far below this
RENDER_TIME_LIMIT_S = 2.0         # a trusted request template's rendering time
MAX_CONSTRAINT_CHARS = 64 << 10   # a structured-output constraint, as JSON text
MAX_SCHEMA_DEPTH = 64             # JSON levels of a schema: xgrammar's compile time grows steeply with nesting
GRAMMAR_TIME_LIMIT_S = 10.0       # (arrays nested 200 deep: 1 s on 2 cores; 600 deep: over 20 s)


class Renderer:
    """The front end's tokenizer (a copy of the engine's, used by one worker thread) and its limits."""

    def __init__(self, tokenizer, max_model_len: int, trust_request_chat_template: bool = False,
                 max_body_bytes: int = MAX_BODY_BYTES, render_time_limit_s: float = RENDER_TIME_LIMIT_S):
        self.tokenizer = copy.deepcopy(tokenizer)        # the engine thread keeps using its own
        self.max_model_len = max_model_len
        self.trust_request_chat_template = trust_request_chat_template
        self.max_body_bytes = max_body_bytes
        self.render_time_limit_s = render_time_limit_s
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab()))   # byte-level: >= its decoded length
        self.char_cap = max_model_len * self.max_token_chars
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-renderer")

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ------------------------------------------------------------------ the body
    async def read_body(self, request) -> bytes:
        """The raw body, at most max_body_bytes (413 beyond, before reading it where Content-Length says so)."""
        declared = request.headers.get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large(int(declared))
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large(size, at_least=True)
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self, size: int, at_least: bool = False) -> APIError:
        return APIError(f"the request body is {'more than ' if at_least else ''}{size} bytes; this server takes at "
                        f"most {self.max_body_bytes} bytes. Send fewer or shorter prompts.",
                        status_code=413, type="request_too_large")

    # ------------------------------------------------------------------ chat templates
    async def render_chat(self, messages: list[dict], options: dict) -> str:
        """The chat rendered by the model's template, or by the request's own where the server trusts them."""
        own = "chat_template" in options
        if own and not self.trust_request_chat_template:
            raise APIError("'chat_template' was sent with the request, but this server does not run request "
                           "chat templates (a template is a program). Leave it out to use the model's template, "
                           "or start the server with --trust-request-chat-template.", param="chat_template")
        if own:
            text = await self._run(self._render_within_limit, messages, options)
        else:
            text = await self._run(apply_chat_template, self.tokenizer, messages, options)
        self.check_chars(text, "chat_template" if own else "messages", what="the rendered chat")
        return text

    def _render_within_limit(self, messages: list[dict], options: dict) -> str:
        deadline = time.monotonic() + self.render_time_limit_s

        def tracer(frame, event, arg):
            if time.monotonic() > deadline:
                raise TimeoutError
            return tracer
        sys.settrace(tracer)
        try:
            return apply_chat_template(self.tokenizer, messages, options)
        except APIError as e:
            if isinstance(e.__context__, TimeoutError):      # chat_utils re-raised the template's error
                raise self._slow_template() from None
            raise
        except TimeoutError:
            raise self._slow_template() from None
        finally:
            sys.settrace(None)

    def _slow_template(self) -> APIError:
        return APIError(f"the request's chat_template did not finish rendering within {self.render_time_limit_s} "
                        "s; a chat template should only lay out the messages. Simplify it, or leave it out to use "
                        "the model's template.", param="chat_template")

    # ------------------------------------------------------------------ images
    async def load_images(self, images: list[ImagePart], mm_processor) -> list:
        """A chat's image parts decoded (PIL images) in the worker thread, before anything is queued: a malformed
        image, a URL, a file outside allowed_local_media_path or one image too many is a 400 naming its part."""
        return await self._run(load_images, images, mm_processor)

    # ------------------------------------------------------------------ grammars
    async def compile_grammar(self, manager, params, param: str) -> None:
        """Compile a request's constraint with the engine's StructuredOutputManager (its cache), within limits."""
        text = params.json if isinstance(params.json, str) else json.dumps(
            [params.json, params.regex, params.choice, params.grammar])
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise APIError(f"the {param} constraint is {len(text)} characters as JSON; this server compiles at most "
                           f"{MAX_CONSTRAINT_CHARS}. Use a smaller schema, regex or grammar.", param=param)
        depth = json_depth(_parsed(params.json))
        if depth > MAX_SCHEMA_DEPTH:
            raise APIError(f"the {param} JSON schema nests {depth} levels deep; this server compiles at most "
                           f"{MAX_SCHEMA_DEPTH}. Flatten the schema.", param=param)
        try:
            await asyncio.wait_for(in_daemon_thread(manager.grammar_for, params), GRAMMAR_TIME_LIMIT_S)
        except ValueError as e:
            raise APIError(str(e), param=param) from None
        except TimeoutError:
            raise APIError(f"the {param} constraint did not compile within {GRAMMAR_TIME_LIMIT_S} s; use a smaller "
                           "schema, regex or grammar.", param=param) from None

    # ------------------------------------------------------------------ tokens
    def check_chars(self, text: str, param: str, what: str = "the prompt") -> None:
        if len(text) > self.char_cap:
            raise APIError(f"{what} is {len(text)} characters; at most {self.char_cap} can fit max_model_len "
                           f"({self.max_model_len} tokens of at most {self.max_token_chars} characters each). "
                           "Shorten it.", param=param)

    async def tokenize(self, prompts: list[str | list[int]], param: str,
                       add_special_tokens: bool = True) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) per prompt; a prompt of ids passes as it is (the engine checks its ids)."""
        for p in prompts:
            if isinstance(p, str):
                self.check_chars(p, param)
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(await self._run(self._encode_all, texts, add_special_tokens) if texts else ())
        return [(p, next(encoded)) if isinstance(p, str) else (None, list(p)) for p in prompts]

    def _encode_all(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [self.tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]

    async def decode(self, token_ids: list[int]) -> str:
        return await self._run(self.tokenizer.decode, token_ids)

    async def decode_many(self, token_id_lists: list[list[int]]) -> list[str]:
        return await self._run(lambda: [self.tokenizer.decode(ids) for ids in token_id_lists])


def _parsed(schema):
    if isinstance(schema, str):
        try:
            return json.loads(schema)
        except (ValueError, RecursionError):
            return None                          # the compile says what is wrong with it
    return schema


def json_depth(value) -> int:
    """Levels of nesting of a JSON value (a scalar is 1), counted without recursion."""
    depth, level = 0, [value]
    while level:
        depth += 1
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v if isinstance(v, list) else ())]
    return depth


def in_daemon_thread(fn, *args) -> asyncio.Future:
    """fn(*args) in a daemon thread of its own (one that a shutdown does not wait for), as an asyncio future."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(outcome, ok):
        if not future.done():                    # the caller may have stopped waiting
            (future.set_result if ok else future.set_exception)(outcome)

    def run():
        try:
            result, ok = fn(*args), True
        except BaseException as e:               # handed to the waiting request
            result, ok = e, False
        loop.call_soon_threadsafe(settle, result, ok)
    threading.Thread(target=run, daemon=True, name="minivllm-grammar").start()
    return future
