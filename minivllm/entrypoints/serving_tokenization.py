"""POST /tokenize and POST /detokenize (vLLM's entrypoints/openai/serving_tokenization.py): text or a chat to
token ids, and back, with the served model's tokenizer; and GET /tokenizer_info, the tokenizer's configuration
(served only with --enable-tokenizer-info-endpoint, as vLLM: it shows the chat template and the checkpoint's path).

Owns: reading those two bodies, and the tokenizer info's shape (vLLM's TokenizerInfoResponse: the tokenizer's
`init_kwargs`, i.e. its tokenizer_config.json as loaded, without file paths, special tokens as their text, plus
`tokenizer_class`). The front end's tokenizer does the work (renderer.py: off the event loop and off the engine
thread, within its limits).
"""

from __future__ import annotations

from fastapi import Request

from minivllm.entrypoints.chat_utils import parse_chat_options, parse_messages
from minivllm.entrypoints.protocol import APIError, check_fields, read_field, read_text
from minivllm.entrypoints.request_options import parse_token_ids
from minivllm.entrypoints.serving_engine import OpenAIServing
from minivllm.entrypoints.tool_calls import read_tools


class OpenAIServingTokenization(OpenAIServing):

    async def create_tokenize(self, request: Request) -> dict:
        body = await self.read_body(request)
        check_fields(body, "/tokenize")
        if ("prompt" in body) == ("messages" in body):
            raise APIError("/tokenize takes either 'prompt' (text) or 'messages' (a chat), exactly one.",
                           param="prompt")
        if body.get("tools") is not None and "messages" not in body:
            raise APIError("'tools' goes with 'messages' (the chat template lays them out); a 'prompt' is tokenized "
                           "as it is.", param="tools")
        if "messages" in body:     # as vLLM: the template carries the special tokens, so none are added
            options = parse_chat_options(body)
            tools = read_tools(body)
            if tools is not None:                 # as vLLM: rendered as a chat request with these tools would be
                options["tools"] = tools
            text = await self.renderer.render_chat(parse_messages(body), options)
            add_special_tokens = read_field(body, "add_special_tokens", "bool", False)
        else:
            prompt = read_field(body, "prompt", "string")
            if prompt is None:
                raise APIError("'prompt' is null; it must be a string.", param="prompt")
            text = read_text(prompt, "prompt")
            add_special_tokens = read_field(body, "add_special_tokens", "bool", True)
        [(_, ids)] = await self.renderer.tokenize([text], "messages" if "messages" in body else "prompt",
                                                  add_special_tokens)
        return {"count": len(ids), "max_model_len": self.async_engine.max_model_len, "tokens": ids,
                "token_strs": None}

    async def create_detokenize(self, request: Request) -> dict:
        body = await self.read_body(request)
        check_fields(body, "/detokenize")
        ids = parse_token_ids(body, "tokens", len(self.async_engine.tokenizer))
        return {"prompt": await self.renderer.decode(ids)}

    def get_tokenizer_info(self) -> dict:
        """GET /tokenizer_info: the tokenizer's configuration, as vLLM's TokenizerInfo.to_dict writes it."""
        tokenizer = self.renderer.tokenizer
        config = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
                  if k not in ("vocab_file", "merges_file")}
        return {**json_ready(config), "tokenizer_class": type(tokenizer).__name__}


def json_ready(value):
    """A tokenizer config as JSON: special tokens (AddedToken) as their text, dict keys as strings."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)
