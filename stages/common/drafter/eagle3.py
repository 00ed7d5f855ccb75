"""The EAGLE-3 drafter as a torch module, every family of it, loadable from either checkpoint layout.

One decoder layer whose attention reads `cat(input_layernorm(embed), hidden_norm(h))` (2H wide), a residual on h,
a SwiGLU MLP, then `norm` and `lm_head` over the draft vocab. `fc` projects the target's three concatenated aux
hidden states (3 * H_target -> H) into h for the first draft step; later steps feed back the layer's own output.
Parameter names match the sglang layout, so `state_dict()` is a checkpoint.

The families differ in three places, each decided here from the config, so no caller branches on them:
- before fc (EAGLE-3.1): `input_norm` over the concatenated aux states (norm_before_fc), then `fc_norm.{k}` on each
  (fc_norm); vLLM's `combine_hidden_states` applies them in this order.
- the next step's input (EAGLE-3.1 `norm_output`): the post-`norm` state instead of the layer's residual output.
- the attention: Llama's q/k/v, or DeepSeek's MLA (`MLAAttention`), both through the same KV and TTT caches.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from stages.common.drafter.checkpoint import DrafterCheckpoint, write_drafter
from stages.common.drafter.config import DrafterConfig, Layout
from stages.common.drafter.vocab import VocabMap


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before scaling, as Llama does, so bf16 matches the engines.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


@functools.lru_cache(maxsize=16)
def inverse_frequencies(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def rope(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding in the Llama (rotate-half) convention; x is [B, heads, T, head_dim]."""
    inv_freq = inverse_frequencies(x.shape[-1], theta, x.device)
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq  # [B, T, head_dim/2]
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, head_dim]
    return (x.float() * angles.cos() + rotate_half(x.float()) * angles.sin()).to(x.dtype)


def interleaved_rope(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """DeepSeek's rotary embedding, which rotates the pairs (x[2i], x[2i+1]) (vLLM's is_neox_style=False): the pairs
    moved to the halves, then rotate-half, as transformers' DeepSeek-V3 does. Queries and keys get the same
    permutation, so their dot products are DeepSeek's."""
    B, heads, T, dim = x.shape
    halves = x.view(B, heads, T, dim // 2, 2).transpose(-1, -2).reshape(B, heads, T, dim)
    return rope(halves, position_ids, theta)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int,
                     attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA of T new queries over `past` cached plus T new keys (grouped-query heads allowed; values may be narrower
    than queries and keys, as MLA's are)."""
    T = q.shape[2]
    if attention_mask is None and T > 1:  # one query may attend every cached key: no mask to build
        attention_mask = torch.ones(T, past + T, dtype=torch.bool, device=q.device).tril(past)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, enable_gqa=q.shape[1] != k.shape[1])


@dataclass
class KVCache:
    """Keys and values of earlier positions, [B, heads, T, head_dim] each: decoding one position after another."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def truncate(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        past = self.length
        self.keys = k if self.keys is None else torch.cat((self.keys, k), dim=2)
        self.values = v if self.values is None else torch.cat((self.values, v), dim=2)
        return causal_attention(q, self.keys, self.values, past, attention_mask)


@functools.lru_cache(maxsize=32)
def ttt_mask(T: int, steps: int, device: torch.device) -> torch.Tensor:
    """[T, steps * T] bool, over the keys of every unrolled step side by side: position t sees step 0's keys up to
    t, and its own key of each later step."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return torch.cat([causal] + [torch.eye(T, dtype=torch.bool, device=device)] * (steps - 1), dim=1)


def explicit_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """The TTT attention with its scores built out: [B, heads, T, T] over step 0's keys, one score per later step."""
    scale, T, groups = q.shape[-1] ** -0.5, q.shape[2], q.shape[1] // keys[0].shape[1]
    if groups > 1:  # repeat_interleave copies even by 1, and every step's diagonal product keeps its copy
        keys = [step_keys.repeat_interleave(groups, dim=1) for step_keys in keys]
        values = [step_values.repeat_interleave(groups, dim=1) for step_values in values]
    above = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    q = q * scale  # scaled before the product, and the mask applied in place: one [B, h, T, T] tensor, not three
    prefix = (q @ keys[0].transpose(-1, -2)).masked_fill_(above, float("-inf"))
    diagonal = torch.stack([(q * step_keys).sum(-1) for step_keys in keys[1:]], dim=-1)  # [B, h, T, k]
    weights = torch.softmax(torch.cat((prefix, diagonal), dim=-1).float(), dim=-1).to(q.dtype)
    # split, not indexed per step: its backward builds one [B, h, T, T + k] gradient where indexing built one a step
    prefix_weights, diagonal_weights = weights.split([T, len(keys) - 1], dim=-1)
    out = prefix_weights @ values[0]
    if len(values) > 1:
        out = out + (diagonal_weights.unsqueeze(-1) * torch.stack(values[1:], dim=-2)).sum(-2)
    return out


def fused_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """The same attention as one SDPA call over every step's keys under `ttt_mask`: a fused kernel (memory-efficient
    attention on a GPU, which takes a mask where flash attention does not) that keeps no [B, heads, T, T] scores for
    backward. Grouped key heads are expanded first: not every fused kernel takes `enable_gqa`, and one that does not
    would fall back to the math kernel, which builds the scores."""
    groups = q.shape[1] // keys[0].shape[1]
    stacked_keys, stacked_values = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    if groups > 1:
        stacked_keys = stacked_keys.repeat_interleave(groups, dim=1)
        stacked_values = stacked_values.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, stacked_keys, stacked_values, attn_mask=ttt_mask(q.shape[2], len(keys),
                                                                                                q.device))


@dataclass
class TTTCache:
    """Training-time test: the keys and values of every unrolled draft step over the same T positions.

    Step 0 attends causally over the target-fed positions; at step k, position t also attends to its own keys of
    steps 1..k (the "diagonal"), which is exactly what position t's k-th draft sees at inference: the prefix the
    target verified plus its own earlier drafts.

    On a CPU the explicit form runs: every figure of the built-in world was computed with it, and SDPA's CPU kernel
    rounds differently in the last bits, which training amplifies into another world. Anywhere else (a GPU, and the
    meta device the tests run the GPU path on) the fused form runs: at the Kimi drafter's shape the explicit form
    keeps ~2.7 GB of fp32 scores a step for backward. tests/test_ttt.py holds the two equal, values and gradients.
    """

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.keys)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        if len(self.keys) == 1:
            return causal_attention(q, k, v, 0, attention_mask)
        attention = explicit_ttt_attention if q.device.type == "cpu" else fused_ttt_attention
        return attention(q, self.keys, self.values)


class Eagle3Attention(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        H, bias = config.hidden_size, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.rope_theta = config.rope_theta
        self.q_proj = nn.Linear(2 * H, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * H, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * H, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, H, bias=bias)

    def input_projections(self) -> list[nn.Linear]:
        """The projections that read the 2H-wide cat(embeds, hidden)."""
        return [self.q_proj, self.k_proj, self.v_proj]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cache: KVCache | TTTCache | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q, position_ids, self.rope_theta), rope(k, position_ids, self.rope_theta)
        if cache is None:
            out = causal_attention(q, k, v, 0, attention_mask)
        else:
            out = cache.attend(q, k, v, attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class MLAAttention(nn.Module):
    """DeepSeek's multi-head latent attention on the 2H-wide drafter input (vLLM's deepseek_eagle3.py, NeMo
    Automodel's draft_deepseek.py): queries through a low-rank `q_a_proj` (or a plain `q_proj` when q_lora_rank is
    null); keys and values expanded from one normed latent of kv_lora_rank, plus one rope key shared by all heads.
    Computed in the expanded form (per-head k and v), which is what the absorbed kernels compute."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        H, eps, heads = config.hidden_size, config.rms_norm_eps, config.num_heads
        q_rank, kv_rank = config.layer.get("q_lora_rank"), config.mla_dim("kv_lora_rank")
        self.nope, self.rope_dim, self.v_dim = (config.mla_dim(key) for key in
                                                ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        self.num_heads, self.kv_rank, self.rope_theta = heads, kv_rank, config.rope_theta
        q_width = heads * (self.nope + self.rope_dim)
        if q_rank:
            self.q_a_proj = nn.Linear(2 * H, q_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_rank, eps)
            self.q_b_proj = nn.Linear(q_rank, q_width, bias=False)
        else:
            self.q_proj = nn.Linear(2 * H, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * H, kv_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_rank, eps)
        self.kv_b_proj = nn.Linear(kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, H, bias=False)

    def input_projections(self) -> list[nn.Linear]:
        """The projections that read the 2H-wide cat(embeds, hidden)."""
        return [self.q_proj if hasattr(self, "q_proj") else self.q_a_proj, self.kv_a_proj_with_mqa]

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cache: KVCache | TTTCache | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.queries(x).view(B, T, self.num_heads, self.nope + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        q_rope = interleaved_rope(q_rope, position_ids, self.rope_theta)
        k_rope = interleaved_rope(k_rope.view(B, 1, T, self.rope_dim), position_ids, self.rope_theta)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(B, self.num_heads, T, self.rope_dim)), dim=-1)
        out = causal_attention(q, k, v, 0, attention_mask) if cache is None else cache.attend(q, k, v, attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.v_dim))


class Eagle3MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.self_attn = MLAAttention(config) if config.mla else Eagle3Attention(config)
        self.mlp = Eagle3MLP(H, config.intermediate_size)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                cache: KVCache | TTTCache | None = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(embeds), normed_hidden), dim=-1)
        h = residual + self.self_attn(x, position_ids, cache, attention_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class DraftOutput:
    logits: torch.Tensor | None  # [B, T, draft_vocab]; None where the caller asked for `normed` only
    hidden: torch.Tensor  # [B, T, H], the next draft step's input: the layer output before `norm` (after it with
    # EAGLE-3.1's norm_output)
    normed: torch.Tensor  # [B, T, H], what lm_head reads


class Eagle3Drafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        aux = config.aux_hidden_size
        self.input_norm = RMSNorm(3 * aux, config.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(aux, config.rms_norm_eps) for _ in range(3)) if config.fc_norm else None
        self.fc = nn.Linear(3 * aux, H, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    @classmethod
    def from_checkpoint(cls, source: str | Path | DrafterCheckpoint, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu") -> "Eagle3Drafter":
        """Load either layout; every tensor is read once and assigned, never copied into a second model."""
        checkpoint = source if isinstance(source, DrafterCheckpoint) else DrafterCheckpoint.open(source)
        with torch.device("meta"):
            model = cls(checkpoint.config)
        names = model.state_dict().keys()
        state = {}
        for name in names:
            tensor = checkpoint.tensor(name).to(device)
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            state[name] = tensor
        model.load_state_dict(state, assign=True)
        return model

    @classmethod
    def initialised(cls, config: DrafterConfig, vocab_map: VocabMap, seed: int = 0) -> "Eagle3Drafter":
        """A fresh drafter (torch's default init) carrying `vocab_map`."""
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            model = cls(config)
        finally:
            torch.random.set_rng_state(generator_state)
        model.set_vocab_map(vocab_map)
        return model

    def set_vocab_map(self, vocab_map: VocabMap) -> None:
        self.d2t.copy_(vocab_map.d2t)
        self.t2d.copy_(vocab_map.t2d)

    def vocab_map(self) -> VocabMap:
        # A copy: set_vocab_map writes into the buffers in place, and .cpu() of a CPU tensor is no copy.
        return VocabMap(self.d2t.detach().cpu().clone(), self.t2d.detach().cpu().clone(), source="<module>")

    def save(self, out_dir: str | Path, layout: Layout = "sglang") -> Path:
        state = {name: tensor.detach().cpu().contiguous() for name, tensor in self.state_dict().items()}
        return write_drafter(out_dir, self.config, state, layout)

    def aux_as_fc_reads(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The concatenated aux states through EAGLE-3.1's norms (none for EAGLE-3): what `fc` multiplies."""
        if self.input_norm is not None:
            aux_hidden = self.input_norm(aux_hidden)
        if self.fc_norm is not None:
            chunks = aux_hidden.chunk(len(self.fc_norm), dim=-1)
            aux_hidden = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return aux_hidden

    def project_aux(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, 3 * H_target] concatenated aux hidden states -> [B, T, H], in the drafter's dtype (the states may
        come as the target or its cache stored them; DeepSpeed's bf16 casts only the drafter)."""
        return self.fc(self.aux_as_fc_reads(aux_hidden.to(self.fc.weight.dtype)))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                cache: KVCache | TTTCache | None = None, attention_mask: torch.Tensor | None = None,
                head: bool = True) -> DraftOutput:
        """`head=False` leaves the logits to the caller (training takes lm_head only at the positions with a loss)."""
        if position_ids is None:
            start = cache.length if isinstance(cache, KVCache) else 0
            position_ids = torch.arange(start, start + embeds.shape[1], device=embeds.device)[None]
        out = self.midlayer(embeds.to(self.fc.weight.dtype), hidden, position_ids, cache, attention_mask)
        normed = self.norm(out)
        return DraftOutput(logits=self.lm_head(normed) if head else None,
                           hidden=normed if self.config.norm_output else out, normed=normed)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.d2t[draft_ids] + draft_ids
