"""What a completion or chat request asks for besides sampling (vLLM's extra request fields): its prompts, its
stream options, where its prompt is cut, its priority, and the token ids its answer carries.

Owns: reading those fields from a body (protocol.py reads the sampling fields; both raise APIError naming the
field), and `OutputOptions`, the frozen answer the serving modules read. Pure functions of the body and the
server's flags: no engine, no HTTP.

    field                          route       what it changes                        as vLLM's
    stream_options                 both        include_usage: a last chunk with usage  StreamOptions
                                               continuous_usage_stats: usage on every
                                               chunk too (with include_usage)
    truncate_prompt_tokens         both        the prompt cut to k tokens (-1: max_model_len)
    truncation_side                both        "left" keeps the last k (the default),  truncation_side
                                               "right" the first k
    priority                       both        lower runs first (the scheduler is      priority
                                               always priority-ordered here)
    return_token_ids               both        prompt_token_ids and each choice's       return_token_ids
                                               token_ids in the answer
    return_tokens_as_token_ids     both        logprobs tokens written "token_id:N"     (and the server flag
                                                                                        --return-tokens-as-token-ids)
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.entrypoints.protocol import APIError, describe, read_field, read_text

MAX_PROMPTS = 1024                   # prompts in one /v1/completions request
TRUNCATION_SIDES = ("left", "right")


@dataclass(frozen=True)
class OutputOptions:
    """A request's extra options, read once (read_output_options) and carried to its answer."""
    stream: bool = False
    include_usage: bool = False             # a last chunk with the usage
    continuous_usage: bool = False          # usage on every chunk too
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    priority: int = 0
    return_token_ids: bool = False
    tokens_as_token_ids: bool = False

    def truncate(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's ids cut as the request asks: the last k ("left", vLLM's default) or the first k."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        k = max_model_len if k == -1 else k
        return ids[-k:] if self.truncation_side == "left" else ids[:k]


def read_output_options(body: dict, tokens_as_token_ids_default: bool = False) -> OutputOptions:
    """The body's OutputOptions. tokens_as_token_ids_default: the server's --return-tokens-as-token-ids, which a
    request's own `return_tokens_as_token_ids` overrides (as vLLM)."""
    stream, include_usage, continuous = parse_stream(body)
    truncate = read_field(body, "truncate_prompt_tokens", "int")
    if truncate is not None and truncate < 1 and truncate != -1:
        raise APIError(f"'truncate_prompt_tokens' is {truncate}; it must be >= 1 (keep k of the prompt's tokens) or "
                       "-1 (max_model_len of them).", param="truncate_prompt_tokens")
    side = read_field(body, "truncation_side", "string", "left")
    if side not in TRUNCATION_SIDES:
        raise APIError(f"'truncation_side' is {describe(side)}; it must be 'left' (keep the prompt's last "
                       "truncate_prompt_tokens tokens) or 'right' (keep its first ones).", param="truncation_side")
    priority = read_field(body, "priority", "int", 0)         # read_field keeps it within 64 bits, as vLLM
    as_ids = read_field(body, "return_tokens_as_token_ids", "bool", tokens_as_token_ids_default)
    return OutputOptions(stream, include_usage, continuous, truncate, side, priority,
                         read_field(body, "return_token_ids", "bool", False), as_ids)


def parse_stream(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats). stream_options is only allowed with stream=true, as in
    OpenAI's API; continuous_usage_stats counts only with include_usage, as vLLM."""
    stream = read_field(body, "stream", "bool", False)
    options = read_field(body, "stream_options", "object")
    if options is None:
        return stream, False, False
    if not stream:
        raise APIError("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise APIError(f"'stream_options' has {', '.join(map(repr, unknown))}; it takes 'include_usage' and "
                       "'continuous_usage_stats'.", param="stream_options")
    include = read_field(options, "include_usage", "bool", False)
    return stream, include, include and read_field(options, "continuous_usage_stats", "bool", False)


def parse_prompt(body: dict) -> list[str | list[int]]:
    """Completion prompts: a string, a list of token ids, or a list of those (a batch: one choice each)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError("'prompt' is required: a string, a list of token ids, or a list of those.", param="prompt")
    if isinstance(prompt, str) or is_token_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str) or is_token_ids(p) for p in prompt):
        raise APIError(f"'prompt' is {describe(prompt)}; it must be a string, a list of token ids, or a "
                       "non-empty list of those.", param="prompt")
    if len(prompt) > MAX_PROMPTS:
        raise APIError(f"'prompt' holds {len(prompt)} prompts; one request takes at most {MAX_PROMPTS}. "
                       "Split it into several requests.", param="prompt")
    return [read_text(p, "prompt") if isinstance(p, str) else list(p) for p in prompt]


def is_token_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def parse_token_ids(body: dict, name: str, vocab_size: int) -> list[int]:
    """body[name] as a list of token ids, each in [0, vocab_size)."""
    ids = body.get(name)
    if not is_token_ids(ids) or not all(0 <= t < vocab_size for t in ids):
        raise APIError(f"'{name}' is {'missing' if ids is None else describe(ids)}; it must be a list of token "
                       f"ids in [0, {vocab_size}).", param=name)
    return ids


def token_as_id(token_id: int, logprob=None) -> str:
    """A logprobs token as return_tokens_as_token_ids writes it (vLLM's form: any token survives JSON)."""
    return f"token_id:{token_id}"
