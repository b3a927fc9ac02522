"""A tiny random-weight LLaVA checkpoint for tests: a 2-layer Llama behind a 3-layer CLIP vision tower.

`make_tiny_llava(path)` writes a complete checkpoint directory, written by transformers' own classes, that
minivllm (`python -m` tools, the engine) and transformers load unchanged:

    config.json, generation_config.json, model.safetensors      LlavaForConditionalGeneration (fp32)
    tokenizer files                                              the default model's, plus "<image>" (id 49152)
    processor_config.json, preprocessor_config.json            LlavaProcessor: 32x32 images, "<image>" -> 16 tokens

Images are 32x32 pixels in 8x8 patches: 16 patches, and with vision_feature_select_strategy "default" (the CLS row
dropped) 16 image tokens per image.
"""

from __future__ import annotations

from pathlib import Path

import torch

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32
PATCH_SIZE = 8
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2      # 16 ("default": no CLS row)
INIT_STD = 0.05                                          # wide enough that greedy tokens vary (checked below)


def _tokenizer():
    import transformers

    from minivllm.model.default_model import default_model_dir

    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir())
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    return tokenizer


def _config(tokenizer):
    import transformers

    text = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    vision = transformers.CLIPVisionConfig(
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, num_channels=3, hidden_act="quick_gelu")
    return transformers.LlavaConfig(
        vision_config=vision, text_config=text, vision_feature_layer=-2, vision_feature_select_strategy="default",
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), image_seq_length=NUM_IMAGE_TOKENS,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)


def _processor(tokenizer):
    import transformers

    # torchvision is not installed: the PIL image processor, named directly (CLIPImageProcessor would fall back
    # to it with a warning).
    try:
        from transformers import CLIPImageProcessorPil as image_processor_class
    except ImportError:                                   # transformers before the PIL/torchvision split
        from transformers import CLIPImageProcessor as image_processor_class
    image_processor = image_processor_class(size={"shortest_edge": IMAGE_SIZE},
                                            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1, image_token=IMAGE_TOKEN,
        chat_template=tokenizer.chat_template)


def make_tiny_llava(path: Path, seed: int = 0) -> Path:
    """Write the tiny LLaVA checkpoint to `path` (created if needed) and return `path`."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    config = _config(tokenizer)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:                    # layer norms and RMSNorms: keep their ones and zeros
                continue
            param.normal_(0.0, INIT_STD)
    model.eval().save_pretrained(path, safe_serialization=True)
    _processor(tokenizer).save_pretrained(path)
    return path
