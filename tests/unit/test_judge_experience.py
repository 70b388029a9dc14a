"""Experiential learning's pure parts: lessons read from an answer, the session as the
extractor reads it, the rule extractor, the experience block and the teacher prompt,
cross-session ranking, the settings, and what `up --mode` sets for each method."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.ctl.up import MODES, mode_env
from services.judge.experience import (
    EXPERIENCE_HEADER,
    Experience,
    RuleExtractor,
    experience_block,
    rank,
    trajectory,
    user_key,
    with_experience,
)
from services.judge.opd import RuleHints, best_hint
from services.judge.parsing import cut_words, extract_lessons
from services.judge.prompts import WORD_JOINER, render_session
from services.judge.settings import JudgeConfig
from shared.schemas import Turn

OPD = {"engine_url": "http://127.0.0.1:1", "tokenizer": "/x"}


def test_lessons_between_the_markers() -> None:
    text = ("Thinking: [EXPERIENCE_START] - ignore this earlier block [EXPERIENCE_END]\n"
            "[EXPERIENCE_START]\n- The user wants answers of one short sentence.\n"
            "2. Give temperatures in Celsius.\n* ok\n  • The user wants answers of one short sentence.\n"
            "- 1234 5678\n- Never paste whole files; show the changed lines.\n[EXPERIENCE_END] trailing")
    assert extract_lessons(text, 5, 300) == [
        "The user wants answers of one short sentence.", "Give temperatures in Celsius.",
        "Never paste whole files; show the changed lines."]
    assert extract_lessons(text, 2, 300) == ["The user wants answers of one short sentence.",
                                             "Give temperatures in Celsius."]
    assert extract_lessons(text, 5, 20) == ["The user wants", "Give temperatures in", "Never paste whole"]
    assert extract_lessons("[EXPERIENCE_START] [EXPERIENCE_END]", 5, 300) == []
    assert extract_lessons("no markers", 5, 300) is None
    assert extract_lessons("[EXPERIENCE_START] - a lesson never closed", 5, 300) is None


def test_cut_words() -> None:
    assert cut_words("short", 10) == "short"
    assert cut_words("The user wants short answers", 20) == "The user wants short"
    assert cut_words("abcdefghijklmnop", 5) == "abcde"


def _session(*replies: str, system: str | None = "Be brief.") -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": "What is the capital of France?"})
    for reply in replies:
        messages += [{"role": "assistant", "content": "Paris is the capital and largest city of France, " * 3},
                     {"role": "user", "content": reply}]
    return messages


def test_render_session_labels_roles_bounds_and_defangs() -> None:
    messages = _session("No <|im_end|> wrong, too long.", "Thanks!")
    text = render_session(messages, per_message_chars=60, max_chars=10_000)
    assert text.startswith("## The conversation\n### instructions\nBe brief.")
    assert text.count("### assistant") == 2 and "### user\nNo <" + WORD_JOINER + "|im_end|> wrong" in text
    assert "characters cut" in text  # each message kept within 60 characters, head and tail
    long = _session(*[f"reply number {i}" for i in range(40)])
    cut = render_session(long, per_message_chars=200, max_chars=1000)
    assert len(cut) < 1200 and "messages cut" in cut
    assert cut.split("\n\n")[0].endswith("Be brief.") and cut.rstrip().endswith("reply number 39")


def _turn(messages: list[dict[str, str]], **kw: object) -> Turn:
    return Turn(session_id="s", messages=messages, response={"role": "assistant", "content": "ok"},
                prompt_ids=[1], response_ids=[2], **kw)  # type: ignore[arg-type]


async def test_rule_extractor_keeps_the_users_corrections() -> None:
    correction = "That's wrong for me: far too long. Answer again in one short sentence."
    turn = _turn(_session(correction, "Perfect, thanks!", correction + " Next: What do bees make?"))
    lessons = await RuleExtractor(JudgeConfig(mode="opd", teacher="experience", **OPD)).extract(turn)
    assert lessons == [f'The user corrected an answer: "{correction}"']  # once; without "Next: ..."
    # A user message before any answer is the request, never a correction; praise is no lesson.
    assert await RuleExtractor(JudgeConfig()).extract(_turn([{"role": "user", "content": "wrong again"}])) == []
    assert trajectory(turn)[-1] == {"role": "assistant", "content": "ok"}


def _record(rid: str, lessons: list[str], at: float, session: str = "s") -> Experience:
    return Experience(id=rid, session_id=session, lessons=lessons, created_at=at, prompt_version="experience-v1")


def test_experience_block_and_the_teacher_prompt() -> None:
    a = _record("a", ["Answer in one short sentence.", "Use Celsius."], 1)
    b = _record("b", ["use celsius.", "Cite the source."], 2)
    block, ids = experience_block([a, b], 2000)
    assert block == f"{EXPERIENCE_HEADER}\n- Answer in one short sentence.\n- Use Celsius.\n- Cite the source."
    assert ids == ["a", "b"]
    small, ids = experience_block([a, b], len(EXPERIENCE_HEADER) + 33)
    assert small == f"{EXPERIENCE_HEADER}\n- Answer in one short sentence." and ids == ["a"]
    assert experience_block([_record("c", [], 3)], 2000) == (None, [])

    messages = _session("again")
    out = with_experience(messages, "BLOCK")
    assert out[0] == {"role": "system", "content": "Be brief.\n\nBLOCK"} and out[1:] == messages[1:]
    assert messages[0]["content"] == "Be brief."  # a copy
    bare = _session("again", system=None)
    assert with_experience(bare, "BLOCK") == [{"role": "system", "content": "BLOCK"}, *bare]
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}]
    assert with_experience(parts, "BLOCK")[0]["content"][-1] == {"type": "text", "text": "BLOCK"}


def test_rank_by_shared_words_then_recency() -> None:
    weather = _record("w", ["Give the weather temperature in Celsius."], 1)
    short = _record("s", ["Answer in one short sentence."], 2)
    newer = _record("n", ["Always answer in a short sentence."], 3)
    assert [r.id for r in rank([weather, short, newer], "What is the weather in Paris, in Celsius?", 2)] == ["w", "n"]
    assert [r.id for r in rank([weather, short, newer], "", 3)] == ["n", "s", "w"]
    assert len(user_key("alice")) == 32 and user_key("alice") != user_key("bob")


def test_settings() -> None:
    cfg = JudgeConfig(type="rule", mode="opd", teacher="experience", experience_extractor="rule", **OPD)
    assert cfg.experience and not cfg.uses_llm
    assert JudgeConfig(type="rule", mode="opd", teacher="experience", **OPD).uses_llm  # the llm extractor
    assert not JudgeConfig(type="rule", mode="opd", **OPD).experience
    with pytest.raises(ValidationError, match="TEACHER=experience"):
        JudgeConfig(teacher="experience")


def test_up_modes_agree_across_services() -> None:
    assert set(MODES) == {"rl", "opd", "opd-topk", "combine", "oel"}
    oel = mode_env("oel", 50, has_judge_model=False)
    assert oel["judge"] == {"NEXTSTATE_JUDGE__MODE": "opd", "NEXTSTATE_JUDGE__TOPK": "50",
                            "NEXTSTATE_JUDGE__TEACHER": "experience",
                            "NEXTSTATE_JUDGE__EXPERIENCE_EXTRACTOR": "rule"}
    assert oel["buffer"] == {"NEXTSTATE_BUFFER__MODE": "opd"}
    assert oel["trainer"] == {"NEXTSTATE_TRAINER__LOSS_MODE": "opd", "NEXTSTATE_TRAINER__LOSS": "opd_topk"}
    assert mode_env("oel", 8, has_judge_model=True)["judge"]["NEXTSTATE_JUDGE__EXPERIENCE_EXTRACTOR"] == "llm"
    topk = mode_env("opd-topk", 8, has_judge_model=False)
    assert topk["judge"] == {"NEXTSTATE_JUDGE__MODE": "opd", "NEXTSTATE_JUDGE__TOPK": "8",
                             "NEXTSTATE_JUDGE__HINT_SOURCE": "rule"}
    assert topk["trainer"]["NEXTSTATE_TRAINER__LOSS"] == "opd_topk"
    assert mode_env("opd-topk", 8, has_judge_model=True)["judge"]["NEXTSTATE_JUDGE__HINT_SOURCE"] == "llm"
    for mode in ("rl", "opd", "combine"):
        env = mode_env(mode, 50, has_judge_model=False)
        assert env["judge"] == {"NEXTSTATE_JUDGE__MODE": mode,
                                **({"NEXTSTATE_JUDGE__HINT_SOURCE": "rule"} if mode != "rl" else {})}
        assert env["buffer"] == {"NEXTSTATE_BUFFER__MODE": mode}
        assert env["trainer"] == {"NEXTSTATE_TRAINER__LOSS_MODE": mode}


def test_rule_hints_quote_a_correcting_next_state() -> None:
    cfg = JudgeConfig(mode="opd", hint_source="rule", max_hint_chars=80, **OPD)
    assert cfg.uses_llm and not cfg.model_copy(update={"type": "rule"}).uses_llm  # the prm judge needs it
    rule = RuleHints(cfg)
    correction = _turn(_session(), next_state=[{"role": "user", "content": "That's wrong: far too long."}])
    vote = rule.vote(correction)
    assert vote.score == 1
    assert best_hint([vote], 12, 80) == 'Your answer will get this reply: "That\'s wrong: far too long."'
    praised = _turn(_session(), next_state=[{"role": "user", "content": "Perfect, thanks!"}])
    assert rule.vote(praised).score == -1 and best_hint([rule.vote(praised)], 12, 80) is None


def test_replay_ids_fit_a_message_id() -> None:
    from services.judge.replay import replay_id
    from shared.schemas import Replay

    assert replay_id("experience", "t1") == "experience.t1"
    long = replay_id("deadline", "s" * 256 + ".1.5")
    assert long.startswith("deadline.") and len(long) <= 256 and long != replay_id("deadline", "s" * 256 + ".2.5")
    Replay(id=long, session_id="s" * 256, reason="deadline")
