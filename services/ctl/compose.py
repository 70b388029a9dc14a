"""`nextstate compose init`: a `.env` for `docker compose`, so that plain
`docker compose build` and `docker compose up -d` work from the project folder.

    nextstate compose init [--offline] [--model PATH] [--profile cpu|gpu|vllm|ray]

writes `.env` from `.env.example` (the project folder's: where docker-compose.yml is) with
- every secret generated (MinIO's users, each Redis ACL user, the internal token, the
  collector's bearer keys — one for you, one for the environment workers — and
  Grafana's), letters and digits only (they are embedded in redis:// URLs);
- NEXTSTATE_MODEL_DIR: `--model PATH` (an HF folder), or the demo model converted once
  (services/ctl/models.py) in the dtype the profile's engine serves (`compose_dtype`: bf16
  for SGLang on the `gpu` profile, VLLM_DTYPE for `vllm`, else float32; a change of
  profile moves a demo folder to the new dtype's); made readable by every user, since
  the images run as uid 10001 and read it through a bind mount (a folder this user does
  not own and others cannot read is refused, with the paths to fix);
- COMPOSE_PROFILES (and ENGINE_KIND=vllm for the vllm profile);
- with `--offline`, COMPOSE_FILE naming deploy/compose/offline.yml, after building its
  base images (deploy/offline/bases.sh) unless `--no-bases`. Its builds use the classic
  builder: compose takes DOCKER_BUILDKIT=0 from the environment only (not from .env), so
  the printed next step says so.

An existing `.env` keeps every value it has (secrets stay what the volumes were created
with); only what the flags name changes. It prints the collector's URL and your key.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from services.ctl.models import (
    ensure_default_model,
    is_default_model,
    is_model_folder,
    make_readable,
    served_dtype,
    unreadable,
)

OFFLINE_FILE = "deploy/compose/offline.yml"
BASES = "deploy/offline/bases.sh"
PROFILES = ("cpu", "gpu", "vllm", "ray")
_SECRET_WORDS = ("PASSWORD", "SECRET", "TOKEN", "API_KEY")
_LINE = re.compile(r"^([A-Z_][A-Z0-9_]*)=(.*)$")


def register(sub: Any) -> None:
    p = sub.add_parser("compose", help="set up `docker compose` for this project folder")
    csub = p.add_subparsers(dest="compose_command", required=True, metavar="ACTION")
    init = csub.add_parser("init", help="write .env: secrets, the model folder, the profile")
    init.add_argument("--dir", type=Path, default=Path.cwd(),
                      help="the project folder, with docker-compose.yml (default: here)")
    init.add_argument("--env-file", type=Path, help="where to write (default: DIR/.env)")
    init.add_argument("--model", help="an HF model folder (default: the demo model, SmolLM2-135M-Instruct)")
    init.add_argument("--profile", choices=PROFILES, default=None, help="the stack (default: cpu)")
    init.add_argument("--offline", action="store_true",
                      help=f"no image registry: build the base images here and use {OFFLINE_FILE}")
    init.add_argument("--no-bases", action="store_true", help=f"with --offline: do not run {BASES}")
    init.add_argument("--port", type=int, help="the collector's host port (default 8000)")
    init.add_argument("--bind", help="the collector's host address (default 127.0.0.1: this machine only)")
    p.set_defaults(func=main)


def secret() -> str:
    return secrets.token_hex(24)


def is_secret(name: str) -> bool:
    return any(w in name for w in _SECRET_WORDS) or name.endswith("_KEYS")


def read_env(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if m := _LINE.match(line.strip()):
                out[m.group(1)] = m.group(2)
    return out


def render(template: str, values: dict[str, str]) -> str:
    """`template` (.env.example) with `values` put in; names it lacks go at the top."""
    lines, seen = [], set()
    for line in template.splitlines():
        m = _LINE.match(line)
        if m and m.group(1) in values:
            seen.add(m.group(1))
            line = f"{m.group(1)}={values[m.group(1)]}"
        lines.append(line)
    extra = [f"{k}={v}" for k, v in values.items() if k not in seen]
    head = ["# Written by `nextstate compose init`; keep it private (it holds every secret).", *extra, ""]
    return "\n".join(head + lines) + "\n"


def choose(args: argparse.Namespace, example: dict[str, str], current: dict[str, str]) -> dict[str, str]:
    """The values of the new .env: the current ones, secrets generated where empty, the flags."""
    values = {**example, **{k: v for k, v in current.items() if v != ""}}
    for name in example:
        if is_secret(name) and not values.get(name):
            values[name] = secret()
    keys = [k.strip() for k in values["NEXTSTATE_COLLECTOR__API_KEYS"].split(",") if k.strip()]
    if values["ENVS_API_KEY"] not in keys:  # the environment workers' key must be a collector key
        values["NEXTSTATE_COLLECTOR__API_KEYS"] = ",".join([*keys, values["ENVS_API_KEY"]])
    if args.profile is not None or not current.get("COMPOSE_PROFILES"):
        profile = args.profile or "cpu"
        values["COMPOSE_PROFILES"] = profile
        values["ENGINE_KIND"] = "vllm" if profile == "vllm" else "sglang"
    if args.port is not None:
        values["COLLECTOR_PORT"] = str(args.port)
    if args.bind is not None:
        values["COLLECTOR_BIND"] = args.bind
    if args.offline:
        values["COMPOSE_FILE"] = f"docker-compose.yml:{OFFLINE_FILE}"
    return values


def compose_dtype(values: dict[str, str]) -> str:
    """The dtype the stack of `values` serves the demo model in: SGLang (profile gpu) bf16,
    vLLM (profile vllm) VLLM_DTYPE, our CPU engine float32."""
    profiles = {p.strip() for p in values.get("COMPOSE_PROFILES", "cpu").split(",")}
    if "gpu" in profiles:
        return served_dtype("sglang")
    if "vllm" in profiles:
        return served_dtype("vllm", values.get("VLLM_DTYPE") or "auto")
    return served_dtype("cpu")


def model_folder(arg: str | None, current: str | None, dtype: str = "float32") -> Path:
    if arg is None and current and not is_default_model(Path(current)):
        return Path(current)
    model = Path(arg).expanduser().resolve() if arg else ensure_default_model(dtype=dtype)
    if not is_model_folder(model):
        raise SystemExit(f"nextstate compose init: {model} is not an HF model folder (config.json, *.safetensors)")
    make_readable(model)
    bad = unreadable(model)
    if bad:
        listed = ", ".join(str(p) for p in bad[:5])
        raise SystemExit(f"nextstate compose init: the containers (uid 10001) cannot read {listed}: "
                         f"chmod -R a+rX {model}")
    return model


def main(args: argparse.Namespace) -> int:
    project = args.dir.resolve()
    example_path = project / ".env.example"
    if not (project / "docker-compose.yml").is_file() or not example_path.is_file():
        print(f"nextstate compose init: {project} has no docker-compose.yml and .env.example "
              "(run it in the project folder, or pass --dir)", file=sys.stderr)
        return 2
    env_path = (args.env_file or project / ".env").resolve()
    template = example_path.read_text()
    current = read_env(env_path)
    values = choose(args, read_env(example_path), current)
    values["NEXTSTATE_MODEL_DIR"] = str(model_folder(args.model, current.get("NEXTSTATE_MODEL_DIR"),
                                                     compose_dtype(values)))
    if args.offline and not args.no_bases:
        if shutil.which("docker") is None:
            print("nextstate compose init: --offline builds images: install Docker first "
                  "(`make docker` as root)", file=sys.stderr)
            return 1
        print("building the base images (deploy/offline/bases.sh)…", file=sys.stderr)
        if subprocess.run(["bash", str(project / BASES)], cwd=project).returncode != 0:
            print("nextstate compose init: building the base images failed", file=sys.stderr)
            return 1
    fd = os.open(env_path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(render(template, values))
    os.replace(env_path.with_suffix(".tmp"), env_path)
    bind = values.get("COLLECTOR_BIND", "127.0.0.1")
    host = "127.0.0.1" if bind in ("0.0.0.0", "") else bind
    user_key = values["NEXTSTATE_COLLECTOR__API_KEYS"].split(",")[0]
    print(f"wrote {env_path} (profile {values['COMPOSE_PROFILES']}, model {values['NEXTSTATE_MODEL_DIR']}"
          f"{', offline images' if args.offline else ''})")
    print(f"collector: http://{host}:{values.get('COLLECTOR_PORT', '8000')}/v1  (OPENAI_API_KEY={user_key})")
    build = "DOCKER_BUILDKIT=0 docker compose build" if values.get("COMPOSE_FILE", "").endswith(OFFLINE_FILE) \
        else "docker compose build"
    print(f"next: {build} && docker compose up -d   # then: docker compose run --rm ctl status")
    return 0
