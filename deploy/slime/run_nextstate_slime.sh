#!/usr/bin/env bash
# Train the policy with slime (Megatron on Ray) on nextstate's live traffic.
#
# The collector, judges and buffer run as usual (docker compose / Kubernetes); slime
# replaces nextstate's trainer AND watcher: it pulls batches from the buffer
# (nextstate_rollout.generate_rollout) and pushes every update straight into the SGLang
# engine the collector uses (--rollout-external-engine-addrs), so stop those two
# (`docker compose stop trainer-gpu watcher`) or they fight over the engine's weights.
#
# Hyper-parameters are the seeds': GRPO with one sample per prompt and no reward
# normalisation (A_t = r), PPO clip 0.2 / 0.28 against the engine's behaviour log-probs,
# k3 KL to the reference with beta 0.02, no entropy bonus, Adam lr 1e-6.
# NEXTSTATE_MODE=opd|combine adds slime's on-policy distillation on the judge's teacher
# log-probs (A_t += W_OPD * (teacher_lp - old_lp)).
#
# Required: SLIME_DIR, MEGATRON_DIR, MODEL_ARGS_SCRIPT (slime/scripts/models/<model>.sh),
# HF_CKPT (the policy HF folder the engine serves), REF_LOAD (it converted to Megatron
# torch_dist), ENGINE_ADDRS (host:port of the SGLang engine(s), space-separated).
# The slime environment also needs nextstate's light core: `pip install <repo>` (no torch
# extras). With WEIGHT_TRANSPORT=disk (default) UPDATE_WEIGHT_DIR must be the same path
# on this machine and in the engine (e.g. the shared checkpoints volume).
# PRINT_ONLY=1 prints the train.py arguments instead of starting Ray.
set -euo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
NEXTSTATE_ROOT=${NEXTSTATE_ROOT:-"$(cd -- "${SCRIPT_DIR}/../.." && pwd)"}
SLIME_DIR=${SLIME_DIR:?set SLIME_DIR to a slime checkout}
MEGATRON_DIR=${MEGATRON_DIR:?set MEGATRON_DIR to a Megatron-LM checkout}
MODEL_ARGS_SCRIPT=${MODEL_ARGS_SCRIPT:?set MODEL_ARGS_SCRIPT, e.g. \$SLIME_DIR/scripts/models/qwen3-4B.sh}
HF_CKPT=${HF_CKPT:?set HF_CKPT to the policy HF folder}
REF_LOAD=${REF_LOAD:?set REF_LOAD to the policy in Megatron torch_dist format}
ENGINE_ADDRS=${ENGINE_ADDRS:?set ENGINE_ADDRS to the SGLang engine host:port (space-separated)}
SAVE_DIR=${SAVE_DIR:-${NEXTSTATE_ROOT}/.nextstate/slime}
export NEXTSTATE_SLIME__BUFFER_URL=${NEXTSTATE_SLIME__BUFFER_URL:-http://127.0.0.1:8200}
MODE=${NEXTSTATE_MODE:-rl}
W_OPD=${W_OPD:-1.0}
ACTOR_GPUS=${ACTOR_GPUS:-4}
NUM_GPUS=${NUM_GPUS:-${ACTOR_GPUS}}
WEIGHT_TRANSPORT=${WEIGHT_TRANSPORT:-disk}
UPDATE_WEIGHT_DIR=${UPDATE_WEIGHT_DIR:-/checkpoints/slime}

# shellcheck source=/dev/null
source "${MODEL_ARGS_SCRIPT}"  # defines MODEL_ARGS for the architecture

CKPT_ARGS=(
  --hf-checkpoint "${HF_CKPT}"
  --ref-load "${REF_LOAD}"
  --load "${SAVE_DIR}"
  --save "${SAVE_DIR}"
  --save-interval "${SAVE_INTERVAL:-50}"
)

# One rollout = ROLLOUT_BATCH_SIZE samples from the buffer (match BUFFER_BATCH_SIZE), one
# group of one each, one optimizer step; no prompt dataset, no generation by slime.
# --rollout-temperature must be the temperature the agents sample at (slime recomputes
# log-probs at it; nextstate/temperature_mismatch counts samples that differ).
ROLLOUT_ARGS=(
  --rollout-function-path nextstate_rollout.generate_rollout
  --disable-rollout-global-dataset
  --rollout-external-engine-addrs ${ENGINE_ADDRS}
  --num-rollout "${NUM_ROLLOUT:-100000000}"
  --rollout-batch-size "${ROLLOUT_BATCH_SIZE:-16}"
  --n-samples-per-prompt 1
  --num-steps-per-rollout 1
  --rollout-temperature "${ROLLOUT_TEMPERATURE:-1.0}"
)

GRPO_ARGS=(
  --advantage-estimator grpo
  --disable-rewards-normalization
  --use-rollout-logprobs
  --eps-clip 0.2
  --eps-clip-high 0.28
  --use-kl-loss
  --kl-loss-coef "${KL_COEF:-0.02}"
  --kl-loss-type k3
  --entropy-coef 0.0
)

OPD_ARGS=()
case "${MODE}" in
  rl) ;;
  opd|combine) OPD_ARGS=(--use-opd --opd-type sglang --opd-kl-coef "${W_OPD}") ;;
  *) echo "NEXTSTATE_MODE must be rl, opd or combine (got ${MODE})" >&2; exit 2 ;;
esac

OPTIMIZER_ARGS=(
  --optimizer adam
  --lr "${LR:-1e-6}"
  --lr-decay-style constant
  --weight-decay "${WEIGHT_DECAY:-0.01}"
  --adam-beta1 0.9
  --adam-beta2 0.999
  --clip-grad 1.0
)

# Weights go straight into the serving engine after every step.
WEIGHT_ARGS=(--update-weight-mode full --update-weight-transport "${WEIGHT_TRANSPORT}")
if [[ "${WEIGHT_TRANSPORT}" == disk ]]; then
  WEIGHT_ARGS+=(--update-weight-disk-dir "${UPDATE_WEIGHT_DIR}")
fi

PERF_ARGS=(
  --tensor-model-parallel-size "${TP:-1}"
  --pipeline-model-parallel-size 1
  --context-parallel-size 1
  --recompute-granularity full
  --recompute-method uniform
  --recompute-num-layers 1
  --use-dynamic-batch-size
  --max-tokens-per-gpu "${MAX_TOKENS_PER_GPU:-16384}"
)

MISC_ARGS=(
  --attention-dropout 0.0
  --hidden-dropout 0.0
  --accumulate-allreduce-grads-in-fp32
  --attention-softmax-in-fp32
)

TRAIN_ARGS=(
  --actor-num-nodes 1
  --actor-num-gpus-per-node "${ACTOR_GPUS}"
  --num-gpus-per-node "${NUM_GPUS}"
  "${MODEL_ARGS[@]}"
  "${CKPT_ARGS[@]}"
  "${ROLLOUT_ARGS[@]}"
  "${GRPO_ARGS[@]}"
  "${OPD_ARGS[@]}"
  "${OPTIMIZER_ARGS[@]}"
  "${WEIGHT_ARGS[@]}"
  "${PERF_ARGS[@]}"
  "${MISC_ARGS[@]}"
)

if [[ "${PRINT_ONLY:-0}" == 1 ]]; then
  printf '%s\n' "${TRAIN_ARGS[@]}"
  exit 0
fi

export PYTHONUNBUFFERED=1
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
if [[ -z "${RAY_ADDRESS:-}" ]]; then
  ray start --head --node-ip-address "${MASTER_ADDR}" --num-gpus "${NUM_GPUS}" \
    --disable-usage-stats --dashboard-host=127.0.0.1 --dashboard-port=8265
  RAY_ADDRESS="http://127.0.0.1:8265"
fi

# The rollout manager imports nextstate_rollout (this folder) and shared (the repo root).
RUNTIME_ENV_JSON=$(cat <<EOF
{"env_vars": {
  "PYTHONPATH": "${MEGATRON_DIR}:${SCRIPT_DIR}:${NEXTSTATE_ROOT}:${SLIME_DIR}",
  "CUDA_DEVICE_MAX_CONNECTIONS": "1",
  "NEXTSTATE_SLIME__BUFFER_URL": "${NEXTSTATE_SLIME__BUFFER_URL}"
}}
EOF
)

cd "${SLIME_DIR}"
exec ray job submit --address="${RAY_ADDRESS}" --runtime-env-json="${RUNTIME_ENV_JSON}" \
  -- python3 train_async.py "${TRAIN_ARGS[@]}"
