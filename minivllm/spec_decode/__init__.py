"""Speculative decoding: proposers of draft tokens (vLLM v1's `v1/spec_decode/`). Verification is in
worker/rejection_sampler.py, the bookkeeping of accepted tokens in core/scheduler.py."""
