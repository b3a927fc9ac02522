"""Multimodal inputs (vLLM v1's `vllm/multimodal/`): images in a prompt, the placeholder tokens they become, and
what the engine wires for a vision-language model.

    inputs.py       MultiModalFeature: one image of a prompt (its hash, placeholder range, pixel values)
    processor.py    images in (PIL, data URI, local file) -> pixel values; "<image>" -> N placeholder tokens
    ../core/encoder_cache_manager.py   the scheduler's side: which images' encoder outputs the worker keeps
    ../worker/encoder_runner.py        the worker's side: run the vision encoder, put its rows into the batch
"""

from __future__ import annotations

from minivllm.multimodal.inputs import MultiModalFeature

__all__ = ["MultiModalFeature", "check_multimodal_args", "make_multimodal"]


def make_multimodal(config, model_path, model_cfg, journal):
    """A vision-language model's processor and the scheduler's encoder cache; (None, None) for a text model.
    The cache holds encoder_cache_size rows (vLLM's rule when unset: max_num_batched_tokens, and never less than
    one image)."""
    vision = model_cfg.vision
    if vision is None:
        return None, None
    from minivllm.core.encoder_cache_manager import EncoderCacheManager
    from minivllm.multimodal.processor import MultiModalProcessor

    if config.kv_transfer_config is not None:
        raise ValueError("kv_transfer_config with a vision-language model is not implemented (transferred blocks "
                         "are named by their tokens, not by their images); serve it without a KV connector.")
    rows = vision["num_image_tokens"]
    size = config.encoder_cache_size or max(config.max_num_batched_tokens, rows)
    if size < rows:
        raise ValueError(f"encoder_cache_size is {size} tokens, below one image's {rows}: no image could ever run. "
                         f"Raise encoder_cache_size to at least {rows} (0: the default).")
    processor = MultiModalProcessor(model_path, vision, config.limit_mm_per_prompt, config.allowed_local_media_path)
    return processor, EncoderCacheManager(size, journal)


def check_multimodal_args(limit_mm_per_prompt, encoder_cache_size) -> None:
    if limit_mm_per_prompt is not None:
        if not isinstance(limit_mm_per_prompt, dict) or set(limit_mm_per_prompt) - {"image"}:
            raise ValueError(f"limit_mm_per_prompt is {limit_mm_per_prompt!r}; it must be {{\"image\": N}}.")
        n = limit_mm_per_prompt.get("image", 0)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"limit_mm_per_prompt image is {n!r}; it must be an int >= 0.")
    if not isinstance(encoder_cache_size, int) or isinstance(encoder_cache_size, bool) or encoder_cache_size < 0:
        raise ValueError(f"encoder_cache_size is {encoder_cache_size!r}; it must be an int >= 0 (0: the default).")
