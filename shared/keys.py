"""Every Redis stream, consumer group and key name, built from the configured prefix.

Nothing else in the code base spells a key: import `Keys` and ask it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Short stream names, as docs/streams.md and `nextstate tail` use them.
TURNS = "turns"
SCORED = "scored"
BATCHES = "batches"
CHECKPOINTS = "checkpoints"
POLICY = "policy"
EVALS = "evals"
OUTCOMES = "outcomes"
PROMOTIONS = "promotions"
REPLAYS = "replays"
DEAD = "dead"
STREAMS = (TURNS, SCORED, BATCHES, CHECKPOINTS, POLICY, EVALS, PROMOTIONS, OUTCOMES, REPLAYS, DEAD)

# Consumer groups (stream -> group that consumes it).
GROUP_JUDGE = "judge"
GROUP_BUFFER = "buffer"
GROUP_TRAINER = "trainer"
GROUP_ARCHIVE = "archive"  # the buffer's archiver, beside the trainer on `batches`
GROUP_EVALUATOR = "evaluator"  # on `checkpoints`: enqueues one evaluation job per suite
GROUP_GATE = "gate"  # the watcher's promotion gate, on `evals`
GROUP_OUTCOMES = "buffer"  # the buffer, on `outcomes`: joined with the episodes' scored turns
GROUP_REPLAY = "judge"  # the judges, on `replays`: a session's held turns scored with its experience
GROUPS = {TURNS: GROUP_JUDGE, SCORED: GROUP_BUFFER, BATCHES: GROUP_TRAINER}

# The single field of a stream entry that holds the message JSON.
FIELD = "data"


@dataclass(frozen=True)
class Keys:
    prefix: str = "nextstate"

    def stream(self, name: str) -> str:
        """Full key of a stream given its short name (`turns` -> `nextstate:turns`)."""
        if name not in STREAMS:
            raise ValueError(f"unknown stream {name!r}; one of {', '.join(STREAMS)}")
        return f"{self.prefix}:{name}"

    def short(self, key: str) -> str:
        """Inverse of `stream`: `nextstate:turns` -> `turns`."""
        return key.removeprefix(f"{self.prefix}:")

    @property
    def turns(self) -> str:
        return self.stream(TURNS)

    @property
    def scored(self) -> str:
        return self.stream(SCORED)

    @property
    def batches(self) -> str:
        return self.stream(BATCHES)

    @property
    def checkpoints(self) -> str:
        return self.stream(CHECKPOINTS)

    @property
    def policy(self) -> str:
        return self.stream(POLICY)

    @property
    def dead(self) -> str:
        return self.stream(DEAD)

    @property
    def evals(self) -> str:
        return self.stream(EVALS)

    @property
    def promotions(self) -> str:
        return self.stream(PROMOTIONS)

    # -- bus bookkeeping ---------------------------------------------------------
    def done(self, group: str, message_id: str) -> str:
        """Set once a group has handled a message id (dedupe across redeliveries)."""
        return f"{self.prefix}:done:{group}:{message_id}"

    def shed(self, stream_key: str) -> str:
        """Counter of messages refused because the stream was over its bound."""
        return f"{self.prefix}:shed:{self.short(stream_key)}"

    # -- collector: pending turns waiting for their next state -------------------
    def pending_turn(self, prefix_hash: str) -> str:
        return f"{self.prefix}:pending:{prefix_hash}"

    @property
    def pending_deadlines(self) -> str:
        """Sorted set: pending-turn hash scored by its expiry time."""
        return f"{self.prefix}:pending-deadlines"

    def turn_lineage(self, prefix_hash: str) -> str:
        """Session id and turn index of the response that ends this conversation prefix
        (kept after the pending turn closes, so a branch from it stays in its session)."""
        return f"{self.prefix}:lineage:{prefix_hash}"

    def pairing_anchor(self, anchor: str) -> str:
        """The pending hash of the one turn that registered this pairing anchor, or "*" once
        several did (services/collector/pairing.py), with the lineage's TTL."""
        return f"{self.prefix}:anchor:{anchor}"

    def stored_response(self, response_id: str) -> str:
        """A Responses API object kept for `GET /v1/responses/{id}` and `previous_response_id`
        (JSON: the response and its conversation), with a TTL."""
        return f"{self.prefix}:response:{response_id}"

    # -- buffer -------------------------------------------------------------------
    def session_samples(self, session_id: str) -> str:
        """Set of the turn ids a session has produced samples for (at-least-one rule)."""
        return f"{self.prefix}:session:{session_id}:samples"

    def sample_batched(self, turn_id: str) -> str:
        """Set once a turn's sample is in a published batch: never batched twice."""
        return f"{self.prefix}:batched:{turn_id}"

    # -- `nextstate import --watch` (services/ctl/import_watch.py) ---------------------
    def import_offsets(self, watch: str) -> str:
        """Hash file identity (`<device>:<inode>`) -> JSON {offset, line, head, path, at}: how
        far each file of a watched directory was forwarded (committed once the buffer took it)."""
        return f"{self.prefix}:import:{watch}:offsets"

    def import_lock(self, watch: str) -> str:
        """JSON {host, pid, token}, with a TTL the watcher renews: the one importer of a watch."""
        return f"{self.prefix}:import:{watch}:lock"

    # -- policy versions ------------------------------------------------------------
    @property
    def policy_version(self) -> str:
        """The version the engine serves now (set by the watcher)."""
        return f"{self.prefix}:policy-version"

    @property
    def trainer_version(self) -> str:
        """The newest version the trainer has committed (set by the trainer)."""
        return f"{self.prefix}:trainer-version"

    @property
    def trainer_mismatch(self) -> str:
        """Hash the trainer keeps (`nextstate status` reads it): the train/inference mismatch
        over its last steps — `tokens`, `abs_log_ratio`, `outside_frac`, `alarm` (empty or 1),
        `alarm_since`, `threshold`, `window_steps`, `updated_at` (services/trainer/mismatch.py)."""
        return f"{self.prefix}:trainer-mismatch"

    @property
    def run_owner(self) -> str:
        """JSON {run, at}: the run whose turns this prefix holds (set once by the buffer)."""
        return f"{self.prefix}:run"

    # -- operator-facing state (`nextstate status` reads these) --------------------------
    @property
    def watcher_state(self) -> str:
        """Hash written by the watcher on every pass: what the engine really serves
        (`engine_version`), what it should serve (`target_version`), `mismatch` 0|1,
        `checked_at`, `engine`, `error`."""
        return f"{self.prefix}:watcher-state"

    @property
    def refused_versions(self) -> str:
        """Hash version -> JSON {by, reason, detail, at}: checkpoints a trainer or watcher
        refused (did not verify, could not load). The dead-letter record of checkpoints."""
        return f"{self.prefix}:refused-versions"

    @property
    def services(self) -> str:
        """Hash service name -> JSON {state, pid, restarts, last_exit, since, port,
        serving_path, backoff_s, error}: the processes `nextstate up` supervises, as its
        supervisor sees them."""
        return f"{self.prefix}:services"

    @property
    def archive_state(self) -> str:
        """Hash archive consumer name -> JSON {roll_s, grace_s, held_since, uploaded_at,
        last_key, at}: what each buffer's archiver holds unacknowledged on purpose (the
        batches of its open roll wait for the roll's upload, up to roll_s), so that
        `nextstate status` tells that hold from a stall."""
        return f"{self.prefix}:archive-state"

    @property
    def buffer_counts(self) -> str:
        """Hash outcome -> count: every turn the buffer decided on, counted once
        (kept, forced, stale, and each exclusion reason)."""
        return f"{self.prefix}:buffer-counts"

    def session_decisions(self, session_id: str) -> str:
        """Hash turn id -> outcome: what the buffer decided for each turn of a session
        (written once per turn: redeliveries never count twice)."""
        return f"{self.prefix}:session:{session_id}:decisions"

    def session_settled(self, session_id: str) -> str:
        """Set of turn indexes of a session the buffer has decided on (the at-least-one
        rule waits for a final turn's ancestors)."""
        return f"{self.prefix}:session:{session_id}:settled"

    @property
    def force_candidates(self) -> str:
        """Sorted set turn id -> deadline: final turns waiting for the at-least-one rule."""
        return f"{self.prefix}:force-candidates"

    def force_candidate(self, turn_id: str) -> str:
        """The parked ScoredTurn JSON of a force candidate."""
        return f"{self.prefix}:force-candidate:{turn_id}"

    # The buffer's join of episode sessions (track 2) with their Outcome (episodes.py).
    @property
    def episode_sessions(self) -> str:
        """Sorted set session id -> when to look at it next: episode sessions whose scored
        turns are held for their Outcome (the deadline, now once it came, or a lease's end)."""
        return f"{self.prefix}:episode-sessions"

    def episode_turns(self, session_id: str) -> str:
        """Hash turn id -> held ScoredTurn JSON of an episode session."""
        return f"{self.prefix}:episode:{session_id}:turns"

    def episode_outcome(self, session_id: str) -> str:
        """An episode session's Outcome, as the buffer keeps it (JSON, with a TTL)."""
        return f"{self.prefix}:episode:{session_id}:outcome"

    def episode_group(self, group: str) -> str:
        """Hash of an advantage group's outcomes: group index -> JSON {session, reward,
        error}, and `first` (when its first outcome came: the group's wait starts then)."""
        return f"{self.prefix}:episode-group:{group}"

    def episode_group_stats(self, group: str) -> str:
        """A group's statistics (JSON {mean, std, n, partial}), fixed by whoever first
        settled it: every turn of the group is judged against the same numbers."""
        return f"{self.prefix}:episode-group:{group}:stats"

    # The buffer's chat groups: the n choices of one completion (n > 1), held until every
    # member came when the advantage is taken over the group (chat_groups.py).
    @property
    def chat_groups(self) -> str:
        """Sorted set group id -> when to look at it next: chat groups whose judged
        members are held (the deadline, now once every member came, or a lease's end)."""
        return f"{self.prefix}:chat-groups"

    def chat_group(self, group: str) -> str:
        """Hash of a chat group: `m:<choice index>` -> JSON {session, reward, not judged}
        per member that came, `size`, `first` (when its first member came) and `stats`."""
        return f"{self.prefix}:chat-group:{group}"

    def chat_group_turns(self, group: str) -> str:
        """Hash turn id -> held ScoredTurn JSON of a chat group's judged members."""
        return f"{self.prefix}:chat-group:{group}:turns"

    def chat_group_ready(self, group: str) -> str:
        """Set once every member of a chat group came, or its statistics are fixed: its
        held members are due at once."""
        return f"{self.prefix}:chat-group:{group}:ready"

    # -- evaluation and promotion ---------------------------------------------------------
    def eval_enqueued(self, job_id: str) -> str:
        """Set (NX) when an evaluation job id was enqueued: enqueuing twice runs it once."""
        return f"{self.prefix}:eval-enqueued:{job_id}"

    def model_eval(self, job_id: str) -> str:
        """Hash of one evaluation of a model outside the run (`nextstate eval run --model`),
        written by the evaluator for the CLI that waits on it: `state` (running, retrying,
        done, failed), `attempt`, `error`, `result` (the EvalResult JSON), `at`; with a TTL."""
        return f"{self.prefix}:model-eval:{job_id}"

    @property
    def gate_state(self) -> str:
        """Hash written by the watcher's gate: `promoted` (JSON list of promoted versions,
        oldest first), `best` (JSON suite -> best promoted score), `serving`, `decided_at`."""
        return f"{self.prefix}:gate-state"

    @property
    def lineage(self) -> str:
        """JSON {"base": version, "at", "by"}: the version the trainer must build on next
        (`nextstate rollback`, or the gate rolling back). The trainer rebases on it."""
        return f"{self.prefix}:lineage-base"

    # -- rq job queues -----------------------------------------------------------------
    def queue(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    @property
    def eval_queue(self) -> str:
        """The rq queue of evaluation jobs (one job = one suite on one version)."""
        return self.queue("eval")

    # -- environments (track 2) ----------------------------------------------------------
    @property
    def outcomes(self) -> str:
        return self.stream(OUTCOMES)

    @property
    def envs_queue(self) -> str:
        """The rq queue of environment episodes (one job = one episode)."""
        return self.queue("envs")

    def episode_enqueued(self, job_id: str) -> str:
        """Set (NX) when an episode job id was enqueued: enqueuing twice runs it once."""
        return f"{self.prefix}:episode-enqueued:{job_id}"

    def outcome_published(self, job_id: str) -> str:
        """The session id whose Outcome was published for an episode job (SET NX with the
        XADD, in one script): a rerun after a worker died never publishes a second one."""
        return f"{self.prefix}:outcome-published:{job_id}"

    def eval_episodes(self, evaluation: str) -> str:
        """Hash episode job id -> JSON result of the held-out episodes of one evaluation
        (shared/envjobs.py `enqueue_eval_episodes`): the envs workers write, the evaluator
        reads. Never on `outcomes`: an evaluation episode is not training data."""
        return f"{self.prefix}:eval-episodes:{evaluation}"

    # -- the reward-collapse alarm (the judges' shared window: services/judge/collapse.py) --------
    @property
    def reward_window(self) -> str:
        """List of turn ids, oldest first: the last judged turns whose rewards the collapse
        alarm looks at, shared by every judge replica (trimmed to the window's size)."""
        return f"{self.prefix}:reward-window"

    @property
    def reward_window_turns(self) -> str:
        """Hash turn id -> `<value>|<undecided 0/1>` of each turn in the window (a turn
        judged twice, after a redelivery, is counted once)."""
        return f"{self.prefix}:reward-window-turns"

    @property
    def reward_alarm(self) -> str:
        """Hash the judges keep with the window (`nextstate status` reads it): `v:<value>`
        counts, `undecided`, `turns`, `alarm` (empty, `one-value`, `undecided` or both),
        `alarm_since`, `updated_at`, and the thresholds the last writer used."""
        return f"{self.prefix}:reward-alarm"

    # -- experiential learning (the judge: services/judge/experience.py) ----------------------
    @property
    def replays(self) -> str:
        return self.stream(REPLAYS)

    def experience_session(self, session_id: str) -> str:
        """Hash final turn id -> Experience JSON: what was learned from a session, one record
        per ending (a session ends once; a branch that expired is an ending too). Its
        existence says the session has ended: a later turn is scored at once. TTL."""
        return f"{self.prefix}:experience:session:{session_id}"

    def experience_user(self, user_key: str) -> str:
        """List of Experience JSON, newest first, of one user (`user_key`: a digest of the
        client's `user`), trimmed to the store's bound. TTL, renewed on every push."""
        return f"{self.prefix}:experience:user:{user_key}"

    @property
    def experience_global(self) -> str:
        """List of Experience JSON of every user, newest first, trimmed to the store's bound."""
        return f"{self.prefix}:experience:global"

    def experience_held(self, session_id: str) -> str:
        """Hash turn id -> Turn JSON: a session's turns waiting for its experience (replay)."""
        return f"{self.prefix}:experience:held:{session_id}"

    @property
    def experience_waiting(self) -> str:
        """Sorted set session id -> when to replay it anyway (its deadline, or a claim's lease)."""
        return f"{self.prefix}:experience:waiting"
