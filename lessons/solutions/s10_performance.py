"""Lesson 10's solution: the bytes a decode step must read, and the time that takes at a bandwidth."""


def decode_memory_floor_ms(cfg, itemsize, batch, context, bandwidth):
    """The decode-step memory floor in ms: every weight once (the embedding table is only indexed; the LM head
    is read whole, tied or not) plus the K and V of `context` cached tokens for each of `batch` sequences."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_layer = (h * (q + 2 * kv)                       # qkv_proj
                 + q * h                                # o_proj
                 + h * 2 * cfg.intermediate_size        # gate_up_proj
                 + cfg.intermediate_size * h            # down_proj
                 + 2 * h)                               # the two RMSNorm weights
    weights = cfg.num_hidden_layers * per_layer + h + cfg.vocab_size * h      # + final norm + LM head
    kv_bytes = 2 * cfg.num_hidden_layers * kv * batch * context                # K and V, every layer
    return (weights + kv_bytes) * itemsize / bandwidth * 1e3
