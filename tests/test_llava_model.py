"""LLaVA at the model level (no engine): minivllm's LlavaForConditionalGeneration against transformers' on the tiny
random checkpoint of tests/llava_checkpoint.py, both checkpoint layouts, and the errors it gives."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

from minivllm.model.attention import AttentionMetadata, get_attention_backend
from minivllm.model.layers import PPStage, TPGroup
from minivllm.model.llama import ModelConfig
from minivllm.model.llava import LlavaForConditionalGeneration, merge_multimodal_embeddings
from minivllm.model.loader import load_model
from tests.llava_checkpoint import NUM_IMAGE_TOKENS, make_tiny_llava

CPU = torch.device("cpu")
BLOCK_SIZE = 16
PROMPTS = {
    0: "USER: What is the capital of France? ASSISTANT:",
    1: "USER: <image>\nWhat is in this picture? ASSISTANT:",
    2: "USER: Compare <image> with <image> please. ASSISTANT:",
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("tiny_llava"))


@pytest.fixture(scope="module")
def processor(ckpt):
    from transformers import LlavaProcessor
    return LlavaProcessor.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import LlavaForConditionalGeneration as HFLlava
    return HFLlava.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt, ModelConfig.from_dir(ckpt), torch.float32, CPU)


@pytest.fixture(scope="module")
def images():
    from PIL import Image
    return [Image.fromarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8))
            for seed, shape in ((1, (40, 48, 3)), (2, (32, 32, 3)))]


def inputs(processor, images, num_images: int):
    return processor(text=PROMPTS[num_images], images=images[:num_images] or None, return_tensors="pt")


def run_chunks(model, ids: torch.Tensor, pixel_values: torch.Tensor | None, chunks: list[int],
               backend: str = "auto") -> torch.Tensor:
    """minivllm's logits (num_tokens, vocab) for one sequence, its prompt run as prefill chunks of the given sizes
    into a fresh paged KV cache (as the runner lays it out: block table 0..n-1, slot = position)."""
    cfg = model.cfg
    n = ids.shape[0]
    num_blocks = -(-n // BLOCK_SIZE) + 1
    kv = [(torch.zeros(num_blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim),
           torch.zeros(num_blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim))
          for _ in range(cfg.num_hidden_layers)]
    attn = get_attention_backend(backend, CPU)
    image_rows = model.embed_multimodal(pixel_values).flatten(0, 1) if pixel_values is not None else None
    used, logits, start = 0, [], 0
    for size in chunks:
        rows = slice(start, start + size)
        chunk_ids, end = ids[rows], start + size
        embeds = model.embed_input_ids(chunk_ids)
        k = int((chunk_ids == model.image_token_id).sum())
        if k:                                         # this chunk's image tokens take the next k image rows
            embeds = merge_multimodal_embeddings(chunk_ids, embeds, image_rows[used:used + k], model.image_token_id)
            used += k
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, end), cu_seqlens_q=torch.tensor([0, size], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            block_tables=torch.arange(num_blocks, dtype=torch.int32)[None], max_q_len=size, max_seq_len=end,
            q_lens_cpu=[size], seq_lens_cpu=[end])
        hidden = model(chunk_ids, torch.arange(start, end), kv, meta, attn, inputs_embeds=embeds)
        logits.append(model.compute_logits(hidden))
        start = end
    return torch.cat(logits)


def minivllm_logits(model, batch, chunks=None, backend="auto") -> torch.Tensor:
    ids = batch["input_ids"][0]
    with torch.no_grad():
        return run_chunks(model, ids, batch.get("pixel_values"), chunks or [ids.shape[0]], backend)


def hf_logits(hf, batch) -> torch.Tensor:
    with torch.no_grad():
        return hf(**batch).logits[0].float()


def test_config_and_processor_of_the_tiny_checkpoint(ckpt, processor, images, model_dir):
    cfg = ModelConfig.from_dir(ckpt)
    assert cfg.architecture == "LlavaForConditionalGeneration" and cfg.is_multimodal
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.eos_token_id) == (49153, 64, 2, (2,))
    assert cfg.vision["image_token_id"] == 49152 and cfg.vision["num_image_tokens"] == NUM_IMAGE_TOKENS == 16
    assert cfg.vision["hidden_act"] == "quick_gelu" and cfg.vision["vision_feature_layer"] == -2
    assert cfg.vision["image_size"] == 32 and cfg.vision["patch_size"] == 8 and cfg.vision["hidden_size"] == 32
    ids = inputs(processor, images, 2)["input_ids"][0]
    assert int((ids == 49152).sum()) == 2 * 16                    # "<image>" expands into 16 tokens each
    assert not ModelConfig.from_dir(model_dir).is_multimodal      # a text model's config has no vision part


@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_logits_match_hf(model, hf, processor, images, num_images):
    batch = inputs(processor, images, num_images)
    ours, ref = minivllm_logits(model, batch), hf_logits(hf, batch)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-4
    assert len(set(ours.argmax(-1).tolist())) > 3                 # the random weights are not flat


def test_the_image_changes_the_logits(model, processor, images):
    """The parity above means something: another picture gives other logits after the image."""
    a, b = inputs(processor, images, 1), inputs(processor, images[1:], 1)
    assert (minivllm_logits(model, a)[-1] - minivllm_logits(model, b)[-1]).abs().max().item() > 0.1


def test_chunked_prefill_through_an_image_matches_hf(model, hf, processor, images):
    """The engine's way: the prompt in chunks that cut an image's tokens in two, each chunk's image rows merged
    from the flat image embeddings; the torch reference attention reads the earlier chunks from the cache."""
    batch = inputs(processor, images, 2)
    n = batch["input_ids"].shape[1]
    ours = minivllm_logits(model, batch, chunks=[10, 17, n - 27], backend="torch")
    assert (ours - hf_logits(hf, batch)).abs().max().item() <= 1e-4


def test_image_embeddings_have_one_row_per_image_token(model, processor, images):
    pixel_values = inputs(processor, images, 2)["pixel_values"]
    out = model.embed_multimodal(pixel_values)
    assert out.shape == (2, 16, 64) and out.dtype == torch.float32
    with pytest.raises(ValueError, match="32x32"):
        model.embed_multimodal(torch.zeros(1, 3, 40, 40))


def rewrite_checkpoint(src, dst, rename) -> None:
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(src / "model.safetensors"))
    save_file({rename(k): v for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})


def transformers5_name(name: str) -> str:
    """transformers >= 4.52's in-memory names: model.language_model.*, model.vision_tower.vision_model.*."""
    for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                     ("vision_tower.", "model.vision_tower.vision_model."),
                     ("multi_modal_projector.", "model.multi_modal_projector.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def llava_hf_name(name: str) -> str:
    """llava-hf's original names: language_model.model.*, language_model.lm_head.*, vision_tower.vision_model.*."""
    if name.startswith("vision_tower."):
        return "vision_tower.vision_model." + name[len("vision_tower."):]
    return name


@pytest.mark.parametrize("rename", [transformers5_name, llava_hf_name])
def test_both_checkpoint_layouts_load_to_the_same_logits(tmp_path, ckpt, model, processor, images, rename):
    from safetensors import safe_open
    rewrite_checkpoint(ckpt, tmp_path / "ckpt", rename)
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert any(".vision_model." in n for n in names) and any("layers.0.self_attn.q_proj" in n for n in names)
    other = load_model(tmp_path / "ckpt", ModelConfig.from_dir(tmp_path / "ckpt"), torch.float32, CPU)
    batch = inputs(processor, images, 1)
    assert torch.equal(minivllm_logits(other, batch), minivllm_logits(model, batch))


def with_config(ckpt, dst, **changes):
    """A copy of the checkpoint (weights linked) whose config.json has `changes` (a__b: key b of nested config a)."""
    dst.mkdir()
    for f in ckpt.iterdir():
        (dst / f.name).symlink_to(f)
    config = json.loads((ckpt / "config.json").read_text())
    for key, value in changes.items():
        *outer, last = key.split("__")
        d = config
        for part in outer:
            d = d[part]
        d[last] = value
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_full_strategy_keeps_the_cls_row_and_matches_hf(tmp_path, ckpt, processor, images):
    from transformers import LlavaForConditionalGeneration as HFLlava
    path = with_config(ckpt, tmp_path / "full", vision_feature_select_strategy="full", vision_feature_layer=-1)
    cfg = ModelConfig.from_dir(path)
    assert cfg.vision["num_image_tokens"] == 17
    ours = load_model(path, cfg, torch.float32, CPU)
    assert len(ours.vision_tower.encoder.layers) == 3
    tok = processor.tokenizer
    ids = tok("A picture:")["input_ids"] + [49152] * 17 + tok(" it shows")["input_ids"]
    batch = {"input_ids": torch.tensor([ids]), "pixel_values": inputs(processor, images, 1)["pixel_values"]}
    ref = hf_logits(HFLlava.from_pretrained(path, dtype=torch.float32).eval(), batch)
    assert (minivllm_logits(ours, batch) - ref).abs().max().item() <= 1e-4


def test_wrong_number_of_image_tokens_is_refused(model, processor, images):
    batch = inputs(processor, images, 1)
    ids = batch["input_ids"][0]
    two_images = model.embed_multimodal(inputs(processor, images, 2)["pixel_values"])
    with pytest.raises(ValueError, match="16 image tokens .* 32 embedding rows"):
        merge_multimodal_embeddings(ids, model.embed_input_ids(ids), two_images, model.image_token_id)


def test_a_list_of_vision_feature_layers_is_refused(tmp_path, ckpt, model):
    path = with_config(ckpt, tmp_path / "list", vision_feature_layer=[-2, -1])
    with pytest.raises(ValueError, match=r"vision_feature_layer is \[-2, -1\]"):
        ModelConfig.from_dir(path)
    cfg = dataclasses.replace(model.cfg, vision={**model.cfg.vision, "vision_feature_layer": [-2, -1]})
    with pytest.raises(ValueError, match=r"vision_feature_layer is \[-2, -1\]"):
        LlavaForConditionalGeneration(cfg)


def test_other_language_models_and_vision_towers_are_refused(tmp_path, ckpt):
    path = with_config(ckpt, tmp_path / "qwen", text_config__model_type="qwen2")
    with pytest.raises(ValueError, match="'qwen2'.*Llama"):
        ModelConfig.from_dir(path)


def test_parallelism_and_quantization_are_refused(ckpt, model):
    with pytest.raises(ValueError, match="tensor_parallel_size is 2.*tensor_parallel_size=1"):
        LlavaForConditionalGeneration(model.cfg, TPGroup(rank=0, size=2))
    with pytest.raises(ValueError, match="pipeline_parallel_size is 2.*pipeline_parallel_size=1"):
        LlavaForConditionalGeneration(model.cfg, pp=PPStage(rank=0, size=2, start_layer=0, end_layer=1))
    with pytest.raises(ValueError, match="quantization='int8'.*LLaVA"):
        load_model(ckpt, model.cfg, torch.float32, CPU, quantization="int8")
