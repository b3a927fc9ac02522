"""Sampler: one token per row of logits, each row with its own SamplingParams.

Owns: the penalties and filters, temperature, min-p, top-k, top-p and the random draw. It reads
`request.sampling_params`, the request's tokens and `bad_words_token_ids`, and, for seeded requests, advances
`request.generator`; it changes nothing else.

The order is vLLM v1's: on the raw logits, allowed_token_ids, bad_words, min_tokens and logit_bias, then the
repetition, frequency and presence penalties (so greedy rows feel all of these); then greedy rows take the
argmax; the others divide by temperature, drop tokens under min_p, then apply top-k / top-p and draw.
A batch where no request uses a penalty or filter skips all of it.

The draw is the inverse CDF: one uniform u per row, and the first token whose cumulative probability
exceeds u (`draw_from`). A seeded request draws its u from its own generator, so its tokens do not depend on
what else is in the batch; unseeded rows share the engine's generator. (vLLM draws by the "exponential race",
argmax(probs / E) with E ~ Exp(1) per token, which is as exact; on a CPU its vocabulary of noise per row costs
about 40 ms at 32 rows x 49,152 tokens, against 1.5 ms for a cumulative sum and a search.)
"""

from __future__ import annotations

import torch

from minivllm.core.request import Request
from minivllm.model._kernels import kernels

cpu_ops = kernels.cpu_ops


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)   # for requests without their own seed

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if self.generator.device != device:       # first draw on a GPU: a generator there, same seed
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    @staticmethod
    def _request_generator(request: Request, device: torch.device) -> torch.Generator:
        if request.generator.device != device:    # requests start with a CPU generator (request.py)
            request.generator = torch.Generator(device=device).manual_seed(request.sampling_params.seed)
        return request.generator

    def get_rng_state(self, requests: list[Request]) -> list[tuple[object, torch.Generator, torch.Tensor]]:
        """The random state this step may consume: the shared generator and every seeded request's. A failed step
        puts it back (`set_rng_state`), so its retry draws what the step would have drawn."""
        holders = [self] + [r for r in requests if r.generator is not None]
        return [(h, h.generator, h.generator.get_state()) for h in holders]

    @staticmethod
    def set_rng_state(state: list[tuple[object, torch.Generator, torch.Tensor]]) -> None:
        for holder, generator, rng in state:
            generator.set_state(rng)
            holder.generator = generator

    def generator_for(self, request: Request, device: torch.device) -> torch.Generator:
        """The generator a request draws from: its own when seeded, else the engine's shared one."""
        if request.generator is not None:
            return self._request_generator(request, device)
        return self._shared_generator(device)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        return self.sample(logits, requests).tolist()

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """logits (num_rows, vocab_size) fp32, one row per request that samples this step -> (num_rows,) int64
        token ids where the logits are. Waits for nothing on a GPU (async scheduling feeds the result to the next
        batch on the device); `__call__` returns them as a list."""
        params = [r.sampling_params for r in requests]
        if any(p.uses_logits_processing for p in params):
            logits = apply_penalties_and_filters(logits, requests)
        greedy = torch.tensor([p.greedy for p in params])
        if bool(greedy.all()):
            return argmax(logits)

        device = logits.device
        probs = sampling_probs(logits, params)                              # (num_rows, vocab)

        # One uniform per row, drawn where the logits are: per-request generators for seeded rows, the
        # shared one for the rest (in row order, one batched draw).
        uniforms = torch.empty(len(requests), dtype=torch.float64, device=device)
        shared = [i for i, r in enumerate(requests) if r.generator is None]
        if shared:
            uniforms[_device_tensor(shared, device)] = torch.rand(len(shared), dtype=torch.float64, device=device,
                                          generator=self._shared_generator(device))
        for i, r in enumerate(requests):
            if r.generator is not None:
                uniforms[i] = torch.rand(1, dtype=torch.float64, device=device,
                                         generator=self._request_generator(r, device))[0]
        sampled = draw_from(probs, uniforms)
        if bool(greedy.any()):                                  # a mixed batch: greedy rows keep their argmax
            sampled = torch.where(greedy.to(device, non_blocking=True), argmax(logits), sampled)
        return sampled


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits (rows, vocab) fp32 -> (rows,) int64, the greedy tokens. On a CPU with the C++ kernels built, their
    argmax_rows (kernels/cpu_sampling.cpp: torch.argmax's answer, ties and NaN included, 1.24 -> 0.19 ms at 32 x
    49,152); elsewhere torch.argmax."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and cpu_ops.available():
        return cpu_ops.argmax_rows(logits.contiguous())
    return logits.argmax(dim=-1)


def _device_tensor(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small tensor of host values on `device`, copied without waiting for the device. (`torch.tensor(values,
    device="cuda")` waits for everything queued on the stream: under async scheduling that is the forward the
    sampler is about to read.)"""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def draw_from(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """An exact draw per row of `weights` (rows, vocab), non-negative and not necessarily normalised, given one
    uniform in [0, 1) per row (rows,): the first token whose cumulative weight exceeds u x the row's total.
    Returns (rows,) int64 token ids.

    The sum runs in fp64, so a token of weight 0 has exactly its predecessor's cumulative sum and can never be
    the first to exceed it; u < 1 keeps the target below the row's total, so some token always does."""
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)                  # (rows, vocab), non-decreasing
    target = uniforms.to(torch.float64)[:, None] * cdf[:, -1:]         # (rows, 1), in [0, total)
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=weights.shape[1] - 1)


def sampling_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """The distribution each row samples from: softmax of logits / temperature after min-p, top-k and top-p
    (greedy rows: temperature 1, their argmax is kept). (rows, vocab) fp32."""
    device = logits.device
    temperature = _device_tensor([p.temperature if not p.greedy else 1.0 for p in params], device)
    logits = logits / temperature[:, None]
    min_p = [p.min_p for p in params]
    if any(m > 0 for m in min_p):
        logits = apply_min_p(logits, min_p)
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = apply_top_k_top_p(logits, top_k, top_p)
    return logits.softmax(dim=-1)


# Top-k / top-p look at this many of a row's most likely tokens first (more when a top_k asks for more): a
# partial sort (`topk`) of 1,024 of 49,152 logits costs about 9 ms at 32 rows on a 2-core CPU, a full sort 67.
TOP_CANDIDATES = 1024


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf. top_k -1 and top_p 1.0 keep all.

    Top-k first, then top-p on what top-k kept (renormalised), as vLLM. Both sets are prefixes of the row sorted
    by logit, so on a CPU only the most likely TOP_CANDIDATES tokens are sorted; a row whose top-p set does not
    end among them (a flat distribution) is decided again on its fully sorted row. The result is the same either
    way. On a GPU the full sort is cheap, and deciding which rows to redo would wait for the device."""
    vocab = logits.shape[1]
    k_list = [kk if 0 < kk < vocab else vocab for kk in top_k]
    k = _device_tensor(k_list, logits.device)
    p = _device_tensor(top_p, logits.device, logits.dtype)
    log_total = logits.logsumexp(dim=-1)                                      # (rows,) the whole row's
    width = min(vocab, max([TOP_CANDIDATES] + [kk for kk in k_list if kk < vocab]))
    if logits.device.type != "cpu":
        width = vocab
    top_logits, order = logits.topk(width, dim=-1) if width < vocab else logits.sort(dim=-1, descending=True)
    keep, decided = _top_k_top_p_prefix(top_logits, k, p, log_total)          # (rows, width), (rows,)
    out = torch.full_like(logits, float("-inf")).scatter_(1, order, top_logits.masked_fill(~keep, float("-inf")))
    unfiltered = [i for i, (kk, pp) in enumerate(zip(k_list, top_p)) if kk == vocab and pp >= 1]
    if unfiltered:                                                            # rows asking for neither: untouched
        rows = _device_tensor(unfiltered, logits.device)      # (a list index would be a synchronous copy on a GPU)
        out[rows] = logits[rows]
    undecided = (~decided).nonzero()[:, 0] if width < vocab else []
    if len(undecided):                                                        # the nucleus runs past the candidates
        full_logits, full_order = logits[undecided].sort(dim=-1, descending=True)
        keep, _ = _top_k_top_p_prefix(full_logits, k[undecided], p[undecided], log_total[undecided])
        out[undecided] = torch.full_like(full_logits, float("-inf")).scatter_(
            1, full_order, full_logits.masked_fill(~keep, float("-inf")))
    return out


def _top_k_top_p_prefix(sorted_logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor,
                        log_total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The heart of top-k / top-p, on the first `width` logits of each row sorted in descending order.

    sorted_logits (rows, width); k (rows,) in 1..vocab; p (rows,); log_total (rows,) logsumexp of the whole row.
    Returns keep (rows, width) bool, and decided (rows,) bool: whether the kept set is surely inside these
    `width` tokens (top-k cut it, or the tokens here already hold mass p, or top-p is off)."""
    width = sorted_logits.shape[1]
    ranks = torch.arange(width, device=sorted_logits.device)[None, :]
    drop = ranks >= k[:, None]                                                # top-k
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    # Top-p renormalises over what top-k kept: that set is inside these tokens when k <= width.
    within = k <= width
    log_norm = torch.where(within, masked.logsumexp(dim=-1), log_total)       # (rows,)
    probs = (masked - log_norm[:, None]).exp()                                # (rows, width)
    mass = probs.cumsum(dim=-1)
    uses_p = p < 1                                # p = 1 keeps all (the fp32 sum can reach 1 before the end)
    drop |= ((mass - probs) >= p[:, None]) & uses_p[:, None]      # the smallest set reaching top_p (>= 1 token)
    decided = within | ~uses_p | (mass[:, -1] >= p)
    return ~drop, decided


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Set logits whose probability is below min_p x the row's top probability to -inf (min_p 0 keeps all)."""
    probs = logits.softmax(dim=-1)                                           # (rows, vocab)
    threshold = _device_tensor(min_p, logits.device, probs.dtype)[:, None] * probs.amax(-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Structured output: set every token the row's grammar forbids to -inf; returns a new tensor.

    bitmask (rows, ceil(vocab / 32)) int32, xgrammar's layout: bit j of word w allows token 32 * w + j.
    A row of -1 (all bits set) allows everything (a request without a grammar)."""
    rows, vocab = logits.shape
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    words = bitmask.to(logits.device)                                          # (rows, words)
    allowed = ((words[:, :, None] >> bits) & 1).bool().reshape(rows, -1)[:, :vocab]   # (rows, vocab)
    return logits.masked_fill(~allowed, float("-inf"))


def _padded(rows: list[list[int]], pad: int, device: torch.device, left: bool = False) -> torch.Tensor:
    """A (len(rows), longest) int64 tensor of the rows, padded with `pad` (on the left when `left`)."""
    width = max((len(r) for r in rows), default=0)
    out = [([pad] * (width - len(r)) + r) if left else (r + [pad] * (width - len(r))) for r in rows]
    return _device_tensor(out, device, torch.long).reshape(len(rows), width)


def apply_penalties_and_filters(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """vLLM's masks, bias and penalties on the raw logits (num_rows, vocab); returns a new tensor.

    Only small index tensors are built from the requests; every change to the logits is one batched op.
    Rows whose request uses none of these come out unchanged (their factors are 1 and 0, exact in fp32)."""
    logits = logits.clone()
    num_rows, vocab = logits.shape
    device = logits.device
    params = [r.sampling_params for r in requests]
    neg_inf = float("-inf")

    # allowed_token_ids: everything else is -inf.
    restricted = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if restricted:
        mask = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)
        mask[_device_tensor(restricted, device)] = True
        rows = [i for i in restricted for _ in params[i].allowed_token_ids]
        cols = [t for i in restricted for t in params[i].allowed_token_ids]
        mask[_device_tensor(rows, device), _device_tensor(cols, device)] = False
        logits.masked_fill_(mask, neg_inf)

    # bad_words: a word's last token is banned when the output ends with the word's other tokens.
    words = [(i, w) for i, r in enumerate(requests) for w in r.bad_words_token_ids]
    if words:
        prefix_len = max(len(w) for _, w in words) - 1
        word_rows = _device_tensor([i for i, _ in words], device)
        last = _device_tensor([w[-1] for _, w in words], device)
        if prefix_len == 0:
            match = torch.ones(len(words), dtype=torch.bool, device=device)
        else:
            prefixes = _padded([w[:-1] for _, w in words], -1, device, left=True)       # (words, prefix_len)
            tails = _padded([r.output_token_ids[-prefix_len:] for r in requests], -2, device, left=True)
            tails = torch.cat([torch.full((num_rows, prefix_len - tails.shape[1]), -2, device=device), tails], 1)
            match = ((prefixes == tails[word_rows]) | (prefixes == -1)).all(dim=-1)    # (words,)
        logits[word_rows[match], last[match]] = neg_inf

    # min_tokens: EOS (unless ignore_eos) and the stop tokens are banned until min_tokens were generated.
    stops = [(i, t) for i, r in enumerate(requests) if r.num_output_tokens < r.sampling_params.min_tokens
             for t in set(r.sampling_params.stop_token_ids) | (set() if r.sampling_params.ignore_eos
                                                                 else set(r.eos_token_ids))]
    if stops:
        logits[_device_tensor([i for i, _ in stops], device),
               _device_tensor([t for _, t in stops], device)] = neg_inf

    # logit_bias: added to the logits.
    bias = [(i, t, b) for i, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()]
    if bias:
        logits.index_put_((_device_tensor([i for i, _, _ in bias], device),
                           _device_tensor([t for _, t, _ in bias], device)),
                          _device_tensor([b for _, _, b in bias], device, logits.dtype), accumulate=True)

    # Penalties. counts[i, t]: how often token t is in row i's output; seen: in its prompt or output.
    penalized = [p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params]
    if any(penalized):
        outputs = _padded([r.output_token_ids if pen else [] for r, pen in zip(requests, penalized)], vocab, device)
        counts = torch.zeros(num_rows, vocab + 1, device=device, dtype=logits.dtype)  # +1: the padding column
        counts.scatter_add_(1, outputs, torch.ones(outputs.shape, device=device, dtype=logits.dtype))
        counts = counts[:, :vocab]                                                     # (rows, vocab)
        rep = _device_tensor([p.repetition_penalty for p in params], device, logits.dtype)[:, None]
        if any(p.repetition_penalty != 1 for p in params):
            prompts = _padded([r.prompt_token_ids if p.repetition_penalty != 1 else []
                               for r, p in zip(requests, params)], vocab, device)
            seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=device)
            seen.scatter_(1, prompts, True)
            seen = seen[:, :vocab] | (counts > 0)
            factor = torch.where(seen, rep, torch.ones_like(rep))                     # (rows, vocab)
            logits = torch.where(logits > 0, logits / factor, logits * factor)
        freq = _device_tensor([p.frequency_penalty for p in params], device, logits.dtype)[:, None]
        presence = _device_tensor([p.presence_penalty for p in params], device, logits.dtype)[:, None]
        logits = logits - freq * counts - presence * (counts > 0).to(logits.dtype)
    return logits
