"""DeepSeek-V3's forward as DeepSeek's own reference code computes it, in plain torch, on a checkpoint in the HF
layout: the third opinion when two engines disagree about an MLA model (docs/families.md, "Who computes MLA as
DeepSeek does").

It follows deepseek-ai/DeepSeek-V3 `inference/model.py` (at 9b4e978), the `attn_impl = "naive"` branch (the
`absorb` one is the same sums in another order), step for step:
- `apply_rotary_emb` (378-393): the rope slice is read as complex pairs (x[2i], x[2i+1]), each turned by its
  position's angle, frequencies `1 / theta ** (arange(0, d, 2) / d)` (`precompute_freqs_cis`, 366);
- `MLA.forward` (459-497): `q = wq_b(q_norm(wq_a(x)))` (or `wq(x)` without a q LoRA), split into nope and rope
  parts, rope on `q_pe` and on the one shared `k_pe`; `kv = wkv_b(kv_norm(latent))` split into `k_nope` and `v`;
  scores over `cat(nope, rope)` times `softmax_scale = qk_head_dim ** -0.5` (434), a causal mask, softmax in fp32;
  `q_norm` and `kv_norm` are `RMSNorm(dim)` with its default eps 1e-6 (278, 428, 431), whatever the config says;
- `Gate.forward` (566-598): sigmoid (or softmax) scores, plus `e_score_correction_bias` for choosing only, the
  group-limited top-k (groups scored by their top-2 sum when there is a bias), weights the chosen experts' plain
  scores, normalised for sigmoid, times `route_scale` (`routed_scaling_factor`);
- `MoE.forward` (679-693): routed experts weighted, plus the shared experts; `Block` (733-735): pre-norm residual
  blocks, a dense MLP in the first `n_dense_layers` (`first_k_dense_replace`) and an MoE after.

HF names map to DeepSeek's as its `inference/convert.py` maps them (q_a_proj -> wq_a, q_a_layernorm -> q_norm,
kv_a_proj_with_mqa -> wkv_a, kv_a_layernorm -> kv_norm, gate_proj -> w1, up_proj -> w3, down_proj -> w2, ...).
YaRN (`rope_scaling`) is refused: no model here has it, and regraft refuses it for MLA drafters.

Only torch and safetensors: the bench scripts and the tests import it in any venv.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

LATENT_EPS = 1e-6  # DeepSeek's RMSNorm default, which its q_norm and kv_norm keep


def rope_angles(rope_dim: int, theta: float, length: int) -> torch.Tensor:
    """`precompute_freqs_cis` without YaRN: [length, rope_dim / 2] complex unit rotations."""
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    freqs = torch.outer(torch.arange(length), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rope on x [B, S, heads, rope_dim]: adjacent pairs as complex numbers, rotated."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * angles.view(1, x.shape[1], 1, -1)).flatten(3).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def theta_of(config: dict) -> float:
    return float((config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0)))


def check_no_yarn(config: dict) -> None:
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", None):
        raise NotImplementedError(f"rope {kind}: the DeepSeek reference here implements plain rope only")


def mla_attention(weights: dict[str, torch.Tensor], config: dict, x: torch.Tensor, rotary=apply_rotary_emb,
                  latent_eps: float = LATENT_EPS) -> torch.Tensor:
    """`MLA.forward` (naive) over x [B, S, in] at positions 0..S-1, causal; `weights` in HF names, no prefix
    (`q_a_proj.weight`, ...). `rotary` is DeepSeek's unless a test swaps in another convention."""
    B, S, _ = x.shape
    heads, nope, rope, v_dim, rank = (config[key] for key in ("num_attention_heads", "qk_nope_head_dim",
                                                              "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))
    if config.get("q_lora_rank"):
        q = F.linear(rms_norm(F.linear(x, weights["q_a_proj.weight"]), weights["q_a_layernorm.weight"], latent_eps),
                     weights["q_b_proj.weight"])
    else:
        q = F.linear(x, weights["q_proj.weight"])
    q_nope, q_pe = q.view(B, S, heads, nope + rope).split([nope, rope], dim=-1)
    angles = rope_angles(rope, theta_of(config), S)
    q_pe = rotary(q_pe, angles)
    latent, k_pe = F.linear(x, weights["kv_a_proj_with_mqa.weight"]).split([rank, rope], dim=-1)
    k_pe = rotary(k_pe.unsqueeze(2), angles)
    kv = F.linear(rms_norm(latent, weights["kv_a_layernorm.weight"], latent_eps), weights["kv_b_proj.weight"])
    k_nope, v = kv.view(B, S, heads, nope + v_dim).split([nope, v_dim], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    k = torch.cat([k_nope, k_pe.expand(-1, -1, heads, -1)], dim=-1)
    scores = torch.einsum("bshd,bthd->bsht", q, k) * (nope + rope) ** -0.5
    scores = scores + torch.full((S, S), float("-inf")).triu_(1)[:, None]
    scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
    return F.linear(torch.einsum("bsht,bthd->bshd", scores, v).flatten(2), weights["o_proj.weight"])


def mlp(weights: dict[str, torch.Tensor], prefix: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = (F.linear(x, weights[prefix + name]) for name in ("gate_proj.weight", "up_proj.weight"))
    return F.linear(F.silu(gate) * up, weights[prefix + "down_proj.weight"])


def moe(weights: dict[str, torch.Tensor], prefix: str, config: dict, x: torch.Tensor) -> torch.Tensor:
    """`Gate.forward` and `MoE.forward` over x [tokens, dim]."""
    scores = F.linear(x, weights[prefix + "gate.weight"])
    scores = scores.softmax(dim=-1, dtype=torch.float32) if config["scoring_func"] == "softmax" else scores.sigmoid()
    original = scores
    bias = weights.get(prefix + "gate.e_score_correction_bias")
    if bias is not None:
        scores = scores + bias
    groups = config.get("n_group") or 1
    if groups > 1:
        scores = scores.view(x.shape[0], groups, -1)
        group_scores = scores.amax(dim=-1) if bias is None else scores.topk(2, dim=-1)[0].sum(dim=-1)
        chosen = group_scores.topk(config["topk_group"], dim=-1)[1]
        dropped = scores.new_ones(x.shape[0], groups, dtype=torch.bool).scatter_(1, chosen, False)
        scores = scores.masked_fill(dropped.unsqueeze(-1), float("-inf")).flatten(1)
    indices = scores.topk(config["num_experts_per_tok"], dim=-1)[1]
    routed = original.gather(1, indices)
    if config["scoring_func"] == "sigmoid":
        routed = routed / routed.sum(dim=-1, keepdim=True)
    routed = routed * config.get("routed_scaling_factor", 1.0)
    out = torch.zeros_like(x)
    for expert in range(config["n_routed_experts"]):
        rows, slot = torch.where(indices == expert)
        if rows.numel():
            out[rows] += mlp(weights, f"{prefix}experts.{expert}.", x[rows]) * routed[rows, slot, None]
    return out + mlp(weights, prefix + "shared_experts.", x)


def load(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A DeepSeek-V3 checkpoint in the HF layout: its config and every tensor, as float32."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    weights = {}
    for shard in sorted(folder.glob("*.safetensors")):
        weights.update({name: tensor.float() for name, tensor in load_file(str(shard)).items()})
    return config, weights


@torch.no_grad()
def forward(config: dict, weights: dict[str, torch.Tensor], tokens: list[int], capture: dict | None = None
            ) -> torch.Tensor:
    """`Transformer.forward` on one sequence, logits at every position [S, vocab] (DeepSeek's returns the last
    one's; the same sums). `capture`, if given, gets each layer's attention output and residual stream."""
    check_no_yarn(config)
    eps = config["rms_norm_eps"]
    h = F.embedding(torch.as_tensor(tokens)[None], weights["model.embed_tokens.weight"])
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        attention_weights = {name[len(prefix + "self_attn."):]: tensor for name, tensor in weights.items()
                             if name.startswith(prefix + "self_attn.")}
        x = rms_norm(h, weights[prefix + "input_layernorm.weight"], eps)
        attention = mla_attention(attention_weights, config, x)
        h = h + attention
        x = rms_norm(h, weights[prefix + "post_attention_layernorm.weight"], eps)
        if layer < config["first_k_dense_replace"]:
            h = h + mlp(weights, prefix + "mlp.", x)
        else:
            h = h + moe(weights, prefix + "mlp.", config, x[0])[None]
        if capture is not None:
            capture[f"attention.{layer}"], capture[f"layer.{layer}"] = attention[0], h[0]
    return F.linear(rms_norm(h, weights["model.norm.weight"], eps), weights["lm_head.weight"])[0]
