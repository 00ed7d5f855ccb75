"""A stand-in for a stage in a local job (tests/test_launchers.py): it records the CUDA_VISIBLE_DEVICES its job was
given and when it ran, and can wait for other jobs to be running beside it.

In: the node's config: `record` (a folder), `job` (its name), `meet` (names of jobs that must have started too, else
it fails after MEET_TIMEOUT_S), `hold_s` (how long it stays after that). Out: `<record>/<job>.json` with `gpus`,
`start`, `end`; a StageOutcome like a stage's. Importable by a job (standard library and pipelines.core.jobs only).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from pipelines.core.jobs import StageOutcome

MEET_TIMEOUT_S = 120.0


def record(stage: str, config: dict[str, Any]) -> StageOutcome:
    folder, start = Path(config["record"]), time.time()
    (folder / f"{config['job']}.start").touch()
    deadline = time.monotonic() + MEET_TIMEOUT_S
    while not all((folder / f"{other}.start").exists() for other in config.get("meet", [])):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{config['job']} ran alone: {config['meet']} never started beside it")
        time.sleep(0.05)
    time.sleep(config.get("hold_s", 0.3))
    seen = {"gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": start, "end": time.time()}
    (folder / f"{config['job']}.json").write_text(json.dumps(seen))
    return StageOutcome(config["out"], False, headline=f"{stage} on GPUs [{seen['gpus']}]")
