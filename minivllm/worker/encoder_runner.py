"""The worker's side of images (vLLM v1's `_execute_mm_encoder` and `_gather_mm_embeddings` in its model runner).

Owns: the encoder outputs themselves (mm_hash -> (rows, hidden) tensor), kept for as long as the scheduler's
EncoderCacheManager counts them, and putting their rows into a step's input embeddings. The scheduler decides
everything (which images to encode, which outputs to drop); this only does it, in that order:

    1. drop    outputs the scheduler evicted in earlier steps (MultiModalBatch.free)
    2. encode  this step's new images, all in one call of the vision encoder (MultiModalBatch.encode)
    3. gather  embed the step's tokens, then overwrite the rows of image tokens with their encoder rows:
               a span (row, mm_hash, first, n) is rows [row, row + n) <- output[mm_hash][first:first + n],
               so a prefill chunk that cuts an image in two takes the rows of its part only
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minivllm.core.request import Request


@dataclass
class MultiModalBatch:
    """One step's image work, sent in ModelInput.mm (plain data)."""
    free: list[str] = field(default_factory=list)
    encode: list = field(default_factory=list)                        # MultiModalFeature
    spans: list[tuple[int, str, int, int]] = field(default_factory=list)


def image_spans(req: Request, start: int, end: int, first_row: int) -> list[tuple[int, str, int, int]]:
    """The spans of the request's image tokens among its positions [start, end), which are the flat batch's rows
    from `first_row` on."""
    spans = []
    for f in req.mm_features:
        if f.overlaps(start, end):
            lo, hi = max(start, f.offset), min(end, f.end)
            spans.append((first_row + lo - start, f.mm_hash, lo - f.offset, hi - lo))
    return spans


class EncoderRunner:
    def __init__(self, model):
        self.model = model
        self.outputs: dict[str, torch.Tensor] = {}
        self.num_images_encoded = 0         # encoder runs, one per image: equal images in flight share one

    @torch.inference_mode()
    def run(self, mm: MultiModalBatch) -> bool:
        """Steps 1 and 2; True when the step's tokens include image tokens (then `inputs_embeds`)."""
        for mm_hash in mm.free:
            self.outputs.pop(mm_hash, None)
        if mm.encode:
            param = next(self.model.vision_tower.parameters())
            pixels = torch.stack([f.pixel_values for f in mm.encode]).to(param.device, param.dtype)
            for f, rows in zip(mm.encode, self.model.embed_multimodal(pixels)):   # (images, rows, hidden)
                self.outputs[f.mm_hash] = rows
            self.num_images_encoded += len(mm.encode)
        return bool(mm.spans)

    def inputs_embeds(self, mm: MultiModalBatch, input_ids: torch.Tensor) -> torch.Tensor:
        """Step 3: (num_tokens, hidden) embeddings of the step, image rows from the encoder outputs."""
        embeds = self.model.embed_input_ids(input_ids)
        for row, mm_hash, first, n in mm.spans:
            embeds[row:row + n] = self.outputs[mm_hash][first:first + n]
        return embeds
