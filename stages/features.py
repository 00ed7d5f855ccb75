"""features stage: run the target once over the training data and cache what the drafter trains on.

In: the target model folder, chat JSONL, and the aux layers (from a drafter's config, or given).
Out: `features-NNNNN.safetensors` shards (stages/common/feature_shards.py) and a manifest with the aux layer ids
(output-of-layer convention). A sweep of N fine-tunes (`finetune.features=DIR`) then runs the
expensive target forward once instead of N times.

    python -m stages.features target=DIR data=FILE drafter=DRAFTER out=DIR
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from omegaconf import MISSING, DictConfig
from tqdm import tqdm

from stages.common.artifacts import staged_output
from stages.common.chat import load_tokenizer, tokenized_chats
from stages.common.checkpoint import DrafterCheckpoint
from stages.common.drafter_config import OUTPUT_OF_LAYER, aux_layer_ids_for, convert_aux_layer_ids
from stages.common.feature_shards import shard_path, write_shard
from stages.common.stage import StageResult, register_schema, setting, stage_main
from stages.common.target import TargetModel


@dataclass
class FeaturesConfig:
    target: str = MISSING
    data: str = MISSING
    out: str = MISSING
    drafter: Optional[str] = None  # take the aux layers (and convention) from this drafter's config
    aux_layer_ids: Optional[list[int]] = None  # or give them, in the output-of-layer convention
    trust_remote_code: bool = False  # run the code in the target's folder (Kimi's tokenizer and model need it)
    max_length: int = setting(256, at_least=4)  # tokens per conversation, as the fine-tunes will truncate them
    batch_size: int = setting(8, at_least=1)  # conversations per target forward
    rows_per_shard: int = setting(512, at_least=1)  # conversations per safetensors shard


register_schema("features", FeaturesConfig)


def aux_layers(cfg: DictConfig) -> list[int]:
    """Output-of-layer ids: the drafter's (converted), the given ones, or the default for the target's depth."""
    if cfg.drafter:
        config = DrafterCheckpoint.open(cfg.drafter).config
        if config.aux_layer_ids:
            return convert_aux_layer_ids(config.aux_layer_ids, config.aux_convention, OUTPUT_OF_LAYER)
    if cfg.aux_layer_ids:
        return list(cfg.aux_layer_ids)
    return aux_layer_ids_for(json.loads((Path(cfg.target) / "config.json").read_text())["num_hidden_layers"])


def run(cfg: DictConfig) -> StageResult:
    layer_ids = aux_layers(cfg)
    target = TargetModel.load(cfg.target, layer_ids, OUTPUT_OF_LAYER, trust_remote_code=cfg.trust_remote_code)
    rows = tokenized_chats(load_tokenizer(cfg.target, cfg.trust_remote_code), Path(cfg.data), cfg.max_length)
    count = rows["input_ids"].shape[0]
    with staged_output(cfg.out, "features", cfg) as staged:
        shard, pending = 0, []
        for start in tqdm(range(0, count, cfg.batch_size), desc="features", unit=" batch", mininterval=1.0):
            batch = {name: tensor[start:start + cfg.batch_size] for name, tensor in rows.items()}
            features = target.batch_features(batch)
            pending.append({**batch, "aux_hidden": features.aux_hidden, "last_hidden": features.last_hidden})
            if sum(p["input_ids"].shape[0] for p in pending) >= cfg.rows_per_shard or start + cfg.batch_size >= count:
                merged = {name: torch.cat([p[name] for p in pending]) for name in pending[0]}
                write_shard(shard_path(staged.path, shard), merged)
                shard, pending = shard + 1, []
        metrics = {"rows": count, "shards": shard, "tokens": int(rows["attention_mask"].sum())}
        staged.update(metrics=metrics, aux_layer_ids=layer_ids, aux_convention=OUTPUT_OF_LAYER,
                      max_length=cfg.max_length, target=str(Path(cfg.target).absolute()))
    return StageResult(Path(cfg.out), metrics, f"{count} conversations, {shard} shards")


if __name__ == "__main__":
    raise SystemExit(stage_main("features", run))
