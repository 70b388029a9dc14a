"""The error a suite raises when it cannot score the candidate. Apart from the package's
__init__ (`resolve`), which imports the env suite (environment.py) that raises it."""

from __future__ import annotations

from shared.errors import NextstateError


class SuiteError(NextstateError):
    """A suite could not score the candidate (a model call failed, nothing could be rated)."""
