"""The compose pieces that need no Docker engine: the offline override, the Dockerfiles'
build arguments, `nextstate compose init`, the model folder's modes, and `.env` through
a real shell's `source`. (tests/e2e/test_compose.py runs them all in Docker.)"""

from __future__ import annotations

import argparse
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from services.ctl import bucket_roles, compose, infra
from services.ctl.models import make_readable, unreadable
from services.evaluator.settings import EvalConfig
from tests.unit.test_deploy_compose import ENV_EXAMPLE, REPO, parse_env_file
from tests.unit.test_deploy_compose import compose as render_compose

OFFLINE = REPO / "deploy/compose/offline.yml"
DOCKERFILES = sorted((REPO / "deploy").glob("Dockerfile.*")) + sorted((REPO / "deploy/offline").glob("Dockerfile.*"))


class ComposeLoader(yaml.SafeLoader):
    """YAML with compose's merge tags (`!reset`, `!override`): read as plain values."""


for _tag in ("!reset", "!override"):
    ComposeLoader.add_constructor(
        _tag, lambda loader, node: loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode)
        else loader.construct_mapping(node) if isinstance(node, yaml.MappingNode) else loader.construct_scalar(node))


def load_entrypoint() -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location("s3_entrypoint", REPO / "deploy/offline/s3_entrypoint.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_dockerfile_asks_a_registry_for_its_frontend() -> None:
    """`# syntax=` makes BuildKit pull a frontend image from Docker Hub."""
    for path in DOCKERFILES:
        assert not re.search(r"^#\s*syntax\s*=", path.read_text(), re.M), path


def test_our_dockerfiles_take_the_base_and_the_torch_wheel_as_arguments() -> None:
    for name in ("light", "torch", "vllm"):
        text = (REPO / "deploy" / f"Dockerfile.{name}").read_text()
        assert "ARG PYTHON_IMAGE=python:3.11-slim" in text, name
        froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
        assert all(f.startswith("${") for f in froms), (name, froms)  # no base hard-coded
        if name != "light":
            assert "ARG TORCH_WHEELS_IMAGE=${PYTHON_IMAGE}" in text
            assert "COPY --from=wheels /wheels /wheels" in text


def test_the_torch_image_creates_the_folders_its_volumes_mount_owned_by_its_user() -> None:
    text = (REPO / "deploy/Dockerfile.torch").read_text()
    final = text[text.rindex("\nFROM "):]
    mkdir = re.search(r"mkdir -p ([^\\\n]+)", final)
    chown = re.search(r"chown nextstate:nextstate ([^\\\n]+)", final)
    assert mkdir and chown
    for folder in ("/checkpoints", "/eval-checkpoints", "/var/lib/nextstate"):
        assert folder in mkdir.group(1).split() and folder in chown.group(1).split(), folder
    # and every volume mounted read-write into a torch-image service is one of them
    doc = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    for name, svc in doc["services"].items():
        if "Dockerfile.torch" not in str(svc.get("build", {}).get("dockerfile", "")):
            continue
        for vol in svc.get("volumes", []):
            parts = str(vol).split(":")
            if len(parts) == 2 and not parts[0].startswith(("$", ".", "/")):
                assert parts[1] in chown.group(1).split(), (name, vol)


def test_code_is_copied_after_the_locked_dependencies_so_a_code_change_reuses_them() -> None:
    for name, lock in (("light", "image-light"), ("torch", "${LOCK}")):
        text = (REPO / "deploy" / f"Dockerfile.{name}").read_text()
        install = text.index(f"pip install --require-hashes --no-deps -r /tmp/lock/{lock}.txt")
        assert text.index(f"COPY deploy/lock/{lock}.txt deploy/lock/lock.py") < install
        assert install < text.index(f"lock.py --verify {lock}") < text.index("COPY shared")
        # nothing but the lock installs: no pyproject, no unpinned requirement, no README
        assert "pyproject.toml" not in text and "COPY README.md" not in text
        assert not re.search(r"pip install (?!--require-hashes|--no-deps /wheels|--index-url)", text), name
        # one stage after the wheels: no venv copied between stages on a dependency change
        assert "COPY --from=build" not in text


def test_the_offline_override_swaps_every_third_party_image_and_builds_on_local_bases() -> None:
    base = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    offline = yaml.load(OFFLINE.read_text(), Loader=ComposeLoader)["services"]
    assert set(offline) <= set(base)
    bases = (REPO / "deploy/offline/bases.sh").read_text()
    for name in ("redis", "minio"):
        image = offline[name]["image"]
        assert image.split(":-", 1)[1].rstrip("}") in bases, image  # an image bases.sh builds
    assert offline["bucket-init"]["entrypoint"] == ["python", "-m", "services.ctl.bucket_roles", "init"]
    built = {n for n, s in base.items() if "build" in s and "gpu" not in s.get("profiles", [])}
    assert built <= set(offline), f"built on the official base offline: {built - set(offline)}"
    for name in built:
        build = offline[name]["build"]
        assert build["network"] == "host"
        assert "nextstate-offline/python:3.11" in build["args"]["PYTHON_IMAGE"]
        assert "nextstate-offline/torch-wheels" in build["args"]["TORCH_WHEELS_IMAGE"]


def test_the_offline_s3_grants_what_bucket_roles_grants() -> None:
    s3 = load_entrypoint()
    assert s3.ROLES == bucket_roles.ROLES and s3.READS == bucket_roles.READS  # type: ignore[attr-defined]
    assert s3.WRITES == bucket_roles.WRITES  # type: ignore[attr-defined]
    env = {"MINIO_ROOT_USER": "admin-key", "MINIO_ROOT_PASSWORD": "admin-secret", "BUCKET": "b1",
           **{f"MINIO_{r.upper()}_SECRET": f"{r}-secret" for r in bucket_roles.ROLES}}
    ids = {i["name"]: i for i in s3.identities(env)["identities"]}  # type: ignore[attr-defined]
    assert ids["admin"]["credentials"] == [{"accessKey": "admin-key", "secretKey": "admin-secret"}]
    for role in ("admin", *bucket_roles.ROLES):
        assert ids[role]["actions"] == bucket_roles.weed_actions(role, "b1"), role
        if role != "admin":
            assert ids[role]["credentials"][0]["accessKey"] == f"nextstate-{role}"
    with pytest.raises(SystemExit, match="MINIO_TRAINER_SECRET"):
        s3.identities({k: v for k, v in env.items() if k != "MINIO_TRAINER_SECRET"})  # type: ignore[attr-defined]


def test_no_weed_of_ours_sends_telemetry(tmp_path: Path) -> None:
    s3 = load_entrypoint()
    assert "-master.telemetry=false" in s3.weed_argv(tmp_path / "c.json")  # type: ignore[attr-defined]
    try:
        argv = infra.weed_argv(tmp_path, infra.weed_ports(), "b")
    except infra.MissingBinary:
        pytest.skip("no weed here")
    assert "-master.telemetry=false" in argv


def test_a_shell_that_sources_env_keeps_the_evaluation_suites() -> None:
    """`set -a; . ./.env` before compose strips quotes: the format must survive it."""
    out = subprocess.run(["bash", "-c", f'set -a; . "{ENV_EXAMPLE}"; printf %s "$EVAL_SUITES"'],
                         capture_output=True, text=True, check=True, timeout=10).stdout
    evaluator = render_compose({**filled_env(), "EVAL_SUITES": out})["services"]["evaluator"]
    assert EvalConfig(suites=evaluator["environment"]["NEXTSTATE_EVAL__SUITES"]).suites == ["demo", "drift"]
    # the JSON form a user may still have, before and after a shell took its quotes
    for text in ('["demo","drift"]', "[demo,drift]", "demo, drift"):
        assert EvalConfig(suites=text).suites == ["demo", "drift"], text  # type: ignore[arg-type]


def filled_env() -> dict[str, str]:
    from tests.unit.test_deploy_compose import filled_example_env

    return filled_example_env()


def test_published_ports_are_loopback_by_default_and_chosen_in_env() -> None:
    svcs = render_compose(filled_env())["services"]
    assert svcs["collector"]["ports"] == ["127.0.0.1:8000:8000"]
    assert svcs["buffer"]["ports"] == ["127.0.0.1:8200:8200"]
    svcs = render_compose({**filled_env(), "COLLECTOR_BIND": "0.0.0.0", "COLLECTOR_PORT": "18000",
                           "BUFFER_PORT": "18200"})["services"]
    assert svcs["collector"]["ports"] == ["0.0.0.0:18000:8000"]
    assert svcs["buffer"]["ports"] == ["127.0.0.1:18200:8200"]


def test_the_judge_never_asks_the_serving_engine_by_default() -> None:
    for env in (filled_env(), {k: v for k, v in filled_env().items() if not k.startswith("JUDGE_")}):
        judge = render_compose(env)["services"]["judge"]["environment"]
        assert judge["NEXTSTATE_JUDGE__TYPE"] == "rule"
        assert "engine:" not in judge["NEXTSTATE_JUDGE__URL"]
        assert judge["NEXTSTATE_JUDGE__HINT_SOURCE"] == "rule"
        assert judge["NEXTSTATE_JUDGE__EXPERIENCE_EXTRACTOR"] == "rule"


# -- the model folder ---------------------------------------------------------------------
def test_make_readable_opens_owner_only_folders_and_files(tmp_path: Path) -> None:
    model = tmp_path / "m"
    (model / "sub").mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"x")
    (model / "sub" / "t.json").write_text("{}")
    for p in (model, model / "sub"):
        p.chmod(0o700)
    for p in (model / "model.safetensors", model / "sub" / "t.json"):
        p.chmod(0o600)
    assert len(unreadable(model)) == 4
    make_readable(model)
    assert unreadable(model) == []
    assert stat.S_IMODE((model / "model.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE(model.stat().st_mode) == 0o755


# -- nextstate compose init ------------------------------------------------------------
def project(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    root.mkdir()
    for name in ("docker-compose.yml", ".env.example"):
        (root / name).write_text((REPO / name).read_text())
    return root


def fake_model(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"weights")
    (path / "model.safetensors").chmod(0o600)
    path.chmod(0o700)
    return path


def init(root: Path, *argv: str) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    compose.register(sub)
    args = parser.parse_args(["compose", "init", "--dir", str(root), *argv])
    return int(args.func(args))


def test_compose_init_writes_an_env_compose_accepts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = project(tmp_path)
    model = fake_model(tmp_path / "model")
    assert init(root, "--offline", "--no-bases", "--model", str(model), "--port", "18123") == 0
    env_path = root / ".env"
    assert stat.S_IMODE(env_path.stat().st_mode) == 0o600
    env = parse_env_file(env_path)
    example = parse_env_file(ENV_EXAMPLE)
    secrets = [n for n in example if compose.is_secret(n)]
    assert secrets and all(re.fullmatch(r"[0-9a-f]{48}", env[n]) for n in secrets if n != "NEXTSTATE_COLLECTOR__API_KEYS")
    assert len({env[n] for n in secrets}) == len(secrets)  # every secret its own
    keys = env["NEXTSTATE_COLLECTOR__API_KEYS"].split(",")
    assert len(keys) == 2 and env["ENVS_API_KEY"] == keys[1]
    assert env["COMPOSE_FILE"] == "docker-compose.yml:deploy/compose/offline.yml"
    assert env["COMPOSE_PROFILES"] == "cpu" and env["ENGINE_KIND"] == "sglang"
    assert env["NEXTSTATE_MODEL_DIR"] == str(model) and unreadable(model) == []
    render_compose(env)  # every required variable is set
    out = capsys.readouterr().out
    assert f"http://127.0.0.1:18123/v1  (OPENAI_API_KEY={keys[0]})" in out
    assert "DOCKER_BUILDKIT=0 docker compose build" in out  # compose takes it from the environment only

    # again, with another profile: the secrets stay (the volumes were made with them)
    assert init(root, "--profile", "vllm") == 0
    again = parse_env_file(env_path)
    assert all(again[n] == env[n] for n in secrets)
    assert again["COMPOSE_PROFILES"] == "vllm" and again["ENGINE_KIND"] == "vllm"
    assert again["NEXTSTATE_MODEL_DIR"] == str(model) and again["COLLECTOR_PORT"] == "18123"


def test_compose_init_refuses_a_folder_that_is_no_model_or_that_containers_cannot_read(
        tmp_path: Path) -> None:
    root = project(tmp_path)
    with pytest.raises(SystemExit, match="not an HF model folder"):
        init(root, "--model", str(tmp_path))
    # a folder of another user's, owner-only: not ours to chmod, so refused with the fix
    theirs = fake_model(tmp_path / "theirs")
    if os.getuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    for p in (theirs, *theirs.iterdir()):
        os.chown(p, 12345, 12345)
    with pytest.raises(SystemExit, match=r"cannot read .*chmod -R a\+rX"):
        init(root, "--model", str(theirs))


def test_compose_init_outside_a_project_says_where_to_run_it(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert init(tmp_path, "--model", str(tmp_path)) == 2
    assert "has no docker-compose.yml" in capsys.readouterr().err
