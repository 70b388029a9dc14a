"""Putting a committed version into an engine, whatever its format (the watcher, the evaluator).

A full version (an HF folder) replaces the engine's weights: `update_weights` with weight
version `str(version)`. An adapter version (a PEFT folder) is loaded beside the base weights
under the name `str(version)` and becomes the engine's weight version (what requests naming
no adapter get, and what clients with `adapters=True` name); then every other adapter named
like a version is unloaded — requests running on one finish on it, new ones take the new
adapter. An unload that fails is reported in the message, not as a failed load: the engine
serves the new version either way, and the next load unloads the leftover.
"""

from __future__ import annotations

import logging

from shared.engine_client.base import EngineClient
from shared.errors import EngineError
from shared.schemas import CheckpointManifest

log = logging.getLogger(__name__)


async def serve_version(
    engine: EngineClient, path: str, manifest: CheckpointManifest, *, abort_all_requests: bool = False
) -> tuple[bool, str]:
    """Make `engine` serve `manifest`'s version from the folder at `path` (as the engine sees
    it); (success, the engine's message). Engine errors propagate as they do for a load."""
    name = manifest.weight_version
    if manifest.format == "full":
        return await engine.update_weights(path, name, abort_all_requests=abort_all_requests)
    answer = await engine.load_adapter(name, path)
    if not answer.ok:
        return False, answer.message
    leftovers = []
    for other in answer.loaded or ():
        if other == name or not other.isdigit():
            continue  # not one of ours: an adapter someone else loaded stays
        try:
            gone = await engine.unload_adapter(other)
            ok, why = gone.ok, gone.message
        except EngineError as exc:
            ok, why = False, str(exc)
        if not ok:
            leftovers.append(other)
            log.warning("could not unload the adapter a new version replaced", extra={
                "version": manifest.version, "adapter": other, "error": why[:300]})
    note = f"; adapters {', '.join(leftovers)} still loaded" if leftovers else ""
    return True, f"LoRA adapter {name} loaded{note}"
