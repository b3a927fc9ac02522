"""Images through the OpenAI chat endpoint and LLM.chat: a real server on the tiny random LLaVA checkpoint
(tests/llava_checkpoint.py), the official `openai` client, and Hugging Face's LlavaForConditionalGeneration on the
same prompt (the model's chat template, rendered by the processor with the same images) as the oracle.

A user message's content is a list of parts; each image part ({"type": "image_url", ...}) becomes the model's
"<image>" placeholder at its place (parts joined with "\\n", chat_utils.py), and its image is decoded by the
server's front end before anything is queued: a bad image is a 400 naming the part (messages[i].content[j])."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from minivllm.config import EngineConfig
from minivllm.entrypoints.api_server import run_server_in_thread
from tests.llava_checkpoint import make_tiny_llava

pytestmark = pytest.mark.slow
MAX_TOKENS = 8
QUESTION = "What is in this image?"
NOISE = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
OTHER = Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 48, 3), dtype=np.uint8))


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_chat(*urls: str, text: str = QUESTION) -> list[dict]:
    """One user message: the images first, then the text (LLaVA-1.5's layout)."""
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def start(config: EngineConfig):
    from app import build_app

    app, async_engine = build_app(config, dashboard=False)
    srv = run_server_in_thread(app)
    srv.engine = async_engine
    return srv


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("tiny-llava-api"))


@pytest.fixture(scope="module")
def server(ckpt):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)         # the engine thread gets one core, the clients and the HTTP loop the other
    srv = start(EngineConfig(model=str(ckpt), num_kv_blocks=16, device="cpu", dtype="float32",
                             limit_mm_per_prompt={"image": 2}))
    yield srv
    srv.stop()
    srv.engine.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def hf_greedy(ckpt):
    """Hugging Face's greedy tokens and prompt length for a one-image chat, rendered by the model's chat template
    with "<image>\\n" in front of the text and expanded by the processor."""
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(ckpt)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()

    def run(image: Image.Image) -> tuple[list[int], int]:
        text = processor.tokenizer.apply_chat_template([{"role": "user", "content": f"<image>\n{QUESTION}"}],
                                                       tokenize=False, add_generation_prompt=True)
        batch = processor(text=text, images=[image], return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**batch, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
        n = batch["input_ids"].shape[1]
        return ids[0, n:].tolist(), n
    return run


def greedy_chat(client, model_name, messages, **kw):
    return client.chat.completions.create(model=model_name, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                          logprobs=True, extra_body={"ignore_eos": True}, **kw)


def test_an_image_part_reaches_the_model_and_answers_as_hugging_face(client, model_name, hf_greedy, ckpt):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    out = greedy_chat(client, model_name, image_chat(data_uri(png(NOISE))))
    want, prompt_len = hf_greedy(NOISE)
    assert out.usage.prompt_tokens == prompt_len              # "<image>" became its 16 rows
    assert out.usage.completion_tokens == MAX_TOKENS
    assert [c.token for c in out.choices[0].logprobs.content] == [tokenizer.decode([t]) for t in want]
    assert out.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
    # another image, another answer: the image decided it
    other = greedy_chat(client, model_name, image_chat(data_uri(png(OTHER))))
    assert other.usage.prompt_tokens == prompt_len
    lps = [[c.logprob for c in o.choices[0].logprobs.content] for o in (out, other)]
    assert other.choices[0].message.content != out.choices[0].message.content or lps[0] != lps[1]


def test_a_streamed_answer_with_an_image_adds_up_to_the_whole_one(client, model_name):
    messages = image_chat(data_uri(png(NOISE)), "data:image/png;base64," + base64.b64encode(png(OTHER)).decode(),
                          text="Compare them.")
    whole = greedy_chat(client, model_name, messages)
    stream = client.chat.completions.create(model=model_name, messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        pieces += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == whole.choices[0].message.content
    assert usage.prompt_tokens == whole.usage.prompt_tokens and usage.completion_tokens == MAX_TOKENS


def test_without_max_tokens_the_answer_fills_the_kv_pool_that_the_images_rows_leave(client, model_name, server):
    # 16 blocks of 16 tokens: the default length counts both images' 16 rows each, not their one placeholder each
    out = client.chat.completions.create(model=model_name, temperature=0, extra_body={"ignore_eos": True},
                                         messages=image_chat(data_uri(png(NOISE)), data_uri(png(OTHER))))
    assert out.usage.total_tokens == server.engine.max_request_tokens
    assert out.choices[0].finish_reason == "length"


def bad_image_cases(tmp_png: str) -> list[tuple[str, list, str]]:
    """(case, content parts after the text, the part the 400 must name)."""
    garbage = b"\x89PNG\r\n\x1a\n" + bytes(np.random.default_rng(2).integers(0, 256, 200, dtype=np.uint8))
    url = lambda u: {"type": "image_url", "image_url": {"url": u}}     # noqa: E731
    ok = url(data_uri(png(NOISE)))
    return [("bad_base64", [url("data:image/png;base64,@@not*base64@@")], "messages[0].content[1]"),
            ("png_header_then_garbage", [url(data_uri(garbage))], "messages[0].content[1]"),
            ("wrong_data_uri_header", [url(data_uri(png(NOISE), mime="text/plain"))], "messages[0].content[1]"),
            ("http_url", [url("http://example.com/cat.png")], "messages[0].content[1]"),
            ("https_url_as_a_string", [{"type": "image_url", "image_url": "https://example.com/cat.png"}],
             "messages[0].content[1]"),
            ("local_file_without_allowed_local_media_path", [url("file://" + tmp_png)], "messages[0].content[1]"),
            ("plain_local_path", [ok, url(tmp_png)], "messages[0].content[2]"),
            ("three_images_over_the_limit_of_two", [ok, ok, ok], "messages[0].content[3]"),
            ("url_not_a_string", [{"type": "image_url", "image_url": {"url": 5}}], "messages[0].content[1]")]


def test_bad_images_are_a_400_naming_the_part_and_nothing_is_queued(server, model_name, tmp_path):
    (tmp_path / "cat.png").write_bytes(png(NOISE))
    for case, parts, param in bad_image_cases(str(tmp_path / "cat.png")):
        body = {"model": model_name, "max_tokens": 2,
                "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}] + parts}]}
        r = httpx.post(f"{server.url}/v1/chat/completions", content=json.dumps(body),
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, (case, r.text)
        error = r.json()["error"]
        assert error["param"] == param and param in error["message"], (case, error)
        assert error["type"] == "invalid_request_error"
    assert server.engine.snapshot().num_requests == 0
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_the_openai_client_gets_bad_request_for_a_network_image(client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, max_tokens=2,
                                       messages=image_chat("https://example.com/cat.png"))
    assert "network" in info.value.message and "messages[0].content[0]" in info.value.message


def test_an_image_part_to_a_text_only_model_is_a_400_naming_the_part():
    srv = start(EngineConfig(num_kv_blocks=8, device="cpu", dtype="float32"))
    try:
        body = {"messages": [{"role": "user", "content": [
            {"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": data_uri(png(NOISE))}}]}]}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "messages[0].content[1]" in error["message"] and "text only" in error["message"]
        assert error["param"] == "messages[0].content"
    finally:
        srv.stop()
        srv.engine.shutdown()


def test_offline_chat_with_an_image_equals_the_server_and_hugging_face(client, model_name, ckpt, hf_greedy,
                                                                         tmp_path):
    from minivllm import LLM, SamplingParams

    (tmp_path / "noise.png").write_bytes(png(NOISE))
    llm = LLM(model=str(ckpt), num_kv_blocks=16, limit_mm_per_prompt={"image": 2},
              allowed_local_media_path=str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    served = greedy_chat(client, model_name, image_chat(data_uri(png(NOISE)))).choices[0].message.content
    pil_part = [{"role": "user", "content": [{"type": "image_pil", "image_pil": NOISE},
                                             {"type": "text", "text": QUESTION}]}]
    outs = llm.chat([image_chat(data_uri(png(NOISE))), image_chat("file://" + str(tmp_path / "noise.png")),
                     pil_part], params, use_tqdm=False)
    want, prompt_len = hf_greedy(NOISE)
    for out in outs:
        assert out.outputs[0].token_ids == want and len(out.prompt_token_ids) == prompt_len
        assert out.outputs[0].text == served
    with pytest.raises(ValueError, match=r"conversation 0: messages\[0\]\.content\[0\].*network"):
        llm.chat(image_chat("http://example.com/cat.png"), params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[2\].*limit_mm_per_prompt"):
        llm.chat(image_chat(*[data_uri(png(NOISE))] * 3), params, use_tqdm=False)
