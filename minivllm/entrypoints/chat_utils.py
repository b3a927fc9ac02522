"""Chat messages in a request, and the chat template that turns them into a prompt (vLLM's
entrypoints/chat_utils.py).

Owns: reading `messages` (roles, text content) and the template's options, and rendering the template. It never
tokenizes; the server renders and tokenizes in its front end's worker thread (renderer.py), LLM.chat in the
caller's. Anything wrong raises protocol.APIError naming the field, as every request body check does.
"""

from __future__ import annotations

from minivllm.entrypoints.protocol import APIError, describe, read_field, read_text

CHAT_ROLES = ("system", "developer", "user", "assistant")


def parse_messages(body: dict) -> list[dict]:
    """Chat messages as {"role", "content": str}. Content may be a string or a list of text parts."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        got = "missing" if messages is None else describe(messages)
        raise APIError(f"'messages' is {got}; it must be a non-empty list of {{'role', 'content'}} objects.",
                       param="messages")
    out = []
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
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise APIError(f"{where}.content[{j}] is {describe(part)}; only text parts "
                                   "({'type': 'text', 'text': ...}) are supported.", param=f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise APIError(f"{where}.content is {describe(content)}; it must be a string or a list of "
                           "text parts.", param=f"{where}.content")
        out.append({"role": "system" if role == "developer" else role,
                    "content": read_text(content, f"{where}.content")})
    return out


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
