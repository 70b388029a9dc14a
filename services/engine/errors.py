"""The engine's load errors, apart from what raises them: services/engine/model.py (a model
folder) and services/engine/lora.py (an adapter, `AdapterError(ModelLoadError)`) both raise
them, and the model module builds on the LoRA one, so neither may define them for the other."""

from __future__ import annotations

from shared.errors import NextstateError


class ModelLoadError(NextstateError):
    """A model folder cannot be served: missing, unreadable, or incomplete."""
