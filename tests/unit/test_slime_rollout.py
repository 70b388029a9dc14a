"""deploy/slime: TrainSample -> slime Sample conversion, the rollout function, the launch script.

slime is not installed here, so the conversion runs against the documented stand-in
(deploy/slime/slime_standin.py), whose field names are checked against slime's real
`Sample` (as read from THUDM/slime, slime/utils/types.py). The rollout function against a
real buffer process on a real Redis is in tests/integration/test_slime_rollout_buffer.py.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.ctl.infra import free_port
from shared.errors import SettingsError
from shared.schemas import TrainBatch, TrainSample
from shared.settings import load_settings

REPO = Path(__file__).resolve().parents[2]
SLIME_DIR = REPO / "deploy/slime"
sys.path.insert(0, str(SLIME_DIR))

import nextstate_rollout as R  # noqa: E402
import slime_standin  # noqa: E402

# Field names of slime's Sample (THUDM/slime, slime/utils/types.py) that the stand-in mirrors.
SLIME_SAMPLE_FIELDS = {
    "group_index", "index", "rollout_id", "prompt", "tokens", "multimodal_inputs",
    "multimodal_train_inputs", "multimodal_train_input_id", "apply_chat_template_kwargs",
    "response", "response_length", "label", "reward", "loss_mask", "weight_versions",
    "rollout_log_probs", "rollout_top_p_token_ids", "rollout_top_p_token_offsets",
    "rollout_routed_experts", "remove_sample", "teacher_log_probs", "status", "metadata",
    "generate_function_path", "custom_rm_path", "train_metadata", "session_id",
    "non_generation_time", "spec_info", "prefix_cache_info",
}


def sample(n_prompt: int = 3, n_resp: int = 2, *, lp: bool = True, teacher: bool = False,
           reward: float = 1.0, version: int = 2, temperature: float = 1.0) -> TrainSample:
    return TrainSample(
        session_id="s1", turn_index=4, tokens=list(range(10, 10 + n_prompt + n_resp)),
        response_length=n_resp, loss_mask=[1] * n_resp, reward=reward,
        rollout_logprobs=[-0.5] * n_resp if lp else None,
        teacher_logprobs=[-0.25] * n_resp if teacher else None,
        policy_version=version, weight_version=str(version), temperature=temperature,
    )


def test_standin_is_used_without_slime_and_mirrors_slime_names() -> None:
    assert R.Sample is slime_standin.Sample
    assert R.RolloutFnTrainOutput is slime_standin.RolloutFnTrainOutput
    names = {f.name for f in dataclasses.fields(slime_standin.Sample)}
    assert names <= SLIME_SAMPLE_FIELDS, names - SLIME_SAMPLE_FIELDS
    assert {s.value for s in slime_standin.Sample.Status} == {
        "pending", "completed", "truncated", "aborted", "failed"}


def test_to_sample_maps_every_field() -> None:
    ts = sample(teacher=True, reward=-1.0)
    s = R.to_sample(ts, 7, batch_id="b1", use_opd=True)
    assert (s.index, s.group_index) == (7, 7)
    assert s.tokens == ts.tokens and s.response_length == 2 and s.loss_mask == [1, 1]
    assert s.reward == -1.0 and isinstance(s.reward, float)
    assert s.rollout_log_probs == [-0.5, -0.5] and s.teacher_log_probs == [-0.25, -0.25]
    assert s.weight_versions == ["2"] and s.session_id == "s1"
    assert s.status is R.Sample.Status.COMPLETED
    assert s.metadata == {"nextstate_sample_id": ts.id, "nextstate_batch_id": "b1",
                          "policy_version": 2, "turn_index": 4, "temperature": 1.0,
                          "mode": "rl", "forced": False}
    # Copies, not aliases of the message's lists.
    s.tokens.append(0)
    assert len(ts.tokens) == 5


def test_teacher_log_probs_only_under_opd_with_the_behaviour_fallback() -> None:
    assert R.to_sample(sample(teacher=True), 0, batch_id="b", use_opd=False).teacher_log_probs is None
    # No hint: teacher = behaviour log-probs, so the OPD term is 0 and only r trains.
    no_hint = R.to_sample(sample(teacher=False), 0, batch_id="b", use_opd=True)
    assert no_hint.teacher_log_probs == no_hint.rollout_log_probs == [-0.5, -0.5]


def test_convert_drops_what_the_loss_cannot_use_and_keeps_order() -> None:
    batches = [
        TrainBatch(samples=[sample(lp=True), sample(lp=False)]),
        TrainBatch(samples=[sample(lp=False, teacher=True), sample(n_prompt=1, n_resp=1)]),
    ]
    out, dropped = R.convert(batches, 10, need_rollout_logprobs=True, use_opd=False)
    assert [s.index for s in out] == [10, 11] and dropped == {"no_rollout_logprobs": 2}
    assert [s.metadata["nextstate_batch_id"] for s in out] == [batches[0].id, batches[1].id]
    out, dropped = R.convert(batches, 0, need_rollout_logprobs=False, use_opd=True)
    assert len(out) == 3 and dropped == {"no_teacher": 1}
    out, dropped = R.convert(batches, 0, need_rollout_logprobs=False, use_opd=False)
    assert len(out) == 4 and not dropped


def test_rollout_log_probs_are_all_or_none() -> None:
    mixed = [R.to_sample(sample(lp=x), i, batch_id="b", use_opd=False) for i, x in enumerate([True, False])]
    assert R.uniform_logprobs(mixed) == 1
    assert all(s.rollout_log_probs is None for s in mixed)
    full = [R.to_sample(sample(), i, batch_id="b", use_opd=False) for i in range(2)]
    assert R.uniform_logprobs(full) == 0 and all(s.rollout_log_probs for s in full)


def test_rollout_metrics() -> None:
    samples = [R.to_sample(sample(reward=r, version=v, temperature=t), i, batch_id="b", use_opd=False)
               for i, (r, v, t) in enumerate([(1.0, 3, 1.0), (-1.0, 5, 0.7), (1.0, 4, 1.0)])]
    m = R.rollout_metrics(samples, temperature=1.0)
    assert m["nextstate/samples"] == 3 and m["nextstate/reward_mean"] == pytest.approx(1 / 3)
    assert (m["nextstate/policy_version_min"], m["nextstate/policy_version_max"]) == (3, 5)
    assert m["nextstate/temperature_mismatch"] == 1


def test_evaluation_is_refused_with_a_reason() -> None:
    with pytest.raises(NotImplementedError, match="eval-interval"):
        R.generate_rollout(SimpleNamespace(rollout_batch_size=1), 0, None, evaluation=True)


def test_settings_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXTSTATE_SLIME__BUFFER_URL", "http://buffer:8200/")
    monkeypatch.setenv("NEXTSTATE_SLIME__WAIT_S", "5")
    cfg = load_settings(R.SlimeSettings).slime
    assert (cfg.buffer_url, cfg.wait_s) == ("http://buffer:8200", 5.0)
    monkeypatch.setenv("NEXTSTATE_SLIME__BUFFER_URL", "buffer:8200")
    with pytest.raises(SettingsError, match="NEXTSTATE_SLIME__BUFFER_URL"):
        load_settings(R.SlimeSettings)


def test_an_unreachable_buffer_raises_buffer_unavailable() -> None:
    cfg = R.SlimeConfig(buffer_url=f"http://127.0.0.1:{free_port()}", wait_s=0, timeout_s=2)
    src = R.RolloutSource(cfg)
    try:
        with pytest.raises(R.BufferUnavailable, match="get_data failed"):
            src.pull()
    finally:
        src.close()


def launch_args(tmp_path: Path, **extra: str) -> list[str]:
    model = tmp_path / "model.sh"
    model.write_text("MODEL_ARGS=(--num-layers 2 --hidden-size 64)\n")
    env = {**os.environ, "SLIME_DIR": str(tmp_path), "MEGATRON_DIR": str(tmp_path),
           "MODEL_ARGS_SCRIPT": str(model), "HF_CKPT": "/models/policy", "REF_LOAD": "/ref",
           "ENGINE_ADDRS": "engine:30000 engine2:30000", "PRINT_ONLY": "1", **extra}
    out = subprocess.run(["bash", str(SLIME_DIR / "run_nextstate_slime.sh")], env=env,
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")[:-1]


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, name
    return args[args.index(name) + 1]


def test_launch_script_carries_the_seed_hyper_parameters(tmp_path: Path) -> None:
    args = launch_args(tmp_path)
    module, _, func = flag(args, "--rollout-function-path").rpartition(".")
    assert (SLIME_DIR / f"{module}.py").is_file() and callable(getattr(R, func))
    for name, value in {"--advantage-estimator": "grpo", "--eps-clip": "0.2", "--eps-clip-high": "0.28",
                        "--kl-loss-coef": "0.02", "--kl-loss-type": "k3", "--entropy-coef": "0.0",
                        "--lr": "1e-6", "--n-samples-per-prompt": "1", "--optimizer": "adam",
                        "--update-weight-transport": "disk"}.items():
        assert flag(args, name) == value, name
    for switch in ("--disable-rewards-normalization", "--use-kl-loss", "--use-rollout-logprobs",
                   "--disable-rollout-global-dataset", "--num-layers"):
        assert switch in args, switch
    engines = args.index("--rollout-external-engine-addrs")
    assert args[engines + 1: engines + 3] == ["engine:30000", "engine2:30000"]
    assert "--use-opd" not in args and "--eval-interval" not in args


def test_launch_script_adds_opd_in_opd_and_combine_modes(tmp_path: Path) -> None:
    args = launch_args(tmp_path, NEXTSTATE_MODE="combine", W_OPD="0.5")
    assert "--use-opd" in args and flag(args, "--opd-type") == "sglang"
    assert flag(args, "--opd-kl-coef") == "0.5"
