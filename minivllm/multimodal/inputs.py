r"""MultiModalFeature: one image of a prompt, as the core sees it (vLLM v1's `MultiModalFeatureSpec`).

A LLaVA prompt holds each image as a run of placeholder tokens (the image token id, repeated once per row the
vision encoder produces for it). The core never looks at pixels: it schedules tokens, and an image is the range
[offset, offset + length) of the prompt whose embeddings come from the encoder instead of the token table.

    prompt tokens   [ bos  A  B  <img> <img> ... <img>  C  D ]
                                  \_____ length ______/
                                offset
    mm_hash         sha256 of the pixel values the encoder sees: equal images share an encoder output
                    (encoder cache) and only equal images may share KV blocks (prefix cache)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class MultiModalFeature:
    mm_hash: str                  # identifies the image (hash_pixels)
    offset: int                   # its first placeholder token in the prompt
    length: int                   # placeholder tokens = rows of its encoder output
    pixel_values: torch.Tensor    # (channels, height, width), as the vision encoder takes it

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any of its placeholder tokens is in [start, end)."""
        return self.offset < end and start < self.end

    def __repr__(self) -> str:
        return f"MultiModalFeature({self.mm_hash[:12]}, offset={self.offset}, length={self.length})"


def hash_pixels(pixel_values: torch.Tensor) -> str:
    """A stable name for an image: sha256 over its processed pixels' dtype, shape and bytes."""
    t = pixel_values.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
