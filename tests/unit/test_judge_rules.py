"""The rule judge, plugin judges (loading and results), settings validation."""

from __future__ import annotations

from typing import Any

import pytest

from services.judge.judges import PluginError, PluginJudge, RuleJudge, build_judge, load_plugin
from services.judge.parsing import Score
from services.judge.settings import DEFAULT_NEGATIVE, DEFAULT_POSITIVE, JudgeConfig, JudgeSettings
from shared.errors import SettingsError
from shared.schemas import Turn
from shared.settings import load_settings

NOT_CALLABLE = 42


def turn(next_state: list[dict[str, Any]] | None) -> Turn:
    return Turn(
        session_id="s", messages=[{"role": "user", "content": "hi"}],
        response={"role": "assistant", "content": "hello"}, next_state=next_state,
    )  # fmt: skip


def plugin_sync(t: Turn) -> int:
    return -1 if "bad" in str(t.next_state) else 1


async def plugin_async(t: Turn) -> tuple[int, str]:
    return 0, "async says ambiguous"


def plugin_bad_value(t: Turn) -> int:
    return 2


def plugin_bool(t: Turn) -> bool:
    return True


def plugin_raises(t: Turn) -> int:
    raise RuntimeError("plugin broke")


class Scorer:
    async def __call__(self, t: Turn) -> int:
        return -1


scorer_instance = Scorer()


RULE = RuleJudge(list(DEFAULT_POSITIVE), list(DEFAULT_NEGATIVE))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Thanks, that's perfect!", 1),
        ("thank you", 1),
        ("It works now.", 1),
        ("Process finished with exit code 0", 1),
        ("Correct.", 1),
        ("That's wrong, try again.", -1),
        ("Traceback (most recent call last):\n  File x", -1),
        ("This is not what I asked for", -1),
        ("Please retry", -1),
        ("exit code 2", -1),
        ("It doesn't work", -1),
        ("not correct", -1),
        ("That is incorrect", -1),
        ("What about tomorrow?", 0),  # no cue
        ("Thanks, but it is still wrong", 0),  # cues both ways
        ("", 0),
    ],
)
def test_rule_scores(text: str, expected: Score) -> None:
    assert RULE.score(text)[0] == expected


async def test_rule_judge_reads_the_whole_next_state() -> None:
    verdict = await RULE.judge(turn([{"role": "tool", "content": "ERROR: file not found"}]))
    assert verdict.reward == -1 and verdict.judge == "rule"
    assert verdict.votes[0].score == -1 and "ERROR" in verdict.votes[0].text
    tools_then_user = [{"role": "tool", "content": "42"}, {"role": "user", "content": "perfect"}]
    assert (await RULE.judge(turn(tools_then_user))).reward == 1


async def test_rule_lists_are_configurable() -> None:
    judge = build_judge(JudgeConfig(type="rule", positive=[r"\bship it\b"], negative=[r"\bnope\b"]), None)
    assert (await judge.judge(turn([{"role": "user", "content": "Ship it!"}]))).reward == 1
    assert (await judge.judge(turn([{"role": "user", "content": "nope"}]))).reward == -1
    assert (await judge.judge(turn([{"role": "user", "content": "thanks"}]))).reward == 0


async def test_plugins_sync_async_and_callable_objects() -> None:
    sync = PluginJudge("tests.unit.test_judge_rules:plugin_sync")
    v = await sync.judge(turn([{"role": "user", "content": "bad"}]))
    assert v.reward == -1 and v.judge == "tests.unit.test_judge_rules:plugin_sync"
    assert (await sync.judge(turn([{"role": "user", "content": "fine"}]))).reward == 1
    v = await PluginJudge("tests.unit.test_judge_rules:plugin_async").judge(turn([]))
    assert v.reward == 0 and v.votes[0].text == "async says ambiguous"
    v = await PluginJudge("tests.unit.test_judge_rules:scorer_instance").judge(turn([]))
    assert v.reward == -1
    dotted = build_judge(JudgeConfig(type="tests.unit.test_judge_rules:scorer_instance.__call__"), None)
    assert (await dotted.judge(turn([]))).reward == -1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tests.unit.test_judge_rules:plugin_bad_value", r"must be a number in \[-1, 1\]"),
        ("tests.unit.test_judge_rules:plugin_bool", r"must be a number in \[-1, 1\]"),
        ("tests.unit.test_judge_rules:plugin_raises", "raised RuntimeError: plugin broke"),
    ],
)
async def test_plugin_bad_results_fail_the_turn(spec: str, message: str) -> None:
    with pytest.raises(PluginError, match=message):
        await PluginJudge(spec).judge(turn([]))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:judge", "cannot import 'no_such_module_xyz'"),
        ("tests.unit.test_judge_rules:missing", "has no 'missing'"),
        ("tests.unit.test_judge_rules:NOT_CALLABLE", "is a int, not callable"),
        ("tests.unit.test_judge_rules", "expected module:callable"),
        (":f", "expected module:callable"),
    ],
)
def test_plugin_loading_errors(spec: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_plugin(spec)


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXTSTATE_JUDGE__VOTES", "5")
    monkeypatch.setenv("NEXTSTATE_JUDGE__TYPE", "rule+prm")
    monkeypatch.setenv("NEXTSTATE_JUDGE__API_KEY", "sk-secret")
    monkeypatch.setenv("NEXTSTATE_JUDGE__URL", "https://api.example.com/v1/")
    s = load_settings(JudgeSettings)
    assert s.judge.votes == 5 and s.judge.needed == 3 and s.judge.type == "rule+prm"
    assert s.judge.url == "https://api.example.com/v1"
    assert "sk-secret" not in repr(s)  # the key never shows in reprs or logs


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"NEXTSTATE_JUDGE__TYPE": "llm"}, "NEXTSTATE_JUDGE__TYPE"),
        ({"NEXTSTATE_JUDGE__MODE": "opd"}, "NEXTSTATE_JUDGE__ENGINE_URL and NEXTSTATE_JUDGE__TOKENIZER"),
        ({"NEXTSTATE_JUDGE__VOTES": "3", "NEXTSTATE_JUDGE__QUORUM": "4"}, "quorum 4 exceeds votes 3"),
        ({"NEXTSTATE_JUDGE__URL": "localhost:3000"}, "NEXTSTATE_JUDGE__URL"),
        ({"NEXTSTATE_JUDGE__NEGATIVE": '["(unclosed"]'}, "invalid regular expression"),
    ],
)
def test_settings_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], names: str) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SettingsError, match=names):
        load_settings(JudgeSettings)


def test_quorum_default_is_a_majority() -> None:
    assert [JudgeConfig(votes=m).needed for m in (1, 2, 3, 4, 5)] == [1, 2, 2, 3, 3]
    assert JudgeConfig(votes=3, quorum=1).needed == 1


def test_verdict_grammar_constrains_prm_votes_only() -> None:
    """VERDICT_GRAMMAR: the PRM votes' /generate bodies carry the three-label grammar and the
    verdict-only prompt; hint calls stay free text; it needs the sglang backend and labels."""
    from services.judge.backend import VERDICT_EBNF, SGLangTextBackend

    cfg = JudgeConfig(backend="sglang", verdict_grammar=True, max_tokens=8)
    assert cfg.prompt_version == "prm-verdict-v1"
    backend = SGLangTextBackend(cfg)
    messages = [{"role": "user", "content": "turn"}]
    assert backend.body(messages, "prm")["sampling_params"] == {
        "temperature": 0.6, "max_new_tokens": 8, "ebnf": VERDICT_EBNF}
    assert "ebnf" not in backend.body(messages, "hint")["sampling_params"]
    assert "ebnf" not in SGLangTextBackend(JudgeConfig(backend="sglang")).body(messages, "prm")["sampling_params"]
    assert VERDICT_EBNF == 'root ::= "\\\\boxed{" ("1" | "0" | "-1") "}"'
    for bad in ({"backend": "openai"}, {"backend": "sglang", "scores": "graded"}):
        with pytest.raises(ValueError, match="VERDICT_GRAMMAR"):
            JudgeConfig(verdict_grammar=True, **bad)  # type: ignore[arg-type]
