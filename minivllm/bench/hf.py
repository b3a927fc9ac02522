"""The baseline: Hugging Face transformers' `generate` on the very same requests as minivllm.

Owns: loading the checkpoint with transformers on minivllm's device and dtype, and timing static,
left-padded batches of greedy `generate`, each row forced to its batch's longest output:

    minivllm (continuous batching):  a request leaves the moment it is done; a waiting one takes its place.
    HF (static batches of B):        [r0 r1 ... rB-1] all run max(out_len) steps, then the next batch.

Only the tokens each request asked for count towards HF's throughput.
"""

from __future__ import annotations

import time

from minivllm.bench.workload import ThroughputResult, Workload


def load_hf_model(model_dir, dtype=None, device=None):
    """HF's model on the same device and in the same dtype as minivllm's run (fp32 on a CPU, bf16 on a GPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32)
    return model.to(device or "cpu").eval()


def hf_generate_batch(model, prompts: list[list[int]], max_new_tokens: int) -> list[int]:
    """Greedy `generate` on one left-padded static batch, every row forced to run max_new_tokens steps.

    Returns how many new tokens each row got (all of them equal max_new_tokens).
    """
    import torch

    cfg = model.generation_config
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else model.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else eos
    pad = 0 if pad is None else pad                       # a checkpoint with neither: any id will do
    width = max(len(p) for p in prompts)
    # Left padding: the last column is every row's last prompt token, so new tokens line up.
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)  # (batch, width)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             pad_token_id=pad)                                    # (batch, width + new)
    return [out.shape[1] - width] * len(prompts)


def bench_hf(model, workload: Workload, batch_size: int, progress: bool = True) -> ThroughputResult:
    """Static batches in request order; each runs to its longest request, only asked-for tokens count.

    With progress, one line per finished batch (its steps, time and the running throughput), so a run cut
    off by a time limit (a lent GPU's 15 minutes) still shows HF's rate over the batches it finished.
    """
    counts = []
    start = time.perf_counter()
    for b in range(0, workload.num_requests, batch_size):
        prompts = workload.prompt_token_ids[b:b + batch_size]
        asked = workload.output_lens[b:b + batch_size]
        t0 = time.perf_counter()
        got = hf_generate_batch(model, prompts, max(asked))
        counts += [min(g, a) for g, a in zip(got, asked)]
        if progress:
            now = time.perf_counter()
            print(f"HF batch {b // batch_size + 1}/{-(-workload.num_requests // batch_size)}: {len(prompts)} "
                  f"requests, {max(asked)} steps in {now - t0:.1f} s; so far {sum(counts)} useful tokens in "
                  f"{now - start:.1f} s ({sum(counts) / (now - start):.1f} tokens/s)", flush=True)
    return ThroughputResult("hf", time.perf_counter() - start, counts)
