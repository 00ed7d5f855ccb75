"""evaluate stage: accept_len and tok/s of the fine-tuned drafter on the new target (phase 1).

The very measurement the probe makes (stages/probe.py), so phase 0 and phase 1 numbers compare one to one; only the
drafter differs (a finetune output folder is accepted as it is).

    python -m stages.evaluate target=DIR drafter=FINETUNE_OUT out=DIR [backend=sglang]
"""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from stages.common.cli import StageResult, register_schema, stage_main
from stages.probe import ProbeConfig, measure


@dataclass
class EvaluateConfig(ProbeConfig):
    pass


register_schema("evaluate", EvaluateConfig)


def run(cfg: DictConfig) -> StageResult:
    return measure(cfg, "evaluate")


if __name__ == "__main__":
    raise SystemExit(stage_main("evaluate", run))
