"""Lesson 08's solution: which decoder layers each pipeline stage holds."""


def stage_layers(num_layers, pp_size):
    """[(start, end), ...]: stage s holds layers start..end-1. As even as possible; when they do not divide, the
    earlier stages take one fewer (the first stage also embeds, the last also runs the LM head). Every stage needs
    at least one layer: ValueError if pp_size is below 1 or above num_layers."""
    if pp_size < 1 or num_layers < pp_size:
        raise ValueError(f"{pp_size} stages for {num_layers} layers: each stage needs at least one layer")
    base, extra = divmod(num_layers, pp_size)
    bounds, start = [], 0
    for stage in range(pp_size):
        n = base + (1 if stage >= pp_size - extra else 0)
        bounds.append((start, start + n))
        start += n
    return bounds
