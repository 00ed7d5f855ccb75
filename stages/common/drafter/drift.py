"""How far a target's hidden states moved for a drafter, and the closed-form map that moves them back.

A drafter's `fc` reads the target's aux states; carried to a new target B, it reads B's states where it was trained
on A's. Per aux layer, on the same tokens (rows = tokens, columns = features):
- linear CKA (Kornblith et al. 2019): similarity of the two representations up to rotation and scale (1 = same);
- relative shift `||h_B - h_A|| / ||h_A||` over all tokens (0 = unchanged, ~1.4 = unrelated states of equal size);
- R^2 of the best linear map from B's states to A's, fitted by ridge least squares on one split and scored on
  another: how much of the drift a linear map can undo.

Re-alignment folds such maps into the drafter: with `aux_A ~ aux_B @ M` (M block-diagonal, one [H, H] block per
aux layer, no cross-layer terms: 3 H^2 numbers instead of 9 H^2, and each block is fitted on its own layer's
tokens), `fc(aux_A) = aux_A @ W^T ~ aux_B @ (M @ W^T)`, so `W' = W @ M^T`: the drafter keeps its shape and reads B.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

RIDGE = 1e-3  # relative to the mean eigenvalue of B's Gram matrix: scale-free, and a no-op on well-posed fits


def centred(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x - x.mean(0, keepdim=True)


def linear_cka(a: torch.Tensor, b: torch.Tensor) -> float:
    """CKA with a linear kernel between [n, d] and [n, e]: ||B^T A||_F^2 / (||A^T A||_F ||B^T B||_F), centred."""
    a, b = centred(a), centred(b)
    cross = (b.T @ a).norm() ** 2
    return float(cross / ((a.T @ a).norm() * (b.T @ b).norm()))


def relative_shift(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((b.double() - a.double()).norm() / a.double().norm())


def fit_ridge(source: torch.Tensor, target: torch.Tensor, ridge: float = RIDGE) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, c) minimising ||target - (source @ M + c)||^2 + lambda ||M||^2, lambda = ridge x the mean eigenvalue."""
    mean_s, mean_t = source.double().mean(0), target.double().mean(0)
    s, t = source.double() - mean_s, target.double() - mean_t
    gram = s.T @ s
    lam = ridge * gram.diagonal().mean().clamp_min(1e-12)
    m = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), s.T @ t)
    return m, mean_t - mean_s @ m


def r_squared(predicted: torch.Tensor, actual: torch.Tensor) -> float:
    actual = actual.double()
    residual = (actual - predicted.double()).pow(2).sum()
    return float(1 - residual / (actual - actual.mean(0)).pow(2).sum())


@dataclass
class LayerDrift:
    layer: int  # the aux layer id (the drafter's convention)
    cka: float
    shift: float
    r2_linear: float  # held-out R^2 of the ridge map B -> A
    r2_identity: float  # held-out R^2 of using B's states as they are (what the carried drafter does)

    def as_dict(self) -> dict[str, float]:
        return {"layer": self.layer, "cka": self.cka, "shift": self.shift, "r2_linear": self.r2_linear,
                "r2_identity": self.r2_identity}


@dataclass
class Realignment:
    blocks: list[torch.Tensor]  # one [H, H] map per aux layer: aux_B[k] @ M_k ~ aux_A[k]
    offsets: list[torch.Tensor]  # [H] each; fc has no bias, so they are reported, not folded (see `fold`)

    def fold(self, fc_weight: torch.Tensor) -> torch.Tensor:
        """fc's weight [H_d, 3H] reading B: W' = W @ blockdiag(M)^T. The offsets are left out: folding them needs a
        bias fc does not have (the exported drafter keeps its shape); they are small next to the states (checked
        in the realign report as the R^2 with and without them)."""
        width = self.blocks[0].shape[0]
        pieces = [fc_weight[:, k * width:(k + 1) * width].double() @ m.T for k, m in enumerate(self.blocks)]
        return torch.cat(pieces, dim=1).to(fc_weight.dtype)


def per_layer(aux: torch.Tensor, layers: int) -> list[torch.Tensor]:
    """[n, layers x H] -> layers x [n, H]."""
    return list(aux.reshape(aux.shape[0], layers, -1).unbind(1))


def measure(aux_a: torch.Tensor, aux_b: torch.Tensor, layer_ids: list[int], fit_share: float = 0.5,
            ridge: float = RIDGE) -> tuple[list[LayerDrift], Realignment]:
    """Per-layer drift of B from A on the same [n, 3H] tokens, the ridge maps fitted on the first `fit_share` of
    the tokens (scored on the rest), and the maps refitted on all tokens for folding."""
    split = max(1, int(aux_a.shape[0] * fit_share))
    drifts, blocks, offsets = [], [], []
    for layer, a, b in zip(layer_ids, per_layer(aux_a, len(layer_ids)), per_layer(aux_b, len(layer_ids))):
        m, c = fit_ridge(b[:split], a[:split], ridge)
        held_a, held_b = a[split:], b[split:]
        drifts.append(LayerDrift(layer, linear_cka(a, b), relative_shift(a, b),
                                 r_squared(held_b.double() @ m + c, held_a), r_squared(held_b, held_a)))
        m_all, c_all = fit_ridge(b, a, ridge)
        blocks.append(m_all)
        offsets.append(c_all)
    return drifts, Realignment(blocks, offsets)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def fit_embedding_map(embed_a: torch.Tensor, embed_b: torch.Tensor, eps: float, ridge: float = RIDGE) -> torch.Tensor:
    """M with rmsnorm(e_B) @ M ~ rmsnorm(e_A) over every vocab row (no data needed): the drafter's first layer
    reads each token's embedding through its own RMSNorm, so the map is fitted where the drafter reads it."""
    m, _ = fit_ridge(unit_rms(embed_b, eps), unit_rms(embed_a, eps), ridge)
    return m


def last_aux_gains(drafter) -> list[torch.Tensor]:
    """The gain of the last RMSNorm in front of fc (EAGLE-3.1), one [H] piece per aux state; none for EAGLE-3."""
    if drafter.fc_norm is not None:
        return [norm.weight for norm in drafter.fc_norm]
    if drafter.input_norm is not None:
        return list(drafter.input_norm.weight.chunk(3))
    return []


def as_maps_read(drafter, aux: torch.Tensor) -> torch.Tensor:
    """[n, 3H] aux states where the re-alignment maps act: as fc reads them, but before the last norm's gain. An
    RMSNorm is not linear, so a map in front of it cannot be folded exactly; after it (on the unit-RMS states it
    leaves) it can, and the gain folds into fc with it. EAGLE-3: the states as they are."""
    eps = drafter.config.rms_norm_eps
    if drafter.fc_norm is not None:
        x = drafter.input_norm(aux) if drafter.input_norm is not None else aux
        return torch.cat([unit_rms(chunk, eps) for chunk in x.chunk(3, dim=-1)], dim=-1).to(aux.dtype)
    if drafter.input_norm is not None:
        return unit_rms(aux, eps).to(aux.dtype)
    return aux


def realigned(drafter, aux_maps: Realignment, embed_map: torch.Tensor | None):
    """A copy of the drafter that reads target B: fc folded with the aux maps (fitted on `as_maps_read` states;
    EAGLE-3.1's last norm gain moved into fc, so the norm stays a plain RMSNorm); with `embed_map`, the embedding
    half of the projections reading cat(embeds, hidden) folded with it, the embedding norm's weight moved into them:
    W[:, :H] diag(g) u_A = W[:, :H] diag(g) M^T u_B. Same shapes, same tensor names as the source drafter."""
    import copy

    out = copy.deepcopy(drafter)
    with torch.no_grad():
        gains = last_aux_gains(out)
        fc = drafter.fc.weight * torch.cat(gains) if gains else drafter.fc.weight
        out.fc.weight.copy_(aux_maps.fold(fc))
        for gain in gains:
            gain.fill_(1.0)
        if embed_map is not None:
            layer = out.midlayer
            g, width = layer.input_layernorm.weight.double(), embed_map.shape[0]
            for proj in layer.self_attn.input_projections():
                half = proj.weight[:, :width].double()
                proj.weight[:, :width] = ((half * g) @ embed_map.T).to(proj.weight.dtype)
            layer.input_layernorm.weight.fill_(1.0)
    return out
