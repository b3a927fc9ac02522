"""POST /v1/chat/completions (vLLM's entrypoints/openai/serving_chat.py): a conversation, rendered by the chat
template into one prompt, answered by n choices.

Owns: reading the messages and template options (chat_utils.py; rendered by renderer.py, which also decodes a
vision-language model's image parts before anything is queued), the route's default length (the rest of the
context), the stream's opening role chunks (with vLLM's prompt_token_ids and a first usage when asked), vLLM's chat
`echo` (the last message's text in front of each choice, when it has the answer's role), and the chat logprobs
object ({"content": [...]}, tokens as "token_id:N" with return_tokens_as_token_ids). Running the request
and writing the answer is serving_engine.py's (a beam search's, with `use_beam_search`, serving_beam_search.py's);
tools, tool_choice and the answer's tool calls are tool_calls.py's.
"""

from __future__ import annotations

from fastapi import Request

from minivllm.entrypoints.chat_utils import image_placeholder, parse_chat_options, parse_conversation
from minivllm.entrypoints.protocol import check_fields, read_field
from minivllm.entrypoints.request_options import OutputOptions, read_output_options, token_as_id
from minivllm.entrypoints.response_shapes import ChoiceShape, ResponseMeta, clamp_logprob, make_choice
from minivllm.entrypoints.serving_beam_search import read_beam_search, serve_beam_search
from minivllm.entrypoints.serving_engine import OpenAIServing, ParsedRequest
from minivllm.entrypoints.tool_calls import ToolConfig, read_tool_request
from minivllm.outputs import Logprob, RequestOutput


class OpenAIServingChat(OpenAIServing):
    is_chat = True
    request_id_prefix = "chatcmpl"

    def __init__(self, *args, tool_config: ToolConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_config = tool_config or ToolConfig()
        # Read once, before serving: the tokenizers are not to be shared across threads while requests run.
        self.mm_processor = self.async_engine.engine.input_processor.mm_processor      # None for a text model
        self.image_placeholder = image_placeholder(self.renderer.tokenizer, self.mm_processor)

    async def create_chat_completion(self, request: Request):
        body = await self.read_body(request)
        check_fields(body, "/v1/chat/completions")
        beam_search = read_beam_search(body, chat=True)
        output_options = read_output_options(body, self.tokens_as_token_ids)
        conversation = parse_conversation(body, self.image_placeholder)
        options = parse_chat_options(body)
        echo = echoed_text(body, conversation.messages, options)
        tools = read_tool_request(body, self.tool_config)
        if tools.template_tools is not None:           # as vLLM: the template lays them out for the model
            options["tools"] = tools.template_tools
        images = await self.renderer.load_images(conversation.images, self.mm_processor) if conversation.images else []
        prompt = await self.renderer.render_chat(conversation.messages, options)
        parsed = ParsedRequest([prompt], body, output_options, "messages", tuple(images),
                               tools.output(self.tool_config), echo)
        if beam_search is not None:
            return await serve_beam_search(self, request, parsed, beam_search)
        return await self.serve(request, parsed)

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """The rest of the context (or of the KV pool, if smaller)."""
        return max(1, self.async_engine.max_request_tokens - num_prompt_tokens)

    def opening_chunks(self, meta: ResponseMeta, i: int, n: int, out: RequestOutput,
                       options: OutputOptions) -> list[dict]:
        # OpenAI opens a chat stream with the role, once per choice; as vLLM, only once the engine's first output
        # is here, so a client's time to first token includes the prefill. vLLM's extras ride on these chunks: the
        # prompt's token ids (return_token_ids) and a usage with no completion tokens yet (continuous_usage_stats).
        chunks = [meta.envelope([make_choice(meta, k, "", None, None, stream=True, first=True)], stream=True)
                  for k in range(i * n, (i + 1) * n)]
        for chunk in chunks:
            if options.return_token_ids:
                chunk["prompt_token_ids"] = out.prompt_token_ids
            if options.continuous_usage:
                chunk["usage"] = {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": 0,
                                  "total_tokens": len(out.prompt_token_ids)}
        return chunks

    def create_logprobs(self, shape: ChoiceShape, i: int, token_ids: list[int], entries: list, num_logprobs: int,
                        text_offset: int) -> dict:
        return chat_logprobs(token_ids, entries, num_logprobs, shape.options.tokens_as_token_ids)


def echoed_text(body: dict, messages: list[dict], options: dict) -> str | None:
    """vLLM's chat `echo`: each choice starts with the last message's text when that message has the answer's role
    (the assistant's, or with add_generation_prompt false the last message's own, e.g. a continued one); else None."""
    if not read_field(body, "echo", "bool", False):
        return None
    role = "assistant" if options["add_generation_prompt"] else messages[-1]["role"]
    return messages[-1]["content"] if messages[-1]["role"] == role else None


def _chat_token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": clamp_logprob(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], top_logprobs: int,
                  as_ids: bool = False) -> dict:
    """/v1/chat/completions' logprobs object: {"content": one entry per token, with its top_logprobs most likely
    tokens in rank order}. as_ids: every token written "token_id:N" (return_tokens_as_token_ids, as vLLM)."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        top = sorted(((tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= top_logprobs),
                     key=lambda item: item[1].rank)
        content.append({**_chat_token(token_as_id(token_id) if as_ids else chosen.decoded_token, chosen.logprob),
                        "top_logprobs": [_chat_token(token_as_id(tid) if as_ids else lp.decoded_token, lp.logprob)
                                         for tid, lp in top]})
    return {"content": content}
