"""speculators 0.9.0's own loader on a drafter regraft exported in the speculators layout; run by the reference
venv's python (make venv-ref), never imported by the tests:

    .venv-ref/bin/python tests/speculators_load.py DRAFTER

Prints one JSON line: the tensors of the file the loaded model has no place for, the model's own tensors the file
did not fill (its verifier copies, which speculators loads from the verifier), the tensors loaded with other
values, and the EAGLE-3.1 toggles as speculators' config reads them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from speculators import Eagle3DraftModel

FLAGS = ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual")


def main(drafter: str) -> None:
    model = Eagle3DraftModel.from_pretrained(drafter)
    stored, state = load_file(str(Path(drafter) / "model.safetensors")), model.state_dict()
    print(json.dumps({
        "not_in_model": sorted(set(stored) - set(state)),
        "not_in_file": sorted(set(state) - set(stored)),
        "differ": sorted(name for name in set(stored) & set(state)
                         if not torch.equal(stored[name], state[name].to(stored[name].dtype))),
        "flags": {flag: bool(getattr(model.config, flag, False)) for flag in FLAGS}}))


if __name__ == "__main__":
    main(sys.argv[1])
