"""docker-compose.yml, .env.example and the Dockerfiles, checked by parsing them.

No Docker engine runs here, so the compose file must be right by construction: every
command is a real entrypoint of the package, every `NEXTSTATE_*` variable is a real
settings field (a typo fails), every secret is a `${VAR:?…}` that .env.example names,
dependencies wait on health, judges scale. The helpers at the top (interpolation,
settings-field resolution) are shared with test_deploy_k8s.py.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import os
import re
import socket
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from pydantic import BaseModel

from services.ctl import redis_acl
from services.evaluator.settings import parse_name_list
from shared.consumer import consumer_name
from shared.settings import Settings, load_settings

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"

# `${NAME}`, `${NAME:-default}`, `${NAME-default}`, `${NAME:?message}`, `${NAME?message}`.
# Innermost first: a default may hold another variable (`${JUDGE_MODEL_DIR:-${NEXTSTATE_MODEL_DIR}}`).
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}$]*))?\}")
_SECRET_WORDS = ("PASSWORD", "SECRET", "API_KEY", "TOKEN")


# -- helpers (also used by test_deploy_k8s.py) --------------------------------------------
def parse_env_file(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        assert sep, f"{path.name}: not NAME=value: {line!r}"
        out[name.strip()] = value.strip()
    return out


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's interpolation: `$$` is a literal `$`; `:?` fails on unset or empty."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        val = env.get(name)
        if op in (":?", "?") and (val is None or (op == ":?" and val == "")):
            raise LookupError(f"{name}: {arg}")
        if op == ":-" and not val:
            return arg
        if op == "-" and val is None:
            return arg
        return val or ""

    def resolve(part: str) -> str:
        while (done := _VAR.sub(one, part)) != part:
            part = done
        return part

    parts = value.split("$$")
    return "$".join(resolve(p) for p in parts)


def interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [interpolate_tree(n, env) for n in node]
    if isinstance(node, dict):
        return {k: interpolate_tree(v, env) for k, v in node.items()}
    return node


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, list):
        for n in node:
            yield from _strings(n)
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(k)
            yield from _strings(v)


def referenced_vars(doc: Any) -> dict[str, str | None]:
    """Every variable interpolated in a parsed YAML document (comments do not count)
    -> its operator (None, ':-', '-', ':?', '?')."""
    found: dict[str, str | None] = {}
    for s in _strings(doc):
        s = s.replace("$$", "")
        while matches := list(_VAR.finditer(s)):
            found.update({m.group(1): m.group(2) for m in matches})
            s = _VAR.sub("x", s)
    return found


def filled_example_env() -> dict[str, str]:
    """.env.example with every value compose requires (`:?`, shipped empty) filled the way a
    user would; optional empty values (e.g. TRAINER_LOSS) stay empty."""
    env = parse_env_file(ENV_EXAMPLE)
    refs = referenced_vars(yaml.safe_load(COMPOSE.read_text()))
    for name, value in env.items():
        if value == "" and refs.get(name) in (":?", "?"):
            env[name] = "./models/policy" if name.endswith("_DIR") else f"Filled{name.title()}0123".replace("_", "")
    return env


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def unknown_env_vars(cls: type[BaseModel], names: list[str]) -> list[str]:
    """The `NEXTSTATE_*` names that are not a field path of `cls` (pydantic-settings would
    silently ignore them: extra="ignore"), e.g. NEXTSTATE_JUDGE__VOTE for votes."""
    bad = []
    for name in names:
        parts = name.removeprefix("NEXTSTATE_").lower().split("__")
        model: type[BaseModel] | None = cls
        for i, part in enumerate(parts):
            field = model.model_fields.get(part) if model is not None else None
            if field is None or "" in parts:
                bad.append(name)
                break
            model = _model_in(field.annotation) if i < len(parts) - 1 else None
    return bad


def settings_class(module: str) -> type[Settings]:
    """The Settings subclass of `services.<x>` (the shared Settings for the CLI)."""
    if module == "nextstate":
        return Settings
    mod = importlib.import_module(f"{module}.settings")
    found = [
        obj for obj in vars(mod).values()
        if inspect.isclass(obj) and issubclass(obj, Settings) and obj.__module__ == mod.__name__
    ]
    assert len(found) == 1, f"{module}.settings defines {len(found)} Settings classes"
    return found[0]


def check_settings_env(module: str, env: Mapping[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Every NEXTSTATE_* name is a real field, and the values validate (load_settings)."""
    cls = settings_class(module)
    names = [n for n in env if n.startswith("NEXTSTATE_")]
    assert unknown_env_vars(cls, names) == [], f"{module}: not settings fields"
    for name in [n for n in os.environ if n.startswith("NEXTSTATE_")]:
        monkeypatch.delenv(name)
    for name in names:
        monkeypatch.setenv(name, str(env[name]))
    return load_settings(cls)


def python_module(argv: list[str]) -> str | None:
    """`python -m services.x` -> "services.x"; the `nextstate` script -> "nextstate".
    The Ray nodes of profile `ray` -> "ray"; `sh -c "ray start … && exec python -m services.x"`
    (the trainer's driver joining its node first) -> "services.x"."""
    if argv[:1] == ["nextstate"]:
        return "nextstate"
    if argv[:2] == ["ray", "start"]:
        return "ray"
    if len(argv) >= 3 and argv[0] in ("python", "python3") and argv[1] == "-m":
        return argv[2]
    if len(argv) == 3 and argv[:2] == ["sh", "-c"] and (m := re.search(r"&& exec (python3? -m \S+)$", argv[2])):
        return python_module(m.group(1).split())
    return None


# A service's settings group when it is not the module's name (NEXTSTATE_EVAL__* for the evaluator).
SETTINGS_GROUPS = {"services.evaluator": "EVAL"}


def settings_group(module: str) -> str:
    """`services.judge` -> "JUDGE": the group of NEXTSTATE_<GROUP>__* its settings read."""
    return SETTINGS_GROUPS.get(module, module.split(".")[-1].upper())


def module_entrypoint_exists(module: str) -> bool:
    if module == "ray":  # Ray's CLI, from the `ray` extra the ray image installs
        return '"ray[train]' in (REPO / "pyproject.toml").read_text()
    if module == "nextstate":
        pyproject = (REPO / "pyproject.toml").read_text()
        found = re.search(r'^nextstate\s*=\s*"([\w.]+):\w+"', pyproject, re.M)
        return found is not None and (REPO / (found.group(1).replace(".", "/") + ".py")).is_file()
    return module.startswith("services.") and (REPO / module.replace(".", "/") / "__main__.py").is_file()


# -- the compose file ---------------------------------------------------------------------
def compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    raw = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(raw, dict)
    return dict(interpolate_tree(raw, filled_example_env() if env is None else env))


def services() -> dict[str, dict[str, Any]]:
    return dict(compose()["services"])


def ours() -> Iterator[tuple[str, dict[str, Any], str]]:
    """Services built from our Dockerfiles, with their package entrypoint."""
    for name, svc in services().items():
        if "build" in svc or str(svc.get("image", "")).startswith("nextstate-"):
            argv = list(svc.get("entrypoint") or []) + list(svc.get("command") or [])
            module = python_module(argv)
            assert module is not None, f"{name}: command {argv} is not python -m / nextstate"
            yield name, svc, module


def long_running(svc: Mapping[str, Any]) -> bool:
    return bool(svc.get("restart", "no") != "no")


# Keys of a compose-spec service this file may use; anything else is likely a typo.
KNOWN_SERVICE_KEYS = {
    "build", "command", "container_name", "depends_on", "deploy", "entrypoint", "environment",
    "env_file", "healthcheck", "image", "init", "ipc", "networks", "ports", "profiles",
    "restart", "shm_size", "stop_grace_period", "ulimits", "volumes", "user", "working_dir",
    "labels", "logging", "expose", "extra_hosts", "read_only", "tmpfs", "security_opt", "secrets",
    "pull_policy",
}


def test_top_level_shape() -> None:
    doc = compose()
    assert set(doc) <= {"name", "services", "volumes", "networks", "configs", "secrets"} | {
        k for k in doc if k.startswith("x-")
    }
    for name, svc in doc["services"].items():
        assert set(svc) <= KNOWN_SERVICE_KEYS, f"{name}: unknown keys {set(svc) - KNOWN_SERVICE_KEYS}"


def test_required_variables_are_in_env_example_and_secrets_ship_empty() -> None:
    refs = referenced_vars(yaml.safe_load(COMPOSE.read_text()))
    example = parse_env_file(ENV_EXAMPLE)
    assert set(refs) <= set(example), f"not in .env.example: {sorted(set(refs) - set(example))}"
    required = {n for n, op in refs.items() if op in (":?", "?")}
    assert {"MINIO_ROOT_PASSWORD", "REDIS_PASSWORD", "NEXTSTATE_COLLECTOR__API_KEYS"} <= required
    secrets = [n for n in example if any(w in n for w in _SECRET_WORDS) or n.endswith("_KEYS")]
    assert secrets and all(example[n] == "" for n in secrets), "ship no secret values"
    # As shipped (secrets empty), compose refuses to start, naming the variable.
    with pytest.raises(LookupError, match=r"set \w+ in \.env"):
        compose(parse_env_file(ENV_EXAMPLE))


def test_prod_everywhere_with_no_default_credentials() -> None:
    for name, svc, _ in ours():
        env = svc.get("environment") or {}
        assert env.get("NEXTSTATE_ENV") == "prod", name
    raw = COMPOSE.read_text()
    assert "minioadmin" not in raw


def test_commands_are_real_entrypoints() -> None:
    found = {module for _, _, module in ours()}
    assert {"services.engine", "services.collector", "services.judge", "services.buffer",
            "services.trainer", "services.watcher", "services.evaluator", "services.envs", "nextstate"} <= found
    for module in found:
        assert module_entrypoint_exists(module), f"no entrypoint for {module}"


def test_build_contexts_dockerfiles_and_images() -> None:
    for name, svc in services().items():
        if "build" not in svc:
            continue
        context = REPO / svc["build"]["context"]
        dockerfile = context / svc["build"]["dockerfile"]
        assert context.is_dir() and dockerfile.is_file(), name
    light = (REPO / "deploy/Dockerfile.light").read_text()
    torch_df = (REPO / "deploy/Dockerfile.torch").read_text()
    assert "torch" not in re.sub(r"#.*", "", light).lower(), "the light image must not pull torch"
    assert "-r /tmp/lock/image-light.txt" in light  # a lock made of no extra that pulls torch
    assert not re.search(r"^(torch|transformers-cpu|xgrammar|peft)==", (REPO / "deploy/lock/image-light.txt").read_text(), re.M)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in torch_df
    for text in (light, torch_df):
        users = re.findall(r"^USER\s+(\S+)", text, re.M)
        assert users and users[-1] not in ("root", "0"), "images run as a non-root user"
    ignore = (REPO / ".dockerignore").read_text().split()
    assert "*" in ignore and "!shared" in ignore and "!services" in ignore


def test_each_of_our_images_is_built_by_one_service_and_never_pulled() -> None:
    """`docker compose build` builds each image once (the classic builder would build one
    per service, all at once); the services that share it never ask a registry for it."""
    builders: dict[str, list[str]] = {}
    for name, svc in services().items():
        image = str(svc.get("image", ""))
        if not image.startswith("nextstate-"):
            continue
        if "build" in svc:
            builders.setdefault(image, []).append(name)
        else:
            assert svc.get("pull_policy") == "never", f"{name} would try to pull {image}"
    assert all(len(b) == 1 for b in builders.values()), builders
    used = {str(svc["image"]) for svc in services().values() if str(svc.get("image", "")).startswith("nextstate-")}
    assert used == set(builders), f"no service builds {used - set(builders)}"
    # the builders are in every profile that needs their image (the evaluator: all of them)
    assert builders["nextstate-light:latest"] == ["collector"] and "profiles" not in services()["collector"]
    assert builders["nextstate-torch:latest"] == ["evaluator"] and "profiles" not in services()["evaluator"]


def test_third_party_images_are_pinned() -> None:
    """Images we do not build carry a version tag (never `latest`), as compose and
    .env.example default them; our own images are whatever the user built."""
    env = parse_env_file(ENV_EXAMPLE)
    raw = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, svc in raw.items():
        if "image" not in svc or "build" in svc:
            continue
        for image in (interpolate(svc["image"], {}), interpolate(svc["image"], env)):
            if image.startswith("nextstate-"):
                continue
            repo, _, tag = image.rpartition(":")
            assert repo and tag and tag != "latest" and "/" not in tag, f"{name}: {image}"


def test_judge_scales() -> None:
    for name in ("judge", "envs"):  # `--scale judge=N`, `--scale envs=N`
        svc = services()[name]
        assert "container_name" not in svc
        for port in svc.get("ports", []):
            assert ":" not in str(port), f"{name} publishes a fixed host port: {port}"
    assert not any("container_name" in svc for name, svc, _ in ours())


def test_every_consumer_has_a_stable_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted container keeps its hostname, so a judge named after it takes back its
    own pending turns at once; the one buffer and the trainer have fixed names."""
    svcs = services()
    monkeypatch.setattr(socket, "gethostname", lambda: "3f2a9c81b7d4")  # a container's id
    judge = svcs["judge"]["environment"]["NEXTSTATE_JUDGE__CONSUMER_NAME"]
    assert consumer_name(judge, "judge") == "judge-3f2a9c81b7d4"
    assert consumer_name(svcs["buffer"]["environment"]["NEXTSTATE_BUFFER__CONSUMER_NAME"], "buffer") == "buffer"
    evaluator = svcs["evaluator"]["environment"]["NEXTSTATE_EVAL__CONSUMER_NAME"]
    assert consumer_name(evaluator, "evaluator") == "evaluator-3f2a9c81b7d4"
    envs = svcs["envs"]["environment"]["NEXTSTATE_ENVS__CONSUMER_NAME"]
    assert consumer_name(envs, "envs") == "envs-3f2a9c81b7d4"
    for name in ("trainer-cpu", "trainer-gpu"):  # the default, trainer-<run>
        assert "NEXTSTATE_TRAINER__CONSUMER_NAME" not in svcs[name]["environment"]
    for name, svc, _ in ours():
        names = [str(v) for k, v in (svc.get("environment") or {}).items() if k.endswith("__CONSUMER_NAME")]
        assert all("{pid}" not in n for n in names), f"{name}: a per-process name is not stable"


def test_redis_fsyncs_every_write() -> None:
    command = " ".join(services()["redis"]["command"])
    assert "--appendonly yes" in command and "--appendfsync always" in command


def test_long_running_services_have_healthchecks() -> None:
    for name, svc in services().items():
        if long_running(svc):
            test = (svc.get("healthcheck") or {}).get("test")
            assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name} has no healthcheck"


def test_healthchecks_probe_the_configured_port() -> None:
    for name, svc, module in ours():
        if not long_running(svc):
            continue
        url = re.search(r"http://127\.0\.0\.1:(\d+)/(\w+)", " ".join(svc["healthcheck"]["test"]))
        if module == "ray" or name == "trainer-ray":  # Ray's probe (rank 0's /readyz is on a worker)
            assert svc["healthcheck"]["test"][1:3] == ["ray", "health-check"], name
            continue
        if module == "services.vllm":  # vLLM's own open probe, on its --port
            argv = svc["command"]
            assert url and url.group(2) == "health" and argv[argv.index("--port") + 1] == url.group(1), name
            continue
        assert url and url.group(2) in ("readyz", "healthz"), name
        group = settings_group(module)
        assert svc["environment"][f"NEXTSTATE_{group}__PORT"] == url.group(1), name
        assert svc["environment"][f"NEXTSTATE_{group}__HOST"] == "0.0.0.0", name


def test_depends_on_targets_exist_and_wait_for_health() -> None:
    svcs = services()
    for name, svc in svcs.items():
        deps = svc.get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: use the long depends_on form with conditions"
        for target, spec in deps.items():
            assert target in svcs, f"{name} depends on unknown {target}"
            dep = svcs[target]
            if long_running(dep):
                assert "healthcheck" in dep and spec["condition"] == "service_healthy", (name, target)
            else:
                assert spec["condition"] == "service_completed_successfully", (name, target)
            # A dependency outside the dependent's profiles must be optional.
            if set(dep.get("profiles", [])) - set(svc.get("profiles", [])) and dep.get("profiles"):
                assert spec.get("required") is False, f"{name} -> {target} needs required: false"


def test_both_engines_answer_as_engine() -> None:
    svcs = services()
    cpu, gpu, vllm = svcs["engine-cpu"], svcs["engine-gpu"], svcs["engine-vllm"]
    assert cpu["profiles"] == ["cpu", "ray"] and gpu["profiles"] == ["gpu"] and vllm["profiles"] == ["vllm"]
    for svc in (cpu, gpu, vllm):
        assert "engine" in svc["networks"]["default"]["aliases"]
    assert svcs["trainer-cpu"]["profiles"] == ["cpu", "vllm"] and svcs["trainer-gpu"]["profiles"] == ["gpu"]
    # `ray`: the cpu stack with one trainer, on the Ray cluster, instead of trainer-cpu
    assert svcs["trainer-ray"]["profiles"] == ["ray"]
    assert svcs["trainer-ray"]["environment"]["NEXTSTATE_TRAINER__BACKEND"] == "ray"
    for name, var in (("collector", "NEXTSTATE_COLLECTOR__ENGINE_URL"),
                      ("watcher", "NEXTSTATE_WATCHER__ENGINE_URL"),
                      ("judge", "NEXTSTATE_JUDGE__ENGINE_URL")):
        assert svcs[name]["environment"][var] == "http://engine:30000"
    argv = gpu["entrypoint"] + gpu["command"]
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]

    def flag(name: str) -> str:
        return str(argv[argv.index(name) + 1])

    assert flag("--model-path") == "/models/policy" and flag("--host") == "0.0.0.0"
    assert flag("--port") == "30000" and flag("--weight-version") == "0"
    assert "--enable-metrics" in argv


def test_the_vllm_profile_starts_vllm_as_up_does() -> None:
    """The same flags as shared/vllm_engine.py (what `nextstate up --engine vllm` runs), dev mode
    for reloads, and the clients told to speak vLLM's API when ENGINE_KIND=vllm."""
    from shared.vllm_engine import VLLMLaunch

    env = {**filled_example_env(), "COMPOSE_PROFILES": "vllm", "ENGINE_KIND": "vllm"}
    svcs = compose(env)["services"]
    vllm = svcs["engine-vllm"]
    argv = [str(a) for a in vllm["command"]]
    assert argv[:3] == ["python", "-m", "services.vllm"] and "--api-key" not in argv
    up_argv, up_env = VLLMLaunch(python="python", threads=1).command(Path("/models/policy"), 30000, "0.0.0.0")
    value_flags = {a for a, b in itertools.pairwise(up_argv) if a.startswith("--") and not b.startswith("--")}
    for flag in (a for a in up_argv if a.startswith("--")):
        assert flag in argv, flag
        if flag in value_flags - {"--max-model-len", "--max-num-seqs"}:
            assert argv[argv.index(flag) + 1] == up_argv[up_argv.index(flag) + 1], flag
    assert vllm["environment"]["VLLM_SERVER_DEV_MODE"] == up_env["VLLM_SERVER_DEV_MODE"] == "1"
    assert vllm["environment"]["HF_HUB_OFFLINE"] == "1"
    assert vllm["build"]["dockerfile"] == "deploy/Dockerfile.vllm"
    for name, var in (("collector", "NEXTSTATE_COLLECTOR__ENGINE_KIND"), ("watcher", "NEXTSTATE_WATCHER__ENGINE_KIND"),
                      ("judge", "NEXTSTATE_JUDGE__ENGINE_KIND")):
        assert svcs[name]["environment"][var] == "vllm", name
        raw = yaml.safe_load(COMPOSE.read_text())["services"][name]["environment"][var]
        assert raw == "${ENGINE_KIND:-sglang}", name
    dockerfile = (REPO / "deploy/Dockerfile.vllm").read_text()
    assert "--require-hashes --no-deps -r /tmp/lock/vllm.txt" in dockerfile
    assert "COPY deploy/lock/vllm.txt" in dockerfile and "lock.py --verify vllm" in dockerfile
    assert re.findall(r"^USER\s+(\S+)", dockerfile, re.M)[-1] == "nextstate"


def test_gpu_services_reserve_gpus() -> None:
    svcs = services()
    for name in ("engine-gpu", "trainer-gpu"):
        devices = svcs[name]["deploy"]["resources"]["reservations"]["devices"]
        assert any("gpu" in d["capabilities"] and d["driver"] == "nvidia" for d in devices), name
    for name in ("engine-cpu", "trainer-cpu"):
        assert "deploy" not in svcs[name]


def test_checkpoints_volume_is_shared_by_watcher_and_engines() -> None:
    doc = compose()
    svcs = doc["services"]
    local_dir = svcs["watcher"]["environment"]["NEXTSTATE_WATCHER__LOCAL_DIR"]
    assert f"checkpoints:{local_dir}" in svcs["watcher"]["volumes"]
    assert "NEXTSTATE_WATCHER__ENGINE_DIR" not in svcs["watcher"]["environment"]
    for name in ("engine-cpu", "engine-gpu", "engine-vllm"):
        assert f"checkpoints:{local_dir}:ro" in svcs[name]["volumes"], name
        assert "./models/policy:/models/policy:ro" in svcs[name]["volumes"], name
    named = {v.split(":")[0] for s in svcs.values() for v in s.get("volumes", [])
             if not v.startswith((".", "/"))}
    assert named <= set(doc["volumes"]), f"undeclared volumes {named - set(doc['volumes'])}"
    assert any(v.startswith("redis-data:") for v in svcs["redis"]["volumes"])
    assert "--appendonly yes" in " ".join(svcs["redis"]["command"])


def test_only_the_collector_is_published_beyond_loopback() -> None:
    for name, svc in services().items():
        for port in svc.get("ports", []):
            if name != "collector":
                assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port}"


@pytest.mark.parametrize("name", ["engine-cpu", "collector", "judge", "buffer", "trainer-cpu", "trainer-ray",
                                  "trainer-gpu", "watcher", "eval-engine-cpu", "evaluator", "envs", "ctl"])
def test_nextstate_variables_are_settings_fields(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = dict((n, m) for n, _, m in ours())[name]
    if module != "nextstate" and not module_entrypoint_exists(module):
        pytest.fail(f"{module} has no __main__.py yet")
    env = {k: str(v) for k, v in services()[name]["environment"].items()}
    settings = check_settings_env(module, env, monkeypatch)
    assert settings.env == "prod"
    role = REDIS_ROLES.get(name)
    if role is None:  # the engine never uses Redis: it gets no credential
        assert "NEXTSTATE_REDIS__URL" not in env
        return
    url = urlsplit(settings.redis.url)
    assert (url.username, url.hostname, url.port, url.path) == (role, "redis", 6379, "/0")
    assert url.password == filled_example_env()[redis_acl.PASSWORD_VARS[role]]


# Each service's own Redis ACL user (services/ctl/redis_acl.py).
REDIS_ROLES = {"collector": "collector", "judge": "judge", "buffer": "buffer", "trainer-cpu": "trainer",
               "trainer-gpu": "trainer", "trainer-ray": "trainer", "watcher": "watcher", "evaluator": "evaluator",
               "envs": "envs",
               "ctl": "ctl"}


def test_a_typo_fails_the_field_check() -> None:
    judge = settings_class("services.judge")
    assert unknown_env_vars(judge, ["NEXTSTATE_JUDGE__VOTES", "NEXTSTATE_REDIS__URL"]) == []
    assert unknown_env_vars(judge, ["NEXTSTATE_JUDGE__VOTE"]) == ["NEXTSTATE_JUDGE__VOTE"]
    assert unknown_env_vars(judge, ["NEXTSTATE_JUDGE_VOTES"]) == ["NEXTSTATE_JUDGE_VOTES"]
    assert unknown_env_vars(judge, ["NEXTSTATE_REDIS__URL__X"]) == ["NEXTSTATE_REDIS__URL__X"]
    assert unknown_env_vars(judge, ["NEXTSTATE_BUFFER__PORT"]) == ["NEXTSTATE_BUFFER__PORT"]


def test_interpolation_helper() -> None:
    env = {"A": "1", "E": ""}
    assert interpolate("${A}-${B:-x}-${E:-y}-${E-z}-$${A}", env) == "1-x-y--${A}"
    with pytest.raises(LookupError, match="E: need E"):
        interpolate("${E:?need E}", env)
    assert interpolate("${E?need E}", env) == ""
    assert interpolate("${E:-${A}}/${B:-${E:-d}}", env) == "1/d"  # a default holding another variable
    assert referenced_vars({"k": "${J:-${P:?set P}}"}) == {"J": ":-", "P": ":?"}



def test_every_internal_endpoint_gets_the_internal_token() -> None:
    """One token from .env: every service of ours has it, SGLang gets it as --api-key,
    Prometheus sends it (compose secret -> credentials_file); probes stay on open paths."""
    env = filled_example_env()
    token = env["NEXTSTATE_INTERNAL__TOKEN"]
    refs = referenced_vars(yaml.safe_load(COMPOSE.read_text()))
    assert refs["NEXTSTATE_INTERNAL__TOKEN"] == ":?"
    doc = compose(env)
    svcs = doc["services"]
    for name, svc, _ in ours():
        assert svc["environment"]["NEXTSTATE_INTERNAL__TOKEN"] == token, name
    argv = svcs["engine-gpu"]["entrypoint"] + svcs["engine-gpu"]["command"]
    assert argv[argv.index("--api-key") + 1] == token
    assert "/health " in " ".join(svcs["engine-gpu"]["healthcheck"]["test"]) + " "
    assert doc["secrets"]["internal_token"] == {"environment": "NEXTSTATE_INTERNAL__TOKEN"}
    assert svcs["prometheus"]["secrets"] == ["internal_token"]
    prom = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    for job in prom["scrape_configs"]:
        if job["job_name"] != "prometheus":
            assert job["authorization"] == {"type": "Bearer",
                                            "credentials_file": "/run/secrets/internal_token"}, job
    # Without the token compose refuses to start, naming it.
    with pytest.raises(LookupError, match="NEXTSTATE_INTERNAL__TOKEN"):
        compose({**env, "NEXTSTATE_INTERNAL__TOKEN": ""})


REDIS_EXEC = "exec docker-entrypoint.sh redis-server --aclfile /data/users.acl --appendonly yes --appendfsync always\n"


def test_redis_has_a_password_and_one_acl_user_per_role() -> None:
    """Redis runs the module's container script (same users, same rules), then redis-server
    with the aclfile it wrote; every user's password is a required .env secret, the one
    its service's URL carries. Run for real in tests/integration/test_redis_acl_deploy.py."""
    redis = services()["redis"]
    sh, dash_c, script = redis["command"]
    assert (sh, dash_c) == ("sh", "-c")
    assert script == redis_acl.container_script(users=redis_acl.COMPOSE_USERS) + REDIS_EXEC
    env = filled_example_env()
    assert redis["environment"]["NEXTSTATE_REDIS__PREFIX"] == env["NEXTSTATE_PREFIX"]
    refs = referenced_vars(yaml.safe_load(COMPOSE.read_text()))
    for user in redis_acl.COMPOSE_USERS:
        var = redis_acl.PASSWORD_VARS[user]
        assert refs[var] == ":?" and redis["environment"][var] == env[var], user
        with pytest.raises(LookupError, match=var):
            compose({**env, var: ""})
    assert redis["environment"]["REDISCLI_AUTH"] == env["REDIS_PASSWORD"]  # the healthcheck is admin
    urls = {name: svc["environment"].get("NEXTSTATE_REDIS__URL") for name, svc, _ in ours()}
    assert {urlsplit(u).username for u in urls.values() if u} == set(redis_acl.COMPOSE_USERS) - {"default"}
    assert env["REDIS_PASSWORD"] not in {urlsplit(u).password for u in urls.values() if u}  # none is admin


def test_the_compose_file_has_no_duplicate_keys() -> None:
    """docker compose refuses a mapping that names a key twice (e.g. two `<<` merges);
    PyYAML would silently keep the last one."""

    class Strict(yaml.SafeLoader):
        pass

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
        keys = [k.value for k, _ in node.value if isinstance(k, yaml.ScalarNode)]
        dups = {k for k in keys if keys.count(k) > 1}
        assert not dups, f"line {node.start_mark.line + 1}: {dups} given twice"
        return loader.construct_mapping(node)

    Strict.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    yaml.load(COMPOSE.read_text(), Loader=Strict)


def test_each_bucket_user_has_its_role_and_only_the_trainer_writes_checkpoints() -> None:
    """MinIO users per role (bucket-init creates them with deploy/minio's policies);
    services that never touch the bucket get no credentials for it at all."""
    from services.ctl import bucket_roles

    svcs = services()
    users = {name: svc["environment"].get("NEXTSTATE_BUCKET__ACCESS_KEY") for name, svc, _ in ours()}
    assert users["trainer-cpu"] == users["trainer-gpu"] == "nextstate-trainer"
    assert users["watcher"] == "nextstate-watcher" and users["buffer"] == "nextstate-buffer"
    assert users["evaluator"] == "nextstate-evaluator"
    for name in ("collector", "judge", "engine-cpu", "eval-engine-cpu"):
        assert users[name] is None, f"{name} has bucket credentials it does not need"
    env = filled_example_env()
    assert users["ctl"] == env["MINIO_ROOT_USER"]  # the operator: `nextstate rollback`
    init = svcs["bucket-init"]
    assert "./deploy/minio:/policies:ro" in init["volumes"]
    script = init["command"][0]
    for role in bucket_roles.ROLES:
        assert (REPO / "deploy" / "minio" / f"nextstate-{role}.json").is_file()
        assert init["environment"][f"MINIO_{role.upper()}_SECRET"] == env[f"MINIO_{role.upper()}_SECRET"]
    assert f"for role in {' '.join(bucket_roles.ROLES)}; do" in script and "mc admin policy attach" in script


def test_the_evaluator_has_an_evaluation_engine_of_its_own() -> None:
    """Per profile one evaluation engine answers as `eval-engine`, loading the candidates the
    evaluator installs into the volume they share; never the engine users talk to."""
    svcs = services()
    evaluator = svcs["evaluator"]
    env = evaluator["environment"]
    assert env["NEXTSTATE_EVAL__ENGINE_URL"] == "http://eval-engine:30000"
    local_dir = env["NEXTSTATE_EVAL__LOCAL_DIR"]
    assert f"eval-checkpoints:{local_dir}" in evaluator["volumes"]
    cpu, gpu = svcs["eval-engine-cpu"], svcs["eval-engine-gpu"]
    assert cpu["profiles"] == ["cpu", "vllm", "ray"] and gpu["profiles"] == ["gpu"]
    for svc in (cpu, gpu):
        assert svc["networks"]["default"]["aliases"] == ["eval-engine"]
        assert f"eval-checkpoints:{local_dir}:ro" in svc["volumes"]
        assert "./models/policy:/models/policy:ro" in svc["volumes"]
        assert "checkpoints:/checkpoints:ro" not in svc["volumes"]  # the served policy's are not its
    assert set(evaluator["depends_on"]) >= {"eval-engine-cpu", "eval-engine-gpu", "redis", "bucket-init"}
    assert not ({"engine-cpu", "engine-gpu"} & set(evaluator["depends_on"]))
    argv = gpu["entrypoint"] + gpu["command"]
    assert argv[argv.index("--api-key") + 1] == filled_example_env()["NEXTSTATE_INTERNAL__TOKEN"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and device["device_ids"] == ["1"]
    assert "container_name" not in evaluator
    assert parse_name_list(env["NEXTSTATE_EVAL__SUITES"]) == ["demo", "drift"]
    assert env["NEXTSTATE_EVAL__SUITES"] == "demo,drift"  # survives a shell's `source .env`


# .env.example's recipe for each of `nextstate up --mode`'s modes in compose.
MODE_RECIPES = {
    "rl": {"NEXTSTATE_MODE": "rl"},
    "opd": {"NEXTSTATE_MODE": "opd"},
    "combine": {"NEXTSTATE_MODE": "combine"},
    "opd-topk": {"NEXTSTATE_MODE": "opd", "JUDGE_TOPK": "50", "TRAINER_LOSS": "opd_topk"},
    "oel": {"NEXTSTATE_MODE": "opd", "JUDGE_TOPK": "50", "TRAINER_LOSS": "opd_topk",
            "JUDGE_TEACHER": "experience"},
}


@pytest.mark.parametrize("mode", sorted(MODE_RECIPES))
def test_every_up_mode_has_a_compose_recipe(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The judge, buffer and trainer that compose starts with the recipe load and get what
    `nextstate up --mode` gives them without a judge model."""
    from services.ctl.up import MODES, mode_env

    assert set(MODE_RECIPES) == set(MODES)
    text = ENV_EXAMPLE.read_text()
    for name, value in MODE_RECIPES[mode].items():  # the recipe is the one .env.example states
        if name != "NEXTSTATE_MODE" and mode in ("opd-topk", "oel"):
            assert f"{name}={value if name != 'JUDGE_TOPK' else '50'}" in text, name
    env = {**filled_example_env(), **MODE_RECIPES[mode]}
    svcs = compose(env)["services"]
    # As `up`: without a judge model (.env.example ships JUDGE_URL empty) hints and lessons
    # come from the rule judge, never from the engine users talk to.
    assert env["JUDGE_URL"] == ""
    want = mode_env(mode, 50, has_judge_model=False)
    for name, module, role in (("judge", "services.judge", "judge"), ("buffer", "services.buffer", "buffer"),
                               ("trainer-cpu", "services.trainer", "trainer")):
        got = {k: str(v) for k, v in svcs[name]["environment"].items()}
        for key, value in want[role].items():
            assert got.get(key) == value, (mode, name, key)
        check_settings_env(module, got, monkeypatch)  # the service accepts the combination


def test_the_judge_model_has_an_engine_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Profile `judge-model`: our CPU engine serving the judge model (default: the policy's base
    weights; JUDGE_MODEL_DIR another folder) as `judge`, never the `engine` alias nor the
    served checkpoints, published nowhere; the judges send it the internal token once
    JUDGE_URL names it, and a hosted judge never gets the token."""
    svcs = services()
    jm = svcs["judge-model"]
    assert jm["profiles"] == ["judge-model"] and python_module(jm["command"]) == "services.engine"
    env = jm["environment"]
    assert (env["NEXTSTATE_ENGINE__MODEL"], env["NEXTSTATE_ENGINE__SERVED_MODEL_NAME"]) == ("/models/judge", "judge")
    assert jm["volumes"] == ["./models/policy:/models/judge:ro"]  # the policy's base weights, read-only
    other = compose({**filled_example_env(), "JUDGE_MODEL_DIR": "/srv/qwen"})["services"]["judge-model"]
    assert other["volumes"] == ["/srv/qwen:/models/judge:ro"]
    assert "networks" not in jm and "ports" not in jm  # not `engine`, reachable only inside the stack
    assert env["NEXTSTATE_INTERNAL__TOKEN"] == filled_example_env()["NEXTSTATE_INTERNAL__TOKEN"]
    assert "30000" in " ".join(jm["healthcheck"]["test"])
    judge = svcs["judge"]
    assert judge["depends_on"]["judge-model"] == {"condition": "service_healthy", "required": False}
    token = filled_example_env()["NEXTSTATE_INTERNAL__TOKEN"]
    for url, key in (("http://judge-model:30000", token), ("https://api.example.com/v1", None)):
        got = compose({**filled_example_env(), "JUDGE_URL": url, "JUDGE_MODEL": "judge"})["services"]["judge"]
        settings = check_settings_env("services.judge", {k: str(v) for k, v in got["environment"].items()},
                                      monkeypatch)
        api_key = settings.judge.api_key  # type: ignore[attr-defined]
        assert (api_key.get_secret_value() if api_key is not None else None) == key, url


def test_the_lora_override_appends_the_engines_lora_flags_and_nothing_else() -> None:
    """deploy/compose/lora.yml repeats each engine's command with LoRA flags appended (compose
    replaces a command whole); the vLLM flags are shared/vllm_engine.py's with a LoRA rank;
    TRAINER_LORA switches the trainer and the clients."""
    from shared.vllm_engine import VLLMLaunch

    env = {**filled_example_env(), "TRAINER_LORA": "true", "TRAINER_LORA_RANK": "32"}
    base = compose(env)["services"]
    lora = interpolate_tree(yaml.safe_load((REPO / "deploy/compose/lora.yml").read_text()), env)["services"]
    assert set(lora) == {"engine-gpu", "eval-engine-gpu", "engine-vllm"}
    for name in ("engine-gpu", "eval-engine-gpu"):
        argv = [str(a) for a in lora[name]["command"]]
        assert argv == [str(a) for a in base[name]["command"]] + [
            "--enable-lora", "--max-lora-rank", "32", "--lora-target-modules", "all"], name
    argv = [str(a) for a in lora["engine-vllm"]["command"]]
    up_argv, up_env = VLLMLaunch(python="python", threads=1, lora_rank=32).command(Path("/models/policy"), 30000)
    assert argv == [str(a) for a in base["engine-vllm"]["command"]] + up_argv[up_argv.index("--enable-lora"):]
    assert lora["engine-vllm"]["environment"] == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING":
                                                  up_env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]}
    assert base["trainer-cpu"]["environment"]["NEXTSTATE_TRAINER__LORA"] == "true"
    assert base["trainer-cpu"]["environment"]["NEXTSTATE_TRAINER__LORA_RANK"] == "32"
    assert base["collector"]["environment"]["NEXTSTATE_COLLECTOR__ENGINE_ADAPTERS"] == "true"
    assert base["judge"]["environment"]["NEXTSTATE_JUDGE__ENGINE_ADAPTERS"] == "true"
    assert compose()["services"]["collector"]["environment"]["NEXTSTATE_COLLECTOR__ENGINE_ADAPTERS"] == "false"
