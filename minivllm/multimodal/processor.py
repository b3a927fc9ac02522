"""Images in, placeholder tokens out (vLLM's multimodal processor, for LLaVA).

Owns: turning what a user passes as an image (a PIL image offline; an OpenAI `image_url` of a data URI, or of a
local file under `allowed_local_media_path`) into the pixel values the vision encoder takes, with the checkpoint's
own image processor (its preprocessor_config.json), and expanding each image's one placeholder token in the prompt
into as many tokens as the encoder gives rows:

    "USER: <image>\nWhat is this?"  ->  [... 49152 ...]  ->  [... 49152 x num_image_tokens ...] + MultiModalFeature

Every error names the value, the limit and the fix; a prompt that fails here was never queued.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from pathlib import Path

from minivllm.multimodal.inputs import MultiModalFeature, hash_pixels

MAX_IMAGE_BYTES = 20 * 2 ** 20          # an encoded image larger than this is refused before it is decoded
MAX_IMAGE_PIXELS = 64 * 2 ** 20         # PIL's decompression-bomb guard, made an error


def load_image(source, field: str = "image", allowed_local_media_path: str | None = None):
    """A PIL RGB image from a PIL image, encoded bytes, a data URI, or a local file path (file:// or plain) that
    lies under `allowed_local_media_path` (None: local files are refused, as vLLM's server does). No network."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if isinstance(source, (bytes, bytearray)):
        return _decode(bytes(source), field)
    if not isinstance(source, str):
        raise ValueError(f"{field} is a {type(source).__name__}; pass a PIL image, a data URI or a local file path.")
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        if not header.startswith("data:image/") or not header.endswith(";base64"):
            raise ValueError(f"{field} is a data URI with header {header[:40]!r}; use data:image/<type>;base64,...")
        if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise ValueError(f"{field} holds {len(payload) * 3 // 4} bytes of image; the limit is {MAX_IMAGE_BYTES} "
                             "bytes. Send a smaller image.")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{field} is a data URI whose payload is not valid base64.") from None
        return _decode(data, field)
    if source.startswith(("http://", "https://")):
        raise ValueError(f"{field} is a URL ({source[:60]}); minivllm fetches nothing from the network. Send the "
                         "image inline as a data URI (data:image/png;base64,...).")
    return _decode(_read_local(source, field, allowed_local_media_path), field)


def _read_local(source: str, field: str, allowed: str | None) -> bytes:
    path = Path(source.removeprefix("file://")).expanduser()
    if allowed is None:
        raise ValueError(f"{field} is a local file ({source[:60]}), and local files are off; start the engine with "
                         "allowed_local_media_path=DIR (--allowed-local-media-path) to read images under DIR.")
    root = Path(allowed).expanduser().resolve()
    resolved = path.resolve()
    if not resolved.is_relative_to(root):
        raise ValueError(f"{field} is {source[:60]}, outside allowed_local_media_path ({root}).")
    if not resolved.is_file():
        raise ValueError(f"{field} is {source[:60]}, which is not a file.")
    if resolved.stat().st_size > MAX_IMAGE_BYTES:
        raise ValueError(f"{field} is a file of {resolved.stat().st_size} bytes; the limit is {MAX_IMAGE_BYTES}.")
    return resolved.read_bytes()


def _decode(data: bytes, field: str):
    from PIL import Image

    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{field} holds {len(data)} bytes of image; the limit is {MAX_IMAGE_BYTES} bytes.")
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.width * im.height > MAX_IMAGE_PIXELS:
                raise ValueError(f"{field} is {im.width}x{im.height} pixels; the limit is {MAX_IMAGE_PIXELS} pixels.")
            return im.convert("RGB")
    except ValueError:
        raise
    except Exception as e:                  # PIL's UnidentifiedImageError, truncated files, bombs
        raise ValueError(f"{field} is not an image PIL can read ({type(e).__name__}: {e}).") from None


class MultiModalProcessor:
    """Pixel values and placeholder expansion for one LLaVA checkpoint."""

    def __init__(self, model_path: Path, vision: dict, limit_mm_per_prompt: dict | None,
                 allowed_local_media_path: str | None = None):
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")      # no torchvision: its PIL fallback is fine
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        self.image_token_id = vision["image_token_id"]
        self.num_image_tokens = vision["num_image_tokens"]
        self.max_images = (limit_mm_per_prompt or {}).get("image", DEFAULT_IMAGE_LIMIT)
        self.allowed_local_media_path = allowed_local_media_path

    def load_image(self, source, field: str):
        return load_image(source, field, self.allowed_local_media_path)

    def process(self, token_ids: list[int], mm_data, field: str = "multi_modal_data"
                ) -> tuple[list[int], tuple[MultiModalFeature, ...]]:
        """The prompt with each image's placeholder expanded, and its images as features (in prompt order)."""
        images = self._images(mm_data, field)
        runs = self._placeholder_runs(token_ids)
        if len(runs) != len(images):
            raise ValueError(f"the prompt has {len(runs)} image placeholder(s) (token {self.image_token_id}) but "
                             f"{len(images)} image(s) were given; put one placeholder in the prompt per image.")
        if not images:
            return list(token_ids), ()
        pixels = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
        out: list[int] = []
        features = []
        pos = 0
        for (start, end), pixel_values in zip(runs, pixels):
            out += token_ids[pos:start]
            features.append(MultiModalFeature(hash_pixels(pixel_values), len(out), self.num_image_tokens,
                                              pixel_values))
            out += [self.image_token_id] * self.num_image_tokens
            pos = end
        return out + token_ids[pos:], tuple(features)

    def _images(self, mm_data, field: str) -> list:
        if not isinstance(mm_data, dict):
            raise ValueError(f"{field} is a {type(mm_data).__name__}; pass {{'image': image or [images]}}.")
        unknown = sorted(set(mm_data) - {"image"})
        if unknown:
            raise ValueError(f"{field} has modality {unknown}; this model takes 'image' only.")
        images = mm_data.get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if len(images) > self.max_images:
            raise ValueError(f"{field} has {len(images)} images; limit_mm_per_prompt allows {self.max_images} per "
                             "prompt. Send fewer images or raise limit_mm_per_prompt={'image': N}.")
        return [self.load_image(im, f"{field}['image'][{i}]") for i, im in enumerate(images)]

    def _placeholder_runs(self, token_ids: list[int]) -> list[tuple[int, int]]:
        """[start, end) of each run of image tokens: one token (to expand) or an already expanded run."""
        runs, i = [], 0
        while i < len(token_ids):
            if token_ids[i] != self.image_token_id:
                i += 1
                continue
            j = i
            while j < len(token_ids) and token_ids[j] == self.image_token_id:
                j += 1
            if j - i not in (1, self.num_image_tokens):
                raise ValueError(f"the prompt has a run of {j - i} image tokens at position {i}; an image is one "
                                 f"placeholder token (or {self.num_image_tokens} already expanded).")
            runs.append((i, j))
            i = j
        return runs


DEFAULT_IMAGE_LIMIT = 4
