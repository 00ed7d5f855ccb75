"""EAGLE-3 drafter checkpoints in both layouts real engines read.

- `sglang` (SGLang / SpecForge): `config.json` with `architectures: ["LlamaForCausalLMEagle3"]`, the Llama layer
  fields at top level, `draft_vocab_size`, optional `target_hidden_size` and
  `eagle_config.eagle_aux_hidden_state_layer_ids`; weights `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`.
- `speculators` (vLLM / speculators): `speculators_model_type: eagle3`, the layer config nested in
  `transformer_layer_config`, aux ids at top level; weights `layers.0.*`, optionally `verifier_lm_head`.

Reading detects the layout and reads tensors lazily; writing streams tensors, so converting a Kimi-sized drafter
never holds it in memory. Inside regraft every tensor goes by its sglang name (`midlayer.*`).
The aux-layer convention ("output of layer" vs "input of layer" ids) is recorded in a `regraft` block of the
config; checkpoints without it get it inferred, and say so.

    python -m stages.common.checkpoint SRC OUT --layout speculators   # convert between layouts
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Literal

import torch

from stages.common.errors import RegraftError
from stages.common.tensor_io import SafetensorsFiles, TensorSpec, spec_of, write_safetensors
from stages.common.vocab import VocabMap

Layout = Literal["sglang", "speculators"]
LAYOUTS: tuple[str, ...] = ("sglang", "speculators")
OUTPUT_OF_LAYER = "output_of_layer"
INPUT_OF_LAYER = "input_of_layer"
CONVENTIONS = (OUTPUT_OF_LAYER, INPUT_OF_LAYER)
SGLANG_ARCH = "LlamaForCausalLMEagle3"
SPECULATORS_ARCH = "Eagle3Speculator"
LAYER_PREFIX = {"sglang": "midlayer.", "speculators": "layers.0."}


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
    extra: dict[str, Any] = field(default_factory=dict)  # other top-level keys, kept as they were
    # Keys only one layout understands, by layout; written in that layout, stashed in the `regraft` block otherwise.
    layout_extras: dict[str, dict[str, Any]] = field(default_factory=dict)

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

    def with_aux_convention(self, convention: str) -> "DrafterConfig":
        """The same layers, named in the other convention (ids shift by one)."""
        ids = self.aux_layer_ids and convert_aux_layer_ids(self.aux_layer_ids, self.aux_convention, convention)
        return replace(self, aux_layer_ids=ids, aux_convention=convention, aux_convention_source="recorded")

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        H, I, N, V = self.hidden_size, self.intermediate_size, self.draft_vocab_size, self.vocab_size
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "midlayer.self_attn.q_proj.weight": (q_out, 2 * H),
            "midlayer.self_attn.k_proj.weight": (kv_out, 2 * H),
            "midlayer.self_attn.v_proj.weight": (kv_out, 2 * H),
            "midlayer.self_attn.o_proj.weight": (H, q_out),
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
        }
        if self.attention_bias:
            shapes.update({"midlayer.self_attn.q_proj.bias": (q_out,), "midlayer.self_attn.k_proj.bias": (kv_out,),
                           "midlayer.self_attn.v_proj.bias": (kv_out,), "midlayer.self_attn.o_proj.bias": (H,)})
        return shapes

    def optional_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"embed_tokens.weight": (self.vocab_size, self.hidden_size),
                "verifier_lm_head.weight": (self.draft_vocab_size, self.aux_hidden_size)}


# ---------------------------------------------------------------- config.json <-> DrafterConfig

SGLANG_KEYS = {"architectures", "draft_vocab_size", "target_hidden_size", "eagle_config", "regraft",
               "eagle_aux_hidden_state_layer_ids", "norm_before_residual"}
SPECULATORS_KEYS = {"architectures", "speculators_model_type", "transformer_layer_config", "draft_vocab_size",
                    "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual", "regraft"}
SPECULATORS_ONLY_KEYS = {"speculators_config", "speculators_version", "embed_requires_grad", "enable_sp_ulysses"}
DEFAULT_SPECULATORS_CONFIG = {
    "algorithm": "eagle3", "default_proposal_method": "greedy",
    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
    "verifier": {"name_or_path": None, "architectures": []},
}


def detect_layout(raw: dict[str, Any], path: Path) -> Layout:
    if raw.get("speculators_model_type") == "eagle3":
        return "speculators"
    if SGLANG_ARCH in (raw.get("architectures") or []):
        return "sglang"
    raise RegraftError(path, f"not an EAGLE-3 drafter config (architectures={raw.get('architectures')})",
                       f"expected architectures [{SGLANG_ARCH}] or speculators_model_type eagle3")


def _infer_convention(ids: list[int] | None, layout: Layout) -> tuple[str, str]:
    if ids and ids[0] == 1:
        return OUTPUT_OF_LAYER, "inferred: first aux id is 1"
    if ids and ids[0] == 2:
        return INPUT_OF_LAYER, "inferred: first aux id is 2"
    default = OUTPUT_OF_LAYER if layout == "sglang" else INPUT_OF_LAYER
    return default, f"inferred: {layout} layout default"


def parse_config(raw: dict[str, Any], path: Path) -> tuple[Layout, DrafterConfig]:
    layout = detect_layout(raw, path)
    recorded = dict(raw.get("regraft") or {})
    layout_extras = {name: dict(keys) for name, keys in (recorded.get("layout_extras") or {}).items()}
    if layout == "sglang":
        layer = {k: v for k, v in raw.items() if k not in SGLANG_KEYS}
        eagle = dict(raw.get("eagle_config") or {})
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.pop("eagle_aux_hidden_state_layer_ids", None)
        if ids and eagle.get("use_aux_hidden_state") is True:
            del eagle["use_aux_hidden_state"]  # implied by the ids; rendering sets it again
        own = {"eagle_config": eagle} if eagle else {}
        extra = {}
    else:
        layer = dict(raw.get("transformer_layer_config") or {})
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
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
    if recorded.get("aux_convention") in CONVENTIONS:
        convention, source = recorded["aux_convention"], "recorded"
    else:
        convention, source = _infer_convention(ids, layout)
    config = DrafterConfig(
        layer=layer, draft_vocab_size=int(raw["draft_vocab_size"]), target_hidden_size=raw.get("target_hidden_size"),
        aux_layer_ids=list(ids) if ids else None, aux_convention=convention, aux_convention_source=source,
        target_num_layers=recorded.get("target_num_layers"),
        norm_before_residual=bool(raw.get("norm_before_residual", False)), extra=extra, layout_extras=layout_extras)
    return layout, config


def render_config(config: DrafterConfig, layout: Layout) -> dict[str, Any]:
    own = dict(config.layout_extras.get(layout, {}))
    stashed = {name: keys for name, keys in config.layout_extras.items() if name != layout and keys}
    regraft: dict[str, Any] = {"aux_convention": config.aux_convention, "target_num_layers": config.target_num_layers}
    if layout == "sglang":
        eagle = dict(own.pop("eagle_config", {}))
        if config.aux_layer_ids is not None:
            eagle["eagle_aux_hidden_state_layer_ids"] = list(config.aux_layer_ids)
            eagle.setdefault("use_aux_hidden_state", True)
        raw: dict[str, Any] = {"architectures": [SGLANG_ARCH], **config.layer,
                               "draft_vocab_size": config.draft_vocab_size}
        if config.target_hidden_size is not None:
            raw["target_hidden_size"] = config.target_hidden_size
        if config.norm_before_residual:
            raw["norm_before_residual"] = True
        if eagle:
            raw["eagle_config"] = eagle
    else:
        raw = {"architectures": [SPECULATORS_ARCH], "speculators_model_type": "eagle3",
               "transformer_layer_config": dict(config.layer), "draft_vocab_size": config.draft_vocab_size,
               "norm_before_residual": config.norm_before_residual, "target_hidden_size": config.target_hidden_size,
               "eagle_aux_hidden_state_layer_ids": config.aux_layer_ids}
        if "speculators_config" not in own:  # vLLM reads the proposal method and verifier from it
            own["speculators_config"] = DEFAULT_SPECULATORS_CONFIG
            regraft["generated"] = ["speculators_config"]
    if stashed:
        regraft["layout_extras"] = stashed
    return {**raw, **own, **config.extra, "regraft": regraft}


def file_name(canonical: str, layout: Layout) -> str:
    if canonical.startswith(LAYER_PREFIX["sglang"]):
        return LAYER_PREFIX[layout] + canonical[len(LAYER_PREFIX["sglang"]):]
    return canonical


def canonical_name(stored: str, layout: Layout) -> str:
    name = stored[len("model."):] if stored.startswith("model.") else stored
    prefix = LAYER_PREFIX[layout]
    return LAYER_PREFIX["sglang"] + name[len(prefix):] if name.startswith(prefix) else name


# ---------------------------------------------------------------- reading


class DrafterCheckpoint:
    """A drafter checkpoint on disk: its layout, config and lazily read tensors (by sglang names)."""

    def __init__(self, path: Path, layout: Layout, config: DrafterConfig, files: SafetensorsFiles,
                 stored_names: dict[str, str]):
        self.path, self.layout, self.config, self.files, self.stored_names = path, layout, config, files, stored_names

    @classmethod
    def open(cls, path: str | Path, validate: bool = True) -> "DrafterCheckpoint":
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.exists():
            raise RegraftError(path, "no config.json: not a drafter checkpoint folder",
                               "point at the folder holding config.json and model.safetensors")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise RegraftError(config_file, f"invalid JSON ({exc})", "fix or re-export the config") from exc
        layout, config = parse_config(raw, config_file)
        files = SafetensorsFiles.open_model_dir(path)
        stored_names = {canonical_name(name, layout): name for name in files.names()}
        checkpoint = cls(path, layout, config, files, stored_names)
        return checkpoint.validate() if validate else checkpoint

    def names(self) -> list[str]:
        return list(self.stored_names)

    def __contains__(self, name: str) -> bool:
        return name in self.stored_names

    def tensor(self, name: str) -> torch.Tensor:
        return self.files.get(self.stored_names[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files.shape(self.stored_names[name])

    def dtype(self, name: str) -> torch.dtype:
        return self.files.dtype(self.stored_names[name])

    def gather_rows(self, name: str, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.files.gather_rows(self.stored_names[name], rows, out)

    def row_chunks(self, name: str) -> Iterator[torch.Tensor]:
        return self.files.iter_row_chunks(self.stored_names[name])

    def spec(self, name: str) -> TensorSpec:
        """One stored tensor carried over unchanged: the writer copies its bytes file to file."""
        stored = self.stored_names[name]
        return TensorSpec(name, self.dtype(name), self.shape(name), file_range=self.files.file_range(stored))

    def vocab_map(self) -> VocabMap:
        return VocabMap(self.tensor("d2t"), self.tensor("t2d"), source=str(self.path)).validate()

    def validate(self) -> "DrafterCheckpoint":
        weights = self.path / "model.safetensors"
        expected, optional = self.config.expected_shapes(), self.config.optional_shapes()
        missing = sorted(set(expected) - set(self.stored_names))
        if missing:
            stored = [file_name(n, self.layout) for n in missing]
            raise RegraftError(weights, f"missing tensors {stored}", f"a {self.layout} drafter needs all of them")
        unknown = sorted(set(self.stored_names) - set(expected) - set(optional))
        if unknown:
            raise RegraftError(weights, f"unknown tensors {[self.stored_names[n] for n in unknown]}",
                               "engines skip unknown names silently; rename them to the layout's names")
        for name in self.stored_names:
            want = expected.get(name) or optional[name]
            got = self.shape(name)
            if got != want:
                raise RegraftError(weights, f"{self.stored_names[name]} has shape {list(got)}, config says "
                                   f"{list(want)}", "the config.json does not describe these weights")
        dtypes = {"d2t": torch.int64, "t2d": torch.bool}
        for name, want_dtype in dtypes.items():
            if self.dtype(name) != want_dtype:
                raise RegraftError(weights, f"{name} is {self.dtype(name)}, must be {want_dtype}",
                                   "rebuild the map with the vocab_map stage")
        float_dtypes = {self.dtype(n) for n in self.stored_names if n not in dtypes}
        if not all(d.is_floating_point for d in float_dtypes):
            raise RegraftError(weights, f"weights must be floating point, found {sorted(map(str, float_dtypes))}",
                               "re-export the drafter in bf16/fp16/fp32")
        self.vocab_map()
        return self


# ---------------------------------------------------------------- writing


def write_drafter(out_dir: str | Path, config: DrafterConfig, tensors: dict[str, torch.Tensor | TensorSpec],
                  layout: Layout = "sglang") -> Path:
    """Write config.json and model.safetensors in `layout`; tensors are keyed by sglang names."""
    if layout not in LAYOUTS:
        raise RegraftError(None, f"unknown layout {layout!r}", f"choose one of {LAYOUTS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = []
    for name, value in tensors.items():
        spec = value if isinstance(value, TensorSpec) else spec_of(name, value)
        specs.append(replace(spec, name=file_name(name, layout)))
    write_safetensors(out / "model.safetensors", specs, metadata={"format": "pt"})
    raw = render_config(config, layout)
    tmp = out / ".config.json.tmp"
    tmp.write_text(json.dumps(raw, indent=2) + "\n")
    tmp.replace(out / "config.json")
    return out


def convert_checkpoint(source: str | Path, out_dir: str | Path, layout: Layout,
                       aux_convention: str | None = None) -> Path:
    """Rewrite a checkpoint in another layout (and optionally aux convention), streaming its tensors."""
    from stages.common.artifacts import staged_output

    checkpoint = DrafterCheckpoint.open(source)
    config = checkpoint.config
    if aux_convention and aux_convention != config.aux_convention:
        config = config.with_aux_convention(aux_convention)
    with staged_output(out_dir, "convert", {"source": str(source), "layout": layout,
                                            "aux_convention": config.aux_convention}) as staged:
        write_drafter(staged.path, config, {name: checkpoint.spec(name) for name in checkpoint.names()}, layout)
    return Path(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Convert an EAGLE-3 drafter between layouts.")
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--layout", choices=LAYOUTS, required=True)
    parser.add_argument("--aux-convention", choices=CONVENTIONS)
    args = parser.parse_args(argv)
    try:
        convert_checkpoint(args.source, args.out, args.layout, args.aux_convention)
    except RegraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({args.layout})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
