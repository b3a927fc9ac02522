"""SamplingParams: how one request turns logits into tokens, and when it stops.

Owns: the per-request knobs and their validation. Never touches tensors; the sampler reads these fields.
Every check runs in `__post_init__`, so a bad value fails where it is written, before anything runs.
"""

from __future__ import annotations

import enum
import math
import json
from dataclasses import dataclass, fields

# Temperatures below this are greedy, as in vLLM: dividing logits by 1e-38 overflows to inf and NaN.
SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names)."""
    CUMULATIVE = 0     # everything so far: text and token ids since the start
    DELTA = 1          # only what is new since the previous output (streaming: O(n) in all)
    FINAL_ONLY = 2     # one output, when the request finishes


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a formal language (vLLM's names; core/structured_output.py compiles it with xgrammar).
    Exactly one of the constraints:

    json: a JSON schema (dict or JSON string): the output is a JSON value that conforms to it.
    regex: the output matches this regular expression.
    choice: the output is exactly one of these strings.
    grammar: an EBNF grammar (GBNF, `root ::= ...`) or a Lark grammar (`start: ...`).
    json_object: True: the output is any JSON object.

    Options: disable_any_whitespace (compact JSON: no free whitespace between tokens, which small models can
    otherwise fill forever); disable_additional_properties (objects in `json` take only the listed properties).
    """
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs sets {given or 'no constraint'}; set exactly one of "
                             f"{', '.join(CONSTRAINTS)}.")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON ({e}); pass a JSON schema.") from None
            if not isinstance(self.json, dict):
                raise ValueError(f"structured_outputs.json is {self.json!r}; a JSON schema is an object (a dict).")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured_outputs.{name} is {value!r}; it must be a non-empty string.")
        if self.choice is not None:
            if (isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice is {self.choice!r}; it must be a non-empty list of "
                                 "non-empty strings.")
            self.choice = list(self.choice)
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"structured_outputs.{name} is {value!r}; it must be True or False.")

    @property
    def kind(self) -> str:
        """Which constraint: 'json', 'regex', 'choice', 'grammar' or 'json_object'."""
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))


CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class SamplingParams:
    """Per-request sampling parameters, with vLLM's names and defaults.

    temperature: 0 means greedy (argmax); > 0 scales the logits before sampling (below 1e-5: greedy).
    top_p: keep the smallest set of tokens whose probability mass reaches top_p; 1.0 keeps all.
    top_k: keep the k most likely tokens; -1 (or 0) keeps all.
    seed: a per-request seed: the same seed gives the same tokens whatever else is in the batch.
    n: how many completions to generate for the prompt (parallel sampling: the prompt's KV blocks are shared).
    logprobs: None, or k >= 0: each output token's log-probability and rank, and the k most likely tokens (the
        model's log-softmax, before penalties, temperature and top-k/top-p, as vLLM's default); -1: every token of
        the vocabulary. The engine refuses more than its max_logprobs (EngineConfig; 20 by default, as vLLM's).
    prompt_logprobs: None, or k >= 0 (or -1): the same for every prompt token after the first (the first has none).
    max_tokens: the most tokens to generate (the output may stop earlier on EOS or a stop string).
    stop: strings that end generation; the stop string itself is not included in the text.
    stop_token_ids: token ids that end generation (kept in token_ids, like EOS, but not in the text).
    include_stop_str_in_output: keep the stop string, or the stop/EOS token's text, at the end of the text.
    ignore_eos: keep generating past EOS (benchmarks use this to fix the output length).
    skip_special_tokens: leave special tokens such as <|im_end|> out of the text.
    output_kind: CUMULATIVE (default), DELTA (streaming) or FINAL_ONLY outputs (RequestOutputKind).

    Penalties and filters (vLLM's; the sampler applies them to the raw logits, so greedy rows feel them too):
    presence_penalty: subtract this from every token already in the output (-2..2; > 0 favours new tokens).
    frequency_penalty: subtract this times the token's count in the output (-2..2).
    repetition_penalty: for tokens in the prompt or the output, divide positive logits and multiply negative
        ones by this (> 0; 1 is off; > 1 discourages repeats), as Hugging Face's repetition_penalty.
    min_p: after temperature, drop tokens whose probability is below min_p times the top token's (0..1; 0 is off).
    min_tokens: EOS and stop_token_ids cannot be sampled until this many tokens were generated.
    bad_words: words that must never be generated (each tokenized with and without a leading space).
    allowed_token_ids: only these token ids can be generated.
    logit_bias: {token_id: bias} added to the logits (bias clamped to [-100, 100], as vLLM does).
    truncate_prompt_tokens: keep only the prompt's last k tokens (-1: max_model_len of them), as vLLM does.

    structured_outputs: StructuredOutputsParams (JSON schema, regex, choice, grammar): a grammar masks every step's
        logits to the tokens that keep the output in its language (core/structured_output.py).

    Built once, then read: the values are checked, and `greedy` / `uses_logits_processing` derived, when it is built.
    To change a field, build a new one (`dataclasses.replace(params, temperature=0.7)` checks it again).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check_number("temperature", self.temperature, (int, float))
        if self.temperature < 0:
            raise ValueError(f"temperature is {self.temperature}; it must be >= 0 (0 means greedy).")
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        _check_number("top_p", self.top_p, (int, float))
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p is {self.top_p}; it must be in (0, 1] (1 keeps every token).")
        _check_number("top_k", self.top_k, (int,))
        if self.top_k < -1:
            raise ValueError(f"top_k is {self.top_k}; it must be -1 (off), 0 (off) or a positive count.")
        if self.top_k == 0:
            self.top_k = -1
        _check_number("max_tokens", self.max_tokens, (int,))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens is {self.max_tokens}; it must be >= 1.")
        if self.seed is not None:
            _check_number("seed", self.seed, (int,))
        _check_number("n", self.n, (int,))
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n is {self.n}; it must be in [1, {MAX_N}] (completions per prompt).")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_number(name, value, (int,))
                if value < -1:
                    raise ValueError(f"{name} is {value}; it must be >= 0 (how many of the most likely tokens to "
                                     f"return beside the actual one), -1 (the whole vocabulary), or None for no "
                                     f"{name}.")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind is {self.output_kind!r}; use a RequestOutputKind "
                             f"({', '.join(k.name for k in RequestOutputKind)}).")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} is {getattr(self, name)!r}; it must be True or False.")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop contains {s!r}; each stop string must be a non-empty string.")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"stop_token_ids contains {t!r}; each must be a non-negative int.")
        self._check_penalties_and_filters()
        if self.structured_outputs is not None:
            if isinstance(self.structured_outputs, dict):
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs is {self.structured_outputs!r}; pass StructuredOutputsParams.")
            if self.min_tokens > 0:
                raise ValueError(f"min_tokens is {self.min_tokens} with structured_outputs; they cannot be combined: "
                                 "the grammar decides when the output may end (it forbids EOS until the output is "
                                 "complete, then allows only EOS). Leave min_tokens at 0.")
        # Derived once, here, as vLLM derives its (cached) sampling_type: the sampler reads them every step. So a
        # SamplingParams is not changed once built; dataclasses.replace builds a new one (and checks it).
        self.greedy = self.temperature == 0
        # True when the sampler has to change this request's raw logits (penalties, masks, bias).
        self.uses_logits_processing = (
            self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
            or self.min_tokens > 0 or bool(self.bad_words) or self.allowed_token_ids is not None
            or bool(self.logit_bias))

    def _check_penalties_and_filters(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value, (int, float))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} is {value}; it must be in [-2, 2] (0 is off).")
        _check_number("repetition_penalty", self.repetition_penalty, (int, float))
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty is {self.repetition_penalty}; it must be > 0 "
                             "(1 is off; above 1 discourages repeats).")
        _check_number("min_p", self.min_p, (int, float))
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p is {self.min_p}; it must be in [0, 1] (0 is off).")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not (k >= 1 or k == -1)):
            raise ValueError(f"truncate_prompt_tokens is {k!r}; it must be an int >= 1 (keep the prompt's last k "
                             "tokens) or -1 (max_model_len of them), or None.")
        _check_number("min_tokens", self.min_tokens, (int,))
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens is {self.min_tokens}; it must be in [0, max_tokens={self.max_tokens}].")
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not isinstance(self.bad_words, (list, tuple)):
                raise ValueError(f"bad_words is {self.bad_words!r}; it must be a list of strings.")
            self.bad_words = list(self.bad_words)
            for w in self.bad_words:
                if not isinstance(w, str) or not w.strip() or not w.encode("utf-8", "replace").decode() == w:
                    raise ValueError(f"bad_words contains {w!r}; each bad word must be a non-empty string of "
                                     "characters (a lone surrogate such as '\\ud800' is none).")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise ValueError(f"allowed_token_ids is {self.allowed_token_ids!r}; it must be a non-empty list "
                                 "of token ids (None allows all).")
            self.allowed_token_ids = list(self.allowed_token_ids)
            for t in self.allowed_token_ids:
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise ValueError(f"allowed_token_ids contains {t!r}; each must be a non-negative int.")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias is {self.logit_bias!r}; it must be a dict {{token_id: bias}}.")
            bias = {}
            for t, b in self.logit_bias.items():
                if isinstance(t, str) and t.strip().isdigit():     # JSON keys arrive as strings
                    t = int(t)
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise ValueError(f"logit_bias has key {t!r}; keys must be non-negative token ids.")
                _check_number(f"logit_bias[{t}]", b, (int, float))
                bias[t] = float(min(max(b, -100.0), 100.0))        # vLLM's clamp
            self.logit_bias = bias

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        """Build from a plain dict, refusing keys SamplingParams does not know (a typo must not pass)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known ones are {sorted(known)}.")
        return cls(**d)


INT64_MAX = 2 ** 63 - 1
MAX_N = 128                 # completions per prompt: each is a sequence in the batch
MAX_LOGPROBS = 20           # vLLM's default max_logprobs (EngineConfig.max_logprobs)


def _check_number(name: str, value, types: tuple) -> None:
    """A real number (not a bool, not NaN or infinite); ints must fit in int64, as tensors hold them."""
    if isinstance(value, bool) or not isinstance(value, types):
        kind = "an int" if types == (int,) else "a number"
        raise ValueError(f"{name} is {value!r} ({type(value).__name__}); it must be {kind}.")
    if isinstance(value, int) and abs(value) > INT64_MAX:       # before isfinite: a huge int overflows a float
        shown = str(value) if value.bit_length() < 256 else f"an integer of {len(str(abs(value)))} digits"
        raise ValueError(f"{name} is {shown}; it must fit in a signed 64-bit int (|{name}| <= {INT64_MAX}).")
    if not math.isfinite(value):
        raise ValueError(f"{name} is {value!r}; it must be a finite number.")


__all__ = ["SamplingParams", "RequestOutputKind", "StructuredOutputsParams"]
