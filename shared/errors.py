"""The exception tree shared by every service.

    NextstateError
    ├── SettingsError          bad configuration at start; names the variable
    ├── MalformedMessage       a stream message or request body fails validation
    ├── BusError               Redis streams (publish, consume)
    ├── BufferUnavailable      the buffer's pull API did not answer usefully (retried)
    ├── StoreError             the bucket
    │   ├── ObjectNotFound     the key does not exist (S3 NoSuchKey)
    │   ├── NoCheckpoint       no LATEST / manifest where one was expected
    │   ├── CorruptCheckpoint  a LATEST, manifest or trainer state that is there but unreadable
    │   │   └── IncompatibleCheckpoint  weights that do not fit the model the engine serves
    │   └── ChecksumMismatch   a downloaded file does not match its manifest
    │       └── BrokenDelta    a delta-encoded file cannot be rebuilt (its delta or its base)
    └── EngineError            the inference engine
        ├── EngineUnavailable  cannot connect, or it answered 5xx
        │   └── EngineDied     it stopped serving during an operation it was asked for
        ├── EngineTimeout      no answer within the timeout
        ├── EngineRejected     it answered 4xx: the request itself is wrong
        └── EngineNotSupported this engine does not offer the operation

Every message says what happened and, where it can, what to do about it.
"""

from __future__ import annotations


class NextstateError(Exception):
    """Base of every error raised on purpose by nextstate code."""


class SettingsError(NextstateError):
    """Configuration is invalid; raised once, at start."""


class MalformedMessage(NextstateError):
    """A message (stream entry or request body) does not match its schema."""


class BusError(NextstateError):
    """A Redis streams operation failed."""


class BufferUnavailable(NextstateError):
    """The buffer did not answer GET /get_data usefully (down, 5xx, garbage); retried."""


class StoreError(NextstateError):
    """A bucket operation failed."""


class ObjectNotFound(StoreError):
    """The key does not exist in the bucket (S3 `NoSuchKey`)."""

    def __init__(self, key: str, bucket: str) -> None:
        super().__init__(f"no object {key!r} in bucket {bucket!r}")
        self.key = key
        self.bucket = bucket


class NoCheckpoint(StoreError):
    """The bucket holds no checkpoint where one was expected."""


class CorruptCheckpoint(StoreError):
    """An object of the checkpoint protocol is in the bucket but is not what the protocol
    says (a LATEST or manifest that does not parse, unsafe paths, an unreadable trainer
    state). The bucket answered, so retrying will not help: a reader skips that pointer
    or version. A bucket that does not answer is a plain `StoreError`."""


class IncompatibleCheckpoint(CorruptCheckpoint):
    """A version whose config or tensors do not fit the model the engine serves (another
    architecture, other shapes): the engine must never be asked to load it."""


class ChecksumMismatch(StoreError):
    """A downloaded file's size or sha256 differs from the manifest."""


class BrokenDelta(ChecksumMismatch):
    """A file stored as a delta cannot be rebuilt: the delta is missing or corrupt, or the
    earlier version it builds on is gone or does not verify. The version is refused like
    any that does not verify; a reader falls back to a version it can build."""


class EngineError(NextstateError):
    """The inference engine could not serve a request."""


class EngineUnavailable(EngineError):
    """The engine refused the connection or answered with a 5xx."""


class EngineDied(EngineUnavailable):
    """The engine was healthy, was asked for an operation (a weight reload), and is not
    serving since: vLLM 0.32 dies of a `reload_weights` that fails. It must be restarted."""


class EngineTimeout(EngineError):
    """The engine did not answer within the configured timeout."""


class EngineRejected(EngineError):
    """The engine answered 4xx: the request is wrong, retrying will not help."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


class EngineNotSupported(EngineError):
    """The engine (or its configuration) does not offer this operation; the message says what would."""
