"""A throwaway drafter step for tests/test_registry.py: the fine-tuned drafter copied as it is into drafter/, with
`stamp.json` (its `note`) beside it. The module is both the stage (`run`) and its schema module (no torch)."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import MISSING, DictConfig

from stages.common.contract.artifacts import staged_output
from stages.common.contract.stage import StageResult, register_schema, setting


@dataclass
class StampConfig:
    drafter: str = MISSING  # a drafter folder (a fine-tune's output)
    note: str = "stamped"
    copies: int = setting(1, at_least=1)  # a bound, for the root's check to hold it to
    out: Optional[str] = None


register_schema("stamp", StampConfig)


def run(cfg: DictConfig) -> StageResult:
    with staged_output(cfg.out, "stamp", cfg) as staged:
        given = Path(cfg.drafter)  # a fine-tune's output holds its drafter in drafter/, as this stage's does
        shutil.copytree(given / "drafter" if (given / "drafter").is_dir() else given, staged.path / "drafter")
        (staged.path / "stamp.json").write_text(json.dumps({"note": cfg.note}))
        staged.update(headline=f"stamped: {cfg.note}")
    return StageResult(Path(cfg.out), {}, f"stamped: {cfg.note}")
