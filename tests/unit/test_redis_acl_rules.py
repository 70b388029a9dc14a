"""The Redis ACL rules (services/ctl/redis_acl.py) without a server: their shape, the
container script that writes them, who gets which URL under `up`, and prod's refusal of
a Redis URL without a password. Against a real redis-server: tests/integration/test_redis_acl*.py."""

from __future__ import annotations

import io
import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import services.ctl.redis_acl as redis_acl
from services.ctl.__main__ import build_parser
from services.ctl.supervisor import Proc, Supervisor
from services.ctl.up import Stack
from shared.errors import SettingsError
from shared.settings import Settings, load_settings, redis_url_has_password

PASSWORDS = {u: f"pw{i}x{u}" for i, u in enumerate(redis_acl.USERS)}


def test_service_roles_get_no_admin_and_no_key_outside_the_prefix() -> None:
    for role in redis_acl.ROLES:
        rules = redis_acl.rules(role, "exp")
        text = " ".join(rules)
        assert "+@all" not in text and "~*" not in text and "&" not in text, role
        assert "-@admin" in rules and "-@dangerous" in rules, role
        assert "resetchannels" in rules and "-@all" in rules, role
        for pattern in re.findall(r"(?:%R|%W)?~(\S+?)(?=[ )]|$)", text):
            # rq's keys (outside any prefix): the evaluator's and envs' workers, enqueuing (ctl
            # too), and the envs queue's length (keda's scaler).
            rq_ok = (role in ("evaluator", "envs", "ctl") and pattern.startswith("rq:")) or (
                role == "keda" and pattern == "rq:queue:exp-envs")
            assert pattern.startswith("exp:") or rq_ok, (role, pattern)
        assert "+eval" not in rules and "+@scripting" not in text
    assert redis_acl.rules(redis_acl.ADMIN, "exp") == ["~*", "&*", "+@all"]


def test_what_each_role_may_touch() -> None:
    def keys_of(role: str) -> set[str]:
        return set(re.findall(r"~exp:(\S+?)(?=[ )]|$)", " ".join(redis_acl.rules(role, "exp"))))

    assert "batches" not in keys_of("collector") and "turns" in keys_of("collector")
    assert "batches" not in keys_of("judge") and "done:judge:*" in keys_of("judge")
    assert "turns" not in keys_of("trainer") and "scored" not in keys_of("trainer")
    assert {"policy", "policy-version", "watcher-state", "refused-versions"} <= keys_of("watcher")
    assert not {"turns", "batches", "checkpoints"} & keys_of("watcher")
    assert keys_of("keda") == {"turns"}
    assert "turns" not in keys_of("envs") and "scored" not in keys_of("envs")
    assert redis_acl.rules("ctl", "exp")[0] == "~exp:*"
    # The watcher's only DEL is on policy-version: a selector of its own.
    (selector,) = [r for r in redis_acl.rules("watcher", "exp") if "+del" in r]
    assert selector == "(%W~exp:policy-version +set +del)"


def test_the_evaluator_touches_its_queues_keys_only() -> None:
    """Its stream work under the prefix; in rq's namespace only the eval queue `exp-eval`, its
    registries, workers named after it and evaluation jobs (`eval_2e…`); for its `env:<name>`
    suites, enqueuing episodes on `exp-envs` and reading their results; the state of a
    model's evaluation (`eval run --model`), written only; no Pub/Sub, no INFO."""
    rules = redis_acl.rules("evaluator", "exp")
    text = " ".join(rules)
    ours = set(re.findall(r"~exp:(\S+?)(?=[ )]|$)", text))
    assert ours == {"checkpoints", "done:evaluator:*", "evals", "dead", "eval-enqueued:*",
                    "episode-enqueued:*", "eval-episodes:*", "model-eval:*"}
    assert "(%R~exp:eval-episodes:* +hgetall +hlen)" in rules  # the workers write them
    assert "(%W~exp:model-eval:* +hset +expire)" in rules  # the CLI reads it
    rq = set(re.findall(r"~(rq:\S+?)(?=[ )]|$)", text))
    allowed = re.compile(r"rq:(queues|workers|suspended|[a-z_]+:exp-eval(:intermediate\*|\.\*)?|"
                         r"(job:?|results|execution|executions):eval_2e\*|"
                         r"job:episode_2e\*|queue:exp-envs|workers:exp-envs)")
    assert rq and all(allowed.fullmatch(k) for k in rq), rq
    assert "~rq:*" not in text and "&" not in text and "+info" not in text and "+@pubsub" not in text
    assert "(%W~exp:evals +xadd)" in rules  # publishes results, reads none
    assert "%R~rq:suspended" in text  # `rq suspend` is the operator's
    # Enqueuing is the operator's too (`nextstate eval run`), and nobody else's.
    assert "(~rq:job:eval_2e* ~rq:queue:exp-eval +evalsha +exists +hset +expire +rpush +lpush)" in \
        redis_acl.rules("ctl", "exp")
    assert "(%R~rq:workers:exp-envs +scard)" in rules
    for role in ("collector", "judge", "buffer", "trainer", "watcher"):
        assert "rq:" not in " ".join(redis_acl.rules(role, "exp")), role
    assert "(%R~rq:queue:exp-envs +llen)" in redis_acl.rules("keda", "exp")  # KEDA's listLength, only


def test_the_envs_workers_touch_their_queue_and_the_outcomes_only() -> None:
    """The outcomes stream (published once: the script's keys and its marker), rq's keys of
    the envs queue `exp-envs` and episode jobs (`episode_2e…`); nothing of the loop's data."""
    rules = redis_acl.rules("envs", "exp")
    text = " ".join(rules)
    ours = set(re.findall(r"~exp:(\S+?)(?=[ )]|$)", text))
    assert ours == {"outcomes", "shed:outcomes", "outcome-published:*", "eval-episodes:*"}
    assert "(%W~exp:eval-episodes:* +hset +expire)" in rules  # evaluation results: written, never read
    rq = set(re.findall(r"~(rq:\S+?)(?=[ )]|$)", text))
    allowed = re.compile(r"rq:(queues|workers|suspended|[a-z_]+:exp-envs(:intermediate\*|\.\*)?|"
                         r"(job:?|results|execution|executions):episode_2e\*)")
    assert rq and all(allowed.fullmatch(k) for k in rq), rq
    assert "eval" not in " ".join(k for k in rq) and "+info" not in text and "+@pubsub" not in text
    # Enqueuing episodes and reading the queue's state are the operator's (`nextstate envs run/status`).
    ctl = redis_acl.rules("ctl", "exp")
    assert "(~rq:job:episode_2e* ~rq:queue:exp-envs +evalsha +exists +hset +expire +rpush +lpush)" in ctl


def test_the_docstring_table_has_every_role() -> None:
    doc = redis_acl.__doc__ or ""
    for role in redis_acl.USERS:
        assert re.search(rf"^\| {role} \|", doc, re.M), role


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="prefix"):
        redis_acl.rules("judge", "a*")
    with pytest.raises(ValueError, match="unknown Redis role"):
        redis_acl.rules("janitor", "exp")
    with pytest.raises(ValueError, match="no Redis password for keda"):
        redis_acl.aclfile({u: p for u, p in PASSWORDS.items() if u != "keda"}, "exp")


def test_aclfile_and_setuser_hold_hashes_only(tmp_path: Path) -> None:
    text = redis_acl.aclfile(PASSWORDS, "exp")
    lines = text.splitlines()
    assert [line.split()[:4] for line in lines] == [["user", u, "reset", "on"] for u in redis_acl.USERS]
    for password in PASSWORDS.values():
        assert password not in text and f"#{redis_acl.password_hash(password)}" in text
    cmds = redis_acl.setuser_commands(PASSWORDS, "exp")
    assert [c[:4] for c in cmds] == [["ACL", "SETUSER", u, "reset"] for u in redis_acl.USERS]
    path = redis_acl.write_aclfile(tmp_path / "run" / "redis.acl", PASSWORDS, "exp")
    assert path.read_text() == text and (path.stat().st_mode & 0o777) == 0o600
    assert not list(path.parent.glob("*.tmp"))


def test_new_passwords_are_url_safe_and_distinct() -> None:
    pw = redis_acl.new_passwords()
    assert set(pw) == set(redis_acl.USERS) and len(set(pw.values())) == len(pw)
    assert all(re.fullmatch(r"[0-9a-f]{48}", p) for p in pw.values())
    url = redis_acl.url("judge", pw["judge"], "127.0.0.1", 6390)
    parts = urlsplit(url)
    assert (parts.username, parts.password, parts.port, parts.path) == ("judge", pw["judge"], 6390, "/0")


def _run_script(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = redis_acl.container_script(str(tmp_path / "users.acl"))
    return subprocess.run(["sh", "-c", script], env={"PATH": os.environ["PATH"], **env},
                          capture_output=True, text=True, timeout=30, check=False)


def test_container_script_writes_the_same_aclfile(tmp_path: Path) -> None:
    env = {var: PASSWORDS[u] for u, var in redis_acl.PASSWORD_VARS.items()}
    out = _run_script(tmp_path, {**env, "NEXTSTATE_REDIS__PREFIX": "exp"})
    assert out.returncode == 0, out.stderr
    written = tmp_path / "users.acl"
    assert written.read_text() == redis_acl.aclfile(PASSWORDS, "exp")
    assert (written.stat().st_mode & 0o777) == 0o600


@pytest.mark.parametrize(("var", "value", "says"), [
    ("REDIS_JUDGE_PASSWORD", "", "set REDIS_JUDGE_PASSWORD"),
    ("REDIS_KEDA_PASSWORD", "CHANGE-ME", "set REDIS_KEDA_PASSWORD"),
    ("REDIS_PASSWORD", "has@sign", "REDIS_PASSWORD must be letters and digits"),
    ("NEXTSTATE_REDIS__PREFIX", "bad*prefix", "set NEXTSTATE_REDIS__PREFIX"),
])
def test_container_script_refuses_unset_placeholder_or_unsafe_values(
    tmp_path: Path, var: str, value: str, says: str
) -> None:
    env = {v: PASSWORDS[u] for u, v in redis_acl.PASSWORD_VARS.items()}
    out = _run_script(tmp_path, {**env, "NEXTSTATE_REDIS__PREFIX": "exp", var: value})
    assert out.returncode == 1 and says in out.stderr
    assert not (tmp_path / "users.acl").exists()


def test_cli_prints_the_script_and_the_aclfile(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    assert redis_acl.main(["script", "--compose"]) == 0
    assert capsys.readouterr().out == redis_acl.container_script(users=redis_acl.COMPOSE_USERS).replace("$", "$$")
    for user, var in redis_acl.PASSWORD_VARS.items():
        monkeypatch.setenv(var, PASSWORDS[user])
    assert redis_acl.main(["aclfile", "--prefix", "exp"]) == 0
    assert capsys.readouterr().out == redis_acl.aclfile(PASSWORDS, "exp")
    monkeypatch.delenv("REDIS_CTL_PASSWORD")
    assert redis_acl.main(["setuser"]) == 1
    assert "no Redis password for ctl" in capsys.readouterr().err


# -- up: each process its own user ----------------------------------------------------------------
class Recorder(Supervisor):
    async def start_together(self, procs: Sequence[Proc]) -> list[bool]:
        self.procs.extend(procs)
        return [True] * len(procs)


async def test_up_gives_each_service_its_roles_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("NEXTSTATE_")]:
        monkeypatch.delenv(name)
    args = build_parser().parse_args(["up", "--home", str(tmp_path), "--judges", "2"])
    stack = Stack(args, load_settings(Settings), Recorder(out=io.StringIO()))
    stack.redis_urls = {u: redis_acl.url(u, p, "127.0.0.1", 6390) for u, p in PASSWORDS.items()}
    await stack.services(tmp_path / "model")
    users = {p.name: urlsplit(p.env["NEXTSTATE_REDIS__URL"]).username
             for p in stack.sup.procs if "NEXTSTATE_REDIS__URL" in p.env}
    assert users == {"collector": "collector", "judge-0": "judge", "judge-1": "judge",
                     "buffer": "buffer", "trainer": "trainer", "watcher": "watcher",
                     "evaluator": "evaluator"}
    assert "engine" not in users and "eval-engine" not in users  # they never use Redis


# -- prod: a Redis URL without a password is refused ------------------------------------------------
@pytest.fixture
def prod(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("NEXTSTATE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("NEXTSTATE_ENV", "prod")
    monkeypatch.setenv("NEXTSTATE_BUCKET__ACCESS_KEY", "real")
    monkeypatch.setenv("NEXTSTATE_BUCKET__SECRET_KEY", "real-secret")
    monkeypatch.setenv("NEXTSTATE_INTERNAL__TOKEN", "0123456789abcdef0123")


@pytest.mark.parametrize("url", ["redis://redis:6379/0", "redis://judge@redis:6379/0",
                                 "redis://judge:@redis:6379/0", "unix:///run/redis.sock?db=0"])
def test_prod_refuses_a_redis_url_without_password(prod: None, monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("NEXTSTATE_REDIS__URL", url)
    with pytest.raises(SettingsError, match="NEXTSTATE_REDIS__URL carries no password"):
        load_settings(Settings)


@pytest.mark.parametrize("url", ["redis://judge:s3cret@redis:6379/0", "redis://:s3cret@redis:6379/0",
                                 "rediss://judge:s3cret@redis:6380/1", "unix:///run/redis.sock?password=s3cret"])
def test_prod_takes_a_redis_url_with_password(prod: None, monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("NEXTSTATE_REDIS__URL", url)
    assert load_settings(Settings).redis.url == url
    assert redis_url_has_password(url)


def test_prod_without_any_redis_url_is_a_service_without_redis(prod: None) -> None:
    assert load_settings(Settings).env == "prod"  # the engine: never sets it, never connects


def test_dev_takes_a_redis_url_without_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NEXTSTATE_ENV", raising=False)
    monkeypatch.setenv("NEXTSTATE_REDIS__URL", "redis://127.0.0.1:6379/0")
    assert load_settings(Settings).env == "dev"
