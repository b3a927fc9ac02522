"""The shared prompts and Hugging Face's greedy loop: the independent oracle the parity tests compare with.

A plain module (not conftest.py) so test files can import it: lessons/ has its own conftest.py, and two
modules named `conftest` replace each other in sys.modules."""

from __future__ import annotations

import weakref

import torch

# Six prompts of different lengths and styles, shared by the parity and invariance tests.
PROMPTS = [
    "The capital of France is",
    "Hello, my name is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "In 1969, the first humans to walk on the Moon were",
    "A list of prime numbers: 2, 3, 5, 7,",
    "Once upon a time, in a kingdom far away, there lived a young princess who loved to read books about "
    "dragons, wizards and distant lands. Every evening she",
]



# model -> {prompt ids: the longest greedy continuation computed so far}. Greedy decoding is deterministic, so a
# shorter continuation of the same prompt is a prefix of a longer one: the suite computes each one once.
_GREEDY: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[int, ...], list[int]]]" = weakref.WeakKeyDictionary()


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face transformers' greedy continuation, EOS included: the independent oracle.

    A plain argmax loop over HF's forward with its own KV cache (generate's min_new_tokens would
    mask EOS, which is not greedy). Memoised per model and prompt for the test session (a copy is returned)."""
    done = _GREEDY.setdefault(hf_model, {})
    key = tuple(prompt_ids)
    if len(done.get(key, ())) >= max_new_tokens:
        return list(done[key][:max_new_tokens])
    tokens: list[int] = []
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_new_tokens):
            tok = int(out.logits[0, -1].argmax())
            tokens.append(tok)
            out = hf_model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    done[key] = tokens
    return list(tokens)
