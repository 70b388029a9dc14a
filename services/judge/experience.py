"""Experiential learning: lessons from finished sessions, their store, and the teacher prompt.

On-policy context distillation. When a session ends, an extractor reads the whole
session and writes a few short, reusable lessons (what the user wanted, what went
wrong); they are stored in Redis with their provenance. A turn's teacher prompt is its
own context with the relevant lessons added as a system-message block, and the policy
engine scores the turn's *own* response ids under it (opd.Scorer, with the teacher's
top-K when NEXTSTATE_JUDGE__TOPK is set): the trainer's `opd_topk` loss then teaches the
policy to answer as if it had the experience, without being shown it.

- **Extractors**: `llm` — one call to the judge model (prompt `experience-v1`,
  prompts.py), lessons read between [EXPERIENCE_START] and [EXPERIENCE_END]
  (parsing.extract_lessons: at most EXPERIENCE_MAX_LESSONS, each cut at
  EXPERIENCE_LESSON_CHARS); `rule` — the user's replies that the rule judge reads as
  corrections, verbatim (no model needed: demos, tests).
- **Store** (keys in shared/keys.py): per session a hash (ending turn id -> record; its
  existence says the session has ended), and newest-first lists of records with lessons:
  one per user (the Turn's `user`, keyed by a digest) and one global, each trimmed to
  EXPERIENCE_STORE_MAX. Sessions and users expire after EXPERIENCE_TTL_S. A record is
  written once per ending turn, in one script with its list entries, so a redelivered
  turn never stores it twice.
- **Scopes**: `session` — only the turn's own session's lessons; `cross` — those, plus
  the EXPERIENCE_RECORDS stored records (the user's, else everyone's; the newest
  EXPERIENCE_SCAN of each list) that share the most words with the turn's last user
  message, newest first among equals.

Holding a session's turns until its experience exists, and replaying them then, is
replay.py's part.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import re
import time
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.judge import metrics
from services.judge.backend import JudgeBackend
from services.judge.judges import RuleJudge
from services.judge.opd import OPDResult, Scorer
from services.judge.parsing import cut_words, extract_lessons
from services.judge.prompts import (
    EXPERIENCE_PROMPTS,
    content_text,
    judge_messages,
    last_user_text,
    prompt_for,
    render_session,
)
from services.judge.settings import JudgeConfig
from services.judge.votes import JudgeUnavailable
from shared.schemas import Turn
from shared.streams import Bus

log = logging.getLogger(__name__)

RULE_EXTRACTOR = "experience-rule"
EXPERIENCE_HEADER = "[Experience] Lessons from earlier interactions:"
MAX_ENDINGS = 8  # records kept per session (a session ends once; expired branches add some)


class Experience(BaseModel):
    """What was learned from one ending of a session, with where it came from."""

    model_config = ConfigDict(extra="forbid")

    id: str  # the turn that ended the session
    session_id: str
    user: str | None = None
    lessons: list[str] = Field(default_factory=list)
    turn_ids: list[str] = Field(default_factory=list)  # the session's turns known when it ended
    turn_index: int = 0
    created_at: float = Field(default_factory=time.time)
    prompt_version: str  # the extractor's prompt version, or experience-rule
    extractor_model: str | None = None


def user_key(user: str) -> str:
    """The store's key part for a user id (any text up to 256 chars): a digest."""
    return hashlib.sha256(user.encode()).hexdigest()[:32]


def trajectory(turn: Turn) -> list[dict[str, Any]]:
    """The whole session as the ending turn knows it: its request, its response, what followed."""
    return [*turn.messages, turn.response, *(turn.next_state or [])]


# -- extractors ---------------------------------------------------------------------------


class Extractor(Protocol):
    version: str
    model: str | None

    async def extract(self, turn: Turn) -> list[str]: ...


class LLMExtractor:
    """One call to the judge model; a call that does not answer raises (the turn is retried)."""

    def __init__(self, backend: JudgeBackend, cfg: JudgeConfig) -> None:
        self.backend = backend
        self.cfg = cfg
        self.prompt = prompt_for(cfg.experience_prompt_version, EXPERIENCE_PROMPTS)
        self.version = self.prompt.version
        self.model: str | None = cfg.model

    async def extract(self, turn: Turn) -> list[str]:
        cfg = self.cfg
        rendered = render_session(trajectory(turn), per_message_chars=cfg.max_next_state_chars,
                                  max_chars=cfg.experience_session_chars)  # fmt: skip
        result = await self.backend.call(judge_messages(self.prompt, rendered), "experience")
        if result.text is None:
            metrics.VOTES.labels("experience", "error").inc()
            raise JudgeUnavailable(f"experience extractor: no answer ({result.error})")
        lessons = extract_lessons(result.text, cfg.experience_max_lessons, cfg.experience_lesson_chars)
        if lessons is None:
            metrics.VOTES.labels("experience", "unparsable").inc()
            metrics.PARSE_FAILURES.labels("experience").inc()
            return []
        metrics.VOTES.labels("experience", "ok").inc()
        return lessons


_SENTENCE = re.compile(r"(?<=[.!?])\s+")


class RuleExtractor:
    """The user's replies that the rule judge reads as corrections (negative cues only),
    each as the sentences that hold a negative cue."""

    version = RULE_EXTRACTOR
    model: str | None = None

    def __init__(self, cfg: JudgeConfig) -> None:
        self.cfg = cfg
        self.rule = RuleJudge(cfg.positive, cfg.negative)

    async def extract(self, turn: Turn) -> list[str]:
        lessons: list[str] = []
        answered = False
        for message in trajectory(turn):
            role = message.get("role")
            if role == "assistant":
                answered = True
                continue
            if role != "user" or not answered:
                continue
            text = " ".join(content_text(message.get("content")).split())
            if not text or self.rule.score(text)[0] != -1:
                continue
            # The sentences that correct ("wrong", "again"...), not what the reply goes on to ask.
            cues = [s for s in _SENTENCE.split(text) if any(p.search(s) for p in self.rule.negative)]
            quote = " ".join(cues) or text
            lesson = cut_words(f'The user corrected an answer: "{quote}"', self.cfg.experience_lesson_chars)
            if lesson not in lessons:
                lessons.append(lesson)
        return lessons[-self.cfg.experience_max_lessons :]


def build_extractor(cfg: JudgeConfig, backend: JudgeBackend | None) -> Extractor:
    if cfg.experience_extractor == "rule":
        return RuleExtractor(cfg)
    if backend is None:
        raise ValueError("the llm experience extractor needs the judge model (NEXTSTATE_JUDGE__URL)")
    return LLMExtractor(backend, cfg)


# -- the teacher prompt -------------------------------------------------------------------------


def experience_block(records: Sequence[Experience], max_chars: int) -> tuple[str | None, list[str]]:
    """The system-message block of `records`' lessons (each lesson once, in order, the
    whole within `max_chars`) and the ids of the records it quotes; (None, []) when empty."""
    lines: list[str] = []
    ids: list[str] = []
    seen: set[str] = set()
    used = len(EXPERIENCE_HEADER)
    for record in records:
        for lesson in record.lessons:
            line = f"- {lesson}"
            if lesson.lower() in seen or used + 1 + len(line) > max_chars:
                continue
            seen.add(lesson.lower())
            lines.append(line)
            used += 1 + len(line)
            if record.id not in ids:
                ids.append(record.id)
    if not lines:
        return None, []
    return "\n".join([EXPERIENCE_HEADER, *lines]), ids


def with_experience(messages: Sequence[dict[str, Any]], block: str) -> list[dict[str, Any]]:
    """A copy of `messages` with the experience block in the system message: added to the
    first message when it is a system (or developer) message, else as a new first one
    (templates that take one system message at the start take it so)."""
    out = copy.deepcopy(list(messages))
    if out and out[0].get("role") in ("system", "developer"):
        content = out[0].get("content")
        if isinstance(content, list):
            out[0]["content"] = [*content, {"type": "text", "text": block}]
        else:
            out[0]["content"] = f"{content}\n\n{block}" if content else block
        return out
    return [{"role": "system", "content": block}, *out]


_WORD = re.compile(r"[^\W\d_]{3,}")
_STOP = frozenset("the and you your for are was were this that with what how have has not but can "
                  "from they them their there which when where who why will would should could "
                  "about into just than then also only very more most some such".split())


def words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if w not in _STOP}


def rank(records: Sequence[Experience], text: str, k: int) -> list[Experience]:
    """The k records sharing the most words with `text`, newest first among equals."""
    query = words(text)
    scored = sorted(records, key=lambda r: (-len(query & words(" ".join(r.lessons))), -r.created_at))
    return scored[:k]


# -- the store ------------------------------------------------------------------------------------------

# KEYS: session hash, global list[, user list]. ARGV: record id, record JSON, store max, ttl,
# has lessons (1|0), max endings. 1 when written, 0 when this ending was stored already.
_SAVE = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[6]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[4])
if ARGV[5] == '1' then
  local bound = tonumber(ARGV[3]) - 1
  redis.call('LPUSH', KEYS[2], ARGV[2])
  redis.call('LTRIM', KEYS[2], 0, bound)
  if KEYS[3] then
    redis.call('LPUSH', KEYS[3], ARGV[2])
    redis.call('LTRIM', KEYS[3], 0, bound)
    redis.call('EXPIRE', KEYS[3], ARGV[4])
  end
end
return 1
"""

# KEYS: session hash, held hash, waiting zset. ARGV: turn id, turn JSON, deadline, max held,
# session id. `ended`: the session's experience exists (score the turn now); `full`: too many
# held (score it now); `held`: it waits, and the session's deadline is at least `deadline`.
_HOLD = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 'ended' end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 and redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[4]) then
  return 'full'
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[3], 'GT', ARGV[3], ARGV[5])
return 'held'
"""

# KEYS: waiting zset. ARGV: session id, the score seen, the lease's end. 1 when claimed.
_CLAIM = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) ~= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], 'XX', ARGV[3], ARGV[1])
return 1
"""

# KEYS: held hash, waiting zset. ARGV: session id. Forget the session once nothing is held.
_FINISH = """
if redis.call('HLEN', KEYS[1]) > 0 then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

HoldState = Literal["held", "ended", "full"]


def _parse(data: str) -> Experience | None:
    try:
        return Experience.model_validate_json(data)
    except ValidationError:
        log.error("unreadable experience record skipped")
        return None


class ExperienceStore:
    def __init__(self, bus: Bus, cfg: JudgeConfig) -> None:
        self.bus = bus
        self.keys = bus.keys
        self.cfg = cfg
        r = bus.redis
        self._save, self._hold = r.register_script(_SAVE), r.register_script(_HOLD)
        self._claim, self._finish = r.register_script(_CLAIM), r.register_script(_FINISH)

    # -- records ------------------------------------------------------------------------
    async def recorded(self, session_id: str, record_id: str) -> Experience | None:
        data = await self.bus.redis.hget(self.keys.experience_session(session_id), record_id)
        return None if data is None else _parse(data)

    async def save(self, record: Experience) -> bool:
        """Store `record` (once per ending turn). True when this call wrote it."""
        k = self.keys
        keys = [k.experience_session(record.session_id), k.experience_global]
        if record.user is not None:
            keys.append(k.experience_user(user_key(record.user)))
        args = [record.id, record.model_dump_json(), self.cfg.experience_store_max,
                self.cfg.experience_ttl_s, 1 if record.lessons else 0, MAX_ENDINGS]  # fmt: skip
        return bool(await self._save(keys=keys, args=args))

    async def session(self, session_id: str) -> list[Experience]:
        """The session's records, oldest first."""
        rows = await self.bus.redis.hgetall(self.keys.experience_session(session_id))
        records = [r for r in map(_parse, rows.values()) if r is not None]
        return sorted(records, key=lambda r: r.created_at)

    async def relevant(self, user: str | None, text: str, exclude_session: str) -> list[Experience]:
        """Cross-session: the most relevant stored records of `user` (else everyone's)."""
        k, n = self.keys, self.cfg.experience_records
        if n == 0:
            return []
        lists = ([k.experience_user(user_key(user))] if user is not None else []) + [k.experience_global]
        chosen: list[Experience] = []
        for key in lists:
            rows = await self.bus.redis.lrange(key, 0, self.cfg.experience_scan - 1)
            ids = {r.id for r in chosen}
            pool = [r for r in map(_parse, rows) if r is not None and r.lessons
                    and r.session_id != exclude_session and r.id not in ids]  # fmt: skip
            chosen += rank(pool, text, n - len(chosen))
            if len(chosen) >= n:
                break
        return chosen

    # -- held turns (replay.py) ------------------------------------------------------------
    async def hold(self, turn: Turn, deadline: float) -> HoldState:
        k = self.keys
        state = await self._hold(
            keys=[k.experience_session(turn.session_id), k.experience_held(turn.session_id), k.experience_waiting],
            args=[turn.id, turn.to_json(), deadline, self.cfg.experience_max_held, turn.session_id],
        )  # fmt: skip
        return str(state)  # type: ignore[return-value]

    async def held(self, session_id: str) -> dict[str, str]:
        """Turn id -> Turn JSON of the session's held turns."""
        return dict(await self.bus.redis.hgetall(self.keys.experience_held(session_id)))

    async def held_ids(self, session_id: str) -> list[str]:
        return sorted(await self.bus.redis.hkeys(self.keys.experience_held(session_id)))

    async def release(self, session_id: str, turn_id: str) -> None:
        await self.bus.redis.hdel(self.keys.experience_held(session_id), turn_id)

    async def finish(self, session_id: str) -> bool:
        """Forget the session in the waiting index once it holds nothing (True then)."""
        k = self.keys
        return bool(await self._finish(keys=[k.experience_held(session_id), k.experience_waiting],
                                       args=[session_id]))  # fmt: skip

    async def overdue(self, now: float, limit: int) -> list[tuple[str, float]]:
        """(session id, score) of sessions whose deadline or lease has passed, soonest first."""
        rows = await self.bus.redis.zrangebyscore(self.keys.experience_waiting, "-inf", now,
                                                  start=0, num=limit, withscores=True)  # fmt: skip
        return [(str(m), float(s)) for m, s in rows]

    async def claim(self, session_id: str, score: float, lease_until: float) -> bool:
        return bool(await self._claim(keys=[self.keys.experience_waiting],
                                      args=[session_id, repr(score), lease_until]))  # fmt: skip


# -- the teacher ---------------------------------------------------------------------------------------------


class ExperienceTeacher:
    """Teacher log-probs of a turn under its context plus the relevant experience."""

    def __init__(self, scorer: Scorer, store: ExperienceStore, cfg: JudgeConfig, prompt_version: str) -> None:
        self.scorer = scorer
        self.store = store
        self.cfg = cfg
        self.prompt_version = prompt_version  # the extractor's: what taught the lessons

    async def run(self, turn: Turn) -> OPDResult:
        records = await self.store.session(turn.session_id)
        if self.cfg.experience_scope == "cross":
            records += await self.store.relevant(turn.user, last_user_text(turn.messages), turn.session_id)
        block, ids = experience_block(records, self.cfg.experience_prompt_chars)
        if block is None or not turn.response_ids:
            metrics.EXPERIENCE_TEACHER.labels("none" if block is None else "no_response_ids").inc()
            return OPDResult()
        score = await self.scorer.score(turn, with_experience(turn.messages, block))
        if score is None:
            metrics.EXPERIENCE_TEACHER.labels("rejected").inc()
            return OPDResult(experience_ids=ids)
        metrics.EXPERIENCE_TEACHER.labels("scored").inc()
        return OPDResult(
            teacher_prompt_ids=score.prompt_ids, teacher_logprobs=score.logprobs,
            teacher_topk_ids=score.topk_ids, teacher_topk_logprobs=score.topk_logprobs, experience_ids=ids,
        )  # fmt: skip
