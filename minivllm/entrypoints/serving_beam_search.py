"""`use_beam_search` on /v1/completions and /v1/chat/completions (vLLM's OpenAIServing.beam_search): the answer's
choices are each prompt's n best beams, n being the beam width.

Owns: reading a body's beam search fields (use_beam_search, n, length_penalty, max_tokens, ignore_eos,
include_stop_str_in_output), refusing what a beam search cannot honour (a 400 naming the field: a stream, a
temperature above 0, logprobs, sampling filters, stop strings, tools, images), driving the search (beam_search.py's
BeamSearch) on the AsyncLLMEngine, and the answer body (serving_engine.py's shapes). vLLM has no `early_stopping` on
these routes; the search ends for a prompt once no live beam can still enter its n best (the same answer as running
to max_tokens, BeamSearch._cannot_improve).

The search runs as ordinary requests: each step adds every live beam as a one-token request (one add_requests
command), awaits their outputs, and ranks the candidates on the event loop. Between two steps the engine serves
everyone else, and in a step the beams share the batch with other clients' requests, so a beam search slows no one
more than its n requests would. The prefix cache gives each beam the blocks of the prompt and of its ancestors.

    body ──> BeamSearchParams ──> step: n one-token requests ──> engine thread ──> outputs ──> rank ──> step ...
                                                     search over ──> text (decoded on the engine thread) ──> choices

A client that hangs up cancels the search: the step's requests are aborted (their streams closed).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

from fastapi import Request

from minivllm.beam_search import MAX_BEAM_WIDTH, BeamSearch, BeamSearchOutput, BeamSearchParams, check_prompts
from minivllm.engine.async_llm import NewRequest, RequestError
from minivllm.entrypoints.protocol import (NOT_IMPLEMENTED, APIError, describe, read_field, requested_max_tokens,
                                           sampling_params_from_body)
from minivllm.entrypoints.serving_engine import ParsedRequest, ResponseMeta, make_choice, usage_of
from minivllm.entrypoints.utils import close_all, merged, until_disconnect
from minivllm.outputs import RequestOutput

# The fields a beam search reads, besides the prompt or messages and the chat template's options.
BEAM_SEARCH_READS = {"model", "user", "use_beam_search", "n", "length_penalty", "max_tokens", "max_completion_tokens",
                     "ignore_eos", "include_stop_str_in_output", "cache_salt", "prompt", "messages",
                     "add_generation_prompt", "continue_final_message", "chat_template"}
# Fields a beam search cannot honour, accepted only at a value that means "off" (null or absent always is; so are
# the off values of protocol.NOT_IMPLEMENTED, which clients such as vLLM's benchmark send). truncation_side changes
# nothing without truncate_prompt_tokens, which a beam search refuses.
OFF_VALUES = {"temperature": (0,), "stream": (False,), "top_p": (1,), "top_k": (-1, 0), "min_p": (0,),
              "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "min_tokens": (0,),
              "stop": ([],), "stop_token_ids": ([],), "bad_words": ([],), "skip_special_tokens": (True,),
              "logprobs": (False,), "top_logprobs": (0,), "echo": (False,), "tools": ([],), "tool_choice": ("none",),
              "response_format": ({"type": "text"},), "priority": (0,), "return_token_ids": (False,),
              "return_tokens_as_token_ids": (False,), "truncation_side": ("left", "right")}
WHY = {"temperature": "it keeps the most likely continuations; leave 'temperature' out, or send 0",
       "stream": "it answers once the whole search is over; send 'stream': false",
       "skip_special_tokens": "its text always leaves special tokens out; leave it out"}


def read_beam_search(body: dict, chat: bool) -> BeamSearchParams | None:
    """The body's BeamSearchParams, or None without `use_beam_search: true` (then length_penalty must be off).
    Every field is first checked as for a sampled request (types, ranges, `user`). max_tokens is the body's, else 1
    until serve_beam_search sets the route's default from the prompts."""
    use = read_field(body, "use_beam_search", "bool", False)
    length_penalty = read_field(body, "length_penalty", "number", 1.0)
    if not use:
        if length_penalty != 1:
            raise APIError(f"'length_penalty' is {describe(body['length_penalty'])}; it applies to a beam search "
                           "only: send 'use_beam_search': true with it, or leave it out.", param="length_penalty")
        return None
    sampling_params_from_body(body, chat, default_max_tokens=1)
    for name, value in body.items():
        if name in BEAM_SEARCH_READS or value is None:
            continue
        offs = OFF_VALUES.get(name, ()) + NOT_IMPLEMENTED.get(name, ())
        if any(value == off and isinstance(value, bool) == isinstance(off, bool) for off in offs):
            continue
        why = WHY.get(name, "it ranks continuations by the model's log-probabilities alone; leave it out")
        raise APIError(f"'{name}' is {describe(value)}; a beam search ('use_beam_search': true) cannot honour it: "
                       f"{why}.", param=name)
    n = read_field(body, "n", "int", 1)
    if not 1 <= n <= MAX_BEAM_WIDTH:
        raise APIError(f"'n' is {n}; with 'use_beam_search' it is the beam width, which must be in "
                       f"[1, {MAX_BEAM_WIDTH}] (each step asks for the 2 * n most likely tokens of every beam).",
                       param="n")
    max_tokens = requested_max_tokens(body, chat)[1]
    try:
        return BeamSearchParams(beam_width=n, max_tokens=max_tokens or 1, length_penalty=length_penalty,
                                ignore_eos=read_field(body, "ignore_eos", "bool", False),
                                include_stop_str_in_output=read_field(body, "include_stop_str_in_output", "bool",
                                                                      False))
    except ValueError as e:
        raise APIError(str(e), param=str(e).split(" ", 1)[0]) from None


async def serve_beam_search(serving, request: Request, parsed: ParsedRequest, params: BeamSearchParams):
    """Run the search for the body's prompts and answer with one JSON body (`serving`: the route's OpenAIServing)."""
    if parsed.images:
        raise APIError("a beam search takes text only; this conversation has images.", param=parsed.prompt_param)
    tokenized = await serving.renderer.tokenize(parsed.prompts, parsed.prompt_param)
    params = _sized(serving, parsed, params, [len(ids) for _, ids in tokenized])
    salt = parsed.body.get("cache_salt")
    prompts = [{"prompt_token_ids": ids, **({"prompt": text} if text is not None else {}),
                **({"cache_salt": salt} if salt is not None else {})} for text, ids in tokenized]
    engine = serving.async_engine
    try:
        checked = await engine.call_async(lambda e: check_prompts(e, prompts, params))
    except ValueError as e:
        max_tokens_name = requested_max_tokens(parsed.body, serving.is_chat)[0]
        field = ("cache_salt" if "cache_salt" in str(e) else max_tokens_name if "max_tokens" in str(e)
                 else "n" if str(e).startswith("beam_width ") else None)
        raise APIError(str(e).split(": ", 1)[-1] if len(prompts) == 1 else str(e),
                       param=field or parsed.prompt_param) from None
    except RequestError as e:
        raise APIError(str(e), status_code=503, type="service_unavailable") from None
    meta = ResponseMeta(f"{serving.request_id_prefix}-{uuid.uuid4().hex[:16]}", int(time.time()),
                        serving.models.name, serving.is_chat)
    return await until_disconnect(request, _answer(engine, checked, params, meta), [])


def _sized(serving, parsed: ParsedRequest, params: BeamSearchParams, lengths: list[int]) -> BeamSearchParams:
    """params with max_tokens set: the body's, which must fit the context with every prompt (400 otherwise, as a
    sampled request's), or the route's default for the shortest room any prompt leaves."""
    name, asked = requested_max_tokens(parsed.body, serving.is_chat)
    limit = serving.async_engine.max_model_len
    if asked is None:
        return replace(params, max_tokens=min(serving.default_max_tokens(n) for n in lengths))
    for n in lengths:
        if n < limit < n + asked:
            raise APIError(f"prompt ({n} tokens) + '{name}' ({asked}) is {n + asked} tokens; max_model_len is "
                           f"{limit}. Lower '{name}' to at most {limit - n} or shorten the prompt.", param=name)
    return params


async def _answer(engine, checked: list, params: BeamSearchParams, meta: ResponseMeta) -> dict:
    search = BeamSearch(checked, params, engine.engine.eos_token_ids, engine.max_model_len)
    await run_search(engine, search, params, meta.request_id)
    results = await engine.call_async(            # the engine thread's tokenizer: a few beams, between two steps
        lambda e: search.outputs(lambda ids: e.tokenizer.decode(ids, skip_special_tokens=True)))
    return answer_body(results, params.beam_width, meta)


async def run_search(engine, search: BeamSearch, params: BeamSearchParams, request_id: str) -> None:
    """Step `search` to its end on the AsyncLLMEngine: each step's beams are added in one command and read back."""
    step_params = params.step_params()
    while not search.finished:
        prompts, step = search.requests(), search.num_steps

        def build(_engine, prompts=prompts, step=step) -> list[NewRequest]:
            return [NewRequest(p, step_params, f"{request_id}-step{step}-beam{i}") for i, p in enumerate(prompts)]

        streams = await engine.add_requests(build)
        outputs: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in merged(streams):        # one output each (FINAL_ONLY)
                outputs[i] = out
        finally:
            close_all(streams)                          # no-op once finished; aborts them if cancelled
        search.advance(outputs)


def answer_body(results: list[BeamSearchOutput], n: int, meta: ResponseMeta) -> dict:
    """One choice per beam (index prompt_index * n + rank, best first), as vLLM answers a beam search; usage counts
    the prompts once and the returned beams' tokens."""
    choices, num_tokens = [], 0
    for i, result in enumerate(results):
        for j, beam in enumerate(result.sequences):
            choices.append(make_choice(meta, i * n + j, beam.text, beam.finish_reason, beam.stop_reason, stream=False))
            num_tokens += len(beam.output_token_ids)
    body = meta.envelope(choices, stream=False)
    finals = [RequestOutput("", r.prompt, r.prompt_token_ids, [], True, num_cached_tokens=r.num_cached_tokens)
              for r in results]
    body["usage"] = usage_of(finals, num_tokens)
    return body
