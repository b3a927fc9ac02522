"""POST /v1/completions (vLLM's entrypoints/openai/serving_completion.py): one prompt or a batch of prompts, each
a string or token ids, continued as text.

Owns: reading the prompts, the route's default length (OpenAI's 16 tokens), and the completions logprobs object
(tokens, token_logprobs, top_logprobs, text_offset). Running the request and writing the answer is
serving_engine.py's; echo and prompt_logprobs are read there too, from protocol.LogprobsRequest. With
`use_beam_search` the answer is a beam search's (serving_beam_search.py).
"""

from __future__ import annotations

from fastapi import Request

from minivllm.entrypoints.request_options import parse_prompt, read_output_options, token_as_id
from minivllm.entrypoints.response_shapes import ChoiceShape, clamp_logprob
from minivllm.entrypoints.serving_beam_search import read_beam_search, serve_beam_search
from minivllm.entrypoints.serving_engine import OpenAIServing, ParsedRequest
from minivllm.outputs import Logprob


class OpenAIServingCompletion(OpenAIServing):
    is_chat = False
    request_id_prefix = "cmpl"

    async def create_completion(self, request: Request):
        body = await self.read_body(request)
        beam_search = read_beam_search(body, chat=False)
        prompts = parse_prompt(body)
        parsed = ParsedRequest(prompts, body, read_output_options(body, self.tokens_as_token_ids), "prompt")
        if beam_search is not None:
            return await serve_beam_search(self, request, parsed, beam_search)
        return await self.serve(request, parsed)

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """OpenAI's default of 16 tokens, capped by the context."""
        return min(16, max(1, self.async_engine.max_model_len - num_prompt_tokens))

    def create_logprobs(self, shape: ChoiceShape, i: int, token_ids: list[int], entries: list, num_logprobs: int,
                        text_offset: int) -> dict:
        first_token = shape.echo[i].first_token if shape.echo else ""
        return completion_logprobs(token_ids, entries, num_logprobs, text_offset, lambda _: first_token,
                                   shape.options.tokens_as_token_ids)


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], num_logprobs: int,
                        text_offset: int, text_of, as_ids: bool = False) -> dict:
    """/v1/completions' logprobs object for these tokens: each token's text and logprob, its top_logprobs
    ({text: logprob}: the token itself and the num_logprobs most likely, up to num_logprobs + 1 entries, as OpenAI),
    and text_offset (where each token starts in the choice's text, counting from `text_offset`). An entry that is
    None (the first prompt token, echoed) has logprob None; text_of(token_id) gives its text. as_ids: every token
    written "token_id:N" (return_tokens_as_token_ids; text_offset then counts those strings, as vLLM's does)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    name = token_as_id if as_ids else (lambda tid, lp: lp.decoded_token)
    for token_id, entry in zip(token_ids, entries):
        if entry is None:
            token, logprob, top = token_as_id(token_id) if as_ids else text_of(token_id), None, None
        else:
            token, logprob = name(token_id, entry[token_id]), clamp_logprob(entry[token_id].logprob)
            top = {}
            for tid, lp in list(entry.items())[:num_logprobs + 1]:
                top.setdefault(name(tid, lp), clamp_logprob(lp.logprob))
        tokens.append(token)
        token_logprobs.append(logprob)
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
