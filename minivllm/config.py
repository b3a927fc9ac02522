"""EngineConfig: every engine knob in one slotted dataclass (vLLM spreads these over several configs).

`LLM(**kwargs)` and the CLI filter their arguments through these fields, so a misspelled option is
an error rather than silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None                # a local HF checkpoint directory; None = embedded SmolLM2
    dtype: str = "auto"                     # auto: fp32 on CPU, the checkpoint's dtype (bf16 if fp32) on GPU
    device: str = "auto"                    # auto: cuda if available, else cpu
    block_size: int = 16                    # tokens per KV block
    num_kv_blocks: int | None = None        # None: sized from memory (see model_runner.py)
    kv_cache_memory_gb: float = 1.0         # CPU only, when num_kv_blocks is None
    gpu_memory_utilization: float = 0.9     # CUDA only, when num_kv_blocks is None
    max_num_seqs: int = 256                 # most requests in one step
    max_num_batched_tokens: int = 8192      # token budget of one step (chunked prefill splits longer prompts)
    max_model_len: int | None = None        # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"      # recompute | swap
    swap_space: float = 1.0                 # GiB of CPU memory for swapped-out KV (preemption_mode="swap")
    tensor_parallel_size: int = 1           # ranks; each holds 1/tp of the heads, the MLP and the vocabulary
    distributed_executor_backend: str = "auto"   # auto | uni | mp | external_launcher (see executor.py)
    attention_backend: str = "auto"         # auto | torch | triton
    enforce_eager: bool = False             # CUDA: True runs decode steps eagerly, without CUDA graphs
    seed: int = 0                           # for requests without their own seed

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known ones are {sorted(known)}.")
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} is {value!r}; it must be a positive int.")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks is {self.num_kv_blocks!r}; it must be a positive int or None.")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len is {self.max_model_len!r}; it must be an int >= 2 or None.")
        backends = ("auto", "uni", "mp", "external_launcher")
        if self.distributed_executor_backend not in backends:
            raise ValueError(f"distributed_executor_backend is {self.distributed_executor_backend!r}; "
                             f"choose one of {', '.join(backends)}.")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager is {self.enforce_eager!r}; it must be True or False.")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization is {self.gpu_memory_utilization}; it must be in (0, 1].")
