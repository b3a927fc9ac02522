"""Chat messages in a request, and the chat template that turns them into a prompt (vLLM's
entrypoints/chat_utils.py).

Owns: reading `messages` (roles; content as a string or a list of parts) and the template's options, turning image
parts into placeholders and loaded images (for LLM.chat and the server alike), and rendering the template. It never
tokenizes; the server renders and tokenizes in its front end's worker thread (renderer.py), LLM.chat in the
caller's. Anything wrong raises protocol.APIError naming the field, as every request body check does.

A message's content may be a list of parts, as OpenAI's API takes it:

    {"type": "text", "text": "What is this?"}
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}   (or "image_url": "<url>"; "detail"
                                                            is read and ignored; a local path or file:// URL is read
                                                            only under allowed_local_media_path; no network URLs)
    {"type": "image_pil", "image_pil": <PIL.Image>}        (LLM.chat only, as vLLM's offline API)

The chat template gets text: the parts joined with "\\n" in their order, each image part as the model's image
placeholder ("<image>" for LLaVA), as vLLM lays them out with --interleave-mm-strings (and, for images sent before
the text, as its default does). The images go to the engine separately, in placeholder order.

A conversation may go on after a tool call, as OpenAI's API and vLLM take it: an assistant message with
`tool_calls` (its content may be null) and then `role: "tool"` messages with the `tool_call_id` they answer. The
template gets them as vLLM passes them: `tool_calls` with each call's `arguments` parsed from its JSON string into an
object (what tool-use templates render), `tool_call_id`, and any message's `name`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from minivllm.entrypoints.protocol import APIError, describe, read_field, read_text

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CALL_SHAPE = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<JSON text>"}}'
IMAGE_PART_TYPES = ("image_url", "image_pil")
IMAGE_URL_KEYS = {"url", "detail"}
TEXT_ONLY_MODEL = ("this model takes text only (it is not a vision-language model); send text parts, or serve a "
                   "LLaVA checkpoint to send images")
TEXT_ONLY_ROUTE = "this route takes text parts only (images go to /v1/chat/completions of a vision-language model)"


@dataclass(frozen=True)
class ImagePart:
    """One image of a conversation: what was sent (a URL string, or offline a PIL image) and where."""
    source: object
    field: str                   # messages[i].content[j]: a bad image's `param`


@dataclass
class Conversation:
    """Messages as the chat template takes them ({"role", "content": str}), and their images in order."""
    messages: list[dict]
    images: list[ImagePart] = field(default_factory=list)


def image_placeholder(tokenizer, mm_processor) -> str | None:
    """The text that becomes one image's placeholder token ("<image>" for LLaVA); None for a text-only model."""
    if mm_processor is None:
        return None
    return tokenizer.convert_ids_to_tokens(mm_processor.image_token_id)


def parse_messages(body: dict) -> list[dict]:
    """Chat messages as {"role", "content": str}, text parts only (for routes that take no images)."""
    return parse_conversation(body, None, refusal=TEXT_ONLY_ROUTE).messages


def parse_conversation(body: dict, placeholder: str | None, refusal: str = TEXT_ONLY_MODEL) -> Conversation:
    """A request's `messages`, each image part made `placeholder` (None: image parts are refused, for `refusal`)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        got = "missing" if messages is None else describe(messages)
        raise APIError(f"'messages' is {got}; it must be a non-empty list of {{'role', 'content'}} objects.",
                       param="messages")
    out = Conversation([])
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(f"{where} is {describe(m)}; each message must be an object with 'role' and "
                           "'content'.", param=where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise APIError(f"{where}.role is {describe(role)}; it must be one of {list(CHAT_ROLES)}.",
                           param=f"{where}.role")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        message = {"role": "system" if role == "developer" else role,
                   "content": message_text(content, where, placeholder, out.images, refusal)}
        out.messages.append({**message, **tool_message_fields(m, where)})
    return out


def tool_message_fields(m: dict, where: str) -> dict:
    """What a message carries for a tool-use template besides its text (vLLM's): an assistant's `tool_calls` (their
    arguments parsed into objects; an empty list is dropped), a tool message's `tool_call_id`, any message's `name`."""
    role, fields = m.get("role"), {}
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            if not isinstance(m[key], str) or (key == "tool_call_id" and role != "tool"):
                raise APIError(f"{where}.{key} is {describe(m[key])}; it must be a string"
                               f"{' (on a tool message)' if key == 'tool_call_id' else ''}.", param=f"{where}.{key}")
            fields[key] = m[key]
    calls = m.get("tool_calls")
    if calls is None:
        return fields
    if role != "assistant" or not isinstance(calls, list):
        raise APIError(f"{where}.tool_calls is {describe(calls)}; only an assistant message has tool_calls, a list of "
                       f"{TOOL_CALL_SHAPE}.", param=f"{where}.tool_calls")
    parsed = []
    for j, call in enumerate(calls):
        here = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or call.get("type", "function") != "function":
            raise APIError(f"{here} is {describe(call)}; a tool call is {TOOL_CALL_SHAPE}.", param=here)
        arguments = function.get("arguments") or "{}"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as e:
                raise APIError(f"{here}.function.arguments is not JSON ({e}); a call's arguments are a JSON object "
                               "as text, as the model wrote them.", param=f"{here}.function.arguments") from None
        parsed.append({**call, "type": "function", "function": {**function, "arguments": arguments}})
    return {**fields, "tool_calls": parsed} if parsed else fields


def message_text(content, where: str, placeholder: str | None, images: list[ImagePart],
                 refusal: str = TEXT_ONLY_MODEL) -> str:
    """A message's content as the chat template's text; its image parts are appended to `images`."""
    if isinstance(content, list):
        pieces = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                pieces.append(part["text"])
            elif kind in IMAGE_PART_TYPES:
                if placeholder is None:        # the part is fine; the content cannot hold one here
                    raise APIError(f"{where}.content[{j}] is an image part; {refusal}.", param=f"{where}.content")
                images.append(ImagePart(image_source(part, kind, f"{where}.content[{j}]"), f"{where}.content[{j}]"))
                pieces.append(placeholder)
            else:
                raise APIError(f"{where}.content[{j}] is {describe(part)}; the parts supported are "
                               "{'type': 'text', 'text': ...} and {'type': 'image_url', 'image_url': {'url': ...}}.",
                               param=f"{where}.content")
        content = "\n".join(pieces)
    if not isinstance(content, str):
        raise APIError(f"{where}.content is {describe(content)}; it must be a string or a list of "
                       "content parts.", param=f"{where}.content")
    return read_text(content, f"{where}.content")


def image_source(part: dict, kind: str, where: str):
    """What an image part points at: its URL (a string), or offline its PIL image."""
    value = part.get(kind)
    if kind == "image_pil":
        from PIL import Image
        if not isinstance(value, Image.Image):
            raise APIError(f"{where}.image_pil is a {type(value).__name__}; it must be a PIL image (LLM.chat only; "
                           "over HTTP send an image_url).", param=where)
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - IMAGE_URL_KEYS)
        if unknown:
            raise APIError(f"{where}.image_url has {', '.join(map(repr, unknown))}; it takes 'url' (and 'detail', "
                           "which minivllm ignores).", param=where)
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise APIError(f"{where}.image_url is {describe(part.get(kind))}; it must be {{'url': 'data:image/png;"
                       "base64,...'}} (or a local file path under allowed_local_media_path).", param=where)
    return value


def load_images(images: list[ImagePart], mm_processor) -> list:
    """Each image part decoded (a PIL image), checked against limit_mm_per_prompt first; a bad one is an APIError
    whose `param` is the part (messages[i].content[j])."""
    limit = mm_processor.max_images
    if len(images) > limit:
        extra = images[limit]
        raise APIError(f"{extra.field} is image {limit + 1} of this conversation; limit_mm_per_prompt allows {limit} "
                       "per prompt. Send fewer images, or raise the limit (--limit-mm-per-prompt '{\"image\": N}').",
                       param=extra.field)
    loaded = []
    for part in images:
        try:
            loaded.append(mm_processor.load_image(part.source, part.field))
        except ValueError as e:
            raise APIError(str(e), param=part.field) from None
    return loaded


def parse_chat_options(body: dict, default_add_generation_prompt: bool = True) -> dict:
    """The chat template's options, as apply_chat_template takes them. continue_final_message leaves the
    last (assistant) message open for the model to continue; it excludes add_generation_prompt, as in vLLM."""
    options = {"add_generation_prompt": read_field(body, "add_generation_prompt", "bool",
                                                   default_add_generation_prompt),
               "continue_final_message": read_field(body, "continue_final_message", "bool", False)}
    if options["continue_final_message"]:
        if body.get("add_generation_prompt"):
            raise APIError("'continue_final_message' and 'add_generation_prompt' are both true; the final "
                           "message is either continued or followed by a new one. Set one of them to false.",
                           param="continue_final_message")
        options["add_generation_prompt"] = False
    template = read_field(body, "chat_template", "string")
    if template is not None:
        options["chat_template"] = read_text(template, "chat_template")
    return options


def apply_chat_template(tokenizer, messages: list[dict], options: dict) -> str:
    """The chat template (the model's, or the request's `chat_template`) applied to messages, as text."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **options)
    except Exception as e:      # the template's own checks (jinja2 raises on e.g. bad role order)
        param = "chat_template" if "chat_template" in options else "messages"
        raise APIError(f"the chat template rejected these messages: {e}", param=param) from None
