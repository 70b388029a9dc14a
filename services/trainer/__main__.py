"""`python -m services.trainer`: train on the `batches` stream, publish versions to the bucket.

Configuration comes from `NEXTSTATE_*` / `NEXTSTATE_TRAINER__*` (services/trainer/settings.py);
invalid settings: a message on stderr naming the variable, exit code 2. torch is imported
only once the configuration is known to be valid. One trainer per run: it resumes from
the bucket (LATEST and its trainer state) and replays unacknowledged batches.
`NEXTSTATE_TRAINER__BACKEND=ray` runs it data-parallel on Ray (services/trainer/ray_backend.py).
"""

from __future__ import annotations

import asyncio
import logging
import sys

from services.trainer.settings import TrainerSettings
from shared.errors import NextstateError, SettingsError
from shared.settings import load_settings
from shared.telemetry import configure_logging

log = logging.getLogger("services.trainer")


def main() -> int:
    try:
        settings = load_settings(TrainerSettings)
    except SettingsError as exc:
        print(f"trainer: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log, "trainer")
    from services.trainer.loss_plugins import resolve_loss  # torch: only once settings are valid

    try:  # a bad loss plugin path stops the start here, before any model is loaded
        resolve_loss(settings.trainer.loss or settings.trainer.loss_mode)
    except SettingsError as exc:
        print(f"trainer: {exc}", file=sys.stderr)
        return 2
    if settings.trainer.backend == "ray":  # the same service, data-parallel on a Ray cluster
        from services.trainer.ray_backend import main as main_on_ray

        return main_on_ray(settings)
    from services.trainer.service import run

    try:
        asyncio.run(run(settings))
    except NextstateError as exc:
        log.error("trainer stopped: %s", exc)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
