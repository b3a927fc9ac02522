"""Structured output: a grammar per request that says, every step, which tokens may come next
(vLLM v1's `v1/structured_output/`, with xgrammar as the backend).

Owns: compiling each request's constraint (SamplingParams.structured_outputs) into a grammar, cached by
constraint; one matcher per request (`Grammar`, kept on `request.grammar`); and the batch's token bitmask.

    add_request:  StructuredOutputsParams --compile (xgrammar, cached)--> CompiledGrammar --> request.grammar
    each step:    executor issues the forward, then asks grammar_bitmask(rows that sample)     (CPU, per row)
                  sampler: logits[~allowed] = -inf (sampler.apply_grammar_bitmask), then the usual sampling
                  scheduler.update_from_output: request.grammar.accept(token), journaled (undone on rollback)

The matcher moves only with committed tokens: the scheduler advances it inside the step's transaction and records
`rollback(1)` as the undo, so a step that raises (forward, sampler, detokenizer, Ctrl-C) leaves every grammar where
it was, and the retried step computes the same mask. A recompute preemption needs nothing: the matcher already
holds the output tokens the request re-prefills. Once the grammar is complete it allows only the stop tokens (EOS);
accepting one terminates it and the request finishes as on any EOS.

The bitmask is xgrammar's layout: (rows, ceil(vocab / 32)) int32, bit j of word w allows token 32 * w + j;
a row of -1 (every bit set) allows everything: rows without a grammar.
"""

from __future__ import annotations

import json
from functools import lru_cache

import torch

from minivllm.core.sampling_params import StructuredOutputsParams


class Grammar:
    """One request's position in its grammar (an xgrammar GrammarMatcher)."""

    def __init__(self, compiled, kind: str):
        import xgrammar as xgr
        self.kind = kind                                   # 'json', 'regex', 'choice', 'grammar' or 'json_object'
        self.matcher = xgr.GrammarMatcher(compiled)        # rollback depth unlimited (-1)
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) when the grammar forbids it."""
        if not self.matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        return True

    def rollback(self, num_tokens: int = 1) -> None:
        """Undo the last `num_tokens` accepted tokens (a rolled-back step; rejected speculative tokens)."""
        self.matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` the grammar accepts from here (speculative drafts); changes nothing."""
        accepted = 0
        for token in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return tokens[:accepted]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: nothing may follow."""
        return self.matcher.is_terminated()

    @property
    def is_completed(self) -> bool:
        """The output so far is a complete sentence of the language (only a stop token, or more text, may follow)."""
        return self.matcher.is_completed()

    def describe(self) -> str:
        state = "terminated" if self.is_terminated else "complete" if self.is_completed else "open"
        return f"{self.kind}: {self.num_accepted} token{'' if self.num_accepted == 1 else 's'}, {state}"


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and vocabulary, and fills each step's bitmask."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size                       # the model's (the logits' width), >= the tokenizer's
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None                              # built on first use: costs ~0.1 s for a 49k vocabulary
        self._compile = lru_cache(maxsize=256)(self._compile_uncached)

    @property
    def compiler(self):
        if self._compiler is None:
            import xgrammar as xgr
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler

    def grammar_for(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh matcher for one request. Raises ValueError, saying what is wrong, for a constraint that does
        not compile (the request is then refused before anything is queued)."""
        # The cache key keeps the schema's key order (no sort_keys): its property order is the output's order.
        key = json.dumps({k: getattr(params, k) for k in ("json", "regex", "choice", "grammar", "json_object",
                                                           "disable_any_whitespace", "disable_additional_properties")})
        return Grammar(self._compile(key), params.kind)

    def _compile_uncached(self, key: str):
        p = json.loads(key)
        c = self.compiler
        try:
            if p["json"] is not None:
                schema = p["json"]
                if p["disable_additional_properties"]:
                    schema = no_additional_properties(schema)
                return c.compile_json_schema(json.dumps(schema), any_whitespace=not p["disable_any_whitespace"])
            if p["json_object"]:          # OpenAI's json_object: a JSON *object* (xgrammar's builtin allows any value)
                return c.compile_json_schema('{"type": "object"}', any_whitespace=not p["disable_any_whitespace"])
            if p["regex"] is not None:
                return c.compile_regex(p["regex"])
            if p["choice"] is not None:
                return c.compile_grammar(choice_grammar(p["choice"]))
            if "::=" in p["grammar"]:                      # EBNF (GBNF), xgrammar's own format
                return c.compile_grammar(p["grammar"])
            return c.compile_lark(p["grammar"])            # Lark, as vLLM also takes
        except RuntimeError as e:                          # xgrammar reports parse errors as RuntimeError
            kind = next(k for k in ("json", "regex", "choice", "grammar") if p[k] is not None) if not p[
                "json_object"] else "json_object"
            reason = str(e).strip().splitlines()[-1]
            reason = reason.split("] ", 1)[-1]             # drop xgrammar's "[time] file.cc:line:" prefix
            raise ValueError(f"structured_outputs.{kind} does not compile: {reason}. Fix the {kind} "
                             f"(xgrammar's syntax: JSON Schema, a regex, or EBNF `root ::= ...` / Lark).") from None

    def grammar_bitmask(self, requests: list, drafts: dict[str, list[int]] | None = None) -> torch.Tensor | None:
        """The token bitmask of one step's sampling rows, or None when no request has a grammar. A request has one
        row, or with speculative decoding 1 + len(drafts) rows: row j is the mask after its first j drafts (the
        matcher walks the drafts, which update_draft_token_ids checked it accepts, then rolls back).
        (rows, ceil(vocab / 32)) int32; rows without a live grammar are all ones (-1)."""
        drafts = drafts or {}
        counts = [1 + len(drafts.get(r.request_id, ())) for r in requests]
        if not any(r.grammar is not None and not r.grammar.is_terminated for r in requests):
            return None
        bitmask = torch.full((sum(counts), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        row = 0
        for r, count in zip(requests, counts):
            grammar = r.grammar
            if grammar is not None and not grammar.is_terminated:
                walked = 0
                for j, token in enumerate([*drafts.get(r.request_id, ()), None]):
                    if grammar.matcher.is_terminated():
                        break                                   # rows after a terminating draft stay all ones
                    grammar.fill_bitmask(bitmask, row + j)
                    if token is not None and grammar.matcher.accept_token(token):
                        walked += 1
                if walked:
                    grammar.matcher.rollback(walked)
            row += count
        return bitmask


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly `choices`: root ::= "a" | "b" (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def no_additional_properties(schema):
    """The schema with `additionalProperties: false` on every object that does not say otherwise."""
    if isinstance(schema, list):
        return [no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: no_additional_properties(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out
