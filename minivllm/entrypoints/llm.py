"""LLM: the offline API, with vLLM's names. `LLM(...).generate(prompts, sampling_params)`.

Owns: validating a whole batch before anything runs, driving the engine until the batch is done,
and returning outputs in input order. All the serving logic lives in the engine.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

from minivllm.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from minivllm.config import EngineConfig
from minivllm.engine.input_processor import ProcessedRequest
from minivllm.engine.llm_engine import EngineStats, LLMEngine, PromptType
from minivllm.entrypoints.chat_utils import (apply_chat_template, image_placeholder, load_images, parse_chat_options,
                                             parse_conversation)
from minivllm.entrypoints.protocol import APIError
from minivllm.outputs import RequestOutput
from minivllm.core.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """An offline engine.

    LLM(model=None, dtype="auto", device="auto", block_size=16, num_kv_blocks=None, max_num_seqs=256,
        max_num_batched_tokens=8192, max_model_len=None, enable_prefix_caching=True,
        tensor_parallel_size=1, seed=0, ...)   (every field of EngineConfig)
    model=None loads the embedded SmolLM2-135M-Instruct.
    """

    def __init__(self, model: str | None = None, **kwargs):
        kwargs.setdefault("disable_log_stats", True)      # vLLM's LLM keeps no request histograms unless asked
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in input order.

        Every prompt and parameter set is checked first: a bad one raises ValueError before anything runs.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._broadcast(sampling_params, len(prompts), "sampling_params")
        priority = self._broadcast(priority, len(prompts), "priority", default=0)
        engine = self.llm_engine
        processed = []
        for i, (p, sp, pr) in enumerate(zip(prompts, params, priority)):
            if isinstance(sp, dict):
                sp = SamplingParams.from_dict(sp)
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params[{i}] is a {type(sp).__name__}; pass SamplingParams.")
            try:
                request = engine.input_processor.process_inputs(p, sp, pr)     # checked here, and only here
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            # one output per request, at the end (vLLM's LLM does the same), on a copy: the caller's params stay as
            # given (a copy of checked params, not rebuilt: SamplingParams checked them when they were made)
            sp = copy.copy(sp)
            sp.output_kind = RequestOutputKind.FINAL_ONLY
            processed.append(dataclasses.replace(request, params=sp))
        return self._run(processed, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search (vLLM's LLM.beam_search, beam_search.py): one BeamSearchOutput per prompt, in input order, with
        its params.beam_width best sequences, best first. Each step runs every live beam as a one-token request; the
        prefix cache shares the prompt's KV blocks between the beams. Every prompt is checked first (ValueError)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        return run_beam_search(self.llm_engine, list(prompts), params, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template: str | None = None, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (or `chat_template`) to one conversation (a list of messages) or to a
        list of them, as vLLM's LLM.chat. Messages are read as the server reads them (chat_utils.parse_conversation):
        a content may be a list of parts, text, image_url (a data URI, or a local file under
        allowed_local_media_path) and image_pil (a PIL image); an assistant's tool_calls reach the template with
        their arguments parsed into objects, a tool message's tool_call_id as it is. `continue_final_message` leaves the last (assistant) message open for the model to continue
        (with add_generation_prompt=False, as in vLLM); `tools` (OpenAI function definitions) and
        `chat_template_kwargs` go to the template as they are."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        options = self._chat_options(add_generation_prompt, continue_final_message, chat_template, tools,
                                     chat_template_kwargs)
        tokenizer = self.get_tokenizer()
        mm_processor = self.llm_engine.input_processor.mm_processor          # None for a text model
        placeholder = image_placeholder(tokenizer, mm_processor)
        prompts = []
        for i, conv in enumerate(conversations):
            try:
                parsed = parse_conversation({"messages": conv}, placeholder)     # the server's reading of messages
                loaded = load_images(parsed.images, mm_processor) if parsed.images else []
                text = apply_chat_template(tokenizer, parsed.messages, options)
            except APIError as e:
                raise ValueError(f"conversation {i}: {e.message}") from None
            prompt = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
            if loaded:
                prompt["multi_modal_data"] = {"image": loaded}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    @staticmethod
    def _chat_options(add_generation_prompt: bool, continue_final_message: bool, chat_template: str | None,
                      tools: list[dict] | None, chat_template_kwargs: dict | None) -> dict:
        """apply_chat_template's options, checked as the server checks a request's (chat_utils.parse_chat_options)."""
        body = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
        if chat_template is not None:
            body["chat_template"] = chat_template
        try:
            options = parse_chat_options(body)
        except APIError as e:
            raise ValueError(e.message) from None
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function"
                                                      and isinstance(t.get("function"), dict) for t in tools):
                raise ValueError("tools must be a list of {'type': 'function', 'function': {'name': ..., "
                                 "'parameters': {...}}} definitions (OpenAI's).")
            options["tools"] = tools
        if chat_template_kwargs is not None:
            if not isinstance(chat_template_kwargs, dict):
                raise ValueError(f"chat_template_kwargs is a {type(chat_template_kwargs).__name__}; pass a dict.")
            options.update(chat_template_kwargs)
        return options

    def get_stats(self) -> EngineStats:
        return self.llm_engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache, as vLLM's `LLM.reset_prefix_cache` (after new weights, or before a benchmark
        round): True once done, False (and a warning) while a request holds blocks (LLMEngine.reset_prefix_cache)."""
        return self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes now (otherwise on garbage collection or at exit)."""
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------
    @staticmethod
    def _broadcast(value, n: int, name: str, default=None) -> list:
        if value is None:
            value = default if default is not None else SamplingParams()
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries for {n} prompts; pass one, or one per prompt.")
            return list(value)
        return [value] * n

    def _run(self, requests: list[ProcessedRequest], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        bar = None
        try:
            for request in requests:                  # inside the try: a failed add takes back the rest
                ids.append(engine.add_request(request).request_id)
            if use_tqdm:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:                          # never leave this batch's blocks behind
                engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]
