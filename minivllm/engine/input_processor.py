"""InputProcessor: a prompt and its parameters in, a request the core can run out (vLLM v1's `InputProcessor`).

Owns: tokenizing prompts (strings, token ids, {"prompt"/"prompt_token_ids"} dicts), checking a request once, before
anything is queued (every error names the value, the limit and the fix), and the token ids of its bad words. It
never touches the queues: LLMEngine.add_request takes what `process_inputs` returns and queues it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.sampling_params import MAX_LOGPROBS, SamplingParams

PromptType = str | dict | list


@dataclass(frozen=True)
class ProcessedRequest:
    """A request checked and tokenized: what LLMEngine.add_request queues without looking at it again."""
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    bad_words_token_ids: list[list[int]]
    mm_features: tuple = ()                  # images (multimodal/inputs.py), their placeholders already expanded
    cache_salt: str | None = None            # {"cache_salt": ...}: prefix-cache hits only among equal salts


class InputProcessor:
    mm_processor = None         # images: multimodal/processor.py, set by the engine for a vision-language model

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, kv_cache_manager: KVCacheManager,
                 max_logprobs: int = MAX_LOGPROBS):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs               # EngineConfig.max_logprobs (-1: the whole vocabulary)
        self.kv_cache_manager = kv_cache_manager       # read only: the pool's size bounds a request

    def process_inputs(self, prompt: PromptType, params: SamplingParams, priority: int = 0) -> ProcessedRequest:
        """Tokenize and check one request; ValueError for one that can never run."""
        text, token_ids = self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None:        # vLLM: the prompt's last k tokens (-1: max_model_len)
            token_ids = token_ids[-(self.max_model_len if params.truncate_prompt_tokens == -1
                                    else params.truncate_prompt_tokens):]
        features = ()
        if self.mm_processor is not None:          # a VLM: each image's placeholder becomes its encoder rows
            mm_data = prompt.get("multi_modal_data", {}) if isinstance(prompt, dict) else {}
            token_ids, features = self.mm_processor.process(token_ids, mm_data)
        elif isinstance(prompt, dict) and "multi_modal_data" in prompt:
            raise ValueError("prompt has multi_modal_data, but this model takes text only; serve a vision-language "
                             "model (LlavaForConditionalGeneration) to send images.")
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt is {salt!r}; it must be a non-empty string (or left out).")
        self.validate_request(token_ids, params, priority)
        return ProcessedRequest(text, token_ids, params, priority, self.bad_words_token_ids(params), features, salt)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt is a string, {"prompt_token_ids": [...]} (optionally with "prompt"), or a list of ids.
        Strings are tokenized with the tokenizer's default special tokens (a BOS where the model expects one),
        as vLLM does; chat prompts already carry theirs from the chat template (LLM.chat)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data", "cache_salt"}
            if unknown:
                raise ValueError(f"prompt dict has unknown key(s) {sorted(unknown)}; "
                                 "use 'prompt_token_ids' (and optionally 'prompt').")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt is a {type(prompt).__name__}; pass a string or "
                         "{'prompt_token_ids': [...]}.")

    def validate_request(self, token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Raise ValueError, naming the value and the limit, for a request that can never run."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params is a {type(params).__name__}; pass SamplingParams.")
        if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) >= 2 ** 63:
            raise ValueError(f"priority is {priority!r} ({type(priority).__name__}); it must be an int "
                             "(lower runs first; 0 is the default).")
        n = len(token_ids)
        if n == 0:
            raise ValueError("prompt is empty (0 tokens); give at least one token.")
        vocab = self.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains {bad[:3]}; token ids must be ints in [0, {vocab}).")
        for name, ids in (("allowed_token_ids", params.allowed_token_ids), ("logit_bias", params.logit_bias),
                          ("stop_token_ids", params.stop_token_ids)):
            outside = [t for t in ids or () if t >= vocab]
            if outside:
                raise ValueError(f"{name} has token id(s) {outside[:3]}; token ids must be in [0, {vocab}).")
        for name in ("logprobs", "prompt_logprobs"):         # vLLM's processor check (-1 counts as the vocabulary)
            error = logprobs_over_limit(name, getattr(params, name), self.max_logprobs, vocab)
            if error:
                raise ValueError(error)
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; max_model_len is {self.max_model_len}, which leaves no "
                             f"room for output. Shorten the prompt or raise max_model_len.")
        # The longest the sequence can get: the KV of all but the last token must fit in the whole pool.
        longest = min(n + params.max_tokens, self.max_model_len) - 1
        kv = self.kv_cache_manager
        need = kv.blocks_needed(longest)
        if need > kv.num_blocks:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) needs {need} KV blocks of "
                f"{kv.block_size} tokens, but the whole pool has {kv.num_blocks} "
                f"blocks ({kv.num_blocks * kv.block_size} tokens). Lower max_tokens, "
                "shorten the prompt, or raise num_kv_blocks.")

    def bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word as token ids, as vLLM tokenizes them: as written (leading spaces stripped), and with one
        leading space when that gives a different first token and as many tokens (the word inside a text)."""
        out: list[list[int]] = []
        for word in params.bad_words or []:
            out.append(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced[0] != out[-1][0] and len(spaced) == len(out[-1]):
                out.append(spaced)
        return out


def logprobs_over_limit(name: str, value: int | None, max_logprobs: int, vocab_size: int | None,
                        where: str = "engine") -> str | None:
    """Why a request may not ask for `value` logprobs per token (vLLM's processor check), or None if it may: the
    engine returns at most max_logprobs of them (-1: no limit), and a request's -1 counts as the vocabulary's size
    (vocab_size; None: not known here, so -1 passes only without a limit). None and 0 (the actual token alone) always
    pass. `where`: "engine" or "server", whose fix the message names (max_logprobs, or the server's --max-logprobs)."""
    if not value:
        return None
    if vocab_size is not None and value > vocab_size:
        return f"{name} is {value}; the vocabulary has {vocab_size} tokens. Ask for at most that, or -1 for all."
    asked = vocab_size if value == -1 else value
    if max_logprobs == -1 or (asked is not None and asked <= max_logprobs):
        return None
    what = f"{name} is {value}"
    if value == -1:
        what += (", which asks for every token of the vocabulary" + (f" ({vocab_size})" if vocab_size else "")
                 + " at each position")
    raise_to = "-1 (no limit)" if value == -1 else f"{value} or more (-1: no limit)"
    fix = (f"start the server with --max-logprobs {raise_to}" if where == "server" else
           f"set the engine's max_logprobs to {raise_to}: LLM(max_logprobs=...), or --max-logprobs on the command line")
    setting = f"--max-logprobs {max_logprobs}" if where == "server" else f"max_logprobs={max_logprobs}"
    return (f"{what}; this {where} returns at most {max_logprobs} logprobs per token ({setting}). Ask for at most "
            f"{max_logprobs}, or {fix}.")
