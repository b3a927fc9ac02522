"""Logprobs (vLLM's `SamplingParams.logprobs` and `prompt_logprobs`): what the model thought of each token.

Owns: turning logits into, per row that asks, the actual token's log-probability and rank and the `k` most likely
tokens. Values are the model's own log-softmax, before any penalty, temperature or top-k/top-p (vLLM's default,
"raw logprobs"), so they say what the model predicted, not what the sampler did with it.

    logits (rows, vocab) -> log_softmax -> actual token: logprob, rank (1 = most likely)
                                        -> top k: ids, logprobs (ranks 1..k)

Sample logprobs score the token each sampling row drew. Prompt logprobs score the prompt itself: the row at
position p scores prompt token p + 1, so a prompt of P tokens gets P - 1 entries (the first token has none),
computed chunk by chunk as the prompt is prefilled (`PromptLogprobsSpan` says which rows a request has this step).

A request's k of -1 asks for the whole vocabulary (vLLM's): `num_top` makes it the logits' width before anything is
scored, so the rows of that step are sorted whole (topk of the vocabulary) and the host copies vocab floats per row;
a step where no request asks for -1 keeps its small topk.

Every step takes one path (ModelRunner.sample_tokens): `score_step` right after sampling, on the logits' device and
without waiting for it, then `StepScores.read` on the host. Under async scheduling the scores' tensors are copied to
the host with the batch's sampled tokens in between; otherwise `read` follows at once. `compute_logprobs` is the
same two calls for one list of rows (the lesson's view).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SampleLogprobs:
    """One row: the actual (sampled or prompt) token first, then the top k (which may include it again)."""
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass(frozen=True)
class PromptLogprobsSpan:
    """A request's rows of this step's flat batch that score its prompt: rows first_row .. first_row + num_rows - 1
    hold positions first_token - 1 .., so they score prompt tokens first_token .. first_token + num_rows - 1."""
    request_id: str
    first_row: int
    num_rows: int
    first_token: int          # >= 1: the first prompt token has no logprob


@dataclass(frozen=True)
class PromptLogprobs:
    """One step's chunk of a request's prompt logprobs: entries for prompt tokens first_token, first_token + 1, ..."""
    first_token: int
    rows: list[SampleLogprobs]


@dataclass(frozen=True)
class StepLogprobs:
    """What one step computed for the requests that asked, by request id."""
    sample: dict[str, list[SampleLogprobs]]     # one per new token (speculative decoding: several)
    prompt: dict[str, PromptLogprobs]


@dataclass
class RowScores:
    """`score_rows`' tensors, on the logits' device until copied to the host (async scheduling copies them with the
    sampled tokens, so reading them waits for that batch only)."""
    chosen: torch.Tensor      # (rows,) fp32: each row's token's logprob
    ranks: torch.Tensor       # (rows,) int64: 1 + how many tokens the row finds likelier than it
    top_lp: torch.Tensor      # (rows, k) fp32, most likely first
    top_ids: torch.Tensor     # (rows, k) int64

    def tensors(self) -> list[torch.Tensor]:
        return [self.chosen, self.ranks, self.top_lp, self.top_ids]


SCORE_CHUNK_ROWS = 256      # rows scored at a time: log_softmax and its comparisons are (rows, vocab) temporaries


def score_rows(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> RowScores:
    """logits (rows, vocab), tokens (rows,) int64 on the same device, k the most top entries any row wants.
    Only device work: nothing here waits for the device. Scored SCORE_CHUNK_ROWS rows at a time, so a long prompt's
    prompt logprobs add a few (SCORE_CHUNK_ROWS, vocab) temporaries to its logits, not several copies of them."""
    if logits.shape[0] > SCORE_CHUNK_ROWS:
        parts = [score_rows(logits[i:i + SCORE_CHUNK_ROWS], tokens[i:i + SCORE_CHUNK_ROWS], k).tensors()
                 for i in range(0, logits.shape[0], SCORE_CHUNK_ROWS)]
        return RowScores(*(torch.cat(column) for column in zip(*parts)))
    lp = logits.float().log_softmax(dim=-1)                                         # (rows, vocab)
    chosen = lp.gather(1, tokens[:, None])                                          # (rows, 1)
    ranks = (lp > chosen).sum(dim=-1) + 1
    top_lp, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())   # (rows, k)
    return RowScores(chosen[:, 0], ranks, top_lp, top_ids)


def num_top(k: int, vocab_size: int) -> int:
    """A request's k as a count of top entries: -1 (the whole vocabulary) is vocab_size."""
    return vocab_size if k == -1 else k


def unpack_scores(scores: RowScores, tokens: list[int], num_logprobs: list[int]) -> list[SampleLogprobs]:
    """Row i of `scores` as SampleLogprobs for tokens[i], with its num_logprobs[i] most likely tokens (.tolist():
    waits for the device if the scores are still there)."""
    chosen, ranks = scores.chosen.tolist(), scores.ranks.tolist()
    top_lp, top_ids = scores.top_lp.tolist(), scores.top_ids.tolist()
    return [SampleLogprobs([tokens[i]] + top_ids[i][:n], [chosen[i]] + top_lp[i][:n],
                           [ranks[i]] + list(range(1, n + 1))) for i, n in enumerate(num_logprobs)]


def _score(logits: torch.Tensor, tokens: list[int], num_logprobs: list[int]) -> list[SampleLogprobs]:
    """Every row of logits (rows, vocab) scored at tokens[i], with its num_logprobs[i] most likely tokens."""
    if not tokens:
        return []
    num_logprobs = [num_top(k, logits.shape[-1]) for k in num_logprobs]
    scores = score_rows(logits, torch.tensor(tokens, device=logits.device), max(num_logprobs))
    return unpack_scores(scores, tokens, num_logprobs)


def compute_logprobs(logits: torch.Tensor, sampled: list[int],
                     num_logprobs: list[int | None]) -> list[SampleLogprobs | None]:
    """For each row whose request asked (num_logprobs[i] is not None), its SampleLogprobs; None elsewhere."""
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    result: list[SampleLogprobs | None] = [None] * len(sampled)
    scored = _score(logits[rows], [sampled[i] for i in rows], [num_logprobs[i] for i in rows]) if rows else []
    for i, s in zip(rows, scored):
        result[i] = s
    return result


def prompt_targets(spans: list[PromptLogprobsSpan], prompts: list[list[int]], num_logprobs: list[int]
                   ) -> tuple[list[int], list[int]]:
    """The prompt token each row of the spans scores, and the row's k (span i's request's prompt_logprobs)."""
    tokens, ks = [], []
    for span, prompt, k in zip(spans, prompts, num_logprobs):
        tokens += prompt[span.first_token:span.first_token + span.num_rows]
        ks += [k] * span.num_rows
    return tokens, ks


def split_by_span(spans: list[PromptLogprobsSpan], scored: list[SampleLogprobs]) -> dict[str, PromptLogprobs]:
    """The scored rows of the spans (concatenated in span order) as each request's chunk."""
    out, start = {}, 0
    for span in spans:
        out[span.request_id] = PromptLogprobs(span.first_token, scored[start:start + span.num_rows])
        start += span.num_rows
    return out


@dataclass
class StepScores:
    """One step's logprobs, scored where the logits are and not read yet: the one path of every step. The step
    scores right after it samples (`score_step`) and reads on the host (`read`); under async scheduling the
    tensors travel to the host with the sampled tokens in between, so reading waits for that batch alone."""
    rows: list[int]                   # rows of the step's sampling logits that are scored (their requests asked)
    owners: list[str]                 # ... each row's request id (with drafts: one row per kept token)
    num_logprobs: list[int]           # ... and its k
    sample: RowScores | None          # their scores, or None if no row asked
    spans: list[PromptLogprobsSpan]   # the step's prompt-logprob rows
    prompt_tokens: list[int]          # ... the prompt token each scores
    prompt_ks: list[int]
    prompt: RowScores | None          # their scores, or None if the step has no prompt-logprob rows

    def tensors(self) -> list[torch.Tensor]:
        return [t for s in (self.sample, self.prompt) if s is not None for t in s.tensors()]

    def with_tensors(self, tensors: list[torch.Tensor]) -> "StepScores":
        """The same scores read from `tensors` (the host's copies, in tensors()' order)."""
        it = iter(tensors)
        sample = RowScores(*(next(it) for _ in range(4))) if self.sample is not None else None
        prompt = RowScores(*(next(it) for _ in range(4))) if self.prompt is not None else None
        return dataclasses.replace(self, sample=sample, prompt=prompt)

    def read(self, tokens: list[int], finished: set[str] | frozenset = frozenset()) -> StepLogprobs:
        """The StepLogprobs (.tolist(): waits for the scores if they are still on the device). `tokens`: the token of
        every row of the sampling logits, on the host. Requests in `finished` (stopped or aborted since the batch was
        issued) get no sample logprobs."""
        sample: dict[str, list[SampleLogprobs]] = {}
        if self.sample is not None:
            scored = unpack_scores(self.sample, [tokens[r] for r in self.rows], self.num_logprobs)
            for rid, lp in zip(self.owners, scored):
                if rid not in finished:
                    sample.setdefault(rid, []).append(lp)
        prompt = {}
        if self.prompt is not None:
            prompt = split_by_span(self.spans, unpack_scores(self.prompt, self.prompt_tokens, self.prompt_ks))
        return StepLogprobs(sample, prompt)


def score_step(logits: torch.Tensor | None, tokens: torch.Tensor | None, requests: list, drafts: list[list[int]],
               num_kept: list[int], prompt_logits: torch.Tensor | None, spans: list[PromptLogprobsSpan],
               scheduled: list) -> StepScores | None:
    """Score a step where its logits are, waiting for nothing. Sample logprobs: request i of `requests` owns
    1 + len(drafts[i]) rows of logits (rows, vocab), the first num_kept[i] of which chose a token (tokens: (rows,)
    int64, on the logits' device); those rows are scored if it asked (SamplingParams.logprobs = k). Prompt logprobs:
    the spans' rows of prompt_logits at their prompt tokens (`scheduled`: the step's requests, whose prompts they
    score). None, at no cost, when nothing is asked."""
    rows, owners, ks, first = [], [], [], 0
    for req, d, n in zip(requests, drafts, num_kept):
        k = req.sampling_params.logprobs
        if k is not None:
            rows += range(first, first + n)
            owners += [req.request_id] * n
            ks += [num_top(k, logits.shape[-1])] * n
        first += len(d) + 1
    if not rows and not spans:
        return None
    sample = None
    if rows:
        index = torch.tensor(rows).to(logits.device, non_blocking=True)         # (no sync)
        sample = score_rows(logits[index], tokens[index], max(ks))
    prompt_tokens, prompt_ks, prompt = [], [], None
    if spans:
        by_id = {r.request_id: r for r in scheduled}
        prompt_tokens, prompt_ks = prompt_targets(
            spans, [by_id[s.request_id].prompt_token_ids for s in spans],
            [num_top(by_id[s.request_id].sampling_params.prompt_logprobs, prompt_logits.shape[-1]) for s in spans])
        targets = torch.tensor(prompt_tokens).to(prompt_logits.device, non_blocking=True)     # (prompt rows,)
        prompt = score_rows(prompt_logits, targets, max(prompt_ks))
    return StepScores(rows, owners, ks, sample, spans, prompt_tokens, prompt_ks, prompt)
