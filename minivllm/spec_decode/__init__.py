"""Speculative decoding: proposers of draft tokens (vLLM v1's `v1/spec_decode/`). Verification is in
worker/rejection_sampler.py, the bookkeeping of accepted tokens in core/scheduler.py.

A proposer has two methods, both called on rank 0 only:
    observe(model_input)            after each step's forward (a draft model keeps its KV in step with the target's)
    propose_batch(requests, room)   drafts for requests that just sampled, at most room[i] tokens each

`propose_drafts` decides which requests ask and for how many (ModelRunner.propose_draft_token_ids calls it). This
package reads the worker's plain data (worker/input_batch.py) and never imports the runner: the runner imports it.
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


def propose_drafts(proposer, requests: list, max_model_len: int) -> dict[str, list[int]]:
    """The next step's drafts for these (running, just sampled) requests, by request id, from `proposer` ({} when
    it is None: speculation off). A request gets at most the tokens it may still generate less one (the step that
    verifies k drafts makes up to k + 1), and none if its logits processing depends on the tokens before it
    (penalties, bad_words, min_tokens): the rejection sampler does not replay that."""
    if proposer is None:
        return {}
    asking, room = [], []
    for req in requests:
        sp = req.sampling_params
        if req.is_finished or sp.uses_logits_processing:
            continue
        r = min(sp.max_tokens - req.num_output_tokens, max_model_len - req.num_tokens) - 1
        if r > 0:
            asking.append(req)
            room.append(r)
    return {req.request_id: tokens for req, tokens in zip(asking, proposer.propose_batch(asking, room)) if tokens}
