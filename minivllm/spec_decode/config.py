"""SpeculativeConfig: the `speculative_config` engine option's keys, checked (vLLM's `SpeculativeConfig`).

Owns: which proposer speculative decoding uses and its settings. Plain data: it imports nothing heavy, so the
config module (and the docs tables built from it) can check the option without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` keys). method "ngram": propose the k tokens that followed
    the last n tokens' latest earlier occurrence in the request's own prompt and output (n from prompt_lookup_max
    down to prompt_lookup_min); method "draft_model": a smaller model with the same tokenizer proposes k tokens
    (`model`; `draft_num_layers` keeps only its first layers: the target checkpoint cut down is a draft that
    needs no download)."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    draft_num_layers: int | None = None

    METHODS = ("ngram", "draft_model")
    MAX_TOKENS = 16

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config is {d!r}; it must be a dict (vLLM's JSON), e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}.')
        keys = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
                "draft_num_layers"}
        unknown = sorted(set(d) - keys)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; known ones are {sorted(keys)}.")
        d = dict(d)
        method = d.pop("method", None) or ("draft_model" if d.get("model") else None)
        if method not in cls.METHODS:
            raise ValueError(f"speculative_config method is {method!r}; choose 'ngram', or 'draft_model' with "
                             "a 'model' path.")
        k = d.pop("num_speculative_tokens", None)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= cls.MAX_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens is {k!r}; it must be an int in "
                             f"[1, {cls.MAX_TOKENS}] (tokens proposed per step).")
        cfg = cls(method, k, **d)
        if method == "ngram":
            lo, hi = cfg.prompt_lookup_min, cfg.prompt_lookup_max
            if any(isinstance(v, bool) or not isinstance(v, int) for v in (lo, hi)) or not 1 <= lo <= hi:
                raise ValueError(f"speculative_config prompt_lookup_min is {lo!r} and prompt_lookup_max {hi!r}; "
                                 "they must be ints with 1 <= prompt_lookup_min <= prompt_lookup_max.")
        if method == "draft_model" and cfg.model is None and cfg.draft_num_layers is None and not d.get("model"):
            raise ValueError("speculative_config method 'draft_model' needs 'model' (a checkpoint with the target's "
                             "tokenizer) or 'draft_num_layers' (the target's own first layers).")
        n = cfg.draft_num_layers
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"speculative_config draft_num_layers is {n!r}; it must be a positive int.")
        return cfg
