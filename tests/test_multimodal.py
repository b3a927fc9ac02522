"""Images through the whole engine (issue 45), against Hugging Face transformers' LlavaForConditionalGeneration on the
same random weights (tests/llava_checkpoint.py): greedy tokens over 32 steps with 0, 1 and 2 images, with chunked
prefill cutting through the image tokens and with preemption; the encoder runs once per distinct image; different
images never share a KV block; a failed step leaves the encoder cache consistent; bad input is refused by name.
The logits-level checks are tests/test_llava_model.py's; the scheduler-level ones tests/test_encoder_cache.py's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from llava_checkpoint import make_tiny_llava
from minivllm import LLM, SamplingParams

pytestmark = pytest.mark.slow
MAX_TOKENS = 32
RED, BLUE = Image.new("RGB", (32, 32), (255, 0, 0)), Image.new("RGB", (32, 32), (0, 0, 255))
NOISE = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 48, 3), dtype=np.uint8))
PROMPTS = [("USER: <image>\nWhat is in the image? ASSISTANT:", [RED]),
           ("USER: <image>\nWhat is in the image? ASSISTANT:", [BLUE]),
           ("USER: <image> and <image>, compare them. ASSISTANT:", [NOISE, RED]),
           ("USER: What is the capital of France? ASSISTANT:", [])]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="module")
def hf_tokens(ckpt):
    """Hugging Face's greedy tokens for each of PROMPTS (the oracle)."""
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(ckpt)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    out = []
    for text, images in PROMPTS:
        batch = processor(text=text, images=images or None, return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**batch, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(ids[0, batch["input_ids"].shape[1]:].tolist())
    return out


def as_prompt(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def generate(llm, prompts=PROMPTS, **kw):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)
    return llm.generate([as_prompt(t, ims) for t, ims in prompts], params, use_tqdm=False)


def test_greedy_tokens_equal_hf_with_0_1_2_images_with_chunks_cutting_through_the_images(ckpt, hf_tokens):
    llm = LLM(model=str(ckpt), long_prefill_token_threshold=7, num_kv_blocks=64, limit_mm_per_prompt={"image": 2})
    engine = llm.llm_engine
    with engine.record_traces() as traces:
        outs = generate(llm)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    assert hf_tokens[0] != hf_tokens[1]                   # the image decides the answer: it reached the model
    # 7-token chunks through 16-token images: every image was computed over several steps, and encoded once
    assert {o.prompt_token_ids.count(49152) for o in outs} == {0, 16, 32}
    assert engine.model_runner.encoder_runner.num_images_encoded == 3       # RED twice, BLUE, NOISE: 3 distinct
    assert engine.scheduler.encoder_cache_manager.num_encoder_inputs_scheduled == 3
    assert max(t.num_prefill_tokens for t in traces) <= 7 * len(PROMPTS)
    engine.check_integrity()
    stats = engine.get_stats()        # the live view's encoder cache line
    assert (stats.encoder_cache_size, stats.num_encoder_inputs_scheduled, stats.num_encoder_outputs_kept) == (
        engine.config.max_num_batched_tokens, 3, 3)
    assert stats.encoder_cache_used == 3 * 16
    from minivllm.engine.stats import EngineSnapshot
    from minivllm.entrypoints.dashboard import render_stats
    snap = EngineSnapshot.__new__(EngineSnapshot)
    for name, value in dict(stats=stats, queues=engine.get_queues(), recent_traces=(), paused=False, loop_alive=True,
                            num_requests=0, finished={}).items():
        object.__setattr__(snap, name, value)
    assert f"48 / {stats.encoder_cache_size} rows (3 images kept); images encoded so far 3" in render_stats(snap)


def test_preemption_with_images_gives_the_same_tokens(ckpt, hf_tokens):
    # 10 blocks of 16 tokens for 4 requests of ~30-45 + 32 tokens: they cannot all hold their KV at once
    llm = LLM(model=str(ckpt), num_kv_blocks=10, limit_mm_per_prompt={"image": 2})
    outs = generate(llm)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    llm.llm_engine.check_integrity()


def test_equal_images_share_the_encoder_and_their_blocks_and_different_images_share_no_block(ckpt):
    llm = LLM(model=str(ckpt), num_kv_blocks=64)
    text = PROMPTS[0][0]
    first = generate(llm, [(text, [RED])])[0]
    same = generate(llm, [(text, [RED])])[0]
    other = generate(llm, [(text, [BLUE])])[0]
    assert first.num_cached_tokens == 0
    assert same.num_cached_tokens == (len(same.prompt_token_ids) - 1) // 16 * 16     # every full block
    assert other.num_cached_tokens == 0          # block 0 already holds image tokens: another image, another key
    assert llm.llm_engine.model_runner.encoder_runner.num_images_encoded == 2
    assert same.outputs[0].token_ids == first.outputs[0].token_ids != other.outputs[0].token_ids


def test_n_samples_and_a_failed_step_keep_the_encoder_cache_consistent(ckpt, hf_tokens, monkeypatch):
    llm = LLM(model=str(ckpt), long_prefill_token_threshold=5, num_kv_blocks=64, limit_mm_per_prompt={"image": 2})
    engine = llm.llm_engine
    runner = engine.model_runner
    real, calls = runner.execute_model, {"n": 0}

    def flaky(mi, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] in (2, 5):                 # mid-prefill, after the first image was encoded
            raise RuntimeError("injected")
        return real(mi, *args, **kwargs)
    monkeypatch.setattr(runner, "execute_model", flaky)
    for text, images in PROMPTS[:3]:
        engine.add_request(as_prompt(text, images), SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                  ignore_eos=True, n=2))
    outs, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            for out in engine.step():
                outs[out.request_id] = out
        except RuntimeError:
            failures += 1
        engine.check_integrity()                 # the encoder cache's invariants included
    assert failures == 2
    for i, out in enumerate(outs[str(i)] for i in range(3)):
        assert [c.token_ids for c in out.outputs] == [hf_tokens[i]] * 2


def test_bad_image_input_is_refused_by_name(ckpt, llm):
    vlm = LLM(model=str(ckpt), num_kv_blocks=16, limit_mm_per_prompt={"image": 1})
    params = SamplingParams(temperature=0, max_tokens=2)
    cases = [({"prompt": "<image> <image>", "multi_modal_data": {"image": [RED]}}, "2 image placeholder"),
             ({"prompt": "<image> <image>", "multi_modal_data": {"image": [RED, BLUE]}}, "limit_mm_per_prompt"),
             ({"prompt": "<image>", "multi_modal_data": {"image": "data:image/png;base64,%%%"}}, "base64"),
             ({"prompt": "<image>", "multi_modal_data": {"image": "https://example.com/a.png"}}, "network"),
             ({"prompt": "<image>", "multi_modal_data": {"image": "/etc/hostname"}}, "allowed_local_media_path"),
             ({"prompt": "<image>", "multi_modal_data": {"video": [RED]}}, "'image' only"),
             ("text with <image> but no image", "0 image(s)")]
    for prompt, words in cases:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            vlm.generate(prompt, params, use_tqdm=False)
    assert not vlm.llm_engine.has_unfinished_requests()
    folder = ckpt / "images"
    folder.mkdir(exist_ok=True)
    RED.save(folder / "red.png")
    allowed = LLM(model=str(ckpt), num_kv_blocks=16, allowed_local_media_path=str(folder))
    by_file = allowed.generate({"prompt": "<image>", "multi_modal_data": {"image": f"file://{folder}/red.png"}},
                               params, use_tqdm=False)[0]
    by_pil = allowed.generate({"prompt": "<image>", "multi_modal_data": {"image": RED}}, params, use_tqdm=False)[0]
    assert by_file.outputs[0].token_ids == by_pil.outputs[0].token_ids
    with pytest.raises(ValueError, match="outside allowed_local_media_path"):
        allowed.generate({"prompt": "<image>", "multi_modal_data": {"image": str(ckpt / "config.json")}}, params)
    with pytest.raises(ValueError, match="takes text only"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": RED}}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="encoder_cache_size is 8 tokens, below one image's 16"):
        LLM(model=str(ckpt), num_kv_blocks=16, encoder_cache_size=8)
