"""Lesson 00's solution: how many KV blocks a running request holds after a step."""


def blocks_held(num_prompt_tokens, num_output_tokens, block_size):
    """Blocks in the block table of a request after the step that gave it its `num_output_tokens`-th token: every
    token has KV except the newest, which the next step computes; a partly filled last block counts whole."""
    with_kv = num_prompt_tokens + num_output_tokens - 1
    return -(-with_kv // block_size)                        # ceil(with_kv / block_size)
