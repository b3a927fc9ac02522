"""POST /tokenize and POST /detokenize (vLLM's entrypoints/openai/serving_tokenization.py): text or a chat to
token ids, and back, with the served model's tokenizer.

Owns: reading those two bodies. The tokenizer runs on the engine thread (an AsyncLLMEngine command), as every
tokenization does; only the chat template is rendered here.
"""

from __future__ import annotations

from fastapi import Request

from minivllm.entrypoints.chat_utils import apply_chat_template, parse_chat_options, parse_messages
from minivllm.entrypoints.protocol import APIError, check_fields, parse_token_ids, read_field, read_text
from minivllm.entrypoints.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):

    async def create_tokenize(self, request: Request) -> dict:
        body = await self.read_body(request)
        check_fields(body, "/tokenize")
        if ("prompt" in body) == ("messages" in body):
            raise APIError("/tokenize takes either 'prompt' (text) or 'messages' (a chat), exactly one.",
                           param="prompt")
        if "messages" in body:     # as vLLM: the template carries the special tokens, so none are added
            text = apply_chat_template(self.async_engine.tokenizer, parse_messages(body), parse_chat_options(body))
            add_special_tokens = read_field(body, "add_special_tokens", "bool", False)
        else:
            prompt = read_field(body, "prompt", "string")
            if prompt is None:
                raise APIError("'prompt' is null; it must be a string.", param="prompt")
            text = read_text(prompt, "prompt")
            add_special_tokens = read_field(body, "add_special_tokens", "bool", True)
        ids = await self.async_engine.call_async(
            lambda e: e.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return {"count": len(ids), "max_model_len": self.async_engine.max_model_len, "tokens": ids,
                "token_strs": None}

    async def create_detokenize(self, request: Request) -> dict:
        body = await self.read_body(request)
        check_fields(body, "/detokenize")
        ids = parse_token_ids(body, "tokens", len(self.async_engine.tokenizer))
        return {"prompt": await self.async_engine.call_async(lambda e: e.tokenizer.decode(ids))}
