"""The reward-collapse alarm: has the judge stopped telling turns apart?

A judge can go on answering while its rewards carry no signal: every vote the same value
(a judge model that says `\\boxed{1}` to everything, a rule whose cues never match, a
probability judge stuck at 0.5), or votes that never reach a majority (ties, or nothing
readable: all of them reward 0). Training goes on, on noise or on nothing.

The window is the last `collapse_window` judged turns of *every* judge replica, kept in
Redis (shared/keys.py `reward_window`, `reward_window_turns`, `reward_alarm`) by one
script per published turn, so no replica sees a partial window and a turn judged twice
after a redelivery is counted once. Each turn contributes its *value* (the reward, to one
decimal: -1, 0, 1 for labels) and whether its votes were *undecided* (no label won the
vote, or no vote could be read). Once the window holds `collapse_min_turns` turns, the
alarm is raised when

- one value holds at least `collapse_value_share` of the window (`one-value`), or
- at least `collapse_undecided_share` of the window was undecided (`undecided`);

and it is cleared only once the share is `CLEAR_MARGIN` below its threshold, so a window
near a threshold does not flap. The replica whose turn raised (or cleared) it logs it,
once; every replica's gauges show the window as its last turn left it; `nextstate status`
reads the hash. Not counted: turns without a next state, and `opd` turns (their reward is
0 by design: they teach through the teacher's log-probs).

Defaults (why): 200 turns is a few minutes of a busy deployment and still reacts within
one training batch's worth of collapsed turns; judged from 100. A healthy judge whose
commonest value is 85 % of its verdicts (a policy that already succeeds most of the time)
reaches 95 % over 100 turns with probability 1.5e-3 (binomial), over 200 with 7e-6; at
95 % the policy-gradient signal is 1 turn in 20. More than half of the turns undecided
means most rewards are 0 by indecision, not by judgement: a judge with m = 3 votes that
reads the next state ties rarely.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from services.judge import metrics
from services.judge.parsing import ScoreScale, winning_label
from services.judge.settings import JudgeConfig
from shared.schemas import ScoredTurn, Vote
from shared.streams import Bus

log = logging.getLogger(__name__)

CLEAR_MARGIN = 0.05  # a raised alarm clears once its share is this far below its threshold
REASONS = ("one-value", "undecided")

# KEYS: the window (list of turn ids), its turns (hash id -> "value|undecided"), the alarm hash.
# ARGV: turn id, value, undecided (0|1), window, min turns, value share, undecided share,
#       clear margin (shares in per-mille), now, the two shares as configured (to record).
# Returns {turns, top value, its count, undecided count, alarm, alarm before, update number}.
_ADD = """
local id, value, undecided = ARGV[1], ARGV[2], tonumber(ARGV[3])
local window, min_turns = tonumber(ARGV[4]), tonumber(ARGV[5])
local value_max, undecided_max, margin = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
if redis.call('HSETNX', KEYS[2], id, value .. '|' .. undecided) == 1 then
  redis.call('RPUSH', KEYS[1], id)
  redis.call('HINCRBY', KEYS[3], 'v:' .. value, 1)
  redis.call('HINCRBY', KEYS[3], 'undecided', undecided)
end
while redis.call('LLEN', KEYS[1]) > window do
  local old = redis.call('LPOP', KEYS[1])
  local entry = redis.call('HGET', KEYS[2], old)
  redis.call('HDEL', KEYS[2], old)
  if entry then
    local sep = string.find(entry, '|', 1, true)
    local field = 'v:' .. string.sub(entry, 1, sep - 1)
    if redis.call('HINCRBY', KEYS[3], field, -1) <= 0 then redis.call('HDEL', KEYS[3], field) end
    if string.sub(entry, sep + 1) == '1' then redis.call('HINCRBY', KEYS[3], 'undecided', -1) end
  end
end
local n = redis.call('LLEN', KEYS[1])
local top, top_value, undecided_n = 0, '', 0
local flat = redis.call('HGETALL', KEYS[3])
for i = 1, #flat, 2 do
  local f = flat[i]
  if string.sub(f, 1, 2) == 'v:' then
    local c = tonumber(flat[i + 1])
    if c > top then top, top_value = c, string.sub(f, 3) end
  elseif f == 'undecided' then
    undecided_n = tonumber(flat[i + 1])
  end
end
local was = redis.call('HGET', KEYS[3], 'alarm') or ''
local function hit(count, limit, reason)
  if n < min_turns then return false end
  if string.find(was, reason, 1, true) then limit = limit - margin end
  return count * 1000 >= limit * n
end
local reasons = {}
if hit(top, value_max, 'one-value') then table.insert(reasons, 'one-value') end
if hit(undecided_n, undecided_max, 'undecided') then table.insert(reasons, 'undecided') end
local alarm = table.concat(reasons, ',')
if alarm ~= was then
  redis.call('HSET', KEYS[3], 'alarm', alarm, 'alarm_since', alarm == '' and '' or ARGV[9])
end
redis.call('HSET', KEYS[3], 'turns', n, 'updated_at', ARGV[9], 'window', ARGV[4], 'min_turns', ARGV[5],
           'value_share', ARGV[10], 'undecided_share', ARGV[11])
return {n, top_value, top, undecided_n, alarm, was, redis.call('HINCRBY', KEYS[3], 'seq', 1)}
"""


def value_of(reward: float) -> str:
    """A reward as the window counts it: to one decimal, integral ones without it (`1`, `-0.3`)."""
    rounded = round(reward, 1) + 0.0  # + 0.0: no "-0"
    return str(int(rounded)) if rounded.is_integer() else f"{rounded:g}"


def is_undecided(votes: Sequence[Vote], scale: ScoreScale, threshold: float | None) -> bool:
    """No vote could be read, or (labels) no label won the vote: the reward is 0 by indecision."""
    scores = [v.score for v in votes]
    if all(s is None for s in scores):
        return True
    return scale == "label" and winning_label(scores, threshold) is None


def window_entry(scored: ScoredTurn, scale: ScoreScale, threshold: float | None) -> tuple[str, bool] | None:
    """(value, undecided) of a published turn, or None when it has no judged reward."""
    if not scored.judged or scored.mode == "opd" or not scored.votes:
        return None
    return value_of(scored.reward), is_undecided(scored.votes, scale, threshold)


@dataclass(frozen=True)
class WindowState:
    turns: int
    top_value: str
    top_count: int
    undecided: int
    alarm: tuple[str, ...]
    before: tuple[str, ...]
    seq: int = 0  # the window's update number: replies may come back out of order

    @classmethod
    def from_reply(cls, reply: Sequence[object]) -> WindowState:
        def text(x: object) -> str:
            return x.decode() if isinstance(x, bytes) else str(x)

        n, top_value, top, undecided, alarm, was, seq = reply
        return cls(int(text(n)), text(top_value), int(text(top)), int(text(undecided)),
                   tuple(r for r in text(alarm).split(",") if r), tuple(r for r in text(was).split(",") if r),
                   int(text(seq)))

    def share(self, count: int) -> float:
        return count / self.turns if self.turns else 0.0


class RewardWindow:
    """The judges' shared window (module docstring); `add` after each published turn."""

    def __init__(self, bus: Bus, cfg: JudgeConfig) -> None:
        self.bus = bus
        self.cfg = cfg
        self._add = bus.redis.register_script(_ADD)
        k = bus.keys
        self._keys = [k.reward_window, k.reward_window_turns, k.reward_alarm]
        self._seen = 0  # the newest update whose state the gauges show

    async def add(self, scored: ScoredTurn) -> WindowState | None:
        entry = window_entry(scored, self.cfg.scores, self.cfg.vote_threshold)
        if entry is None:
            return None
        value, undecided = entry
        cfg = self.cfg
        reply = await self._add(keys=self._keys, args=[
            scored.turn.id, value, int(undecided), cfg.collapse_window, cfg.collapse_min_turns,
            round(cfg.collapse_value_share * 1000), round(cfg.collapse_undecided_share * 1000),
            round(CLEAR_MARGIN * 1000), f"{time.time():.3f}", cfg.collapse_value_share,
            cfg.collapse_undecided_share,
        ])
        state = WindowState.from_reply(reply)
        self.report(state)
        return state

    def report(self, s: WindowState) -> None:
        """The gauges (from the newest state this process saw: concurrent turns' replies may
        come back in any order), and a log line (and count) when this turn raised or cleared
        a reason (the script says so to exactly one caller)."""
        if s.seq >= self._seen:
            self._seen = s.seq
            metrics.WINDOW_TURNS.set(s.turns)
            metrics.WINDOW_TOP_SHARE.set(s.share(s.top_count))
            metrics.WINDOW_UNDECIDED_SHARE.set(s.share(s.undecided))
            for reason in REASONS:
                metrics.COLLAPSE.labels(reason).set(reason in s.alarm)
        raised = [r for r in s.alarm if r not in s.before]
        cleared = [r for r in s.before if r not in s.alarm]
        fields = {"window_turns": s.turns, "top_value": s.top_value,
                  "top_share": round(s.share(s.top_count), 3), "undecided_share": round(s.share(s.undecided), 3)}
        for reason in raised:
            metrics.COLLAPSE_ALARMS.labels(reason).inc()
            what = (f"one reward value ({s.top_value}) holds {s.share(s.top_count):.0%}"
                    if reason == "one-value" else f"{s.share(s.undecided):.0%} were undecided (a tie or no "
                                                  "readable vote)")
            log.warning(
                "reward collapse: the judge's votes stop discriminating: of the last %d judged turns %s; "
                "training on these rewards learns nothing (`nextstate status`; what to check: "
                "docs/troubleshooting.md#the-judges-scores-are-all-near-one-value)",
                s.turns, what, extra={"reason": reason, **fields})
        for reason in cleared:
            log.info("reward collapse cleared (%s): the judge's votes discriminate again", reason,
                     extra={"reason": reason, **fields})
