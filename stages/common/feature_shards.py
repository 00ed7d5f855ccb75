"""The features stage's cache as files: `features-NNNNN.safetensors` shards that offline fine-tunes read.

Each shard holds `input_ids`, `attention_mask`, `loss_mask` [n, L], `aux_hidden` [n, L, 3H] and `last_hidden`
[n, L, H] (after the final norm, so logits = lm_head(last_hidden)); the folder's manifest names the aux layers
(output-of-layer convention) and `max_length` they were cached for, which a reader checks before using them.
"""
from __future__ import annotations

from pathlib import Path

import torch

from stages.common.artifacts import read_manifest
from stages.common.errors import RegraftError
from stages.common.tensor_io import SafetensorsFiles, spec_of, write_safetensors

SHARD_PATTERN = "features-*.safetensors"


def shard_path(folder: Path, index: int) -> Path:
    return folder / f"features-{index:05d}.safetensors"


def write_shard(path: Path, rows: dict[str, torch.Tensor]) -> None:
    write_safetensors(path, [spec_of(name, tensor.contiguous()) for name, tensor in rows.items()])


def load_features(path: str | Path, aux_layer_ids: list[int], max_length: int) -> dict[str, torch.Tensor]:
    """Every cached row, checked against what the training expects (aux layers, output convention)."""
    manifest = read_manifest(path)
    if manifest is None or manifest.get("stage") != "features":
        raise RegraftError(path, "not a complete features stage output", "run python -m stages.features first")
    if manifest["aux_layer_ids"] != list(aux_layer_ids) or manifest["max_length"] != max_length:
        raise RegraftError(path, f"cached for aux layers {manifest['aux_layer_ids']} and max_length "
                           f"{manifest['max_length']}, training wants {list(aux_layer_ids)} and {max_length}",
                           "rebuild the features for this drafter")
    shards = [SafetensorsFiles.open_file(shard) for shard in sorted(Path(path).glob(SHARD_PATTERN))]
    return {name: torch.cat([files.get(name) for files in shards]) for name in shards[0].names()}
