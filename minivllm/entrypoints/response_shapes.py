"""The shapes of a completion or chat answer (vLLM's response and stream-chunk models in
entrypoints/openai/protocol.py): the envelope every body and chunk repeats, a choice, the usage object, the prompt
logprobs, and what echo puts in front of a choice.

Owns: these dicts' field names and layout, as vLLM writes them. Pure functions of engine outputs: the serving modules
(serving_engine.py and its subclasses, tool_calls.py, serving_beam_search.py) decide what goes in them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from minivllm.entrypoints.protocol import LogprobsRequest
from minivllm.entrypoints.request_options import OutputOptions
from minivllm.outputs import Logprob, RequestOutput


@dataclass(frozen=True)
class ResponseMeta:
    """What every body and chunk of one response repeats: its id, creation time, model and kind."""
    request_id: str
    created: int
    model: str
    chat: bool

    def envelope(self, choices: list, stream: bool) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}


def usage_of(finals: list[RequestOutput], completion_tokens: int) -> dict:
    """The usage object: prompt and cached tokens from each prompt's final output (counted once per prompt,
    whatever n is, as vLLM does); completion tokens counted over all deltas of all samples by the caller."""
    prompt_tokens = sum(len(f.prompt_token_ids) for f in finals)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(f.num_cached_tokens for f in finals)}}


def running_usage(out: RequestOutput, completion_tokens: int) -> dict:
    """A streamed chunk's usage with continuous_usage_stats (vLLM's): its prompt, and its choice's tokens so far."""
    prompt_tokens = len(out.prompt_token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def make_choice(meta: ResponseMeta, index: int, text: str, finish_reason: str | None, stop_reason, stream: bool,
                first: bool = False, logprobs: dict | None = None) -> dict:
    """One entry of `choices`: a chat message, a chat stream delta (the first one carries the role), or text.
    index: prompt_index * n + sample_index, as vLLM numbers the choices of a batch of prompts."""
    choice: dict = {"index": index}
    if meta.chat and stream:
        choice["delta"] = ({"role": "assistant", "content": text} if first else {"content": text}) \
            if (first or text) else {}
    elif meta.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice.update(logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
    return choice


# JSON has no -inf: a logprob below -9999 is written as -9999.0, as OpenAI and vLLM do.
def clamp_logprob(logprob: float) -> float:
    return max(logprob, -9999.0)


def prompt_logprobs_json(prompt_logprobs: list[dict[int, Logprob] | None]) -> list[dict | None]:
    """RequestOutput.prompt_logprobs as vLLM's API writes it: None, then {token id: {logprob, rank,
    decoded_token}} per prompt token."""
    return [None if entry is None else
            {str(tid): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in entry.items()}
            for entry in prompt_logprobs]


@dataclass(frozen=True)
class EchoText:
    """A prompt as echo shows it: its text, and its first token's (the one token with no logprob)."""
    text: str
    first_token: str


@dataclass(frozen=True)
class ChoiceShape:
    """What the choices of one response hold besides their text: n per prompt, logprobs, the echoed prompts."""
    n: int
    logprobs: LogprobsRequest
    echo: list[EchoText]                       # per prompt; empty without echo
    tools: object = None                       # chat: the tool calls' reader (ParsedRequest.tools)
    options: OutputOptions = OutputOptions()   # token ids, logprobs tokens as ids, usage on every chunk


def with_echo(shape: ChoiceShape, i: int, out: RequestOutput, prompt_logprobs, text: str, token_ids: list[int],
              entries: list, first: bool) -> tuple[str, list[int], list]:
    """A choice's (text, token ids, logprobs entries), with prompt i in front for its first piece when echo is on
    (vLLM's way: a completion's prompt with its tokens; a chat's last message, as text only). echo with max_tokens
    0 leaves the sampled token out."""
    if shape.logprobs.echo_only:
        text, token_ids, entries = "", [], []
    if first and shape.echo:
        text = shape.echo[i].text + text
        if shape.logprobs.echo:
            ids = out.prompt_token_ids
            token_ids, entries = ids + token_ids, (prompt_logprobs or [None] * len(ids)) + entries
    return text, token_ids, entries


def end_of(shape: ChoiceShape, finish_reason, stop_reason) -> tuple:
    """echo with max_tokens 0 ends by length, whatever ended its hidden token."""
    return ("length", None) if shape.logprobs.echo_only and finish_reason is not None else (finish_reason, stop_reason)


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
