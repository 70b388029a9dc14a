"""Loss plugins for the tests (`NEXTSTATE_TRAINER__LOSS=tests.support.loss_plugin:…`).

`reward_weighted_nll`: -scale · token-mean(r · log p) — a REINFORCE without ratio or clip,
simple enough to check against a closed form; its metrics are `plugin_loss` and
`plugin_calls` (1 per micro-batch, so the step's sum counts them).
"""

from __future__ import annotations

import torch

from services.trainer.loss_plugins import LossConfig, LossInputs, Metrics
from services.trainer.losses import masked_mean


def reward_weighted_nll(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Metrics]:
    scale = float(cfg.options.get("scale", 1.0))
    per_token = -scale * inputs.rewards[:, None] * inputs.logprobs  # (B, W)
    loss = masked_mean(per_token, inputs.mask, inputs.num_tokens)
    return loss, {"plugin_loss": loss.detach(), "plugin_calls": torch.tensor(1.0)}


def returns_a_float(inputs: LossInputs, cfg: LossConfig) -> float:
    return 0.0


NOT_A_FUNCTION = 3
