"""The policy's context window at the edge: how long it is, the refusal of a prompt that
does not fit (in the words each API's clients already classify), and the engine's own
refusals said the same way.

The length comes from NEXTSTATE_COLLECTOR__CONTEXT_LENGTH, else the engine's model info
(our engine's and SGLang's `context_length`, vLLM's `max_model_len`), else the model
folder's config (`max_position_embeddings` and its older names); unknown, the collector
checks nothing and the engine's refusal is mapped instead (`engine_refusal`).

Counted as OpenAI and vLLM count it: the prompt is every token of the rendered chat
template (system prompt, tools, history); it fits when at least one token is left to
generate (prompt < context length). A `max_tokens` that would run past the window is,
by NEXTSTATE_COLLECTOR__MAX_TOKENS_OVER_CONTEXT, cut to the room left (`clamp`, the
default, as vLLM does since 0.10: the answer ends with finish_reason "length" where the
window ends) or refused (`refuse`, as OpenAI and SGLang do). Agents configured for a
hosted model often ask for more output than a small policy's whole window (Claude Code
sends `max_tokens: 32000`); refusing those would refuse every request.

The refusal is a 400 that agents recognise as a context overflow and answer by
compacting their history (OpenClaw's and Codex's overflow classifiers, Claude Code's
auto-compact):

    chat       code context_length_exceeded, param messages: "This model's maximum
               context length is N tokens. However, your messages resulted in M tokens.
               Please reduce the length of the messages." (OpenAI's words)
    responses  code context_length_exceeded, param input: "Your input exceeds the context
               window of this model: …" (OpenAI's Responses words, with the counts)
    messages   invalid_request_error: "prompt is too long: M tokens > N maximum"
               (Anthropic's words; N the most input tokens, context length - 1)

with `max_tokens` refused: OpenAI's "However, you requested T tokens (M in the messages,
K in the completion)…" and Anthropic's "input length and `max_tokens` exceed context
limit: M + K > N…".
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from services.collector.openai_shapes import ApiError
from services.collector.settings import OverContext
from shared.errors import EngineRejected

log = logging.getLogger(__name__)

Api = Literal["chat", "responses", "messages"]
OVERFLOW_CODE = "context_length_exceeded"

# The model config keys that hold the window, in the order transformers' configs use them.
CONFIG_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length",
               "n_ctx", "max_seq_len")  # fmt: skip
INFO_KEYS = ("context_length", "max_model_len", "max_context_length", "max_total_tokens")


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else None


def model_config_length(folder: str | Path | None) -> int | None:
    """The window a model folder's config.json declares (its text config's, for a
    multimodal one), or None."""
    if folder is None:
        return None
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for scope in (config, config.get("text_config")):
        if isinstance(scope, dict):
            for key in CONFIG_KEYS:
                if (n := _positive(scope.get(key))) is not None:
                    return n
    return None


def context_length(configured: int | None, info: Mapping[str, Any], folder: str | None) -> int | None:
    """The policy's context length: the setting, else the engine's model info, else the
    model folder's config; None when nothing says."""
    if configured is not None:
        return configured
    for key in INFO_KEYS:
        if (n := _positive(info.get(key))) is not None:
            return n
    return model_config_length(folder)


# -- the refusal, in each API's words --------------------------------------------------------------


def overflow(api: Api, prompt: int, window: int, max_tokens: int | None = None) -> ApiError:
    """The 400 for a prompt of `prompt` tokens (asking for `max_tokens` more, when that is
    what does not fit) in a window of `window`."""
    if api == "messages":
        if max_tokens is None:
            msg = f"prompt is too long: {prompt} tokens > {window - 1} maximum"
        else:
            msg = (f"input length and `max_tokens` exceed context limit: {prompt} + {max_tokens} > "
                   f"{window}, decrease input length or `max_tokens` and try again")  # fmt: skip
        return ApiError(400, msg, code=OVERFLOW_CODE)
    if api == "responses":
        if max_tokens is None:
            msg = (f"Your input exceeds the context window of this model: its maximum context length "
                   f"is {window} tokens, and your input resulted in {prompt} tokens. Please reduce "
                   "the length of the input and try again.")  # fmt: skip
        else:
            msg = (f"Your input exceeds the context window of this model: its maximum context length "
                   f"is {window} tokens, and you requested {prompt + max_tokens} tokens ({prompt} in "
                   f"the input, {max_tokens} in max_output_tokens). Please reduce the length of the "
                   "input or max_output_tokens and try again.")  # fmt: skip
        return ApiError(400, msg, param="input", code=OVERFLOW_CODE)
    if max_tokens is None:
        msg = (f"This model's maximum context length is {window} tokens. However, your messages "
               f"resulted in {prompt} tokens. Please reduce the length of the messages.")  # fmt: skip
    else:
        msg = (f"This model's maximum context length is {window} tokens. However, you requested "
               f"{prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in the "
               "completion). Please reduce the length of the messages or completion.")  # fmt: skip
    return ApiError(400, msg, param="messages", code=OVERFLOW_CODE)


def fit(api: Api, prompt: int, window: int | None, max_tokens: int | None,
        mode: OverContext) -> int | None:  # fmt: skip
    """The `max_tokens` to ask the engine for, or the overflow refusal.

    `max_tokens` None (the client set none, nor the configuration) lets the engine stop
    at the window's end; `clamp` cuts a larger one to the room left."""
    if window is None:
        return max_tokens
    if prompt >= window:
        raise overflow(api, prompt, window)
    if max_tokens is None or prompt + max_tokens <= window:
        return max_tokens
    if mode == "refuse":
        raise overflow(api, prompt, window, max_tokens)
    return window - prompt


# -- the engine's own refusals ------------------------------------------------------------------------

# (pattern, group of the prompt's tokens, group of the window, group of max_tokens or 0)
_ENGINE_OVERFLOWS: tuple[tuple[re.Pattern[str], int, int, int], ...] = tuple(
    (re.compile(p, re.IGNORECASE), a, b, c) for p, a, b, c in (
        # ours (services/engine/protocol.py)
        (r"the prompt has (\d+) tokens; the context length is (\d+)", 1, 2, 0),
        # SGLang
        (r"the input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)", 1, 2, 0),
        (r"maximum context length of (\d+) tokens\. You requested a total of \d+ tokens: (\d+) tokens "
         r"from the input messages and (\d+) tokens for the completion", 2, 1, 3),
        # vLLM (0.32, and the older wordings)
        (r"maximum context length is (\d+) tokens\. However, your prompt contains (?:at least )?(\d+) "
         r"input tokens", 2, 1, 0),
        (r"maximum context length is (\d+) tokens\. However, your request has (\d+) input tokens", 2, 1, 0),
        (r"input length \((\d+)\) exceeds model's maximum context length \((\d+)\)", 1, 2, 0),
        (r"'max_tokens' or 'max_completion_tokens' is too large: (\d+)\. This model's maximum context "
         r"length is (\d+) tokens and your request has (\d+) input tokens", 3, 2, 1),
        (r"maximum context length is (\d+) tokens\. However, you requested \d+ tokens \((\d+) in the "
         r"messages, (\d+) in the completion\)", 2, 1, 3),
    )
)  # fmt: skip
_ENGINE_PREFIX = re.compile(r"^.*?engine answered \d+: ", re.DOTALL)


def engine_detail(exc: EngineRejected) -> str:
    """The engine's own message, without the client's request path and status."""
    return _ENGINE_PREFIX.sub("", str(exc), count=1).strip()


def engine_overflow(api: Api, exc: EngineRejected) -> ApiError | None:
    """The overflow refusal, when the engine's 4xx says the prompt did not fit."""
    text = str(exc)
    for pattern, prompt, window, extra in _ENGINE_OVERFLOWS:
        m = pattern.search(text)
        if m:
            asked = int(m.group(extra)) if extra else None
            return overflow(api, int(m.group(prompt)), int(m.group(window)), asked)
    return None


def engine_refusal(api: Api, exc: EngineRejected) -> ApiError:
    """An engine's 4xx as the client sees it: the overflow in its API's words; the
    engine refusing the collector's own credentials or path as the operator's problem
    (a 502, never the client's 401); anything else a 400 with the engine's reason."""
    found = engine_overflow(api, exc)
    if found is not None:
        return found
    detail = engine_detail(exc)
    if exc.status_code in (401, 403):
        log.error("the engine refused the collector's credentials: %s", exc)
        return ApiError(502, "the model server refused this proxy's credentials (an operator "
                             "problem: NEXTSTATE_INTERNAL__TOKEN must be the token the engine was "
                             "started with); retry later", code="engine_unauthorized",
                        kind="server_error")  # fmt: skip
    if exc.status_code in (404, 405):
        log.error("the engine does not serve the collector's request: %s", exc)
        return ApiError(502, "the model server does not offer what this proxy asked of it (an "
                             "operator problem: check NEXTSTATE_COLLECTOR__ENGINE_KIND and "
                             "ENGINE_URL); retry later", code="engine_mismatch",
                        kind="server_error")  # fmt: skip
    if exc.status_code == 429:
        return ApiError(429, f"the model server is at capacity ({detail}); retry in a few seconds",
                        code="engine_busy")  # fmt: skip
    status = exc.status_code if exc.status_code in (400, 413, 422) else 400
    return ApiError(status, f"the model server refused the request: {detail}. Change the "
                            "request as that says; sent again unchanged it fails again.",
                    code="engine_rejected")  # fmt: skip
