"""Speculative decoding: proposers of draft tokens (vLLM v1's `v1/spec_decode/`). Verification is in
worker/rejection_sampler.py, the bookkeeping of accepted tokens in core/scheduler.py.

A proposer has two methods, both called on rank 0 only:
    observe(model_input)            after each step's forward (a draft model keeps its KV in step with the target's)
    propose_batch(requests, room)   drafts for requests that just sampled, at most room[i] tokens each
"""

from __future__ import annotations


def make_proposer(spec, runner):
    """The proposer a SpeculativeConfig asks for, for the rank-0 ModelRunner `runner` (None: speculation off)."""
    if spec is None:
        return None
    if spec.method == "ngram":
        from minivllm.spec_decode.ngram_proposer import NgramProposer
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    from minivllm.spec_decode.draft_model import DraftModelProposer
    return DraftModelProposer(spec, runner.model_path, runner.model_cfg, runner.dtype, runner.device,
                              runner.backend, runner.block_size, runner.config.max_num_seqs)
