"""minivllm: a compact, readable re-implementation of vLLM's core."""

from minivllm.entrypoints.llm import LLM
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.core.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "StructuredOutputsParams"]
__version__ = "0.1.0"
