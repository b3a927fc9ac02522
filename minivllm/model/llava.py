"""LLaVA: a CLIP vision tower and a two-layer projector in front of the Llama language model (llama.py).

Owns: turning images into embeddings the language model reads in place of a prompt's image placeholder tokens,
and the names of a LLaVA checkpoint's weights. The language model is LlamaForCausalLM itself (this class inherits
its layers, paged-KV forward and LM head), so the runner and the KV cache see a Llama; where a prompt's images go
(which rows hold placeholders, which images a step needs) is the caller's.

    pixel_values (num_images, 3, image_size, image_size)
      -> patch conv + CLS row + positions -> pre_layrnorm                       CLIPVisionEmbeddings
      -> k x [LN -> self-attention -> residual, LN -> MLP -> residual]          CLIPEncoderLayer (k: vision_feature_layer)
      -> drop the CLS row ("default") -> linear_1 -> act -> linear_2            LlavaMultiModalProjector
      -> (num_images, num_image_tokens, hidden)                                 embed_multimodal

    input_ids -> embed_input_ids -> image-token rows replaced, in order         merge_multimodal_embeddings
      -> inputs_embeds -> LlamaForCausalLM.forward(..., inputs_embeds=...) -> hidden -> compute_logits

Only one rank runs it (no tensor or pipeline parallelism); post_layernorm and the vision layers after
vision_feature_layer are never built (LLaVA does not use them), and their checkpoint weights are skipped.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model.layers import PPStage, TPGroup
from minivllm.model.llama import LlamaForCausalLM, ModelConfig


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation: x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu, "gelu_new": partial(F.gelu, approximate="tanh"),
               "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


def activation(name: str, field: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"{field} is {name!r}; minivllm's LLaVA supports {', '.join(ACTIVATIONS)}.")
    return ACTIVATIONS[name]


def layers_to_run(feature_layer, num_layers: int) -> int:
    """How many encoder layers give hidden_states[feature_layer] (hidden_states[0]: the embeddings after
    pre_layrnorm, hidden_states[k]: after k layers; -1 is the last layer's output, -2 the one before)."""
    if not isinstance(feature_layer, int) or isinstance(feature_layer, bool):
        raise ValueError(f"vision_feature_layer is {feature_layer!r}; minivllm takes one layer (an int, e.g. -2), "
                         "not a list of layers to concatenate.")
    k = feature_layer if feature_layer >= 0 else num_layers + 1 + feature_layer
    if not 0 <= k <= num_layers:
        raise ValueError(f"vision_feature_layer is {feature_layer}; the vision tower has {num_layers} layers, so it "
                         f"must lie in [{-(num_layers + 1)}, {num_layers}].")
    return k


class CLIPVisionEmbeddings(nn.Module):
    """Patches as tokens: a stride-patch_size convolution (no bias), a learned CLS row first, learned positions."""

    def __init__(self, v: dict):
        super().__init__()
        self.image_size, self.patch_size = v["image_size"], v["patch_size"]
        num_positions = (self.image_size // self.patch_size) ** 2 + 1
        self.class_embedding = nn.Parameter(torch.empty(v["hidden_size"]))
        self.patch_embedding = nn.Conv2d(v["num_channels"], v["hidden_size"], self.patch_size, self.patch_size,
                                         bias=False)
        self.position_embedding = nn.Embedding(num_positions, v["hidden_size"])

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n, _, height, width = pixel_values.shape
        if height != self.image_size or width != self.image_size:
            raise ValueError(f"pixel_values are {height}x{width} images; this vision tower takes "
                             f"{self.image_size}x{self.image_size} (the checkpoint's image processor makes them).")
        patches = self.patch_embedding(pixel_values)                      # (n, hidden, grid, grid)
        patches = patches.flatten(2).transpose(1, 2)                      # (n, grid * grid, hidden)
        cls = self.class_embedding.expand(n, 1, -1)                       # (n, 1, hidden)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight   # (n, 1 + patches, hidden)


class CLIPAttention(nn.Module):
    """Bidirectional multi-head self-attention over one image's tokens (every token sees every other)."""

    def __init__(self, v: dict):
        super().__init__()
        hidden = v["hidden_size"]
        self.num_heads = v["num_attention_heads"]
        self.head_dim = hidden // self.num_heads
        self.scale = self.head_dim ** -0.5
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.v_proj, self.out_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, seq, hidden = x.shape

        def heads(t):                                                     # (n, seq, hidden) -> (n, heads, seq, d)
            return t.view(n, seq, self.num_heads, self.head_dim).transpose(1, 2)
        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        o = F.scaled_dot_product_attention(q, k, v, scale=self.scale)     # (n, heads, seq, d), no mask
        return self.out_proj(o.transpose(1, 2).reshape(n, seq, hidden))


class CLIPMLP(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        self.fc1 = nn.Linear(v["hidden_size"], v["intermediate_size"])
        self.fc2 = nn.Linear(v["intermediate_size"], v["hidden_size"])
        self.act = activation(v["hidden_act"], "vision_config.hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    """Pre-norm: x + attention(layer_norm1(x)), then x + mlp(layer_norm2(x))."""

    def __init__(self, v: dict):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(v["hidden_size"], eps=v["layer_norm_eps"])
        self.self_attn = CLIPAttention(v)
        self.layer_norm2 = nn.LayerNorm(v["hidden_size"], eps=v["layer_norm_eps"])
        self.mlp = CLIPMLP(v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, v: dict, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(v) for _ in range(num_layers))


class CLIPVisionTower(nn.Module):
    """CLIP's vision transformer up to vision_feature_layer: the hidden states LLaVA reads (no post_layernorm)."""

    def __init__(self, v: dict):
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(v)
        self.pre_layrnorm = nn.LayerNorm(v["hidden_size"], eps=v["layer_norm_eps"])   # (sic: CLIP's name)
        self.encoder = CLIPEncoder(v, layers_to_run(v["vision_feature_layer"], v["num_hidden_layers"]))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixel_values))              # (n, 1 + patches, vision hidden)
        for layer in self.encoder.layers:
            x = layer(x)
        return x


class LlavaMultiModalProjector(nn.Module):
    """Vision features into the language model's embedding space: linear_1 -> act -> linear_2."""

    def __init__(self, v: dict, text_hidden: int):
        super().__init__()
        bias = v.get("multimodal_projector_bias", True)
        self.linear_1 = nn.Linear(v["hidden_size"], text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.act = activation(v.get("projector_hidden_act", "gelu"), "projector_hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def split_checkpoint_name(name: str) -> tuple[str, str] | None:
    """(part, name within it) of a LLaVA checkpoint name, part being "text", "vision" or "projector"; None for a
    name outside the three. Both layouts: transformers >= 4.52's (model.language_model.*, lm_head.weight,
    model.vision_tower.*, model.multi_modal_projector.*) and llava-hf's older one (language_model.model.*,
    language_model.lm_head.weight, vision_tower.*, multi_modal_projector.*); the vision tower's names may or may not
    carry CLIPVisionModel's `vision_model.`."""
    name = name.removeprefix("model.")
    if name.startswith("language_model."):
        rest = name[len("language_model."):]
        return "text", rest.removeprefix("model.")         # lm_head.weight stays lm_head.weight
    if name.startswith("lm_head."):
        return "text", name
    if name.startswith("vision_tower."):
        return "vision", name[len("vision_tower."):].removeprefix("vision_model.")
    if name.startswith("multi_modal_projector."):
        return "projector", name[len("multi_modal_projector."):]
    return None


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """A Llama that also embeds images: `embed_multimodal` makes the rows that replace a prompt's image tokens
    (merge_multimodal_embeddings), and `forward(..., inputs_embeds=...)` runs the merged prompt."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup(), pp: PPStage = PPStage()):
        if tp.size > 1:
            raise ValueError(f"tensor_parallel_size is {tp.size}; LLaVA runs on one rank: use "
                             "tensor_parallel_size=1.")
        if pp.size > 1:
            raise ValueError(f"pipeline_parallel_size is {pp.size}; LLaVA runs on one rank: use "
                             "pipeline_parallel_size=1.")
        if cfg.vision is None:
            raise ValueError(f"a {cfg.architecture} config without vision settings (ModelConfig.vision is None); "
                             "load it with ModelConfig.from_dir from a LLaVA checkpoint.")
        super().__init__(cfg, tp, pp)
        self.vision_tower = CLIPVisionTower(cfg.vision)
        self.multi_modal_projector = LlavaMultiModalProjector(cfg.vision, cfg.hidden_size)
        self.image_token_id: int = cfg.vision["image_token_id"]
        self.num_image_tokens: int = cfg.vision["num_image_tokens"]
        self.keep_cls = cfg.vision["vision_feature_select_strategy"] == "full"

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Image embeddings (num_images, num_image_tokens, hidden) in the model's dtype, from pixel_values
        (num_images, 3, image_size, image_size) as the checkpoint's image processor makes them."""
        weight = self.multi_modal_projector.linear_1.weight
        pixel_values = pixel_values.to(device=weight.device, dtype=weight.dtype)
        features = self.vision_tower(pixel_values)                        # (n, 1 + patches, vision hidden)
        if not self.keep_cls:
            features = features[:, 1:]                                    # "default": drop the CLS row
        return self.multi_modal_projector(features)                      # (n, num_image_tokens, hidden)

    def local_name(self, name: str) -> str | None:
        """A checkpoint name as this model's parameter name: the language model's through LlamaForCausalLM's
        rules (the fused q/k/v and gate/up are packed in load_param), the vision tower's and the projector's under
        vision_tower. and multi_modal_projector.; None for a name of neither (or a skipped weight)."""
        split = split_checkpoint_name(name)
        if split is None:
            return None
        part, rest = split
        if part == "text":
            return super().local_name(rest)
        return f"{'vision_tower' if part == 'vision' else 'multi_modal_projector'}.{rest}"

    def load_param(self, name: str, tensor) -> bool:
        """Load one checkpoint tensor; False if the model has no such weight (post_layernorm, vision layers past
        vision_feature_layer). The vision tower's and projector's weights are plain copies: their q/k/v stay
        separate Linear layers."""
        local = self.local_name(name)
        if local is None:
            return False
        if not local.startswith(("vision_tower.", "multi_modal_projector.")):
            return super().load_param(name, tensor)       # the language model: LlamaForCausalLM's packing
        param = dict(self.named_parameters()).get(local)
        if param is None:
            return False
        with torch.no_grad():
            param.copy_(tensor[:])
        return True


def merge_multimodal_embeddings(input_ids: torch.Tensor, inputs_embeds: torch.Tensor, image_embeds: torch.Tensor,
                                image_token_id: int) -> torch.Tensor:
    """inputs_embeds (num_tokens, hidden) with its image-token rows (input_ids == image_token_id) replaced, in order,
    by image_embeds' rows ((num_images, num_image_tokens, hidden) or already flat (rows, hidden)). A count that does
    not match (a prompt whose placeholders do not match its images) is a ValueError."""
    image_embeds = image_embeds.reshape(-1, inputs_embeds.shape[-1])
    mask = input_ids == image_token_id
    n = int(mask.sum())
    if n != image_embeds.shape[0]:
        raise ValueError(f"the prompt has {n} image tokens (id {image_token_id}) but the images give "
                         f"{image_embeds.shape[0]} embedding rows; each image needs exactly its image tokens.")
    out = inputs_embeds.clone()
    out[mask] = image_embeds.to(out.dtype)
    return out
