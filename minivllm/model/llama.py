"""The Llama family as one compact model: LlamaForCausalLM, Qwen2ForCausalLM (q/k/v bias) and
Qwen3ForCausalLM (RMSNorm on each head's q and k); LLaVA's language model is this Llama too (llava.py).

Owns: the forward pass of one flat batch of tokens (no padding, no batch dimension) through the
decoder, reading and writing the paged KV cache through the attention backend. It does not choose
which tokens run (the scheduler) or where their KV goes (the block manager, via AttentionMetadata).

    input_ids (num_tokens,) -> embed -> 30 x [RMSNorm -> attention -> RMSNorm -> MLP] -> norm
    -> hidden (num_tokens, hidden_size); compute_logits picks the rows that sample.

The layers (layers.py) carry each op's kernels for every platform; how a platform runs them is decided once,
when the weights are loaded (minivllm/platforms/), and never shows here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from minivllm.model.attention import AttentionBackend, AttentionMetadata
from minivllm.model.layers import (MergedColumnParallelLinear, PPStage, ParallelLMHead, QKVParallelLinear, RMSNorm,
                                   RotaryEmbedding, RowParallelLinear, SiluAndMul, TPGroup, VocabParallelEmbedding)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlavaForConditionalGeneration")
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "llava": "LlavaForConditionalGeneration"}
# A multimodal config's settings besides the vision tower's own (the keys of ModelConfig.vision they fill).
_LLAVA_SETTINGS = ("vision_feature_layer", "vision_feature_select_strategy", "projector_hidden_act",
                   "multimodal_projector_bias")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool          # Qwen2
    qk_norm: bool           # Qwen3
    torch_dtype: str
    eos_token_id: tuple[int, ...]
    # A vision-language model's settings (None for a text model), one flat dict: the vision tower's config (CLIP's
    # image_size, patch_size, hidden_size, num_hidden_layers, hidden_act, layer_norm_eps, ...), the LLaVA settings
    # (vision_feature_layer, vision_feature_select_strategy, projector_hidden_act, multimodal_projector_bias),
    # image_token_id (the placeholder token's id) and num_image_tokens (placeholders per image, each an embedding).
    vision: dict | None = field(default=None, hash=False)

    @property
    def is_multimodal(self) -> bool:
        """Whether prompts may carry images: then vision["image_token_id"] marks each image's
        vision["num_image_tokens"] placeholder tokens."""
        return self.vision is not None

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.exists():
            raise FileNotFoundError(f"{path} has no config.json; --model must be a local Hugging Face "
                                    "checkpoint directory (config.json, *.safetensors, tokenizer files).")
        c = json.loads(cfg_file.read_text())
        archs = c.get("architectures") or [_MODEL_TYPE_TO_ARCH.get(c.get("model_type"), str(c.get("model_type")))]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"{path} is a {arch} checkpoint; minivllm supports {', '.join(SUPPORTED_ARCHITECTURES)}.")
        vision, dtype = None, c.get("torch_dtype") or c.get("dtype")
        if arch == "LlavaForConditionalGeneration":
            c, vision = _llava_configs(path)             # c: the language model's (a Llama's) config
        rope = c.get("rope_parameters") or {}          # transformers 5 moved rope_theta here
        rope_scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        heads = c["num_attention_heads"]
        eos = c.get("eos_token_id")
        gen_file = path / "generation_config.json"
        if gen_file.exists():
            eos = json.loads(gen_file.read_text()).get("eos_token_id", eos)
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=c.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(c.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=str(dtype or c.get("torch_dtype") or c.get("dtype") or "float32"),
            eos_token_id=eos,
            vision=vision,
        )


def _llava_configs(path: Path) -> tuple[dict, dict]:
    """A LLaVA checkpoint's (text config, ModelConfig.vision), complete: a saved config.json leaves the nested
    configs' defaults out, so transformers' LlavaConfig parses it (the text models' path never imports it)."""
    from transformers import LlavaConfig

    config = LlavaConfig.from_pretrained(path)
    text, vision = config.text_config.to_dict(), config.vision_config.to_dict()
    if text.get("model_type") != "llama":
        raise ValueError(f"{path} is a LLaVA checkpoint whose language model is {text.get('model_type')!r}; "
                         "minivllm runs LLaVA with a Llama language model (text_config.model_type 'llama') only.")
    if vision.get("model_type") != "clip_vision_model":
        raise ValueError(f"{path} is a LLaVA checkpoint whose vision tower is {vision.get('model_type')!r}; "
                         "minivllm runs LLaVA with a CLIP vision tower (vision_config.model_type "
                         "'clip_vision_model') only.")
    vision.update({key: getattr(config, key) for key in _LLAVA_SETTINGS})
    layer, strategy = vision["vision_feature_layer"], vision["vision_feature_select_strategy"]
    if not isinstance(layer, int):
        raise ValueError(f"{path}: vision_feature_layer is {layer!r}; minivllm takes one layer (an int, e.g. -2), "
                         "not a list of layers to concatenate.")
    if strategy not in ("default", "full"):
        raise ValueError(f"{path}: vision_feature_select_strategy is {strategy!r}; choose 'default' or 'full'.")
    vision["image_token_id"] = config.image_token_id      # older configs call it image_token_index: both read here
    vision["num_image_tokens"] = (vision["image_size"] // vision["patch_size"]) ** 2 + (strategy == "full")
    return text, vision


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.qkv_bias, tp)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, False, tp)
        self.num_heads = cfg.num_attention_heads // tp.size      # this rank's heads
        self.num_kv_heads = cfg.num_key_value_heads // tp.size
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        # An fp8 KV cache's per-layer scales (the cache holds K / k_scale, V / v_scale); set by the model
        # runner's calibration (worker/kv_scales.py) when kv_cache_dtype is fp8, ignored by other caches.
        self.k_scale = 1.0
        self.v_scale = 1.0
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, positions, hidden, kv_cache, meta: AttentionMetadata, backend: AttentionBackend,
                rotary: RotaryEmbedding):
        n = hidden.shape[0]
        qkv = self.qkv_proj(hidden)                                           # (n, (h + 2 * kv_h) * d)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)                          # (n, heads, head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)                       # (n, kv_heads, head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        key_cache, value_cache = kv_cache
        o = backend.forward(q, k, v, key_cache, value_cache, meta, self.scale,
                            self.k_scale, self.v_scale)                       # (n, heads, head_dim)
        return self.o_proj(o.reshape(n, q_size))                              # (n, hidden)


class LlamaMLP(nn.Module):
    """The gated MLP: down(silu(gate(x)) * up(x)), with gate and up as one matmul."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp)
        self.act_fn = SiluAndMul()

    def forward(self, x):
        gate_up = self.gate_up_proj(x)                                        # (n, 2 * intermediate / tp)
        x = self.act_fn(gate_up)                                              # silu(gate) * up: (n, intermediate / tp)
        return self.down_proj(x)                                              # (n, hidden)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, tp)
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, meta, backend, rotary):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, backend, rotary)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fused parameter, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup(), pp: PPStage = PPStage()):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.pp = pp
        # Pipeline parallelism: this stage's layers [start, end); the first stage embeds, the last normalizes and
        # owns the LM head. `self.layers[i]` is decoder layer start + i.
        self.start_layer = pp.start_layer
        self.end_layer = cfg.num_hidden_layers if pp.end_layer is None else pp.end_layer
        if pp.is_first:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, tp) for _ in range(self.start_layer, self.end_layer))
        if pp.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
            if cfg.tie_word_embeddings and pp.is_first:
                self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata, backend: AttentionBackend,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None):
        """The last stage returns hidden (num_tokens, hidden) after the final norm; other stages return
        (hidden, residual), what the next stage takes as `intermediate`. `inputs_embeds` (num_tokens, hidden), on the
        first stage: the embeddings to run instead of input_ids' (a multimodal prompt's, images merged in)."""
        if self.pp.is_first:
            hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (num_tokens, hidden)
            residual = None
        else:
            hidden, residual = intermediate
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, backend, self.rotary)
        if not self.pp.is_last:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings (num_tokens, hidden) of input_ids (num_tokens,), on the first stage."""
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()                                   # (rows, vocab_size) fp32

    def local_name(self, name: str) -> str | None:
        """A checkpoint name as this stage's parameter name (layer index made local), or None if another stage
        owns it. A tied LM head on a last stage that does not embed is loaded from the embedding."""
        name = name.removeprefix("model.")
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return None                     # tied: the head is the embedding (loaded from embed_tokens)
        if name.startswith("layers."):
            index, rest = name[len("layers."):].split(".", 1)
            if not self.start_layer <= int(index) < self.end_layer:
                return None
            return f"layers.{int(index) - self.start_layer}.{rest}"
        if name.startswith("embed_tokens.") and not self.pp.is_first:
            tied_head = self.pp.is_last and self.cfg.tie_word_embeddings
            return name.replace("embed_tokens.", "lm_head.") if tied_head else None
        if name.startswith(("norm.", "lm_head.")) and not self.pp.is_last:
            return None
        return name

    def load_param(self, name: str, tensor) -> bool:
        """Load one checkpoint tensor by its Hugging Face name; False if the model has no such weight.
        `tensor` may be a lazy safetensors slice: sharded layers read only their rows or columns of it.
        copy_ converts to the parameter's dtype and device."""
        name = self.local_name(name)
        if name is None:
            return False                    # another pipeline stage's weight, or a tied head's copy
        shard_id = None
        for piece, (fused, sid) in self.packed_modules.items():
            if f".{piece}." in name:
                name, shard_id = name.replace(piece, fused), sid
                break
        params = dict(self.named_parameters(remove_duplicate=False))
        if name not in params:
            return False
        param = params[name]
        module = self.get_submodule(name.rsplit(".", 1)[0])
        loader = getattr(module, "weight_loader", None)
        with torch.no_grad():
            if loader is not None:
                loader(param, tensor, shard_id)
            else:
                param.copy_(tensor[:])
        return True
