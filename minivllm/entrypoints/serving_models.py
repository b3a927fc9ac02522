"""The served model's names (vLLM's entrypoints/openai/serving_models.py): what /v1/models lists, and which
`model` a request may name.

Owns: the names only, fixed when the server is built. It never touches the engine beyond reading its path
and config.
"""

from __future__ import annotations

import time
from pathlib import Path

from minivllm.engine.async_llm import AsyncLLMEngine
from minivllm.entrypoints.protocol import APIError, describe, read_field

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class OpenAIServingModels:
    """served_model_name: what /v1/models lists; requests may name it or the model's path. Defaults to the
    checkpoint directory's name ("SmolLM2-135M-Instruct" for the embedded default model)."""

    def __init__(self, async_engine: AsyncLLMEngine, served_model_name: str | None = None):
        self.async_engine = async_engine
        self.model_path = Path(async_engine.engine.model_path)
        config_model = async_engine.engine.config.model
        self.name = served_model_name or (Path(config_model).name if config_model else DEFAULT_MODEL_NAME)
        self.accepted_names = ({self.name, str(self.model_path), self.model_path.name}
                               | ({config_model} if config_model else set()))
        self.created = int(time.time())

    def check_model(self, body: dict) -> None:
        """A request's `model`, if it names one, must be served here."""
        model = read_field(body, "model", "string")
        if model is not None and model not in self.accepted_names:
            # vLLM's answer: 404, type "NotFoundError", code 404.
            raise APIError(f"The model {describe(model)} does not exist; this server serves '{self.name}' (see "
                           "/v1/models).", param="model", status_code=404, type="NotFoundError", code=404)

    def show_available_models(self) -> dict:
        """/v1/models' body: the one model served here."""
        return {"object": "list", "data": [{
            "id": self.name, "object": "model", "created": self.created, "owned_by": "minivllm",
            "root": str(self.model_path), "parent": None, "max_model_len": self.async_engine.max_model_len}]}
