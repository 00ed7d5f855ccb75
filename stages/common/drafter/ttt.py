"""EAGLE-3 training-time test (TTT): the drafter unrolled for `ttt_steps` draft steps, as the field trains it.

Alignment (SpecForge's): at position t, step 0 reads the target's aux hidden state of token t and the embedding of
token t+1 and predicts token t+2; step k reads its own step k-1 output at t and the embedding of token t+1+k, at
position id t+k, and predicts token p = t+2+k. The label is the target's next-token distribution at position p-1
restricted to the draft vocab (soft cross-entropy); a prediction whose target argmax lies outside the draft vocab
carries no loss and counts as wrong; `loss_k = -(mask * sum p log q).mean()` over all B*T positions and the total is
`sum(decay**k * loss_k)`.

Which predictions carry loss and count (`LossMask`, on the assistant mask `m`), for step k's prediction of p:
- `drafted` (default): m[t+1], m[t+2], ..., m[p] all set. At inference the target emits the first token of every
  answer itself (prefill or bonus token), so a chain starts from a verified token t+1 inside an answer and drafts
  tokens of that same answer: the first token of a turn is never drafted, its end-of-turn marker is, the token after
  it never is, and no chain crosses a user turn.
- `specforge`: m[p-2] = m[t+k] (SpecForge 0.2.0 and EAGLE-3's cnets.py: the mask is never shifted with the inputs).
- `speculators`: m[p-1] = m[t+1+k] (vllm-project/speculators; SpecForge issue #885 / PR #895).
Step k has labels at t <= T-2-k (the target's logits at t+1+k, the last one predicting the token after the row);
`drafted` counts that token as outside the mask.

The target-side work runs once per batch (`TargetSignals`: the full-vocab argmax, the draft-vocab logits; here the
in-draft-vocab check and the fp32 softmax); each step takes views shifted by k. The drafter's lm_head runs only at the
positions that carry a loss (the others add nothing to the loss and count as wrong), and the soft cross-entropy
keeps only those logits for its backward (`SoftCrossEntropy`), so neither the time nor the memory of the draft-vocab
head grows with the positions the mask leaves out.

Metrics come back as counts, so batches and ranks add up exactly: `full_acc_k` (right at step k over the positions
the mask admits), `cond_acc_k` (right at step k where steps 0..k-1 were all right, over admitted positions where
they were) and `sim_accept_len = 1 + sum_k prod_{i<=k} cond_acc_i`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from stages.common.drafter.eagle3 import Eagle3Drafter, TTTCache
from stages.common.drafter.loss_mask import LossMask
from stages.common.drafter.target import TargetSignals

DECAY = 0.8  # weight of draft step k's loss is DECAY**k


class SoftCrossEntropy(torch.autograd.Function):
    """`-sum_rows sum_j p_j log softmax(z)_j` over the rows `index` picks from the target's draft-vocab
    probabilities, whose gradient is `softmax(z) * sum_j p_j - p`: the backward keeps the logits alone and gathers
    p again, instead of autograd keeping the logits, their log-softmax and a copy of p per draft step."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target_p: torch.Tensor, index: tuple[torch.Tensor, ...] | None
                ) -> torch.Tensor:
        ctx.index = index
        ctx.save_for_backward(logits, target_p)
        z, p = logits.float(), gather_rows(target_p, index)
        # sum p log softmax(z) = sum p z - sum_rows (sum_j p_j) logsumexp(z): no [rows, N] product built
        return (p.sum(-1) * torch.logsumexp(z, dim=-1)).sum() - torch.vdot(p.flatten(), z.flatten())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, target_p = ctx.saved_tensors
        p = gather_rows(target_p, ctx.index)
        grad_logits = torch.softmax(logits.float(), dim=-1).mul_(p.sum(-1, keepdim=True)).sub_(p).mul_(grad)
        return grad_logits.to(logits.dtype), None, None


def admitted(mask: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The positions a [B, L] mask admits, as indices; None on the meta device, where their count is unknown and
    every position is taken (memory.py's estimate: an upper bound)."""
    return None if mask.device.type == "meta" else mask.nonzero(as_tuple=True)


def gather_rows(x: torch.Tensor, index: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    """[B, L, ...] -> [rows, ...] at `index` (every position where None)."""
    return x.flatten(0, 1) if index is None else x[index]


def scatter_rows(values: torch.Tensor, index: tuple[torch.Tensor, ...] | None, shape: torch.Size) -> torch.Tensor:
    """The inverse of gather_rows for one value per row, the rest False."""
    if index is None:
        return values.reshape(shape)
    placed = torch.zeros(shape, dtype=values.dtype, device=values.device)
    placed[index] = values
    return placed


def shift_left(x: torch.Tensor, steps: int) -> torch.Tensor:
    """x[:, t + steps] at t, zero past the end (dim 1 is time)."""
    if steps == 0:
        return x
    pad = torch.zeros_like(x[:, :steps])
    return torch.cat((x[:, steps:], pad), dim=1)


def draft_vocab_ids(drafter: Eagle3Drafter) -> torch.Tensor:
    """[N] the target id of every draft id, in draft order."""
    return drafter.draft_to_target(torch.arange(drafter.d2t.numel(), device=drafter.d2t.device))


def loss_gates(loss_mask: torch.Tensor, rule: LossMask | str, ttt_steps: int) -> list[torch.Tensor]:
    """Per step k, [B, T-1-k] bool: whether step k's prediction at position t (of token p = t+2+k) counts, by
    `rule`. Position t runs to T-2-k, the last with a label (the target's logits at t+1+k); `drafted` counts the
    token after the row (p = T) as outside the mask."""
    mask, rule = loss_mask.to(torch.bool), LossMask(rule)
    T = mask.shape[1]
    beyond = torch.cat((mask, mask.new_zeros(mask.shape[0], 1)), dim=1)  # m[T] = False
    gates: list[torch.Tensor] = []
    for k in range(ttt_steps):
        L = max(T - 1 - k, 0)
        if rule is LossMask.drafted:  # m[t+1] & ... & m[t+2+k]: one more token each step
            gate = beyond[:, 1:T] & beyond[:, 2:] if k == 0 else gates[-1][:, :L] & beyond[:, 2 + k:]
        elif rule is LossMask.specforge:
            gate = mask[:, k:T - 1]
        else:
            gate = mask[:, 1 + k:]
        gates.append(gate[:, :L])
    return gates


@dataclass
class TTTStats:
    """Per-step sums over a batch: losses (already decayed-weighted in `loss`) and accuracy counts."""

    loss: torch.Tensor  # scalar: sum_k decay**k * loss_k, what backward() runs on
    step_losses: torch.Tensor  # [K]
    correct: torch.Tensor  # [K] admitted positions predicted right
    valid: torch.Tensor  # [K] positions the loss mask admits
    cond_correct: torch.Tensor  # [K] right where every earlier step was right
    cond_valid: torch.Tensor  # [K] admitted positions where every earlier step was right

    def metrics(self) -> dict[str, float]:
        return ttt_metrics(self.step_losses, self.correct, self.valid, self.cond_correct, self.cond_valid)


def ttt_metrics(step_losses: torch.Tensor, correct: torch.Tensor, valid: torch.Tensor, cond_correct: torch.Tensor,
                cond_valid: torch.Tensor, decay: float = DECAY) -> dict[str, float]:
    """Per-step metrics, `loss` (the decay-weighted total) and `sim_accept_len`, from (summed) counts."""
    metrics: dict[str, float] = {"loss": float(sum(decay ** k * float(l) for k, l in enumerate(step_losses)))}
    accept, chain = 1.0, 1.0
    for k in range(len(step_losses)):
        cond_acc = float(cond_correct[k]) / max(float(cond_valid[k]), 1.0)
        metrics.update({f"loss_{k}": float(step_losses[k]), f"full_acc_{k}": float(correct[k]) / max(float(valid[k]), 1.0)})
        if k > 0:  # step 0 has no earlier steps: its conditional accuracy is full_acc_0, one figure with one name
            metrics[f"cond_acc_{k}"] = cond_acc
        chain *= cond_acc
        accept += chain
    metrics["sim_accept_len"] = accept
    return metrics


def ttt_forward(drafter: Eagle3Drafter, embed: Callable[[torch.Tensor], torch.Tensor], input_ids: torch.Tensor,
                loss_mask: torch.Tensor, aux_hidden: torch.Tensor, target: TargetSignals, ttt_steps: int,
                rule: LossMask | str = LossMask.drafted, decay: float = DECAY) -> TTTStats:
    """Unroll the drafter over a batch of target features; see the module docstring for the alignment and `rule`."""
    B, T = input_ids.shape
    if target.draft_logits.shape[-1] != drafter.d2t.numel():
        raise ValueError(f"target signals over {target.draft_logits.shape[-1]} draft ids, the drafter has "
                         f"{drafter.d2t.numel()}")
    # Once per batch: index j holds the target's view of token j+1 (its next-token logits at position j).
    with torch.no_grad():
        in_vocab = drafter.t2d[target.argmax]  # [B, T]
        target_p = torch.softmax(target.draft_logits, dim=-1, dtype=torch.float32)  # [B, T, N]
        target_top = target_p.argmax(-1)  # [B, T]
    gates = loss_gates(loss_mask, rule, ttt_steps)
    positions = torch.arange(T, device=input_ids.device)[None].expand(B, T)
    hidden = drafter.project_aux(aux_hidden)
    cache = TTTCache()
    all_right_so_far = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
    losses, stats = [], {name: [] for name in ("correct", "valid", "cond_correct", "cond_valid")}
    total = hidden.new_zeros((), dtype=torch.float32)
    for k in range(ttt_steps):
        L = max(T - 1 - k, 0)  # positions t with a label for token t+2+k: the target's logits at t+1+k
        gate = gates[k]
        position_mask = gate & in_vocab[:, 1 + k:]
        out = drafter(embed(shift_left(input_ids, 1 + k)), hidden, positions + k, cache=cache, head=False)
        rows = admitted(position_mask)
        logits = drafter.lm_head(gather_rows(out.normed[:, :L], rows))  # [rows, N]
        loss_k = SoftCrossEntropy.apply(logits, target_p[:, 1 + k:], rows) / (B * T)
        right = scatter_rows(logits.argmax(-1) == gather_rows(target_top[:, 1 + k:], rows), rows,
                             position_mask.shape) & position_mask
        so_far = all_right_so_far[:, :L]
        stats["correct"].append(right.sum())
        stats["valid"].append(gate.sum())
        stats["cond_correct"].append((right & so_far).sum())
        stats["cond_valid"].append((gate & so_far).sum())
        all_right_so_far = so_far & right
        losses.append(loss_k.detach())
        total = total + decay ** k * loss_k
        hidden = out.hidden
    as_tensor = {name: torch.stack(values).detach() for name, values in stats.items()}
    return TTTStats(loss=total, step_losses=torch.stack(losses), **as_tensor)
