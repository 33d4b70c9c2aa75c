"""The base of the server's request and response models."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ApiModel(BaseModel):
    """A pydantic model whose validator and serializer are built when the model is first
    used, not when its class is defined (pydantic's ``defer_build``): the server defines ~60
    models, most of which a given deployment never uses (Responses, Anthropic, scoring, RL),
    and building them all slowed every start-up's single-threaded Python
    (``docs/measurements.md``, "Server start-up")."""

    model_config = ConfigDict(defer_build=True)
