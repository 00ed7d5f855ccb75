"""EAGLE-3 training-time test (TTT): the drafter unrolled for `ttt_steps` draft steps, as the field trains it.

Alignment (SpecForge's): at position t, step 0 reads the target's aux hidden state of token t and the embedding of
token t+1 and predicts token t+2; step k reads its own step k-1 output at t and the embedding of token t+1+k, at
position id t+k, and predicts token t+2+k. The label is the target's next-token distribution restricted to the draft
vocab (soft cross-entropy). A prediction carries loss only where the predicted token is an assistant token and the
target's argmax lies in the draft vocab; the total is `sum(decay**k * loss_k)`.

Metrics come back as counts, so batches and ranks add up exactly: `full_acc_k` (right at step k over assistant
tokens), `cond_acc_k` (right at step k where steps 0..k-1 were all right) and
`sim_accept_len = 1 + sum_k prod_{i<=k} cond_acc_i`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from stages.common.eagle3 import Eagle3Drafter, TTTCache

DECAY = 0.8  # weight of draft step k's loss is DECAY**k


def shift_left(x: torch.Tensor, steps: int) -> torch.Tensor:
    """x[:, t + steps] at t, zero past the end (dim 1 is time)."""
    if steps == 0:
        return x
    pad = torch.zeros_like(x[:, :steps])
    return torch.cat((x[:, steps:], pad), dim=1)


@dataclass
class TTTStats:
    """Per-step sums over a batch: losses (already decayed-weighted in `loss`) and accuracy counts."""

    loss: torch.Tensor  # scalar: sum_k decay**k * loss_k, what backward() runs on
    step_losses: torch.Tensor  # [K]
    correct: torch.Tensor  # [K] assistant positions predicted right
    valid: torch.Tensor  # [K] assistant positions
    cond_correct: torch.Tensor  # [K] right where every earlier step was right
    cond_valid: torch.Tensor  # [K] assistant positions where every earlier step was right

    def metrics(self) -> dict[str, float]:
        return ttt_metrics(self.step_losses, self.correct, self.valid, self.cond_correct, self.cond_valid)


def ttt_metrics(step_losses: torch.Tensor, correct: torch.Tensor, valid: torch.Tensor, cond_correct: torch.Tensor,
                cond_valid: torch.Tensor, decay: float = DECAY) -> dict[str, float]:
    """Per-step metrics, `loss` (the decay-weighted total) and `sim_accept_len`, from (summed) counts."""
    metrics: dict[str, float] = {"loss": float(sum(decay ** k * float(l) for k, l in enumerate(step_losses)))}
    accept, chain = 1.0, 1.0
    for k in range(len(step_losses)):
        cond_acc = float(cond_correct[k]) / max(float(cond_valid[k]), 1.0)
        metrics.update({f"loss_{k}": float(step_losses[k]), f"full_acc_{k}": float(correct[k]) / max(float(valid[k]), 1.0),
                        f"cond_acc_{k}": cond_acc})
        chain *= cond_acc
        accept += chain
    metrics["sim_accept_len"] = accept
    return metrics


def ttt_forward(drafter: Eagle3Drafter, embed: Callable[[torch.Tensor], torch.Tensor], input_ids: torch.Tensor,
                loss_mask: torch.Tensor, aux_hidden: torch.Tensor, target_logits: torch.Tensor, ttt_steps: int,
                decay: float = DECAY) -> TTTStats:
    """Unroll the drafter over a batch of target features; see the module docstring for the alignment."""
    B, T = input_ids.shape
    draft_ids = drafter.d2t + torch.arange(drafter.d2t.numel(), device=drafter.d2t.device)
    loss_mask = loss_mask.to(torch.bool)
    positions = torch.arange(T, device=input_ids.device)[None].expand(B, T)
    hidden = drafter.project_aux(aux_hidden)
    cache = TTTCache()
    all_right_so_far = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
    losses, stats = [], {name: [] for name in ("correct", "valid", "cond_correct", "cond_valid")}
    total = hidden.new_zeros(())
    for k in range(ttt_steps):
        logits_k = shift_left(target_logits, 1 + k)  # the target's distribution for token t+2+k
        assistant = shift_left(loss_mask, 2 + k)
        in_vocab = drafter.t2d[logits_k.argmax(-1)]
        position_mask = (assistant & in_vocab).to(hidden.dtype)
        target_p = torch.softmax(logits_k[..., draft_ids].float(), dim=-1)
        out = drafter(embed(shift_left(input_ids, 1 + k)), hidden, positions + k, cache=cache)
        log_p = F.log_softmax(out.logits.float(), dim=-1)
        loss_k = -(position_mask * (target_p * log_p).sum(-1)).mean()
        right = (out.logits.argmax(-1) == target_p.argmax(-1)) & assistant & in_vocab
        stats["correct"].append(right.sum())
        stats["valid"].append(assistant.sum())
        stats["cond_correct"].append((right & all_right_so_far).sum())
        stats["cond_valid"].append((assistant & all_right_so_far).sum())
        all_right_so_far = all_right_so_far & right
        losses.append(loss_k.detach())
        total = total + decay ** k * loss_k
        hidden = out.hidden
    as_tensor = {name: torch.stack(values).detach() for name, values in stats.items()}
    return TTTStats(loss=total, step_losses=torch.stack(losses), **as_tensor)
