"""EngineConfig: every engine option in one slotted dataclass, and the command-line flags made from it.

Owns: each option's name, default, help text and allowed values, and the checks on them (`validate`).
Everything that builds an engine goes through here, so an option is written once and a misspelled one
is an error rather than silently ignored:

    LLM(max_num_seqs=8), AsyncLLMEngine.from_engine_args(...)   -> EngineConfig.from_kwargs(...)
    python -m minivllm.generate / app.py / -m minivllm.bench     -> add_engine_args(parser)
                                                                     EngineConfig.from_cli_args(args)

A field becomes a flag by its name and type: `max_num_seqs: int` -> `--max-num-seqs N`; `int | None`
-> an int flag whose absence means None; a bool that defaults to False -> `--enforce-eager`; a bool
that defaults to True, or a `bool | None` that defaults to None (the engine decides) -> a pair, as vLLM's
argparse makes them: `--enable-chunked-prefill` / `--no-enable-chunked-prefill`.
vLLM spreads these options over several config classes and EngineArgs; minivllm keeps one.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from minivllm.core.sampling_params import MAX_LOGPROBS
from minivllm.spec_decode.config import SpeculativeConfig      # speculative_config's keys (also minivllm.config's)


# On 2 cores a 96-token chunk at 8,000 tokens of context takes 1.4 s (fp32): the longest wait it gives other streams
# (`python -m minivllm.bench long-prompt`; docs/benchmarks.md).
CPU_LONG_PREFILL_TOKEN_THRESHOLD = 96


def option(default, help: str, choices: tuple[str, ...] | None = None):
    """A field with its help text (and, for the command line, its allowed values)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(slots=True)
class EngineConfig:
    model: str | None = option(
        None, "a local Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files); "
        "default: the embedded SmolLM2-135M-Instruct")
    dtype: str = option(
        "auto", "weight and KV cache dtype; auto: float32 on a CPU, the checkpoint's dtype on a GPU "
        "(bfloat16 if the checkpoint is float32)", ("auto", "float32", "float16", "bfloat16"))
    quantization: str | None = option(
        None, "CPU: quantization of the linear layers and LM head (platforms/cpu/quantization.py). Weight-only: int8 "
        "(per channel), int4 (groups of 32), gguf (int4 from a Q4_1-derived checkpoint's own blocks, such as the "
        "embedded default model's), faster at small batches; w8a8_int8: int8 weights and int8 activations per "
        "token, w4a8_int8: int4 weights and int8 activations per group of 32 (integer dot products, AVX-512 "
        "VNNI), faster than bf16 at every batch size and in prefill, at some quality",
        ("int8", "int4", "gguf", "w8a8_int8", "w4a8_int8"))
    kv_cache_dtype: str = option(
        "auto", "KV cache dtype; auto: the model's dtype; fp8 (alias fp8_e4m3): e4m3 with a per-layer scale for K "
        "and one for V, calibrated at load (half of bf16's KV bytes, a quarter of fp32's)",
        ("auto", "fp8", "fp8_e4m3"))
    device: str = option("auto", "auto: cuda if torch sees a GPU, else cpu; or cpu, cuda, cuda:N")
    block_size: int = option(16, "tokens per KV block")
    num_kv_blocks: int | None = option(
        None, "KV blocks in the pool; default: sized from memory (kv_cache_memory_gb on a CPU, "
        "gpu_memory_utilization on CUDA)")
    kv_cache_memory_gb: float = option(1.0, "CPU: GiB for the KV cache when num_kv_blocks is not given")
    gpu_memory_utilization: float = option(
        0.9, "CUDA: the fraction of free GPU memory for the KV cache when num_kv_blocks is not given")
    max_num_seqs: int = option(256, "most requests in one step")
    max_num_batched_tokens: int = option(
        8192, "token budget of one step (longer prompts are split across steps: chunked prefill); "
        "at least max_num_seqs")
    enable_chunked_prefill: bool = option(
        True, "split a prompt that does not fit in what is left of a step's budget across steps, between other "
        "requests' decodes (chunked prefill, vLLM's option); off: a prompt's uncached tokens run whole in one step "
        "or it waits, and max_num_batched_tokens must be at least max_model_len")
    long_prefill_token_threshold: int | None = option(
        None, "most tokens one request's prefill computes in a step, so a long prompt is prefilled in chunks "
        "between other requests' decodes (vLLM's name; 0: no cap; as in vLLM it also caps a decode's 1 + speculative "
        "drafts); default: 0 on a GPU, "
        "CPU_LONG_PREFILL_TOKEN_THRESHOLD on a CPU, where a step of a long chunk would stall every stream")
    max_model_len: int | None = option(
        None, "longest prompt + output in tokens; default: the model's max_position_embeddings")
    enable_prefix_caching: bool = option(
        True, "share the KV blocks of common prompt prefixes across requests (the older --no-prefix-caching also "
        "turns it off)")
    preemption_mode: str = option(
        "recompute", "when KV blocks run out, a preempted request's KV is recomputed later, or swapped to "
        "a CPU pool", ("recompute", "swap"))
    swap_space: float = option(1.0, "GiB of CPU memory for swapped-out KV blocks (preemption_mode swap)")
    tensor_parallel_size: int = option(1, "ranks; each holds 1/tp of the heads, the MLP and the vocabulary")
    pipeline_parallel_size: int = option(
        1, "pipeline stages; each holds a contiguous slice of the layers (and its TP ranks); "
        "VLLM_PP_LAYER_PARTITION=\"a,b,...\" sets the layers per stage")
    data_parallel_size: int = option(
        1, "engine replicas, each in its own process with the whole model (and its own TP/PP ranks); app.py serves "
        "them behind one OpenAI server that routes each request to the least-loaded one (entrypoints/dp_router.py)")
    data_parallel_backend: str = option(
        "mp", "how data-parallel replicas start: mp (processes on this machine) or ray (Ray actors on a local cluster "
        "or the one RAY_ADDRESS names)", ("mp", "ray"))
    max_concurrent_batches: int | None = option(
        None, "pipeline parallelism: batches in flight at once (the engine schedules the next batch while earlier "
        "ones are in later stages, as vLLM v1's batch queue); default pipeline_parallel_size; 1 sends one batch "
        "through the stages at a time")
    distributed_executor_backend: str = option(
        "auto", "how the ranks start (worker/executor.py): auto, uni (one rank), mp (worker processes), "
        "external_launcher (torchrun), ray (Ray actors placed by a placement group; worker/ray_executor.py)",
        ("auto", "uni", "mp", "external_launcher", "ray"))
    attention_backend: str = option(
        "auto", "auto: triton on CUDA; on a CPU cpu (C++ decode attention, built on first use) when a C++ compiler "
        "is there, else torch (the PyTorch reference)", ("auto", "torch", "triton", "cpu"))
    enforce_eager: bool = option(False, "CUDA: run decode steps eagerly, without CUDA graphs")
    async_scheduling: bool | None = option(
        None, "schedule the next batch while the device runs this one: its sampled tokens stay on the device and "
        "become the next batch's inputs, so the host's work overlaps the GPU's (as vLLM's --async-scheduling); "
        "one rank, no speculative decoding. Unset (the default, as in vLLM): on where it works and pays, CUDA with "
        "one rank and no speculative decoding; off on a CPU, which runs the forward in the host's own thread")
    seed: int = option(0, "seed of the sampler for requests without a seed of their own")
    max_logprobs: int = option(
        MAX_LOGPROBS, "most logprobs a request may ask for per token (logprobs, prompt_logprobs; the API's "
        "top_logprobs), as vLLM's; -1: no limit, and a request's -1 returns the whole vocabulary at each position")
    disable_log_stats: bool = option(
        False, "keep no per-request histograms (vLLM's request and iteration histograms on /metrics), as vLLM's "
        "--disable-log-stats; the offline LLM sets it unless given, as vLLM's LLM does")
    speculative_config: dict | None = option(
        None, "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4} or {\"model\": PATH, \"num_speculative_tokens\": 4} "
        "(a draft model; \"draft_num_layers\": N keeps its first N layers)")
    limit_mm_per_prompt: dict | None = option(
        None, "vision-language models: most images in one prompt, as vLLM's JSON {\"image\": N}; default 4")
    encoder_cache_size: int = option(
        0, "vision-language models: rows of image encoder output kept for the requests that need them (one row per "
        "image placeholder token); 0: max_num_batched_tokens, and never less than one image (vLLM's rule)")
    allowed_local_media_path: str | None = option(
        None, "vision-language models: a directory whose image files requests may name (file://...); default: none")
    kv_events_config: dict | None = option(
        None, "KV cache events for a router, as vLLM's JSON (engine/kv_events.py): {\"enable_kv_cache_events\": "
        "true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"topic\": \"\"}")
    kv_transfer_config: dict | None = option(
        None, "prefill/decode disaggregation, as vLLM's JSON (kv_transfer/): {\"kv_connector\": "
        "\"SharedStorageConnector\", \"kv_role\": \"kv_both\", \"kv_connector_extra_config\": "
        "{\"shared_storage_path\": DIR}} or {\"kv_connector\": \"TCPConnector\", \"kv_role\": \"kv_consumer\", "
        "\"kv_port\": 14579} (the producer: \"kv_producer\" and the consumer's kv_ip and kv_port); one rank")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known ones are {sorted(known)}.")
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        """The config that flags made by `add_engine_args` ask for, checked.

        A field missing from `args` (the command excluded it) or None there keeps its default: so a
        command may own a flag of a field's name, as generate's `--seed` (default None) does."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}
        return cls.from_kwargs(**given)

    def validate(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} is {value!r}; it must be a positive int.")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks is {self.num_kv_blocks!r}; it must be a positive int or None.")
        if self.max_concurrent_batches is not None:
            if not isinstance(self.max_concurrent_batches, int) or self.max_concurrent_batches < 1:
                raise ValueError(f"max_concurrent_batches is {self.max_concurrent_batches!r}; it must be a positive "
                                 "int or None (None: one per pipeline stage).")
            if self.max_concurrent_batches > 1 and self.pipeline_parallel_size == 1:
                raise ValueError(f"max_concurrent_batches is {self.max_concurrent_batches} but pipeline_parallel_size "
                                 "is 1: batches overlap only across pipeline stages. Raise pipeline_parallel_size or "
                                 "leave max_concurrent_batches unset.")
        threshold = self.long_prefill_token_threshold
        if threshold is not None and (not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0):
            raise ValueError(f"long_prefill_token_threshold is {threshold!r}; it must be an int >= 0 (0: no cap) or "
                             "None (the platform's default).")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len is {self.max_model_len!r}; it must be an int >= 2 or None.")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # As vLLM: a step must be able to give each of max_num_seqs running requests its decode token.
            raise ValueError(f"max_num_batched_tokens is {self.max_num_batched_tokens}, below max_num_seqs "
                             f"({self.max_num_seqs}): a step could not give every running request a token. "
                             f"Raise max_num_batched_tokens to at least {self.max_num_seqs} or lower "
                             f"max_num_seqs to at most {self.max_num_batched_tokens}.")
        if self.quantization is not None and self.quantization not in choices_of("quantization"):
            raise ValueError(f"quantization is {self.quantization!r}; choose one of "
                             f"{', '.join(choices_of('quantization'))}, or leave it unset (None) for full weights.")
        for name in ("kv_cache_dtype", "data_parallel_backend", "distributed_executor_backend"):
            if getattr(self, name) not in choices_of(name):
                raise ValueError(f"{name} is {getattr(self, name)!r}; choose one of {', '.join(choices_of(name))}.")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs is {self.max_logprobs!r}; it must be an int >= 0, or -1 (no limit).")
        for name in ("enforce_eager", "disable_log_stats"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} is {getattr(self, name)!r}; it must be True or False.")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling is {self.async_scheduling!r}; it must be True or False, or None "
                             "(unset: on where it works and pays, see async_scheduling_on).")
        if self.async_scheduling:
            if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
                raise ValueError(f"async_scheduling with tensor_parallel_size {self.tensor_parallel_size} and "
                                 f"pipeline_parallel_size {self.pipeline_parallel_size} is not implemented: the next "
                                 "batch's input tokens stay on rank 0's device. Use one rank (both 1), or turn "
                                 "async_scheduling off (pipeline stages already overlap with max_concurrent_batches).")
            if self.speculative_config is not None:
                raise ValueError("async_scheduling with speculative_config is not implemented (the next step's drafts "
                                 "need this step's tokens on the host); turn one of them off.")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization is {self.gpu_memory_utilization}; it must be in (0, 1].")
        if self.speculative_config is not None:
            spec = SpeculativeConfig.from_dict(self.speculative_config)   # raises, naming the key, if it is wrong
            if spec.method == "draft_model" and self.pipeline_parallel_size > 1:
                raise ValueError("speculative_config method 'draft_model' with pipeline_parallel_size > 1 is not "
                                 "implemented (the draft runs beside the first stage); use 'ngram'.")

        if self.kv_events_config is not None:
            from minivllm.engine.kv_events import KVEventsConfig
            KVEventsConfig.from_dict(self.kv_events_config)               # raises, naming the key, if it is wrong
        from minivllm.multimodal import check_multimodal_args
        check_multimodal_args(self.limit_mm_per_prompt, self.encoder_cache_size)
        if self.kv_transfer_config is not None:
            KVTransferConfig.from_dict(self.kv_transfer_config)           # raises, naming the key, if it is wrong
            if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
                raise ValueError("kv_transfer_config with tensor_parallel_size or pipeline_parallel_size > 1 is not "
                                 "implemented (blocks move between single-rank instances); use one rank per instance.")
        self._check_chunked_prefill()

    def _check_chunked_prefill(self) -> None:
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill is {self.enable_chunked_prefill!r}; it must be True or False.")
        if not self.enable_chunked_prefill and self.long_prefill_token_threshold:
            raise ValueError(f"long_prefill_token_threshold is {self.long_prefill_token_threshold} but "
                             "enable_chunked_prefill is False: the threshold caps prefill chunks, and with chunked "
                             "prefill off a prompt runs whole. Leave long_prefill_token_threshold unset (or 0), or "
                             "turn chunked prefill on.")
        if self.max_model_len is not None:
            self.check_max_model_len(self.max_model_len)

    def max_model_len_for(self, max_position_embeddings: int) -> int:
        """max_model_len for a model with this many positions (the option, or all of them), checked."""
        max_model_len = self.max_model_len or max_position_embeddings
        if max_model_len > max_position_embeddings:
            raise ValueError(f"max_model_len is {max_model_len}, above the model's max_position_embeddings of "
                             f"{max_position_embeddings}.")
        self.check_max_model_len(max_model_len)
        return max_model_len

    def check_max_model_len(self, max_model_len: int) -> None:
        """With chunked prefill off a prompt runs whole in one step, so the step's token budget, and a vision-language
        model's encoder cache (its images are encoded in that step), must hold the longest one (vLLM's rule too)."""
        if self.enable_chunked_prefill:
            return
        for name in ("max_num_batched_tokens", "encoder_cache_size"):
            value = getattr(self, name)
            if value < max_model_len and (value or name == "max_num_batched_tokens"):   # encoder cache 0: the budget
                raise ValueError(f"{name} is {value}, below max_model_len ({max_model_len}), and "
                                 "enable_chunked_prefill is False: a prompt runs whole in one step, so a longer one "
                                 f"could never run. Raise {name} to at least {max_model_len}, lower max_model_len to "
                                 f"{value}, or turn chunked prefill on.")

    def long_prefill_token_threshold_on(self, device_type: str) -> int:
        """The option when it is set; unset, CPU_LONG_PREFILL_TOKEN_THRESHOLD on a CPU (docs/benchmarks.md has the
        inter-token latency it keeps while a long prompt arrives) and 0 (no cap) elsewhere, and always 0 with chunked
        prefill off (a prompt runs whole)."""
        if not self.enable_chunked_prefill:
            return 0
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        return CPU_LONG_PREFILL_TOKEN_THRESHOLD if device_type == "cpu" else 0

    def async_scheduling_on(self, device_type: str) -> bool:
        """Whether the engine schedules ahead: the option when it is set; unset, vLLM's rule (on unless something
        cannot use it) with one more case: off on a CPU, where the forward runs in the host's own thread and there
        is nothing to overlap (docs/benchmarks.md has both platforms' measurements)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        one_process = (self.tensor_parallel_size == self.pipeline_parallel_size == 1
                       and self.distributed_executor_backend in ("auto", "uni"))
        return device_type == "cuda" and one_process and self.speculative_config is None

    @property
    def kv_transfer(self) -> "KVTransferConfig | None":
        return None if self.kv_transfer_config is None else KVTransferConfig.from_dict(self.kv_transfer_config)

    @property
    def speculative(self) -> "SpeculativeConfig | None":
        return None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)


@dataclass(frozen=True)
class KVTransferConfig:
    """Which connector moves KV between instances, and this instance's part (vLLM's `KVTransferConfig` keys)."""
    kv_connector: str
    kv_role: str                          # kv_producer: saves prompts' KV; kv_consumer: loads it; kv_both: both
    kv_ip: str = "127.0.0.1"              # TCPConnector: the consumer's address (it listens there)
    kv_port: int = 14579                  # TCPConnector: the consumer's port (0: any free one)
    kv_buffer_size: int = 10 ** 9         # TCPConnector: bytes of received blocks a consumer keeps
    kv_connector_extra_config: dict = field(default_factory=dict)   # SharedStorageConnector: shared_storage_path

    @classmethod
    def from_dict(cls, d: dict) -> "KVTransferConfig":
        if not isinstance(d, dict):
            raise ValueError(f"kv_transfer_config is {d!r}; it must be a dict (vLLM's JSON), e.g. "
                             '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", '
                             '"kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}.')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown key(s) {unknown}; known ones are {sorted(known)}.")
        connectors = ("SharedStorageConnector", "TCPConnector")
        if d.get("kv_connector") not in connectors:
            raise ValueError(f"kv_transfer_config kv_connector is {d.get('kv_connector')!r}; choose one of "
                             f"{', '.join(connectors)}.")
        roles = ("kv_producer", "kv_consumer", "kv_both") if d["kv_connector"] == "SharedStorageConnector" \
            else ("kv_producer", "kv_consumer")
        if d.get("kv_role") not in roles:
            raise ValueError(f"kv_transfer_config kv_role is {d.get('kv_role')!r}; {d['kv_connector']} takes "
                             f"{', '.join(roles)}.")
        cfg = cls(**d)
        if cfg.kv_connector == "SharedStorageConnector" and not cfg.kv_connector_extra_config.get(
                "shared_storage_path"):
            raise ValueError("kv_transfer_config for SharedStorageConnector needs kv_connector_extra_config "
                             '{"shared_storage_path": DIR}, a directory every instance can read and write.')
        if not isinstance(cfg.kv_port, int) or not 0 <= cfg.kv_port < 65536:
            raise ValueError(f"kv_transfer_config kv_port is {cfg.kv_port!r}; it must be an int in [0, 65535].")
        if not isinstance(cfg.kv_buffer_size, int) or cfg.kv_buffer_size < 1:
            raise ValueError(f"kv_transfer_config kv_buffer_size is {cfg.kv_buffer_size!r}; it must be a positive "
                             "int (bytes).")
        return cfg


def choices_of(name: str) -> tuple[str, ...]:
    return next(f.metadata["choices"] for f in fields(EngineConfig) if f.name == name)


# Flags kept from before a field took vLLM's pair of flags: field -> the old flag, which still turns it off.
LEGACY_OFF_FLAGS = {"enable_prefix_caching": "--no-prefix-caching"}


def flag_of(name: str) -> str:
    """The command-line flag of an EngineConfig field: `--max-num-seqs`, `--enforce-eager`, `--enable-prefix-caching`
    (a bool that defaults to True or None also takes `--no-` before its name, as `--no-enable-prefix-caching`)."""
    return "--" + name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser, exclude: Iterable[str] = ()) -> argparse._ArgumentGroup:
    """Add a flag for every EngineConfig field but those in `exclude` to `parser`, in a group of their own.

    Each flag's dest is the field's name and its default the field's default, so with no engine flag
    given, `EngineConfig.from_cli_args(parser.parse_args(...))` is `EngineConfig()`."""
    exclude = set(exclude)
    names = {f.name for f in fields(EngineConfig)}
    if exclude - names:
        raise ValueError(f"exclude names {sorted(exclude - names)}, which are not EngineConfig fields; "
                         f"the fields are {sorted(names)}.")
    group = parser.add_argument_group("engine options (EngineConfig, minivllm/config.py)")
    types_ = typing.get_type_hints(EngineConfig)
    for f in fields(EngineConfig):
        if f.name in exclude:
            continue
        help_ = f.metadata["help"].replace("%", "%%")          # argparse formats help with %
        kind = _scalar(types_[f.name])
        if kind is bool and f.default is not False:     # --x / --no-x (None: neither given, the engine decides)
            group.add_argument(flag_of(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                               default=f.default, help=f"{help_} (--no-{f.name.replace('_', '-')}: off)")
            if f.name in LEGACY_OFF_FLAGS:
                group.add_argument(LEGACY_OFF_FLAGS[f.name], dest=f.name, action="store_false", help=argparse.SUPPRESS)
        elif kind is bool:
            group.add_argument(flag_of(f.name), dest=f.name, action="store_true", help=help_)
        else:
            number = kind in (int, float) and not f.metadata["choices"]
            number = "N" if number else "JSON" if kind is _json_object else None
            default = "" if f.default is None else f"; default: {f.default}"
            group.add_argument(flag_of(f.name), dest=f.name, type=kind, default=f.default,
                               choices=f.metadata["choices"], metavar=number,
                               help=help_ + default)
    return group


def _scalar(annotation) -> type:
    """int for `int` and `int | None`; likewise str, float, bool; a dict option is read as JSON."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    return _json_object if annotation is dict else annotation


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, not {text!r}")
    return value
