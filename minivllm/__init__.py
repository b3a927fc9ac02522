"""minivllm: a compact, readable re-implementation of vLLM's core.

The names below are imported on first use (as vLLM's own `vllm/__init__.py` does), so `import minivllm.x`
does not pay for torch until something needs it: the entry points re-start themselves with a faster CPU
runtime (platforms/cpu/runtime.py) before torch is imported.
"""

import importlib

MODULE_ATTRS = {
    "LLM": "minivllm.entrypoints.llm",
    "BeamSearchParams": "minivllm.beam_search",
    "CompletionOutput": "minivllm.outputs",
    "RequestOutput": "minivllm.outputs",
    "SamplingParams": "minivllm.core.sampling_params",
    "StructuredOutputsParams": "minivllm.core.sampling_params",
}

__all__ = list(MODULE_ATTRS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in MODULE_ATTRS:
        value = getattr(importlib.import_module(MODULE_ATTRS[name]), name)
        globals()[name] = value                  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
