"""Teacher-forced replay: the log-probs a trainer recomputes for the rollout's tokens (the GRPO ratio check).

Per row, one unpadded, cache-free forward over prompt + response; fp32 log_softmax; gather the response
tokens. A rollout's recorded log-probs must match these, or the importance ratio is biased from step one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from harness.ar.loop import Rollout

__all__ = ["teacher_forced_logp"]


@torch.no_grad()
def teacher_forced_logp(backend: Any, prompts: Sequence[torch.Tensor], rollout: Rollout) -> torch.Tensor:
    """Replay log-probs ``[B, N]`` of ``rollout``'s tokens (0 past each row's length, as the rollout records)."""
    if len(prompts) != rollout.tokens.shape[0]:
        raise ValueError(f"{len(prompts)} prompts for a rollout of {rollout.tokens.shape[0]} rows")
    out = torch.zeros_like(rollout.logp)
    for i, prompt in enumerate(prompts):
        n = int(rollout.lengths[i])
        response = rollout.tokens[i, :n]
        logits = backend.full_forward(torch.cat([prompt, response])).float()
        start = int(prompt.numel()) - 1
        logprobs = torch.log_softmax(logits[start: start + n], dim=-1)
        out[i, :n] = logprobs.gather(1, response[:, None])[:, 0]
    return out
