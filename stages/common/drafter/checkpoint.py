"""EAGLE-3 drafter checkpoints: the tensors of either layout real engines read, read lazily and written streaming.

- `sglang` (SGLang / SpecForge): weights `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`.
- `speculators` (vLLM / speculators): the layer is `layers.0.*`; may carry `verifier_lm_head`.

The config.json side (layouts, aux-layer conventions) is stages/common/drafter/config.py. Reading detects the
layout; writing streams tensors, so converting a Kimi-sized drafter never holds it in memory. Inside regraft every
tensor goes by its sglang name (`midlayer.*`).

    python -m stages.common.drafter.checkpoint SRC OUT --layout speculators   # convert between layouts
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch

from stages.common.drafter.config import (CONVENTIONS, LAYOUT_CONVENTION, LAYOUTS, DrafterConfig, Layout,
                                          in_stage_output, parse_config, render_config, trained_for)
from stages.common.contract.errors import RegraftError
from stages.common.drafter.tensor_io import SafetensorsFiles, TensorSpec, spec_of, write_safetensors
from stages.common.drafter.vocab import VocabMap

LAYER_PREFIX = {"sglang": "midlayer.", "speculators": "layers.0."}


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
                  layout: Layout = "sglang", aux_convention: str | None = None) -> Path:
    """Write config.json and model.safetensors in `layout`; tensors are keyed by sglang names. The aux ids are
    written in the convention the layout's engines read (`LAYOUT_CONVENTION`) unless `aux_convention` says."""
    if layout not in LAYOUTS:
        raise RegraftError(None, f"unknown layout {layout!r}", f"choose one of {LAYOUTS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = []
    for name, value in tensors.items():
        spec = value if isinstance(value, TensorSpec) else spec_of(name, value)
        specs.append(replace(spec, name=file_name(name, layout)))
    write_safetensors(out / "model.safetensors", specs, metadata={"format": "pt"})
    raw = render_config(config, layout, aux_convention)
    tmp = out / ".config.json.tmp"
    tmp.write_text(json.dumps(raw, indent=2) + "\n")
    tmp.replace(out / "config.json")
    return out


def convert_checkpoint(source: str | Path, out_dir: str | Path, layout: Layout, aux_convention: str | None = None,
                       verifier: str | None = None, verifier_name: str | None = None) -> Path:
    """Rewrite a checkpoint in another layout, streaming its tensors; its aux ids in the convention the layout's
    engines read unless `aux_convention` says otherwise. `verifier` (a target folder or hub id) is the target it
    serves, deployed as `verifier_name` (default: `verifier` as given; `DrafterConfig.with_verifier`); without
    either, the verifier the checkpoint records, else (speculators, whose loader needs one) the target folder the
    stage output holding it was made for, a folder in regraft's cache for the built-in world (`trained_for`)."""
    from stages.common.contract.artifacts import staged_output

    checkpoint = DrafterCheckpoint.open(source)
    config = checkpoint.config
    if verifier or verifier_name:
        config = config.with_verifier(verifier or verifier_name, verifier_name)
        if config.verifier is None:  # a folder in the cache, named by the user: as named
            config = config.with_local_verifier(Path(verifier))
    elif config.verifier is None and layout == "speculators" and (local := trained_for(source)) is not None:
        config = config.with_local_verifier(local)  # the built-in world's target: loadable here, named nowhere else
    convention = aux_convention or LAYOUT_CONVENTION[layout]
    with staged_output(out_dir, "convert", {"source": str(source), "layout": layout,
                                            "aux_convention": convention}) as staged:
        write_drafter(staged.path, config, {name: checkpoint.spec(name) for name in checkpoint.names()}, layout,
                      convention)
    return Path(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Convert an EAGLE-3 drafter between layouts.")
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--layout", choices=LAYOUTS, required=True)
    parser.add_argument("--aux-convention", choices=CONVENTIONS,
                        help="default: the layout's engines' (sglang: output_of_layer, speculators: input_of_layer)")
    parser.add_argument("--verifier", help="the target folder (or hub id) the drafter serves: speculators records "
                        "its name and architectures (default: what the checkpoint records)")
    parser.add_argument("--verifier-name", help="the hub id the verifier is deployed by (default: --verifier as given)")
    args = parser.parse_args(argv)
    try:
        convert_checkpoint(args.source, args.out, args.layout, args.aux_convention, args.verifier, args.verifier_name)
    except RegraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({args.layout}); {what_a_loader_needs(Path(args.out))}")
    return 0


def what_a_loader_needs(export: Path) -> str:
    """The export's verifier, as its log line says it: what speculators' loader (which reads the verifier's config
    and embeddings by that name) and an engine will look for."""
    name = DrafterCheckpoint.open(export).config.verifier or json.loads((export / "config.json").read_text()).get(
        "speculators_config", {}).get("verifier", {}).get("name_or_path")
    if name is None:
        return ("it names no verifier: speculators' loader needs one (--verifier FOLDER, or --verifier-name HUB_ID "
                "for the target as deployed); vLLM serves it beside the target it is given")
    if in_stage_output(Path(name)):
        return (f"its verifier is {name}, a folder in regraft's cache on this machine: loaders here read the "
                "target's config and embeddings from it; for another machine, name the target as deployed "
                "(--verifier-name HUB_ID, or target.name= in the run)")
    return f"its verifier is {name}: a loader reads the target's config and embeddings from it"


if __name__ == "__main__":
    sys.exit(main())
