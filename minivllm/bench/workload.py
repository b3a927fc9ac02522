"""The offline workload, and how a run of it is measured.

Owns: the seeded synthetic requests both engines run (`Workload.random`: nano-vllm's workload, N requests of
random token ids, prompt lengths U[a, b], output lengths U[c, d]; `Workload.repeat`: chat prompts that ask the
model to repeat, correct or rename within real text the prompt holds, for speculative decoding), what one
engine did with them (`ThroughputResult`, `LatencyResult`), and `percentile`, which every benchmark mode
reports with.
Throughput counts only the tokens requests asked for: HF's static batches run every row to the longest
request of the batch, and those extra tokens are waste.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from minivllm.bench.passages import CODE, PASSAGES
from minivllm.core.sampling_params import SamplingParams

# Random prompt ids are drawn from [TOKEN_ID_LOW, min(TOKEN_ID_HIGH, vocab_size)): SmolLM2's special
# tokens sit at the bottom of its vocabulary, and the top is left alone for checkpoints with added tokens.
TOKEN_ID_LOW = 100
TOKEN_ID_HIGH = 49_000


def greedy_params(max_tokens: int) -> SamplingParams:
    """What every benchmark request asks for: greedy (both engines do the same work) and ignore_eos (it
    produces exactly max_tokens tokens)."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)


# The repeat workload's tasks: (how, which text). Each is one SmolLM2-135M-Instruct answers greedily with a near
# copy of the text (checked: 0.77-1.0 of the reference's words in order, difflib over words, 114-188 tokens):
# "repeat" asks for the passage word for word, "typo" for the passage with 4 letter swaps fixed, "rename" for
# the code with a variable renamed. Left out, because the model does not copy them: repeating Dickens and fixing
# its typos (it loops on "it was the age of ..." to max_tokens), fixing Austen's or Darwin's typos (it wanders
# off or stops early), and a shorter function (it rewrote the body instead of renaming).
REPEAT_TASKS = [("repeat", "gettysburg"), ("typo", "gettysburg"), ("repeat", "austen"), ("repeat", "darwin"),
                ("repeat", "constitution"), ("repeat", "declaration"), ("typo", "declaration"),
                ("rename", "inventory")]
RENAME = ("items", "records")           # the rename task's variable, old and new


def with_typos(text: str, num_typos: int = 4, seed: int = 0) -> str:
    """`text` with two neighbouring letters swapped inside `num_typos` words of 6+ letters (seeded)."""
    rng = random.Random(seed)
    words = text.split(" ")
    candidates = [i for i, w in enumerate(words) if len(w) >= 6 and w.isalpha()]
    for i in rng.sample(candidates, num_typos):
        w = words[i]
        j = rng.randrange(1, len(w) - 2)                  # never the first or the last letter
        words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def repeat_task(how: str, name: str) -> tuple[str, str]:
    """One repeat-workload task: (the user's message, the answer a perfect model gives)."""
    if how == "repeat":
        return f"Repeat the following text exactly, word for word:\n\n{PASSAGES[name]}", PASSAGES[name]
    if how == "typo":
        return ("Fix the spelling mistakes in this paragraph and output the corrected paragraph only:\n\n"
                + with_typos(PASSAGES[name]), PASSAGES[name])
    if how == "rename":
        old, new = RENAME
        return (f"Rename the variable `{old}` to `{new}` in this Python code and output the whole code:\n\n"
                f"```python\n{CODE[name]}```", CODE[name].replace(old, new))
    raise ValueError(f"repeat task {how!r}; choose repeat, typo or rename.")


@dataclass(frozen=True)
class Workload:
    """The requests both engines run: prompt_token_ids[i] asks for exactly output_lens[i] tokens, or, when
    ignore_eos is False, for at most that many (it stops at EOS)."""
    prompt_token_ids: list[list[int]]
    output_lens: list[int]
    seed: int
    name: str = "random"
    ignore_eos: bool = True

    def sampling_params(self) -> list[SamplingParams]:
        """Greedy, one per request: both engines (and spec on and off) do the same work."""
        return [SamplingParams(max_tokens=n, ignore_eos=self.ignore_eos, temperature=0) for n in self.output_lens]

    @classmethod
    def random(cls, num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
               vocab_size: int, seed: int = 0) -> "Workload":
        rng = random.Random(seed)
        low, high = TOKEN_ID_LOW, min(TOKEN_ID_HIGH, vocab_size)
        if high <= low:                                   # a toy vocabulary: use all of it
            low = 0
        prompts, outs = [], []
        for _ in range(num_requests):
            n = rng.randint(*input_len)                    # randint is inclusive at both ends: U[a, b]
            prompts.append([rng.randrange(low, high) for _ in range(n)])
            outs.append(rng.randint(*output_len))
        return cls(prompts, outs, seed)

    @classmethod
    def repeat(cls, tokenizer, num_requests: int, max_tokens: int, seed: int = 0) -> "Workload":
        """Chat prompts (the tokenizer's template, as `LLM.chat`) whose answers copy text from the prompt:
        REPEAT_TASKS in order, cycling when num_requests is larger. Each stops at EOS or max_tokens; a copy
        of these texts is 110-190 tokens. The tasks are fixed: `seed` is only recorded."""
        prompts = []
        for i in range(num_requests):
            message, _ = repeat_task(*REPEAT_TASKS[i % len(REPEAT_TASKS)])
            text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                 add_generation_prompt=True)
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        return cls(prompts, [max_tokens] * num_requests, seed, name="repeat", ignore_eos=False)

    @property
    def num_requests(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class ThroughputResult:
    """One engine's run over a workload. `output_tokens_per_request[i]` counts useful tokens only."""
    engine: str
    wall_s: float
    output_tokens_per_request: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_tokens_per_request)

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s


@dataclass
class LatencyResult:
    """Per-request latencies from RequestOutput.metrics, in seconds.

    TTFT counts from arrival, so it includes the time a request waited in the queue (all requests of
    an offline run arrive at once). TPOT is the mean gap between a request's later tokens.
    """
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks, as numpy's default."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
