"""Built-in tools a request offers that the engine cannot run: left out, or refused.

OpenAI's Responses API and Anthropic's Messages API let a request offer tools that the
provider itself runs (web search, file search, code interpreter, computer use,
Anthropic's server tools). Agents offer them by default (the Codex CLI sends
`{"type": "web_search"}` with every request); this server serves a model, not those
tools. By NEXTSTATE_COLLECTOR__UNSUPPORTED_TOOLS:

    drop    (default) the tools are left out of the prompt, the model never sees them,
            the answer says which in `X-Nextstate-Dropped-Tools` (their types, comma
            separated) and `nextstate_collector_dropped_tools_total{api,type}` counts them;
    refuse  a 400 naming the first one (what the collector did before).

A `tool_choice` that *forces* one of them is a 400 either way: the request cannot be
answered as asked.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from services.collector import metrics as M
from services.collector.openai_shapes import ApiError
from services.collector.settings import UnsupportedTools

DROPPED_HEADER = "x-nextstate-dropped-tools"

# Responses API tool types run by the provider (and `custom` freeform tools, whose
# grammar-constrained input this server does not parse).
RESPONSES_BUILTINS = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
    "file_search", "computer", "computer_use", "computer_use_preview", "code_interpreter",
    "image_generation", "mcp", "local_shell", "shell", "apply_patch", "custom", "tool_search",
})  # fmt: skip
# Anthropic's server and schema-less tools, by family (`web_search_20250305` -> web_search).
ANTHROPIC_FAMILIES = ("web_search", "web_fetch", "code_execution", "bash", "text_editor",
                      "computer", "memory", "tool_search_tool_regex", "tool_search_tool_bm25",
                      "mcp_toolset")  # fmt: skip


_DATED = re.compile(r"(?P<family>[a-z_]+?)(?:_\d{8})?")


def anthropic_family(kind: str) -> str | None:
    """The family of an Anthropic built-in tool type (`web_search_20250305` -> web_search),
    or None for a type that is none of them (a 400 as an unknown type)."""
    m = _DATED.fullmatch(kind)
    family = m.group("family") if m else None
    return family if family in ANTHROPIC_FAMILIES else None


class Dropped:
    """The built-in tools one request offered, left out by the policy (or refused)."""

    def __init__(self, api: str, policy: UnsupportedTools) -> None:
        self.api = api
        self.policy = policy
        self.types: list[str] = []

    def offer(self, kind: str, label: str, refusal: ApiError) -> None:
        """One built-in tool of type `kind` (`label`: the metric's): dropped, or `refusal`."""
        if self.policy == "refuse":
            raise refusal
        if kind not in self.types:
            self.types.append(kind)
        M.DROPPED_TOOLS.labels(self.api, label).inc()

    def header(self) -> tuple[str, ...]:
        return tuple(self.types)


def header_value(types: Iterable[str]) -> str:
    """The header's value: plain ASCII names only (client-chosen types are not echoed raw)."""
    return ", ".join(t for t in types if t.isascii() and t.isprintable() and "," not in t)
