"""Beam search above the engine (vLLM's `LLM.beam_search`, `BeamSearchParams`, `vllm/beam_search.py`).

Owns: the beam search parameters and their checks, the search itself (one step: every live beam of every prompt
becomes an ordinary one-token request asking for its 2 * beam_width most likely next tokens; each prompt keeps its
beam_width best continuations by cumulative logprob, and a beam that ends on EOS moves to the prompt's finished
list) and the final ranking by vLLM's length-penalised score. The engine never knows it runs a beam search: each
beam is a prompt made of the original prompt and the beam's tokens, and the prefix cache hands every beam the KV
blocks of the prompt and of the prefix it shares with the others, so a step computes about one block per beam.

    prompt ──step──> 2k candidates per beam ──best k non-EOS──> beams ──step──> ... ──> best k of finished + beams
                        │ EOS (unless ignore_eos)                                          (by score, vLLM's rule)
                        └──────────────────────────> finished

`BeamSearch` is the search without an engine (requests out, outputs in); `run_beam_search` drives it on an
LLMEngine (LLM.beam_search), entrypoints/serving_beam_search.py on the AsyncLLMEngine (the API's use_beam_search).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from minivllm.core.sampling_params import MAX_LOGPROBS, SAMPLING_EPS, RequestOutputKind, SamplingParams
from minivllm.outputs import Logprob, RequestOutput

# Each step asks for 2 * beam_width logprobs: vLLM's default max_logprobs (20) allows 10 beams. The cap stays 10 when
# an engine allows more; an engine that allows fewer refuses wider beams (check_prompts).
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
MAX_LENGTH_PENALTY = 10.0              # (10 ** 7 tokens) ** 10 is still a float; the useful range is about 0..2


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams (fields, names and defaults).

    beam_width: beams kept per prompt, and sequences returned (1..10: a step asks for 2 * beam_width logprobs).
    max_tokens: the most tokens a beam generates (fewer where the context ends first).
    ignore_eos: EOS is an ordinary token: no beam finishes before max_tokens.
    temperature: 0 (the default) ranks only the most likely tokens; above 0 each beam's step also samples a token
        at this temperature, which joins its candidates when it is not among them (vLLM's behaviour).
    length_penalty: the final ranking's score is cumulative logprob / length ** length_penalty (get_beam_search_score),
        in [-10, 10].
    include_stop_str_in_output: keep the EOS token's text at the end of a finished beam's text (as SamplingParams).
    """
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width)
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width is {self.beam_width}; it must be in [1, {MAX_BEAM_WIDTH}] (each step asks "
                             f"the engine for the 2 * beam_width most likely tokens, at most {MAX_LOGPROBS} under "
                             "vLLM's default max_logprobs).")
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens is {self.max_tokens}; it must be >= 1.")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} is {getattr(self, name)!r}; it must be True or False.")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} is {value!r}; it must be a finite number.")
        if abs(self.length_penalty) > MAX_LENGTH_PENALTY:
            raise ValueError(f"length_penalty is {self.length_penalty}; it must be in [-{MAX_LENGTH_PENALTY}, "
                             f"{MAX_LENGTH_PENALTY}] (a beam's length ** length_penalty must stay a float).")
        if self.temperature < 0:
            raise ValueError(f"temperature is {self.temperature}; it must be >= 0 (0: rank the most likely tokens).")
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0

    def step_params(self) -> SamplingParams:
        """What each beam asks the engine for at each step: one token and the 2 * beam_width most likely ones."""
        return SamplingParams(max_tokens=1, temperature=self.temperature, logprobs=2 * self.beam_width,
                              output_kind=RequestOutputKind.FINAL_ONLY)


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} is {value!r} ({type(value).__name__}); it must be an int.")


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's BeamSearchSequence). `tokens` holds the prompt and the beam's tokens, as in vLLM (the
    beam's own are `output_token_ids`); `logprobs` one {token id: Logprob} per output token: the 2 * beam_width
    most likely tokens at that step. A beam that ended on EOS keeps the EOS in its tokens (finish_reason "stop",
    stop_reason the EOS id); `text` is the output's text (not the prompt's), without the EOS's unless
    include_stop_str_in_output."""
    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The best beam_width sequences of one prompt, best first (vLLM's BeamSearchOutput), and the prompt."""
    sequences: list[BeamSearchSequence]
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0          # prompt tokens the first step found in the prefix cache


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's score: cumulative logprob / length ** length_penalty, where length counts every token of `tokens`
    (the prompt's too, as vLLM's do) except a final EOS. Hugging Face divides by the generated length instead."""
    seq_len = len(tokens)
    if eos_token_id is not None and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (seq_len ** length_penalty)


def _score(beam: BeamSearchSequence, length_penalty: float) -> float:
    """A beam's score; only an EOS that finished it is left out of its length (one ignore_eos kept is a token)."""
    return get_beam_search_score(beam.tokens, beam.cum_logprob,
                                 beam.stop_reason if beam.finish_reason == "stop" else None, length_penalty)


@dataclass
class _Instance:
    """One prompt's search: its live beams and its best finished ones."""
    prompt: str | None
    prompt_token_ids: list[int]
    cache_salt: str | None
    max_len: int                        # the longest a beam gets: prompt + max_tokens, or the context
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)
    num_cached_tokens: int | None = None


class BeamSearch:
    """The search for several prompts at once, without an engine:

        search = BeamSearch(prompts, params, eos_token_ids, max_model_len)
        while not search.finished:
            outputs = <run search.requests() with params.step_params(), one output each, in order>
            search.advance(outputs)
        results = search.outputs(decode)

    prompts: (text or None, token ids, cache_salt or None) each, already checked by the engine.
    """

    def __init__(self, prompts: list[tuple[str | None, list[int], str | None]], params: BeamSearchParams,
                 eos_token_ids: frozenset[int], max_model_len: int):
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.instances = [_Instance(text, list(ids), salt, min(len(ids) + params.max_tokens, max_model_len),
                                    [BeamSearchSequence(list(ids), [], num_prompt_tokens=len(ids))])
                          for text, ids, salt in prompts]
        self.num_steps = 0

    @property
    def finished(self) -> bool:
        return not any(inst.beams for inst in self.instances)

    def requests(self) -> list[dict]:
        """This step's prompts: one per live beam, prompt by prompt, beam by beam (advance takes them in order)."""
        out = []
        for inst in self.instances:
            for beam in inst.beams:
                prompt: dict = {"prompt_token_ids": beam.tokens}
                if inst.cache_salt is not None:
                    prompt["cache_salt"] = inst.cache_salt
                out.append(prompt)
        return out

    def advance(self, outputs: list[RequestOutput]) -> None:
        """Extend every beam by its step's candidates and keep each prompt's best (outputs in requests()' order)."""
        width, pos = self.params.beam_width, 0
        if len(outputs) != sum(len(inst.beams) for inst in self.instances):
            raise ValueError(f"advance got {len(outputs)} outputs for {len(self.requests())} beams.")
        for inst in self.instances:
            candidates = []
            for beam in inst.beams:
                out = outputs[pos]
                pos += 1
                if inst.num_cached_tokens is None:
                    inst.num_cached_tokens = out.num_cached_tokens
                candidates += self._candidates(inst, beam, out)
            candidates.sort(key=lambda c: c[0], reverse=True)      # stable: ties keep beam, then rank, order
            inst.beams = [_extend(beam, token_id, entry, cum) for cum, token_id, beam, entry in candidates[:width]]
            if inst.beams and len(inst.beams[0].tokens) >= inst.max_len:    # out of tokens: they end here
                for beam in inst.beams:
                    beam.finish_reason = "length"
                self._keep_best(inst, inst.beams)
                inst.beams = []
            elif inst.beams and self._cannot_improve(inst):
                inst.beams = []
        self.num_steps += 1

    def _candidates(self, inst: _Instance, beam: BeamSearchSequence, out: RequestOutput) -> list[tuple]:
        """(cumulative logprob, token id, beam, logprobs entry) of every continuation the step returned; the ones
        that end on EOS finish at once."""
        completion = out.outputs[0]
        if not completion.logprobs:
            raise RuntimeError(f"beam search: the engine ended a step's request with finish_reason "
                               f"{completion.finish_reason!r} and no logprobs.")
        entry = completion.logprobs[0]
        found, finished = [], []
        for token_id, lp in entry.items():
            cum = beam.cum_logprob + lp.logprob
            if token_id in self.eos_token_ids:
                done = _extend(beam, token_id, entry, cum)
                done.finish_reason, done.stop_reason = "stop", token_id
                finished.append(done)
            else:
                found.append((cum, token_id, beam, entry))
        self._keep_best(inst, finished)
        return found

    def _keep_best(self, inst: _Instance, finished: list[BeamSearchSequence]) -> None:
        """Only the best beam_width finished beams can be returned, and their scores never change: keep those."""
        if finished:
            inst.completed = sorted(inst.completed + finished, key=lambda b: _score(b, self.params.length_penalty),
                                    reverse=True)[:self.params.beam_width]

    def _cannot_improve(self, inst: _Instance) -> bool:
        """True when no live beam, nor anything it can grow into, can score above the worst of beam_width finished
        beams: then the result is already what running to max_tokens would give, and the prompt's search ends.
        A beam's cumulative logprob only falls, so its best possible score is cum / L ** length_penalty at the
        longest length L it can reach (length_penalty > 0) or at its length now (<= 0)."""
        lp = self.params.length_penalty
        if len(inst.completed) < self.params.beam_width:
            return False
        best = inst.beams[0]
        length = inst.max_len if lp > 0 else len(best.tokens)
        return best.cum_logprob / (length ** lp) < _score(inst.completed[-1], lp)

    def outputs(self, decode) -> list[BeamSearchOutput]:
        """Each prompt's best beam_width beams, best first, by vLLM's score; `decode(token ids)` makes their text."""
        results = []
        for inst in self.instances:
            for beam in inst.beams:                 # still live (a search stopped early): they end by length
                beam.finish_reason = "length"
            best = sorted(inst.completed + inst.beams, key=lambda b: _score(b, self.params.length_penalty),
                          reverse=True)[:self.params.beam_width]
            for beam in best:
                ids = beam.output_token_ids
                if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                    ids = ids[:-1]
                beam.text = decode(ids)
            results.append(BeamSearchOutput(best, inst.prompt, inst.prompt_token_ids, inst.num_cached_tokens or 0))
        return results


def _extend(beam: BeamSearchSequence, token_id: int, entry: dict[int, Logprob], cum: float) -> BeamSearchSequence:
    return BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [entry], cum,
                              num_prompt_tokens=beam.num_prompt_tokens)


def check_prompts(engine, prompts: list, params: BeamSearchParams) -> list[tuple[str | None, list[int], str | None]]:
    """(text, token ids, cache_salt) of each prompt, checked as a request of max_tokens would be (ValueError
    naming the prompt). `engine` is an LLMEngine; call it on the thread that owns the engine."""
    checked = []
    sp = SamplingParams(max_tokens=params.max_tokens, logprobs=2 * params.beam_width)
    limit = engine.input_processor.max_logprobs
    if limit != -1 and sp.logprobs > limit:
        raise ValueError(f"beam_width is {params.beam_width}; each step asks for the 2 * beam_width = {sp.logprobs} "
                         f"most likely tokens, and this engine's max_logprobs is {limit}. Lower beam_width to at most "
                         f"{limit // 2}, or raise max_logprobs (--max-logprobs).")
    for i, prompt in enumerate(prompts):
        try:
            if isinstance(prompt, dict) and "multi_modal_data" in prompt:
                raise ValueError("beam search takes text prompts; this one has multi_modal_data.")
            request = engine.input_processor.process_inputs(prompt, sp)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
        checked.append((request.prompt, request.prompt_token_ids, request.cache_salt))
    return checked


def run_beam_search(engine, prompts: list, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """Beam search for every prompt on an LLMEngine (LLM.beam_search): each step runs all live beams of all prompts
    as one batch of one-token requests."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params is a {type(params).__name__}; pass BeamSearchParams.")
    search = BeamSearch(check_prompts(engine, prompts, params), params, engine.eos_token_ids, engine.max_model_len)
    step_params = params.step_params()
    bar = None
    if use_tqdm:
        from tqdm.auto import tqdm
        bar = tqdm(total=params.max_tokens, desc="Beam search", unit="token", dynamic_ncols=True)
    try:
        while not search.finished:
            search.advance(_run_step(engine, search.requests(), step_params))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return search.outputs(lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True))


def _run_step(engine, prompts: list[dict], params: SamplingParams) -> list[RequestOutput]:
    """Run one-token requests for `prompts` on the engine until all have finished; their outputs, in order."""
    ids: list[str] = []
    results: dict[str, RequestOutput] = {}
    try:
        for prompt in prompts:
            ids.append(engine.add_request(prompt, params).request_id)
        while len(results) < len(ids):
            outputs = engine.step()
            results.update((out.request_id, out) for out in outputs if out.finished)
            if not outputs and not engine.has_unfinished_requests():
                raise RuntimeError("beam search: the engine has nothing left to run, but a step's requests have "
                                   "not finished.")
    except BaseException:
        for rid in ids:                           # never leave a step's blocks behind
            engine.abort_request(rid)
        raise
    return [results[rid] for rid in ids]
