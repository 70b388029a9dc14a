"""Which scored turns become training samples, and what a sample holds: pure functions.

Inclusion (docs/design.md#rewards-and-advantages):

- a side turn, or a turn without response tokens, is never a sample;
- a turn without a next state (`judged=False`) is excluded;
- rl: the reward must be non-zero (A = r, so r = 0 teaches nothing);
  opd: teacher log-probs must be present (A = teacher - old);
  combine: either of the two.

At least one sample per session: a session's *final* turn (closed by `session_done` or
`ttl`, or without a next state, None or empty; never an `unchosen` member of a group,
whose session went on with the chosen one) that the rules above exclude is kept anyway, flagged
`forced=True`, when the session has produced fewer than `min_samples_per_session`
samples. A forced sample has `loss_mask` = 1 on every response token and the turn's own
reward, which for a forced turn is 0 in rl mode (else it would have been included) and
whatever the judge gave otherwise, without teacher log-probs if it had none. So its
policy-gradient term is zero (A = 0 in rl; the trainer must treat missing teacher
log-probs as A = 0 in opd/combine) while the KL-to-reference term and the token-mean
still count it: the session trains, anchored to the reference, in no direction the
data did not support. A mask of 0 instead would make "at least one sample trains"
empty words (OpenClaw-RL likewise promotes such a turn to loss_mask = 1).

Staleness: a sample whose behaviour log-probs come from a policy more than
`max_staleness` versions behind the trainer is not trained on its reward. A sample
without behaviour log-probs (imported text) is exempt: the trainer uses its own
log-probs for it, so it is on-policy by construction. Staleness is decided *before* the
at-least-one rule: a session's stale final turn may still be its forced sample, and
then it is an anchor only (reward 0, no teacher log-probs: A = 0, only the KL term
counts), so a stale gradient never trains.

Environment episodes' turns (episodes.py) are rewarded by their Outcome instead
(rewards.py); `signal_missing` and staleness apply to them, the at-least-one rule does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.schemas import Mode, ScoredTurn, TrainSample

FINAL_CLOSES = frozenset({"session_done", "ttl"})


@dataclass(frozen=True)
class Verdict:
    """What the rules say about one scored turn, before any session or staleness check."""

    eligible: bool
    reason: str | None  # why it is not eligible (a metric label), None when eligible
    final: bool  # the session's last turn: the at-least-one rule may keep it
    buildable: bool  # a sample can be built at all (main turn with response tokens)

    @property
    def may_force(self) -> bool:
        return self.buildable and not self.eligible and self.final


def is_final(scored: ScoredTurn) -> bool:
    """The session's last turn: closed by session end or expiry, or nothing came after it.
    An unchosen member of a group never is: its session went on with its sibling."""
    turn = scored.turn
    if turn.closed_by == "unchosen":
        return False
    return turn.closed_by in FINAL_CLOSES or not turn.next_state or not scored.judged


def classify(scored: ScoredTurn, mode: Mode) -> Verdict:
    turn = scored.turn
    final = is_final(scored)
    if turn.turn_type != "main":
        return Verdict(False, "side", final, buildable=False)
    if not turn.response_ids:
        return Verdict(False, "no_tokens", final, buildable=False)
    if not scored.judged:
        return Verdict(False, "no_next_state", final, buildable=True)
    reason = signal_missing(scored.reward, scored.teacher_logprobs is not None, mode)
    return Verdict(reason is None, reason, final, buildable=True)


def signal_missing(reward: float, has_teacher: bool, mode: Mode) -> str | None:
    """Why a sample with this reward (and teacher log-probs or not) teaches nothing in
    `mode`, or None when it does."""
    if mode == "rl" and reward == 0:
        return "zero_reward"
    if mode == "opd" and not has_teacher:
        return "no_teacher"
    if mode == "combine" and reward == 0 and not has_teacher:
        return "zero_reward_no_teacher"
    return None


def staleness(scored: ScoredTurn, trainer_version: int | None) -> int | None:
    """Versions between the policy that sampled the turn and the trainer (None: exempt)."""
    turn = scored.turn
    if trainer_version is None or turn.response_logprobs is None:
        return None
    return max(0, trainer_version - turn.policy_version)


def build_sample(
    scored: ScoredTurn, mode: Mode, *, forced: bool = False, anchor_only: bool = False,
    reward: float | None = None,
) -> TrainSample:
    """The TrainSample of a turn; its id is the turn id (so batches dedupe by turn).

    `anchor_only` (a stale turn kept by the at-least-one rule): reward 0 and no teacher
    log-probs, so its advantage is 0 in every mode and only the KL term trains.
    `reward`: instead of the judge's (an episode's turn: rewards.py).
    """
    if reward is None:
        reward = float(scored.reward)
    turn = scored.turn
    n = len(turn.response_ids)
    return TrainSample(
        id=turn.id,
        session_id=turn.session_id,
        turn_index=turn.turn_index,
        tokens=[*turn.prompt_ids, *turn.response_ids],
        response_length=n,
        loss_mask=[1] * n,
        reward=0.0 if anchor_only else reward,
        rollout_logprobs=turn.response_logprobs,
        teacher_logprobs=None if anchor_only else scored.teacher_logprobs,
        teacher_topk_ids=None if anchor_only else scored.teacher_topk_ids,
        teacher_topk_logprobs=None if anchor_only else scored.teacher_topk_logprobs,
        policy_version=turn.policy_version,
        weight_version=turn.weight_version,
        temperature=turn.sampling.temperature,
        mode=mode,
        forced=forced,
        group_id=turn.group_id,
    )
