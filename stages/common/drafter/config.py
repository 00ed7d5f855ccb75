"""A drafter's config.json, whatever the layout, as one `DrafterConfig`; and the two aux-layer conventions.

- `sglang` (SGLang / SpecForge): `architectures: ["LlamaForCausalLMEagle3"]`, the Llama layer fields at top level,
  `draft_vocab_size`, optional `target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`. An MLA
  drafter in this layout is the plain HF config vLLM registers: `architectures: ["Eagle3DeepseekV2ForCausalLM"]`
  (or V3), `model_type: deepseek_v2` (vLLM turns a `deepseek_v3` draft config into an MTP model), the MLA fields.
- `speculators` (vLLM / speculators): `speculators_model_type: eagle3`, the layer config nested in
  `transformer_layer_config`, aux ids at top level. Its loader takes llama and qwen3 layers only: no MLA drafter.

Families (`DrafterConfig.family`): `eagle3`; `eagle3.1`, any of the three EAGLE-3.1 toggles (top-level keys in both
layouts; vLLM also reads `norm_before_fc` from `eagle_config`): `fc_norm` (an RMSNorm per aux state before fc),
`norm_before_fc` (one RMSNorm over the concatenated aux states), `norm_output` (the next draft step reads the
post-norm state); `mla`, a DeepSeek MLA attention (`kv_lora_rank` set), with or without the toggles.

"Output of layer" ids `[1, L//2-1, L-4]` (SpecForge, EAGLE) and "input of layer" ids `[2, L//2, L-3]` (vLLM,
speculators) name the same tensors and differ by one. The convention is recorded in a `regraft` block of every
config regraft writes; a config without it gets it inferred, and says so. The checkpoint's tensors are read and
written by stages/common/drafter/checkpoint.py.

Every key of a drafter config is known or refused (`check_keys`), at every level (top, `eagle_config`,
`transformer_layer_config`): engines apply keys regraft would ignore (vLLM decodes `norm_output: true` differently),
so a drafter is decoded here the way its engines decode it, or not at all. The rule: a key regraft reads
(`STRUCTURAL_KEYS`) or that cannot change what the drafter computes (`METADATA_KEYS`) is accepted with any value; a key
that changes the forward (`FUNCTION_KEYS`) is accepted only at the value regraft implements (absent and null read as
that value); any other key is refused, since no one can tell it is harmless.

An export names the verifier as it will be deployed (`verifier_identity`): a hub id when given, else the target
folder as the user gave it; a stage never writes a folder inside a regraft stage output (the cache exists on one
machine only). The export command, given no name and finding none recorded, names the target folder the drafter was
made for, in the cache too (`trained_for`), since speculators' loader cannot load a drafter that names no verifier.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from stages.common.contract.artifacts import read_manifest
from stages.common.contract.errors import RegraftError

Layout = Literal["sglang", "speculators"]
LAYOUTS: tuple[str, ...] = ("sglang", "speculators")

OUTPUT_OF_LAYER = "output_of_layer"
INPUT_OF_LAYER = "input_of_layer"
CONVENTIONS = (OUTPUT_OF_LAYER, INPUT_OF_LAYER)
SGLANG_ARCH = "LlamaForCausalLMEagle3"
SPECULATORS_ARCH = "Eagle3Speculator"
MLA_ARCHS = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")  # vLLM's registry: deepseek_eagle3.py
MLA_MODEL_TYPE = "deepseek_v2"  # vLLM rewrites a deepseek_v3 draft config into DeepSeek's MTP, which fails for EAGLE-3
EAGLE31_FLAGS = ("fc_norm", "norm_before_fc", "norm_output")
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# how a drafter is built for `family` (FinetuneConfig.family): EAGLE-3.1 as speculators 0.9.0 trains Llama-arch
# drafters (--norm-before-fc --norm-output); mla3.1 as the Kimi line's eagle3.1-mla drafters (fc_norm, norm_output)
FAMILY_FLAGS: dict[str, dict[str, bool]] = {
    "eagle3": {}, "eagle3.1": {"norm_before_fc": True, "norm_output": True},
    "mla": {}, "mla3.1": {"fc_norm": True, "norm_output": True}}


def default_aux_layer_ids(num_target_layers: int, convention: str) -> list[int]:
    """The field's default aux layers for a target with L layers: [1, L//2-1, L-4] as outputs of layers."""
    L = num_target_layers
    output_ids = [1, L // 2 - 1, L - 4]
    return convert_aux_layer_ids(output_ids, OUTPUT_OF_LAYER, convention)


def convert_aux_layer_ids(ids: list[int], source: str, dest: str) -> list[int]:
    """The output of layer i is the input of layer i+1: the two conventions differ by exactly one."""
    if source not in CONVENTIONS or dest not in CONVENTIONS:
        raise ValueError(f"aux convention must be one of {CONVENTIONS}")
    shift = {(OUTPUT_OF_LAYER, INPUT_OF_LAYER): 1, (INPUT_OF_LAYER, OUTPUT_OF_LAYER): -1}.get((source, dest), 0)
    return [i + shift for i in ids]


@dataclass
class DrafterConfig:
    """What a drafter's config.json says, independent of layout."""

    layer: dict[str, Any]  # the Llama decoder-layer fields (hidden_size, heads, vocab_size = target vocab, ...)
    draft_vocab_size: int
    target_hidden_size: int | None = None
    aux_layer_ids: list[int] | None = None
    aux_convention: str = OUTPUT_OF_LAYER
    aux_convention_source: str = "recorded"  # or how it was inferred
    target_num_layers: int | None = None
    norm_before_residual: bool = False
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm on each aux state before fc (`fc_norm.{k}.weight`)
    norm_before_fc: bool = False  # EAGLE-3.1: one RMSNorm over the concatenated aux states (`input_norm.weight`)
    norm_output: bool = False  # EAGLE-3.1: the next draft step reads the post-`norm` state, not the residual
    verifier: str | None = None  # the target it was trained for, as deployed (`verifier_identity`); None: unknown
    verifier_architectures: list[str] = field(default_factory=list)  # that target's config.json architectures
    extra: dict[str, Any] = field(default_factory=dict)  # other top-level keys, kept as they were
    # Keys only one layout understands, by layout; written in that layout, stashed in the `regraft` block otherwise.
    layout_extras: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def mla(self) -> bool:
        """A DeepSeek MLA attention (its latent rank set), not Llama's."""
        return is_mla(self.layer)

    @property
    def eagle31_flags(self) -> list[str]:
        return [flag for flag in EAGLE31_FLAGS if getattr(self, flag)]

    @property
    def family(self) -> str:
        """eagle3, eagle3.1, mla or mla3.1: the backbone, and whether any EAGLE-3.1 toggle is on."""
        if not self.eagle31_flags:
            return "mla" if self.mla else "eagle3"
        return "mla3.1" if self.mla else "eagle3.1"

    def describe(self) -> str:
        """The family as every stage shows it: `mla3.1 (fc_norm, norm_output)`."""
        return self.family + (f" ({', '.join(self.eagle31_flags)})" if self.eagle31_flags else "")

    def mla_dim(self, key: str) -> int:
        return int(self.layer[key])

    @property
    def hidden_size(self) -> int:
        return int(self.layer["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.layer["vocab_size"])

    @property
    def num_heads(self) -> int:
        return int(self.layer["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.layer.get("num_key_value_heads") or self.num_heads)

    @property
    def head_dim(self) -> int:
        return int(self.layer.get("head_dim") or self.hidden_size // self.num_heads)

    @property
    def intermediate_size(self) -> int:
        return int(self.layer["intermediate_size"])

    @property
    def aux_hidden_size(self) -> int:
        return int(self.target_hidden_size or self.hidden_size)

    @property
    def rms_norm_eps(self) -> float:
        return float(self.layer.get("rms_norm_eps", 1e-6))

    @property
    def rope_theta(self) -> float:
        rope = self.layer.get("rope_parameters") or {}
        return float(self.layer.get("rope_theta") or rope.get("rope_theta") or 10000.0)

    @property
    def attention_bias(self) -> bool:
        return bool(self.layer.get("attention_bias", False))

    def with_verifier(self, target_dir: str | Path, name: str | None = None) -> "DrafterConfig":
        """Trained for the target in `target_dir`, deployed as `name` (`verifier_identity`); a folder that is not
        there (a hub id given as the target) keeps the architectures recorded before."""
        verifier, architectures = verifier_identity(target_dir, name)
        return replace(self, verifier=verifier, verifier_architectures=architectures or self.verifier_architectures)

    def with_local_verifier(self, folder: Path) -> "DrafterConfig":
        """Named by the target folder it was trained for as it lies here, inside regraft's cache too: the export
        command's last resort, so that a loader on this machine (speculators reads the verifier's config and
        embeddings from the name) finds it."""
        architectures = list(raw_target_config(folder).get("architectures") or [])
        return replace(self, verifier=str(folder.absolute()),
                       verifier_architectures=architectures or self.verifier_architectures)

    def with_aux_convention(self, convention: str) -> "DrafterConfig":
        """The same layers, named in the other convention (ids shift by one)."""
        ids = self.aux_layer_ids and convert_aux_layer_ids(self.aux_layer_ids, self.aux_convention, convention)
        return replace(self, aux_layer_ids=ids, aux_convention=convention, aux_convention_source="recorded")

    def attention_shapes(self) -> dict[str, tuple[int, ...]]:
        """The attention's weights: Llama's q/k/v/o, or MLA's (q through a LoRA unless q_lora_rank is null; one
        latent and one shared rope key for k and v). The first projections read the 2H-wide cat(embeds, hidden)."""
        H, heads = self.hidden_size, self.num_heads
        if self.mla:
            q_rank, kv_rank = self.layer.get("q_lora_rank"), self.mla_dim("kv_lora_rank")
            nope, rope, v = (self.mla_dim(key) for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
            q = {"q_a_proj.weight": (q_rank, 2 * H), "q_a_layernorm.weight": (q_rank,),
                 "q_b_proj.weight": (heads * (nope + rope), q_rank)} if q_rank else \
                {"q_proj.weight": (heads * (nope + rope), 2 * H)}
            shapes = {**q, "kv_a_proj_with_mqa.weight": (kv_rank + rope, 2 * H), "kv_a_layernorm.weight": (kv_rank,),
                      "kv_b_proj.weight": (heads * (nope + v), kv_rank), "o_proj.weight": (H, heads * v)}
            return {f"midlayer.self_attn.{name}": shape for name, shape in shapes.items()}
        q_out, kv_out = heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {"q_proj.weight": (q_out, 2 * H), "k_proj.weight": (kv_out, 2 * H),
                  "v_proj.weight": (kv_out, 2 * H), "o_proj.weight": (H, q_out)}
        if self.attention_bias:
            shapes.update({"q_proj.bias": (q_out,), "k_proj.bias": (kv_out,), "v_proj.bias": (kv_out,),
                           "o_proj.bias": (H,)})
        return {f"midlayer.self_attn.{name}": shape for name, shape in shapes.items()}

    def aux_norm_shapes(self) -> dict[str, tuple[int, ...]]:
        """EAGLE-3.1's norms before fc: one per aux state (fc_norm), one over all three (norm_before_fc)."""
        shapes = {f"fc_norm.{k}.weight": (self.aux_hidden_size,) for k in range(3)} if self.fc_norm else {}
        if self.norm_before_fc:
            shapes["input_norm.weight"] = (3 * self.aux_hidden_size,)
        return shapes

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        H, I, N, V = self.hidden_size, self.intermediate_size, self.draft_vocab_size, self.vocab_size
        shapes: dict[str, tuple[int, ...]] = {
            **self.attention_shapes(),
            "midlayer.mlp.gate_proj.weight": (I, H),
            "midlayer.mlp.up_proj.weight": (I, H),
            "midlayer.mlp.down_proj.weight": (H, I),
            "midlayer.input_layernorm.weight": (H,),
            "midlayer.hidden_norm.weight": (H,),
            "midlayer.post_attention_layernorm.weight": (H,),
            "fc.weight": (H, 3 * self.aux_hidden_size),
            "norm.weight": (H,),
            "lm_head.weight": (N, H),
            "d2t": (N,),
            "t2d": (V,),
            **self.aux_norm_shapes(),
        }
        return shapes

    def optional_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"embed_tokens.weight": (self.vocab_size, self.hidden_size),
                "verifier_lm_head.weight": (self.draft_vocab_size, self.aux_hidden_size)}


# ---------------------------------------------------------------- the keys regraft knows

# Read by regraft: the layer's shape, the draft vocab, the aux layers, the layout's own blocks.
STRUCTURAL_KEYS = frozenset({
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "rms_norm_eps", "rope_theta", "rope_parameters", "attention_bias", "vocab_size", "draft_vocab_size",
    "target_hidden_size", "norm_before_residual", "eagle_config", "eagle_aux_hidden_state_layer_ids",
    "speculators_model_type", "transformer_layer_config", "speculators_config", "regraft", *EAGLE31_FLAGS, *MLA_KEYS})
# Cannot change what the drafter computes at inference: provenance, the dtype on disk, token ids, cache and training
# switches, the position limit (RoPE does not read it), embedding tying (the drafter has no embedding of its own).
METADATA_KEYS = frozenset({
    "torch_dtype", "dtype", "transformers_version", "_name_or_path", "auto_map", "bos_token_id", "eos_token_id",
    "pad_token_id", "initializer_range", "use_cache", "pretraining_tp", "tie_word_embeddings",
    "max_position_embeddings", "max_window_layers", "speculators_version", "embed_requires_grad", "enable_sp_ulysses",
    "num_lookahead_tokens",
    # a DeepSeek config's MoE fields: vLLM's MLA drafter builds one dense MLP (intermediate_size) and reads none
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace",
    "moe_layer_freq", "routed_scaling_factor", "topk_method", "topk_group", "n_group", "scoring_func",
    "norm_topk_prob", "aux_loss_alpha", "seq_aux", "ep_size"})
# Change the forward, by the value regraft implements: one layer, plain RoPE, SiLU MLP without biases, the aux states
# through fc. Scaled RoPE and the rest are refused at any other value until regraft implements them.
FUNCTION_KEYS: dict[str, Any] = {
    "use_aux_hidden_state": True,
    "num_hidden_layers": 1, "hidden_act": "silu", "mlp_bias": False, "qkv_bias": False, "bias": False,
    "logit_scale": 1.0, "is_causal": True, "attention_dropout": 0.0, "rope_scaling": None,
    "use_sliding_window": False, "sliding_window": None, "layer_types": None, "parallel_drafting": False}
PLAIN_ROPE = (None, "default")


def _implemented(key: str, value: Any) -> bool:
    if value is None or value == FUNCTION_KEYS.get(key):
        return True
    if key in ("rope_scaling", "rope_parameters") and isinstance(value, dict):
        return value.get("rope_type", value.get("type")) in PLAIN_ROPE
    if key == "layer_types":  # vLLM gives a "sliding_attention" layer a window
        return isinstance(value, list) and set(value) <= {"full_attention"}
    return key == "rope_parameters"  # a plain number or list: transformers' own shapes, read for rope_theta only


def check_keys(raw: dict[str, Any], path: Path, where: str = "") -> None:
    """Refuse, with one line naming the key, a config regraft would decode differently from its engines."""
    for key, value in raw.items():
        name = f"{where}{key}"
        if key in FUNCTION_KEYS or key == "rope_parameters":
            if not _implemented(key, value):
                raise RegraftError(path, f"{name}={json.dumps(value)} changes how the drafter decodes, and regraft "
                                   f"does not implement it (engines apply it, so regraft's numbers would be wrong)",
                                   f"use a drafter without {key} (or with {key}={json.dumps(FUNCTION_KEYS.get(key))})")
        elif key not in STRUCTURAL_KEYS and key not in METADATA_KEYS:
            raise RegraftError(path, f"unknown drafter config key {name}: engines may apply it, regraft would not",
                               f"remove it; if it cannot change the drafter's function, add it to METADATA_KEYS in "
                               f"stages/common/drafter/config.py")
    for block in ("eagle_config", "transformer_layer_config"):
        if isinstance(raw.get(block), dict):
            check_keys(raw[block], path, f"{where}{block}.")


# ---------------------------------------------------------------- config.json <-> DrafterConfig

SGLANG_KEYS = {"architectures", "draft_vocab_size", "target_hidden_size", "eagle_config", "regraft",
               "eagle_aux_hidden_state_layer_ids", "norm_before_residual", *EAGLE31_FLAGS}
SPECULATORS_KEYS = {"architectures", "speculators_model_type", "transformer_layer_config", "draft_vocab_size",
                    "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual", "regraft",
                    *EAGLE31_FLAGS}
SPECULATORS_ONLY_KEYS = {"speculators_config", "speculators_version", "embed_requires_grad", "enable_sp_ulysses"}
DEFAULT_SPECULATORS_CONFIG = {
    "algorithm": "eagle3", "default_proposal_method": "greedy",
    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
    "verifier": {"name_or_path": None, "architectures": []},
}


def detect_layout(raw: dict[str, Any], path: Path) -> Layout:
    if raw.get("speculators_model_type") == "eagle3":
        return "speculators"
    if {SGLANG_ARCH, *MLA_ARCHS} & set(raw.get("architectures") or []):
        return "sglang"
    raise RegraftError(path, f"not an EAGLE-3 drafter config (architectures={raw.get('architectures')})",
                       f"expected architectures [{SGLANG_ARCH}] (or {MLA_ARCHS[0]}) or speculators_model_type eagle3")


def _infer_convention(ids: list[int] | None, layout: Layout) -> tuple[str, str]:
    if ids and ids[0] == 1:
        return OUTPUT_OF_LAYER, "inferred: first aux id is 1"
    if ids and ids[0] == 2:
        return INPUT_OF_LAYER, "inferred: first aux id is 2"
    default = OUTPUT_OF_LAYER if layout == "sglang" else INPUT_OF_LAYER
    return default, f"inferred: {layout} layout default"


def parse_config(raw: dict[str, Any], path: Path) -> tuple[Layout, DrafterConfig]:
    layout = detect_layout(raw, path)
    check_keys(raw, path)
    recorded = dict(raw.get("regraft") or {})
    layout_extras = {name: dict(keys) for name, keys in (recorded.get("layout_extras") or {}).items()}
    if layout == "sglang":
        layer = {k: v for k, v in raw.items() if k not in SGLANG_KEYS}
        eagle = dict(raw.get("eagle_config") or {})
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.pop("eagle_aux_hidden_state_layer_ids", None)
        flags = {flag: bool(raw.get(flag) or (flag == "norm_before_fc" and eagle.pop(flag, False)))
                 for flag in EAGLE31_FLAGS}  # vLLM reads norm_before_fc from eagle_config first
        if ids and eagle.get("use_aux_hidden_state") is True:
            del eagle["use_aux_hidden_state"]  # implied by the ids; rendering sets it again
        own = {"eagle_config": eagle} if eagle else {}
        extra = {}
    else:
        layer = dict(raw.get("transformer_layer_config") or {})
        if layer.get("kv_lora_rank"):
            raise RegraftError(path, f"transformer_layer_config.kv_lora_rank={layer['kv_lora_rank']}: an MLA layer, "
                               "which vLLM's speculators loader does not build (llama and qwen3 only)",
                               "write an MLA drafter in the sglang layout (Eagle3DeepseekV2ForCausalLM)")
        if layer.get("model_type", "llama") != "llama":  # vLLM builds a qwen3 layer (q/k norms) for "qwen3"
            raise RegraftError(path, f"transformer_layer_config.model_type={layer['model_type']!r}: regraft's drafter "
                               "is a Llama layer", "use a drafter with a llama layer")
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        flags = {flag: bool(raw.get(flag)) for flag in EAGLE31_FLAGS}
        rest = {k: v for k, v in raw.items() if k not in SPECULATORS_KEYS}
        own = {k: v for k, v in rest.items() if k in SPECULATORS_ONLY_KEYS and k not in recorded.get("generated", [])}
        extra = {k: v for k, v in rest.items() if k not in SPECULATORS_ONLY_KEYS}
    if own:
        layout_extras[layout] = own
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in layer:
            raise RegraftError(path, f"{layout} drafter config has no {key}", "add the Llama layer fields")
    if "draft_vocab_size" not in raw:
        raise RegraftError(path, "drafter config has no draft_vocab_size", "set it to the lm_head row count")
    if layer.get("kv_lora_rank"):
        check_mla(layer, flags, path)
    named = (raw.get("speculators_config") or {}).get("verifier") or {}
    if recorded.get("aux_convention") in CONVENTIONS:
        convention, source = recorded["aux_convention"], "recorded"
    else:
        convention, source = _infer_convention(ids, layout)
    config = DrafterConfig(
        layer=layer, draft_vocab_size=int(raw["draft_vocab_size"]), target_hidden_size=raw.get("target_hidden_size"),
        aux_layer_ids=list(ids) if ids else None, aux_convention=convention, aux_convention_source=source,
        target_num_layers=recorded.get("target_num_layers"),
        norm_before_residual=bool(raw.get("norm_before_residual", layout == "speculators")),  # vLLM's defaults
        **flags,
        verifier=deployable(recorded.get("verifier") or named.get("name_or_path")),
        verifier_architectures=list(recorded.get("verifier_architectures") or named.get("architectures") or []),
        extra=extra, layout_extras=layout_extras)
    return layout, config


def check_mla(layer: dict[str, Any], flags: dict[str, bool], path: Path) -> None:
    """An MLA drafter as vLLM's deepseek_eagle3.py loads it: every MLA dim given, no input_norm."""
    missing = [key for key in MLA_KEYS if key not in layer]
    if missing:
        raise RegraftError(path, f"MLA drafter config has no {', '.join(missing)} (a missing q_lora_rank is read as "
                           "DeepSeek's 1536 by transformers)", "set every MLA dim (null q_lora_rank: no q LoRA)")
    if flags["norm_before_fc"]:
        raise RegraftError(path, "norm_before_fc on an MLA drafter: vLLM's Eagle3DeepseekV2ForCausalLM has no "
                           "input_norm, so engines would not decode it as trained", "use fc_norm instead")


# The aux-layer convention each layout's engines read: SGLang adds one to explicit ids (output of layer); vLLM and
# speculators read id j as the state after j layers (input of layer). A checkpoint is written in its layout's.
LAYOUT_CONVENTION = {"sglang": OUTPUT_OF_LAYER, "speculators": INPUT_OF_LAYER}


def speculators_config(config: DrafterConfig, own: dict[str, Any] | None) -> dict[str, Any]:
    """The `speculators_config` block (proposal method, verifier), the source's own where it had one; the verifier
    as regraft recorded it (a remapped drafter serves another target than its source's block names), or null
    (vLLM needs the key only; `vllm serve EXPORT` loads the verifier by this name)."""
    block = copy.deepcopy(own if own is not None else DEFAULT_SPECULATORS_CONFIG)
    block["verifier"] = {**block.get("verifier", {}), "name_or_path": config.verifier,
                         "architectures": list(config.verifier_architectures)}
    return block


def render_config(config: DrafterConfig, layout: Layout, aux_convention: str | None = None) -> dict[str, Any]:
    """config.json in `layout`, its aux ids in `aux_convention` (default: the one that layout's engines read)."""
    convention = aux_convention or LAYOUT_CONVENTION[layout]
    if config.aux_convention != convention:
        config = config.with_aux_convention(convention)
    own = dict(config.layout_extras.get(layout, {}))
    stashed = {name: keys for name, keys in config.layout_extras.items() if name != layout and keys}
    regraft: dict[str, Any] = {"aux_convention": config.aux_convention, "target_num_layers": config.target_num_layers,
                               "verifier": config.verifier, "verifier_architectures": config.verifier_architectures}
    if layout == "sglang":
        eagle = dict(own.pop("eagle_config", {}))
        if config.aux_layer_ids is not None:
            eagle["eagle_aux_hidden_state_layer_ids"] = list(config.aux_layer_ids)
            eagle.setdefault("use_aux_hidden_state", True)
        layer = {**config.layer, "model_type": MLA_MODEL_TYPE} if config.mla else config.layer
        raw: dict[str, Any] = {"architectures": [MLA_ARCHS[0] if config.mla else SGLANG_ARCH], **layer,
                               "draft_vocab_size": config.draft_vocab_size}
        if config.target_hidden_size is not None:
            raw["target_hidden_size"] = config.target_hidden_size
        if config.norm_before_residual:
            raw["norm_before_residual"] = True
        if eagle:
            raw["eagle_config"] = eagle
    else:
        if config.mla:
            raise RegraftError(None, "an MLA drafter has no speculators layout: vLLM's speculators loader builds "
                               "llama and qwen3 layers only", "write it in the sglang layout (layout=sglang)")
        raw = {"architectures": [SPECULATORS_ARCH], "speculators_model_type": "eagle3",
               "transformer_layer_config": dict(config.layer), "draft_vocab_size": config.draft_vocab_size,
               "norm_before_residual": config.norm_before_residual, "target_hidden_size": config.target_hidden_size,
               "eagle_aux_hidden_state_layer_ids": config.aux_layer_ids}
        if "speculators_config" not in own:  # vLLM reads the proposal method and verifier from it
            regraft["generated"] = ["speculators_config"]
        own["speculators_config"] = speculators_config(config, own.get("speculators_config"))
    raw.update({flag: True for flag in config.eagle31_flags})
    regraft["family"] = config.describe()
    if stashed:
        regraft["layout_extras"] = stashed
    return {**raw, **own, **config.extra, "regraft": regraft}


def aux_layer_ids_for(num_layers: int) -> list[int]:
    """Output-of-layer aux ids for a target of `num_layers`: the field's [1, L//2-1, L-4], which collapses below
    8 layers, where tiny targets get [0, L//2-1, L-2] instead."""
    if num_layers >= 8:
        return default_aux_layer_ids(num_layers, OUTPUT_OF_LAYER)
    return [0, num_layers // 2 - 1, num_layers - 2]


# Model types a multimodal wrapper's text_config may name, as transformers reads them (Kimi-K2.5's says kimi_k2:
# DeepSeek-V3's architecture, which Kimi_K25Config renames on load).
TEXT_MODEL_TYPES = {"kimi_k2": "deepseek_v3"}


def language_model_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A model's config.json fields of its language model: `text_config` for multimodal wrappers (Kimi-K2.5's),
    its model_type as transformers reads it."""
    text = dict(raw.get("text_config") or raw)
    text["model_type"] = TEXT_MODEL_TYPES.get(text.get("model_type"), text.get("model_type"))
    return text


def raw_target_config(target_dir: str | Path) -> dict[str, Any]:
    """A target folder's config.json as written (a multimodal wrapper's whole)."""
    config = Path(target_dir) / "config.json"
    if not config.exists():
        raise RegraftError(target_dir, "no config.json: not a target model folder",
                           "point at the folder save_pretrained wrote for the target")
    try:
        return json.loads(config.read_text())
    except json.JSONDecodeError as exc:
        raise RegraftError(config, f"invalid JSON ({exc})", "fix it, or save the target again") from exc


def target_config(target_dir: str | Path) -> dict[str, Any]:
    """A target folder's config.json, its language-model part for multimodal ones (Kimi-K2.5's text_config)."""
    return language_model_config(raw_target_config(target_dir))


def in_stage_output(path: Path) -> bool:
    """Whether `path` lies inside a complete regraft stage output (the cache: it exists on this machine only)."""
    return any(read_manifest(folder) is not None for folder in (path, *path.parents))


def trained_for(drafter_dir: str | Path) -> Path | None:
    """The target folder a drafter inside a stage output was made for (a fine-tune's `target`, a remap's
    `verifier`, from the output's manifest), when that folder is here; None for a drafter outside the cache."""
    drafter = Path(drafter_dir).absolute()
    for folder in (drafter, *drafter.parents):
        manifest = read_manifest(folder)
        if manifest is not None:
            config = manifest.get("config") or {}
            named = config.get("target") or config.get("verifier")
            return Path(named) if named and (Path(named) / "config.json").is_file() else None
    return None


def deployable(name: str | None) -> str | None:
    """`name` unless it is a folder inside a regraft stage output (records written before exports were named)."""
    return None if not name or in_stage_output(Path(name).absolute()) else name


def verifier_identity(target_dir: str | Path, name: str | None = None) -> tuple[str | None, list[str]]:
    """How an export names its verifier: `name` (the hub id it is deployed by) when given, else the target folder as
    the user gave it (made absolute: the export moves; a hub id as it is), None for a folder inside the cache; and the
    architectures of the target's own config.json (its top level: Kimi-K2.5's multimodal class is what is served)."""
    folder = Path(target_dir)
    if not (folder / "config.json").exists():  # a hub id: nothing here to read
        return name or str(target_dir), []
    architectures = list(json.loads((folder / "config.json").read_text()).get("architectures") or [])
    return name or deployable(str(folder.absolute())), architectures


# vLLM's CPU MLA kernel (cpu_mla.py) takes head size 576 only: kv_lora_rank 512 + qk_rope_head_dim 64, which are
# also DeepSeek-V3's and Kimi-K2's
MLA_LATENT = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}


def is_mla(config: dict[str, Any]) -> bool:
    """A config of DeepSeek's MLA attention (a drafter's layer, or a target's language model: DeepSeek-V3's, Kimi-K2's
    text_config): `kv_lora_rank` set, the latent the keys and values are expanded from."""
    return bool(config.get("kv_lora_rank"))


def mla_dims(target: dict[str, Any], hidden: int, heads: int) -> dict[str, Any]:
    """An MLA drafter's dims: an MLA target's own, else DeepSeek's latent and rope widths with per-head no-rope and
    value widths of the target's head size."""
    if is_mla(target):
        return {key: target.get(key) for key in MLA_KEYS}
    head = hidden // heads
    return {"q_lora_rank": hidden, **MLA_LATENT, "qk_nope_head_dim": head, "v_head_dim": head}


def check_family(key: str, family: str | None) -> None:
    """`family` (None: unset) is one regraft builds; refused as the setting `key` the user wrote."""
    if family is not None and family not in FAMILY_FLAGS:
        raise RegraftError(f"{key}={family}", "not a drafter family", f"choose one of {', '.join(FAMILY_FLAGS)}")


def drafter_config_for(target_dir: str | Path, draft_vocab_size: int, intermediate_size: int | None = None,
                       family: str = "eagle3") -> DrafterConfig:
    """The config of a fresh drafter of `family` (FAMILY_FLAGS) for the target in `target_dir`: its width and
    heads, the field's aux layers."""
    check_family("family", family)
    target = target_config(target_dir)
    num_layers = int(target["num_hidden_layers"])
    layer = {
        "model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu",
        "hidden_size": target["hidden_size"], "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target.get("num_key_value_heads") or target["num_attention_heads"],
        "intermediate_size": intermediate_size or target["intermediate_size"],
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6), "rope_theta": target.get("rope_theta", 10000.0),
        "max_position_embeddings": target.get("max_position_embeddings", 2048), "vocab_size": target["vocab_size"],
    }
    if family.startswith("mla"):
        layer.update(model_type=MLA_MODEL_TYPE, **mla_dims(target, int(layer["hidden_size"]),
                                                            int(layer["num_attention_heads"])))
    return DrafterConfig(layer=layer, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids_for(num_layers),
                         aux_convention=OUTPUT_OF_LAYER, target_num_layers=num_layers, **FAMILY_FLAGS[family])


def check_drafter_fits_target(config: DrafterConfig, target: dict[str, Any], drafter_path: str | Path,
                              target_path: str | Path, same_vocab: bool = True) -> None:
    """The drafter reads the target's token embeddings (hidden_size wide) and its aux states (target_hidden_size,
    three of them into fc); serving it on the target also needs the same vocab (its t2d is over the target's ids).
    `target` is the target's config.json (its text part)."""
    hidden = int(target["hidden_size"])
    if config.hidden_size != hidden or config.aux_hidden_size != hidden:
        raise RegraftError(drafter_path, f"drafter hidden size {config.hidden_size} (aux states "
                           f"{config.aux_hidden_size}) does not match the target's {hidden} ({target_path})",
                           "use a drafter made for a target of this width, or train one from scratch "
                           "(finetune.init=scratch)")
    if same_vocab and config.vocab_size != int(target["vocab_size"]):
        raise RegraftError(drafter_path, f"drafter vocab {config.vocab_size} != target vocab "
                           f"{target['vocab_size']} ({target_path})",
                           "a drafter serves only a target with its tokenizer; for another vocab, remap it first "
                           "and skip phase 0 (pipeline.probe=false)")
