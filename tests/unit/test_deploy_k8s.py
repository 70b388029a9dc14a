"""deploy/k8s: the kustomize base and the GPU overlay, checked by parsing them.

No cluster runs here. The manifests are read as YAML (and rendered with `kubectl
kustomize` when kubectl is installed): every file is in the kustomization, every
workload has probes and resources, every Secret/ConfigMap/PVC reference resolves, every
`NEXTSTATE_*` variable is a real settings field, KEDA scales the judge StatefulSet on
the stream and group that shared/keys.py names, every consumer has a stable name,
Redis fsyncs every write, only the trainer, watcher, buffer and evaluator reach the
bucket, each as its own MinIO user, which the bucket-init Job creates (run here with a
stand-in `mc`), and each evaluator pod carries its own evaluation engine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from services.ctl import bucket_roles, redis_acl
from shared import keys as K
from shared.consumer import consumer_name
from shared.errors import SettingsError
from shared.settings import load_settings
from tests.unit.test_deploy_compose import (
    check_settings_env,
    module_entrypoint_exists,
    python_module,
    settings_class,
    settings_group,
    unknown_env_vars,
)
from tests.unit.test_deploy_compose import services as compose_services

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "deploy/k8s/base"
GPU = REPO / "deploy/k8s/overlays/gpu"
VLLM = REPO / "deploy/k8s/overlays/vllm"
JUDGE_MODEL = REPO / "deploy/k8s/components/judge-model"
JUDGE_MODEL_OVERLAY = REPO / "deploy/k8s/overlays/judge-model"
WORKLOADS = ("Deployment", "StatefulSet")
OUR_IMAGES = ("nextstate-light", "nextstate-torch")
VALID_REDIS_URL = "redis://:Passw0rd@redis:6379/0"
VALID_TOKEN = "0123456789abcdef0123456789abcdef"
# The workloads that use the bucket, each named after its MinIO role (services/ctl/bucket_roles.py).
BUCKET_ROLES = bucket_roles.ROLES
BUCKET_SETTINGS = ("NEXTSTATE_BUCKET__ENDPOINT", "NEXTSTATE_BUCKET__NAME", "NEXTSTATE_BUCKET__SECURE",
                   "NEXTSTATE_BUCKET__REGION")


def kustomization(folder: Path) -> dict[str, Any]:
    doc = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert isinstance(doc, dict)
    return doc


def base_docs() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for name in kustomization(BASE)["resources"]:
        docs += [d for d in yaml.safe_load_all((BASE / name).read_text()) if d]
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(docs: list[dict[str, Any]], kinds: tuple[str, ...] = WORKLOADS
               ) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(container name, pod spec, container) for every container of every workload (of
    `kinds`). A workload's main container is named after it (`evaluator`); a sidecar has
    a name of its own (`eval-engine`)."""
    for d in docs:
        if d["kind"] in kinds:
            spec = d["spec"]["template"]["spec"]
            for c in spec["containers"]:
                yield c["name"], spec, c


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(NAME)` in an env value: an earlier variable's value (`$$` escapes)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


def container_env(c: dict[str, Any], docs: list[dict[str, Any]]) -> dict[str, str]:
    """The container's environment as the pod sees it: ConfigMaps and Secrets resolved,
    `$(NAME)` references expanded."""
    maps = by_kind(docs, "ConfigMap")
    secrets = by_kind(docs, "Secret")
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        if "configMapRef" in src:
            env.update(maps[src["configMapRef"]["name"]]["data"])
        if "secretRef" in src:
            env.update(secrets[src["secretRef"]["name"]]["stringData"])
    for item in c.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env)
        else:
            ref = item["valueFrom"].get("secretKeyRef") or item["valueFrom"]["configMapKeyRef"]
            source = secrets[ref["name"]]["stringData"] if "secretKeyRef" in item["valueFrom"] \
                else maps[ref["name"]]["data"]
            env[item["name"]] = str(source[ref["key"]])
    return env


def ours(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], str]]:
    for name, _, c in containers(docs):
        if c["image"] in OUR_IMAGES:
            module = python_module(list(c.get("command", [])) + list(c.get("args", [])))
            assert module is not None, f"{name}: {c.get('command')} is not python -m services.x"
            yield name, c, module


def test_kustomization_lists_every_file() -> None:
    listed = set(kustomization(BASE)["resources"])
    present = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present, f"unlisted {present - listed}, missing {listed - present}"
    for folder in (GPU, VLLM):
        overlay = kustomization(folder)
        assert overlay["resources"] == ["../../base"]
        patches = {p["path"] for p in overlay["patches"]}
        assert patches == {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
    assert kustomization(BASE)["namespace"] == by_kind(base_docs(), "Namespace").popitem()[0]


def test_every_workload_has_probes_and_resources() -> None:
    docs = base_docs()
    names = {n for n, _, _ in containers(docs)}
    assert {"engine", "collector", "judge", "buffer", "trainer", "watcher", "evaluator", "eval-engine",
            "redis"} <= names
    for name, _, c in containers(docs):
        assert "livenessProbe" in c and "readinessProbe" in c, name
        for part in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][part]), f"{name} {part}"


def test_probes_hit_healthz_and_readyz_on_the_configured_port() -> None:
    docs = base_docs()
    for name, c, module in ours(docs):
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        live, ready = c["livenessProbe"]["httpGet"], c["readinessProbe"]["httpGet"]
        assert (live["path"], ready["path"]) == ("/healthz", "/readyz"), name
        env = container_env(c, docs)
        group = settings_group(module)
        assert int(env[f"NEXTSTATE_{group}__PORT"]) == ports[ready["port"]], name
        assert env[f"NEXTSTATE_{group}__HOST"] == "0.0.0.0", name


def test_commands_are_real_entrypoints() -> None:
    modules = {m for _, _, m in ours(base_docs())}
    assert modules == {f"services.{s}" for s in
                       ("engine", "collector", "judge", "buffer", "trainer", "watcher", "evaluator", "envs")}
    assert all(module_entrypoint_exists(m) for m in modules)


@pytest.mark.parametrize("workload", ["engine", "collector", "judge", "buffer", "trainer", "watcher",
                                      "evaluator", "eval-engine", "envs"])
def test_nextstate_variables_are_settings_fields(workload: str, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = base_docs()
    _, c, module = next(x for x in ours(docs) if x[0] == workload)
    env = container_env(c, docs)
    if "NEXTSTATE_REDIS__URL" in env:  # the template's placeholder password, filled in
        env["NEXTSTATE_REDIS__URL"] = env["NEXTSTATE_REDIS__URL"].replace("CHANGE-ME", "Passw0rd")
    assert "NEXTSTATE_INTERNAL__TOKEN" in env, f"{workload} lacks the internal token"
    env["NEXTSTATE_INTERNAL__TOKEN"] = VALID_TOKEN  # the placeholder, filled in
    settings = check_settings_env(module, env, monkeypatch)
    assert settings.env == "prod"
    assert settings.redis.prefix == K.Keys().prefix
    # Prod refuses default bucket keys only where a bucket is configured: the bucket roles.
    assert ("bucket" in settings.model_fields_set) == (workload in BUCKET_ROLES)
    if workload in BUCKET_ROLES:
        assert settings.bucket.region == bucket_roles.REGION  # narrow roles: no GetBucketLocation


def test_the_secret_template_refuses_to_run_unfilled(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = by_kind(base_docs(), "Secret")["nextstate-secrets"]["stringData"]
    assert all(v.startswith("CHANGE-ME") for v in secret.values()), "ship placeholders only"
    # Redis refuses to start (its ACL script), naming the first password still CHANGE-ME.
    script = by_kind(base_docs(), "ConfigMap")["redis-acl"]["data"]["users-acl.sh"]
    env = {"PATH": os.environ["PATH"], "NEXTSTATE_REDIS__PREFIX": "nextstate", **secret}
    out = subprocess.run(["sh", "-c", script.replace("/data/", "/nonexistent/")], env=env,
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 1 and "set REDIS_PASSWORD" in out.stderr, out.stderr
    monkeypatch.setenv("NEXTSTATE_REDIS__URL", VALID_REDIS_URL)
    monkeypatch.setenv("NEXTSTATE_INTERNAL__TOKEN", secret["NEXTSTATE_INTERNAL__TOKEN"])
    with pytest.raises(SettingsError, match="NEXTSTATE_INTERNAL__TOKEN"):
        load_settings(settings_class("services.judge"))


def test_every_reference_resolves() -> None:
    docs = base_docs()
    maps, secrets = by_kind(docs, "ConfigMap"), by_kind(docs, "Secret")
    claims = by_kind(docs, "PersistentVolumeClaim")
    for name, spec, c in containers(docs, (*WORKLOADS, "Job")):
        for src in c.get("envFrom", []):
            ref = src.get("configMapRef") or src["secretRef"]
            assert ref["name"] in (maps if "configMapRef" in src else secrets), name
        for item in c.get("env", []):
            ref = item.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in secrets[ref["name"]]["stringData"], f"{name}: {ref}"
            ref = item.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                assert ref["key"] in maps[ref["name"]]["data"], f"{name}: {ref}"
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for v in volumes.values():
            if "configMap" in v:
                assert v["configMap"]["name"] in maps, f"{name}: {v['configMap']}"
        for mount in c.get("volumeMounts", []):
            assert mount["name"] in volumes or name == "redis", f"{name}: {mount['name']}"
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, name
    auth = by_kind(docs, "TriggerAuthentication")
    for ta in auth.values():
        for ref in ta["spec"]["secretTargetRef"]:
            assert ref["key"] in secrets[ref["name"]]["stringData"]


def test_services_select_their_pods() -> None:
    docs = base_docs()
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in WORKLOADS}
    for name, svc in by_kind(docs, "Service").items():
        target = workloads[name]
        assert svc["spec"]["selector"].items() <= target["spec"]["template"]["metadata"]["labels"].items()
        port_names = {p["name"] for c in target["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert all(p["targetPort"] in port_names for p in svc["spec"]["ports"]), name
    assert {"collector", "engine", "buffer", "redis"} <= set(by_kind(docs, "Service"))


def test_keda_scales_the_judge_on_the_judge_group() -> None:
    docs = base_docs()
    scaled = by_kind(docs, "ScaledObject")["judge"]["spec"]
    judge = by_kind(docs, "StatefulSet")[scaled["scaleTargetRef"]["name"]]
    assert judge["metadata"]["name"] == "judge" and scaled["scaleTargetRef"]["kind"] == "StatefulSet"
    assert 1 <= scaled["minReplicaCount"] < scaled["maxReplicaCount"]
    prefix = by_kind(docs, "ConfigMap")["nextstate-config"]["data"]["NEXTSTATE_REDIS__PREFIX"]
    keys = K.Keys(prefix)
    assert keys == K.Keys()  # the manifests use the default prefix
    triggers = scaled["triggers"]
    assert triggers and all(t["type"] == "redis-streams" for t in triggers)
    judge_env = container_env(judge["spec"]["template"]["spec"]["containers"][0], docs)
    for t in triggers:
        meta = t["metadata"]
        assert meta["stream"] == keys.turns == keys.stream(K.TURNS)
        assert meta["consumerGroup"] == K.GROUP_JUDGE == K.GROUPS[K.TURNS]
        assert meta["addressFromEnv"] in judge_env and ":" in judge_env[meta["addressFromEnv"]]
        assert t["authenticationRef"]["name"] in by_kind(docs, "TriggerAuthentication")
    pending = [t["metadata"] for t in triggers if "pendingEntriesCount" in t["metadata"]]
    assert pending and int(pending[0]["pendingEntriesCount"]) <= int(judge_env["NEXTSTATE_JUDGE__CONCURRENCY"])


def test_every_consumer_has_a_stable_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted pod reads its group under the name it had: it takes back its own
    pending entries at once instead of waiting for another consumer's janitor."""
    docs = base_docs()
    sets, deps = by_kind(docs, "StatefulSet"), by_kind(docs, "Deployment")
    judge = sets["judge"]["spec"]
    # Stable pod names come from a StatefulSet and its (headless) governing Service.
    governing = by_kind(docs, "Service")[judge["serviceName"]]["spec"]
    assert governing["clusterIP"] == "None"
    assert governing["selector"].items() <= judge["template"]["metadata"]["labels"].items()
    assert judge["podManagementPolicy"] == "Parallel"
    judge_env = container_env(judge["template"]["spec"]["containers"][0], docs)
    monkeypatch.setattr(socket, "gethostname", lambda: "judge-3")  # the pod's hostname
    assert consumer_name(judge_env["NEXTSTATE_JUDGE__CONSUMER_NAME"], "judge") == "judge-3"

    buffer = deps["buffer"]["spec"]
    assert buffer["replicas"] == 1 and buffer["strategy"]["type"] == "Recreate"  # never two at once
    buffer_env = container_env(buffer["template"]["spec"]["containers"][0], docs)
    assert consumer_name(buffer_env["NEXTSTATE_BUFFER__CONSUMER_NAME"], "buffer") == "buffer"

    trainer = deps["trainer"]["spec"]  # keeps its default name, trainer-<run>
    trainer_env = container_env(trainer["template"]["spec"]["containers"][0], docs)
    assert trainer["replicas"] == 1 and "NEXTSTATE_TRAINER__CONSUMER_NAME" not in trainer_env
    for _, c, _ in ours(docs):
        names = [v for k, v in container_env(c, docs).items() if k.endswith("__CONSUMER_NAME")]
        assert all("{pid}" not in n for n in names), "a per-process name is not stable"


def test_redis_fsyncs_every_write() -> None:
    redis = by_kind(base_docs(), "StatefulSet")["redis"]["spec"]["template"]["spec"]["containers"][0]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command and "--appendfsync always" in command


def test_watcher_and_engine_share_checkpoints() -> None:
    docs = base_docs()
    deps = by_kind(docs, "Deployment")
    watcher, engine = deps["watcher"]["spec"]["template"]["spec"], deps["engine"]["spec"]["template"]["spec"]

    def mount_of(spec: dict[str, Any], claim: str) -> str:
        vol = next(v["name"] for v in spec["volumes"]
                   if v.get("persistentVolumeClaim", {}).get("claimName") == claim)
        return str(next(m["mountPath"] for m in spec["containers"][0]["volumeMounts"] if m["name"] == vol))

    local_dir = container_env(watcher["containers"][0], docs)["NEXTSTATE_WATCHER__LOCAL_DIR"]
    assert mount_of(watcher, "checkpoints") == mount_of(engine, "checkpoints") == local_dir
    affinity = watcher["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert affinity["labelSelector"]["matchLabels"] == deps["engine"]["spec"]["selector"]["matchLabels"]


def test_vllm_overlay_starts_vllm_as_up_does() -> None:
    """The engine's arguments are shared/vllm_engine.py's (what `nextstate up --engine vllm` runs)."""
    from shared.vllm_engine import VLLMLaunch

    c = yaml.safe_load((VLLM / "engine-vllm.yaml").read_text())["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["python", "-m", "services.vllm"] and "--api-key" not in c["args"]
    up_argv, up_env = VLLMLaunch(python="python", threads=1).command(Path("/models/policy"), 30000, "0.0.0.0")
    assert c["args"] == [str(a) for a in up_argv[3:]]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["VLLM_SERVER_DEV_MODE"] == up_env["VLLM_SERVER_DEV_MODE"] and env["HF_HUB_OFFLINE"] == "1"


def test_gpu_overlay_patches() -> None:
    engine = yaml.safe_load((GPU / "engine-sglang.yaml").read_text())
    c = engine["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["python3", "-m", "sglang.launch_server"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["args"][c["args"].index("--port") + 1] == "30000"
    assert c["args"][c["args"].index("--model-path") + 1] == "/models/policy"
    trainer = yaml.safe_load((GPU / "trainer-cuda.yaml").read_text())
    t = trainer["spec"]["template"]["spec"]["containers"][0]
    assert t["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "NEXTSTATE_TRAINER__DEVICE", "value": "cuda"} in t["env"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("folder", [BASE, GPU, VLLM, JUDGE_MODEL_OVERLAY], ids=["base", "gpu", "vllm", "judge-model"])
def test_kustomize_renders(folder: Path) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "nextstate", d["metadata"]["name"]
    engine = by_kind(docs, "Deployment")["engine"]["spec"]["template"]["spec"]["containers"][0]
    if folder == GPU:
        assert engine["image"].startswith("lmsysorg/sglang")
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
    elif folder == VLLM:
        assert engine["image"].startswith("nextstate-vllm") and engine["command"][2] == "services.vllm"
        assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
        env = {e["name"]: e for e in engine["env"]}
        assert env["VLLM_SERVER_DEV_MODE"]["value"] == "1" and "secretKeyRef" in env["NEXTSTATE_INTERNAL__TOKEN"]["valueFrom"]
        workloads = {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}
        for name in ("collector", "judge", "watcher"):
            c = workloads[name]["spec"]["template"]["spec"]["containers"][0]
            assert {"name": f"NEXTSTATE_{name.upper()}__ENGINE_KIND", "value": "vllm"} in c["env"], name
    else:
        assert engine["image"].startswith("nextstate-torch")
    check_bucket_access(docs)  # the GPU trainer too: the patch keeps the base's bucket


def test_every_workload_gets_the_internal_token_and_sglang_checks_it() -> None:
    docs = base_docs()
    for name, c, _ in ours(docs):
        refs = {i["name"]: i["valueFrom"]["secretKeyRef"] for i in c["env"] if "valueFrom" in i}
        assert refs["NEXTSTATE_INTERNAL__TOKEN"] == {"name": "nextstate-secrets",
                                                     "key": "NEXTSTATE_INTERNAL__TOKEN"}, name
    # SGLang (GPU overlay) gets it as --api-key, expanded by Kubernetes from the container's
    # environment, which the patch keeps from the base engine container.
    patch = yaml.safe_load((GPU / "engine-sglang.yaml").read_text())["spec"]["template"]["spec"]
    args = patch["containers"][0]["args"]
    assert args[args.index("--api-key") + 1] == "$(NEXTSTATE_INTERNAL__TOKEN)"
    engine = by_kind(docs, "Deployment")["engine"]["spec"]["template"]["spec"]["containers"][0]
    assert "NEXTSTATE_INTERNAL__TOKEN" in {i["name"] for i in engine["env"]}
    # Probes never need it: SGLang's are on /health (open there too).
    assert {patch["containers"][0][p]["httpGet"]["path"] for p in
            ("startupProbe", "livenessProbe", "readinessProbe")} == {"/health"}


# Each service's own Redis ACL user (services/ctl/redis_acl.py); the engine has none.
REDIS_ROLES = {"collector": "collector", "judge": "judge", "buffer": "buffer", "trainer": "trainer",
               "watcher": "watcher", "evaluator": "evaluator", "envs": "envs"}


def test_each_service_connects_to_redis_as_its_own_user() -> None:
    docs = base_docs()
    secret = by_kind(docs, "Secret")["nextstate-secrets"]["stringData"]
    for name, c, _ in ours(docs):
        env = container_env(c, docs)
        role = REDIS_ROLES.get(name)
        if role is None:
            assert "NEXTSTATE_REDIS__URL" not in env, f"{name} never uses Redis: no credential"
            continue
        url = urlsplit(env["NEXTSTATE_REDIS__URL"])
        assert (url.username, url.hostname, url.port, url.path) == (role, "redis", 6379, "/0"), name
        password_ref = next(i for i in c["env"] if i["name"] == "REDIS_USER_PASSWORD")
        assert password_ref["valueFrom"]["secretKeyRef"]["key"] == redis_acl.PASSWORD_VARS[role], name
        assert url.password == secret[redis_acl.PASSWORD_VARS[role]], name
    assert set(REDIS_ROLES) == {n for n, _, _ in ours(docs)} - {"engine", "eval-engine"}


def test_redis_has_the_acl_users_of_the_module() -> None:
    """The Redis pod writes its aclfile with the module's script (the same users and rules),
    from a password per user in the Secret, then runs redis-server with it and AOF.
    Run for real in tests/integration/test_redis_acl_deploy.py."""
    docs = base_docs()
    assert by_kind(docs, "ConfigMap")["redis-acl"]["data"]["users-acl.sh"] == redis_acl.container_script()
    secret = by_kind(docs, "Secret")["nextstate-secrets"]["stringData"]
    assert set(redis_acl.PASSWORD_VARS.values()) <= set(secret)
    pod = by_kind(docs, "StatefulSet")["redis"]["spec"]["template"]["spec"]
    (redis,) = pod["containers"]
    assert redis["command"][:2] == ["sh", "-c"]
    assert redis["command"][2] == ("sh /etc/redis-acl/users-acl.sh && exec docker-entrypoint.sh redis-server "
                                   "--aclfile /data/users.acl --appendonly yes --appendfsync always")
    mount = next(m for m in redis["volumeMounts"] if m["mountPath"] == "/etc/redis-acl")
    assert next(v for v in pod["volumes"] if v["name"] == mount["name"])["configMap"]["name"] == "redis-acl"
    env = container_env(redis, docs)
    for var in redis_acl.PASSWORD_VARS.values():
        assert env[var] == secret[var]
    assert env["NEXTSTATE_REDIS__PREFIX"] == K.Keys().prefix
    assert env["REDISCLI_AUTH"] == secret["REDIS_PASSWORD"]  # the probes' redis-cli is the admin


def test_keda_scales_the_envs_workers_on_the_queue_length() -> None:
    """KEDA's redis `listLength` trigger on rq's list of the envs queue (`rq:queue:<name>`,
    rq/queue.py `redis_queue_namespace_prefix`), read as the keda user."""
    from rq import Queue

    docs = base_docs()
    scaled = by_kind(docs, "ScaledObject")["envs"]["spec"]
    assert scaled["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "envs"}
    envs = by_kind(docs, "Deployment")["envs"]
    assert 1 <= scaled["minReplicaCount"] < scaled["maxReplicaCount"]
    (t,) = scaled["triggers"]
    meta = t["metadata"]
    assert t["type"] == "redis" and int(meta["listLength"]) >= 1
    assert meta["listName"] == Queue.redis_queue_namespace_prefix + K.Keys().envs_queue == "rq:queue:nextstate-envs"
    env = container_env(envs["spec"]["template"]["spec"]["containers"][0], docs)
    assert ":" in env[meta["addressFromEnv"]] and env[meta["usernameFromEnv"]] == "keda"
    assert t["authenticationRef"]["name"] in by_kind(docs, "TriggerAuthentication")
    assert f"(%R~{meta['listName']} +llen)" in redis_acl.rules("keda", "nextstate")


def test_keda_reads_the_backlog_as_the_keda_user() -> None:
    docs = base_docs()
    (auth,) = by_kind(docs, "TriggerAuthentication")["redis-auth"]["spec"]["secretTargetRef"]
    assert (auth["parameter"], auth["key"]) == ("password", redis_acl.PASSWORD_VARS["keda"])
    judge = by_kind(docs, "StatefulSet")["judge"]["spec"]["template"]["spec"]["containers"][0]
    judge_env = container_env(judge, docs)
    for t in by_kind(docs, "ScaledObject")["judge"]["spec"]["triggers"]:
        assert judge_env[t["metadata"]["usernameFromEnv"]] == "keda"


# -- the bucket: one MinIO user per role ---------------------------------------------------
def bucket_access(c: dict[str, Any]) -> tuple[set[str], dict[str, str]]:
    """The ConfigMaps a container reads whole, and its bucket-related variables with the
    Secret key each comes from ("" for a literal value)."""
    maps = {src["configMapRef"]["name"] for src in c.get("envFrom", []) if "configMapRef" in src}
    refs = {i["name"]: i.get("valueFrom", {}).get("secretKeyRef", {}).get("key", "") for i in c.get("env", [])}
    bucket = {k: v for k, v in refs.items()
              if k.startswith(("NEXTSTATE_BUCKET__", "MINIO_")) or v.startswith(("BUCKET_", "MINIO_"))}
    return maps, bucket


def role_keys(role: str) -> dict[str, str]:
    return {"NEXTSTATE_BUCKET__ACCESS_KEY": f"BUCKET_{role.upper()}_ACCESS_KEY",
            "NEXTSTATE_BUCKET__SECRET_KEY": f"BUCKET_{role.upper()}_SECRET_KEY"}


def check_bucket_access(docs: list[dict[str, Any]]) -> None:
    """Trainer, watcher, buffer and evaluator read nextstate-bucket and their own role's keys;
    every other container (the evaluator's engine sidecar too) configures no bucket and holds
    no bucket or MinIO key."""
    seen = set()
    for name, _, c in containers(docs):
        maps, bucket = bucket_access(c)
        if name in BUCKET_ROLES:
            seen.add(name)
            assert "nextstate-bucket" in maps, f"{name} does not read the bucket ConfigMap"
            assert bucket == role_keys(name), f"{name}: {bucket}"
        else:
            assert "nextstate-bucket" not in maps and bucket == {}, f"{name} gets the bucket: {bucket}"
    assert seen == set(BUCKET_ROLES)


def test_only_the_bucket_roles_get_the_bucket_each_with_its_own_keys() -> None:
    docs = base_docs()
    maps = by_kind(docs, "ConfigMap")
    assert not [k for k in maps["nextstate-config"]["data"] if k.startswith("NEXTSTATE_BUCKET__")], \
        "the shared ConfigMap configures a bucket for every service"
    assert set(maps["nextstate-bucket"]["data"]) == set(BUCKET_SETTINGS)
    assert maps["nextstate-bucket"]["data"]["NEXTSTATE_BUCKET__REGION"] == bucket_roles.REGION
    check_bucket_access(docs)
    for name, c, _ in ours(docs):
        env = container_env(c, docs)
        bucket_vars = {k for k in env if k.startswith("NEXTSTATE_BUCKET__")}
        if name in BUCKET_ROLES:
            assert bucket_vars == set(BUCKET_SETTINGS) | set(role_keys(name)), name
        else:
            assert bucket_vars == set(), f"{name} configures a bucket it never uses: {bucket_vars}"
    # One key pair per role in the Secret, no shared pair, and no admin pair: no operator
    # CLI (ctl) runs in these manifests; only bucket-init uses MinIO's root credentials.
    secret = by_kind(docs, "Secret")["nextstate-secrets"]["stringData"]
    bucket_keys = {k for k in secret if k.startswith(("BUCKET_", "NEXTSTATE_BUCKET__", "MINIO_"))}
    assert bucket_keys == {"MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"} | {
        v for role in BUCKET_ROLES for v in role_keys(role).values()}
    for name, _, c in containers(docs, (*WORKLOADS, "Job")):
        module = python_module(list(c.get("command", [])) + list(c.get("args", []))) or ""
        assert module != "nextstate" and not module.startswith("services.ctl"), \
            f"{name} runs the operator CLI: it needs an admin bucket key pair in the Secret"


def test_the_secret_headers_kubectl_command_creates_every_key() -> None:
    text = (BASE / "secret.yaml").read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    named = re.findall(r"--from-literal=([A-Z_]+)=", header)
    secret = by_kind(base_docs(), "Secret")["nextstate-secrets"]["stringData"]
    assert sorted(named) == sorted(secret)


def test_bucket_policies_are_the_modules() -> None:
    """deploy/minio's files cannot be read by kustomize from the base (its load
    restrictor), so the ConfigMap carries copies: they must say what the module says."""
    data = by_kind(base_docs(), "ConfigMap")["bucket-policies"]["data"]
    assert set(data) == {f"nextstate-{role}.json" for role in BUCKET_ROLES}
    for role in BUCKET_ROLES:
        assert json.loads(data[f"nextstate-{role}.json"]) == bucket_roles.minio_policy(role), role
        assert data[f"nextstate-{role}.json"] == (REPO / f"deploy/minio/nextstate-{role}.json").read_text()


def bucket_init(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    job = by_kind(docs, "Job")["bucket-init"]
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    return pod, c


def run_bucket_init(tmp_path: Path, docs: list[dict[str, Any]], secret: dict[str, str]
                    ) -> tuple[subprocess.CompletedProcess[str], list[list[str]]]:
    """The Job's script under sh with the Secret's values, a stand-in `mc` on PATH that
    records its arguments (one call a line, NUL between them)."""
    for d in docs:
        if d["kind"] == "Secret":
            d["stringData"] = secret
    _, c = bucket_init(docs)
    assert c["command"][:2] == ["/bin/sh", "-c"]
    log = tmp_path / "mc.log"
    log.unlink(missing_ok=True)
    fake = tmp_path / "bin" / "mc"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(f'#!/bin/sh\nprintf "%s\\0" "$@" >> {log}\necho >> {log}\n')
    fake.chmod(0o755)
    env = {**container_env(c, docs), "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    out = subprocess.run(["sh", "-c", c["command"][2]], env=env, capture_output=True, text=True,
                         timeout=30, check=False)
    calls = [line.split("\0")[:-1] for line in log.read_text().splitlines()] if log.exists() else []
    return out, calls


def test_bucket_init_creates_one_user_per_role_with_its_policy(tmp_path: Path) -> None:
    docs = base_docs()
    pod, c = bucket_init(docs)
    # Pinned like compose's bucket-init; MinIO's endpoint and bucket from nextstate-bucket.
    assert c["image"] == compose_services()["bucket-init"]["image"]
    assert ":" in c["image"] and not c["image"].endswith(":latest")
    assert "nextstate-bucket" in bucket_access(c)[0]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "policies")
    assert next(v for v in pod["volumes"] if v["name"] == "policies")["configMap"]["name"] == "bucket-policies"
    assert pod["restartPolicy"] in ("OnFailure", "Never")

    secret = {k: f"Filled{k.title().replace('_', '')}0123" for k in
              by_kind(docs, "Secret")["nextstate-secrets"]["stringData"]}
    out, calls = run_bucket_init(tmp_path, docs, secret)
    assert out.returncode == 0, out.stderr
    bucket = by_kind(docs, "ConfigMap")["nextstate-bucket"]["data"]
    assert calls[0] == ["alias", "set", "store", f"http://{bucket['NEXTSTATE_BUCKET__ENDPOINT']}",
                        secret["MINIO_ROOT_USER"], secret["MINIO_ROOT_PASSWORD"]]
    assert calls[1] == ["mb", "--ignore-existing", f"store/{bucket['NEXTSTATE_BUCKET__NAME']}"]
    for role in BUCKET_ROLES:
        access, secret_key = (secret[k] for k in role_keys(role).values())
        policy = f"nextstate-{role}"
        assert ["admin", "policy", "create", "store", policy, f"{mount['mountPath']}/{policy}.json"] in calls
        assert ["admin", "user", "add", "store", access, secret_key] in calls
        assert ["admin", "policy", "attach", "store", policy, "--user", access] in calls
    assert len(calls) == 2 + 3 * len(BUCKET_ROLES)


def test_bucket_init_refuses_placeholders_and_shared_users(tmp_path: Path) -> None:
    docs = base_docs()
    template = dict(by_kind(docs, "Secret")["nextstate-secrets"]["stringData"])
    out, calls = run_bucket_init(tmp_path, docs, template)
    assert out.returncode == 1 and "set MINIO_ROOT_USER" in out.stderr and calls == [], out.stderr
    filled = {k: f"Filled{k.title().replace('_', '')}0123" for k in template}
    out, calls = run_bucket_init(tmp_path, docs, {**filled, "BUCKET_BUFFER_SECRET_KEY": "CHANGE-ME"})
    assert out.returncode == 1 and "set BUCKET_BUFFER_SECRET_KEY" in out.stderr and calls == []
    shared = {**filled, "BUCKET_WATCHER_ACCESS_KEY": filled["BUCKET_TRAINER_ACCESS_KEY"]}
    out, calls = run_bucket_init(tmp_path, docs, shared)
    assert out.returncode == 1 and "must differ" in out.stderr and calls == []
    # An external store over TLS: SECURE "true" makes it https.
    for d in docs:
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "nextstate-bucket":
            d["data"]["NEXTSTATE_BUCKET__SECURE"] = "true"
    out, calls = run_bucket_init(tmp_path, docs, filled)
    assert out.returncode == 0 and calls[0][3].startswith("https://"), out.stderr


def test_each_evaluator_pod_carries_its_own_evaluation_engine() -> None:
    """The evaluator talks to the engine beside it in its pod, never the serving `engine`
    Service: scaling the Deployment scales engines with workers. Candidates go through a
    volume of the pod's own (the evaluator installs, the engine reads)."""
    docs = base_docs()
    evaluator = by_kind(docs, "Deployment")["evaluator"]["spec"]
    pod = evaluator["template"]["spec"]
    by_name = {c["name"]: c for c in pod["containers"]}
    assert set(by_name) == {"evaluator", "eval-engine"}
    main, engine = by_name["evaluator"], by_name["eval-engine"]
    env = container_env(main, docs)
    engine_env = container_env(engine, docs)
    assert env["NEXTSTATE_EVAL__ENGINE_URL"] == f"http://127.0.0.1:{engine_env['NEXTSTATE_ENGINE__PORT']}"
    assert json.loads(env["NEXTSTATE_EVAL__SUITES"]) == ["demo", "drift"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    local_dir = env["NEXTSTATE_EVAL__LOCAL_DIR"]

    def mount(c: dict[str, Any], path: str) -> dict[str, Any]:
        return next(m for m in c["volumeMounts"] if m["mountPath"] == path)

    shared = mount(main, local_dir)
    assert "emptyDir" in volumes[shared["name"]] and not shared.get("readOnly")
    assert mount(engine, local_dir) == {**shared, "readOnly": True}
    for c in (main, engine):  # the base model: the engine serves it, drift's reference reads it
        assert volumes[mount(c, "/models/policy")["name"]]["persistentVolumeClaim"]["claimName"] == "nextstate-models"
    assert "checkpoints" not in {v.get("persistentVolumeClaim", {}).get("claimName") for v in volumes.values()}
    assert not [s for s in by_kind(docs, "Service") if s == "evaluator"]  # nothing calls it
    assert consumer_name(env["NEXTSTATE_EVAL__CONSUMER_NAME"], "evaluator").startswith("evaluator-")
    patch = yaml.safe_load((GPU / "evaluator-sglang.yaml").read_text())["spec"]["template"]["spec"]
    (sglang,) = patch["containers"]
    assert sglang["name"] == "eval-engine" and sglang["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert sglang["args"][sglang["args"].index("--port") + 1] == engine_env["NEXTSTATE_ENGINE__PORT"]
    assert sglang["args"][sglang["args"].index("--api-key") + 1] == "$(NEXTSTATE_INTERNAL__TOKEN)"
    assert "securityContext" not in patch  # root for the SGLang container only, not the evaluator


def test_the_judge_model_component_gives_the_judges_an_engine_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """components/judge-model: our CPU engine serving the judge model (the policy's base weights
    unless its volume is patched) as `judge`, with probes, resources and the internal token,
    never the served checkpoints; the judges' patch points them at it, and their settings
    send it the token. overlays/judge-model is the base with it."""
    docs = [d for d in yaml.safe_load_all((JUDGE_MODEL / "judge-model.yaml").read_text()) if d]
    component = kustomization(JUDGE_MODEL)
    assert component["kind"] == "Component" and set(component["resources"]) == {"judge-model.yaml"}
    assert kustomization(JUDGE_MODEL_OVERLAY)["components"] == ["../../components/judge-model"]
    service, deployment = by_kind(docs, "Service")["judge-model"], by_kind(docs, "Deployment")["judge-model"]
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    (name, spec, c), = containers(docs)
    assert name == "judge-model"
    assert python_module(c["command"]) == "services.engine" and c["image"] == "nextstate-torch"
    env = {e["name"]: e for e in c["env"]}
    assert env["NEXTSTATE_ENGINE__SERVED_MODEL_NAME"]["value"] == "judge"
    assert env["NEXTSTATE_INTERNAL__TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "nextstate-secrets", "key": "NEXTSTATE_INTERNAL__TOKEN"}
    assert {"livenessProbe", "readinessProbe"} <= set(c) and {"cpu", "memory"} <= set(c["resources"]["limits"])
    (mount,) = c["volumeMounts"]
    assert mount["mountPath"] == env["NEXTSTATE_ENGINE__MODEL"]["value"] and mount["readOnly"]
    (volume,) = spec["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == "nextstate-models"  # not `checkpoints`
    patch = yaml.safe_load((JUDGE_MODEL / "judge-uses-judge-model.yaml").read_text())
    judge_env = {e["name"]: e["value"] for e in patch["spec"]["template"]["spec"]["containers"][0]["env"]}
    base_judge = next(c for n, _, c in containers(base_docs()) if n == "judge")
    merged = {**container_env(base_judge, base_docs()), **judge_env,  # the Secret's values filled in
              "NEXTSTATE_INTERNAL__TOKEN": VALID_TOKEN, "NEXTSTATE_REDIS__URL": VALID_REDIS_URL}
    assert merged["NEXTSTATE_JUDGE__URL"] == merged["NEXTSTATE_JUDGE__JUDGE_ENGINE_URL"] == "http://judge-model:30000"
    assert merged["NEXTSTATE_JUDGE__ENGINE_URL"] == "http://engine:30000"  # OPD's teacher: the policy
    settings = check_settings_env("services.judge", merged, monkeypatch)
    key = settings.judge.api_key  # type: ignore[attr-defined]
    assert key is not None and key.get_secret_value() == VALID_TOKEN


COMPONENTS = REPO / "deploy/k8s/components"


def test_the_lora_components_set_real_settings_and_the_engines_lora_flags() -> None:
    """components/lora switches the trainer and the clients (real settings fields); lora-vllm
    gives vLLM shared/vllm_engine.py's LoRA flags; lora-sglang gives both SGLang engines theirs."""
    from shared.vllm_engine import VLLMLaunch

    classes = {"trainer": "services.trainer", "collector": "services.collector", "judge": "services.judge"}
    seen = set()
    for patch in kustomization(COMPONENTS / "lora")["patches"]:
        doc = yaml.safe_load((COMPONENTS / "lora" / patch["path"]).read_text())
        name = doc["metadata"]["name"]
        names = [e["name"] for e in doc["spec"]["template"]["spec"]["containers"][0]["env"]]
        assert unknown_env_vars(settings_class(classes[name]), names) == [], name
        seen.add(name)
    assert seen == set(classes)

    def appended(component: str, target: str) -> list[Any]:
        patch = next(p for p in kustomization(COMPONENTS / component)["patches"] if p["target"]["name"] == target)
        return [op["value"] for op in yaml.safe_load(patch["patch"]) if op["path"].endswith("/args/-")]

    up_argv, _ = VLLMLaunch(python="python", threads=1, lora_rank=16).command(Path("/models/policy"), 30000)
    assert appended("lora-vllm", "engine") == up_argv[up_argv.index("--enable-lora"):]
    for target in ("engine", "evaluator"):
        assert appended("lora-sglang", target) == ["--enable-lora", "--max-lora-rank", "16",
                                                   "--lora-target-modules", "all"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("overlay,engine", [("gpu", "sglang"), ("vllm", "vllm")])
def test_the_lora_components_render_onto_their_overlay(overlay: str, engine: str, tmp_path: Path) -> None:
    shutil.copytree(REPO / "deploy/k8s", tmp_path / "k8s")  # kustomize takes no absolute roots
    folder = tmp_path / "k8s/overlays/mine"
    folder.mkdir()
    (folder / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [f"../{overlay}"],
        "components": ["../../components/lora", f"../../components/lora-{engine}"]}))
    out = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in WORKLOADS}
    args = workloads["engine"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--enable-lora" in args and args[args.index("--max-lora-rank") + 1] == "16"
    trainer = {e["name"]: e.get("value") for e in workloads["trainer"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert trainer["NEXTSTATE_TRAINER__LORA"] == "true" and trainer["NEXTSTATE_TRAINER__LORA_RANK"] == "16"
