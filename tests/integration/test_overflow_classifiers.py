"""The collector's overflow refusals through OpenClaw's own classifier (the real one, from the
npm package `make agents` installs): each is a context overflow to it, with the prompt's
size read back, so OpenClaw compacts instead of telling its user the request was malformed.

Needs the agents `make agents` installs (tests/support/agents.py: skipped without them,
a failure under `make test`). About 4 s (Node loading OpenClaw's bundles).
"""

from __future__ import annotations

import json
import subprocess

from services.collector.context_window import overflow
from tests.support.agents import node_bin, require_agents

# openclaw 2026.9.6's bundles (pinned by deploy/agents/package-lock.json): the failover
# classifier and the helper that reads an overflow's token count back.
CLASSIFY = "node_modules/openclaw/dist/classify-Ds2AuCvN.mjs"  # export a: isLikelyContextOverflowError
OBSERVED = "node_modules/openclaw/dist/embedded-agent-helpers-BFS05UdI.mjs"  # export _: …TokenCount
SCRIPT = "\n".join([
    "const [dir, raw] = process.argv.slice(1);",
    f"const {{ a: isOverflow }} = await import(`${{dir}}/{CLASSIFY}`);",
    f"const {{ _: observed }} = await import(`${{dir}}/{OBSERVED}`);",
    "console.log(JSON.stringify(JSON.parse(raw).map((m) => [isOverflow(m), observed(m) ?? null])));",
])


def openclaw_reads(messages: list[str]) -> list[tuple[bool, int | None]]:
    folder = require_agents()
    node = node_bin(folder) / "node"
    out = subprocess.run([str(node), "--input-type=module", "-e", SCRIPT, str(folder), json.dumps(messages)],
                         capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    return [(bool(a), b) for a, b in json.loads(out.stdout.strip().splitlines()[-1])]


def test_openclaw_compacts_on_every_overflow_the_collector_answers() -> None:
    cases = [(api, asked) for api in ("chat", "responses", "messages") for asked in (None, 500)]
    errors = [overflow(api, 10116, 8192 if asked is None else 10200, asked) for api, asked in cases]  # type: ignore[arg-type]
    # As the clients raise them: the SDKs put the status before the message.
    messages = [f"400 {e.message}" for e in errors]
    old = ("400 the model server refused the request: /generate: engine answered 400: the prompt has "
           "10116 tokens; the context length is 8192")  # what the collector said before
    got = openclaw_reads([*messages, old])
    assert got[:-1] == [(True, 10116 if asked is None else 10616) for _, asked in cases], got
    assert got[-1] == (False, None)
