"""LoRA adapters over HTTP: which `model` a request may name, `/v1/models`, and loading and
unloading adapters while the server runs (vLLM's endpoints and bodies).

A request's `model` is the base model (its served names: `--served-model-name`, the path
it was loaded from) or an adapter's name (`--lora-modules name=path`, or one loaded with
`POST /v1/load_lora_adapter`); anything else is a 400 naming what is served. `/v1/models`
lists the base, then each adapter with its parent (the base) and its folder as `root`;
`/v1/models/{model}` is one of them (a 404 with code `model_not_found` for another name).
The load and unload endpoints are under `/v1/`, so an API key guards them where one is set
(`auth.py`). They answer 200 with a line of text, as vLLM's do; a folder that is not an
adapter for this base, a rank over `--max-lora-rank`, a name already loaded (unless
`load_inplace`) or one of the base's is a 400 naming the problem, an unknown adapter to
unload a 404.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from chunk_llama.server.errors import OpenAIError


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter of that name (else that is a 400)


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # (vLLM's; accepted and not used)


class ServedModels:
    """The names requests may give as `model`: the base's, then the engine's adapters."""

    def __init__(self, engine, base_names: list[str], created: int):
        self.engine, self.base_names, self.created = engine, list(base_names), created

    def adapter_for(self, model: str) -> str | None:
        """The adapter a request naming `model` runs under (None: the base), or a 400."""
        if model in self.base_names:
            return None
        if model in self.engine.adapter_names():
            return model
        adapters = self.engine.adapter_names()
        also = f" and the adapters {', '.join(repr(a) for a in adapters)}" if adapters else ""
        raise OpenAIError(f"model {model!r} does not exist here; this server serves {self.base_names[0]!r}{also}",
                          param="model")

    def listing(self) -> dict:
        """`GET /v1/models`: the base under its first name, then each adapter."""
        base, context = self.base_names[0], self.engine.max_model_len
        data = [{"id": base, "object": "model", "created": self.created, "owned_by": "chunk-llama", "root": base,
                 "parent": None, "max_model_len": context}]
        for adapter in self.engine.adapters.describe():
            data.append({"id": adapter["name"], "object": "model", "created": self.created, "owned_by": "chunk-llama",
                         "root": adapter["source"], "parent": base, "max_model_len": context})
        return {"object": "list", "data": data}

    def retrieve(self, model: str) -> dict:
        """`GET /v1/models/{model}`: the listing's object of `model` (another of the base's
        names gives the base's: requests may name it so), else OpenAI's 404 for a model."""
        data = self.listing()["data"]
        name = self.base_names[0] if model in self.base_names else model
        for item in data:
            if item["id"] == name:
                return item
        served = ", ".join(repr(item["id"]) for item in data)
        raise OpenAIError(f"the model {model!r} does not exist; this server serves {served}", param="model",
                          status=404, code="model_not_found")


def add_adapter_routes(app: FastAPI, engine, models: ServedModels) -> None:
    """`/v1/models`, `/v1/models/{model}`, `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`."""

    @app.get("/v1/models")
    async def list_models():
        return models.listing()

    @app.get("/v1/models/{model:path}")  # a served name may be a path (`org/name`)
    async def retrieve_model(model: str):
        return models.retrieve(model)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest):
        name = body.lora_name
        if name in models.base_names:
            raise OpenAIError(f"{name!r} is the base model's name; give the adapter another", param="lora_name")
        if name in engine.adapter_names() and not body.load_inplace:
            raise OpenAIError(f"the adapter {name!r} has already been loaded (load_inplace: true replaces it)",
                              param="lora_name")
        try:
            await asyncio.to_thread(engine.load_adapter, name, body.lora_path)
        except (ValueError, TypeError, OSError) as error:
            raise OpenAIError(str(error), param="lora_path") from error
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest):
        if body.lora_name not in engine.adapter_names():
            raise OpenAIError(f"the adapter {body.lora_name!r} cannot be found", param="lora_name", status=404,
                              type="not_found_error")
        try:
            await asyncio.to_thread(engine.unload_adapter, body.lora_name)
        except ValueError as error:  # (unloaded meanwhile by another request)
            raise OpenAIError(str(error), param="lora_name", status=404, type="not_found_error") from error
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
