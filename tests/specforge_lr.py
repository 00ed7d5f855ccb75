"""SpecForge 0.2.0's own lr schedule (specforge/lr_scheduler.py::CosineAnnealingWarmupLR, with the warmup count of
specforge/optimizer.py), run by the reference venv's python (make venv-ref), never imported by the tests:

    .venv-ref/bin/python tests/specforge_lr.py TOTAL_STEPS WARMUP_RATIO

Prints one JSON line: the lr (as a share of the peak) each of the TOTAL_STEPS optimizer steps uses, read before the
scheduler moves on, as SpecForge's BF16Optimizer steps it.
"""
from __future__ import annotations

import json
import sys
import warnings

import torch
from specforge.lr_scheduler import CosineAnnealingWarmupLR


def main(total_steps: int, warmup_ratio: float) -> None:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = CosineAnnealingWarmupLR(optimizer, total_steps=total_steps,
                                        warmup_steps=int(warmup_ratio * total_steps))
    used = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note on get_lr inside step, which SpecForge's scheduler calls
        for _ in range(total_steps):
            used.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
    print(json.dumps(used))


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]))
