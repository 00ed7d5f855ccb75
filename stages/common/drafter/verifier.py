"""The verifier (target model) as regraft reads it: config facts, and lm_head rows read lazily by id.

A target folder is what `save_pretrained` writes (config.json plus model.safetensors or an index of shards).
Its output embedding is `lm_head.weight`, or `model.embed_tokens.weight` when the embeddings are tied.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from stages.common.contract.errors import RegraftError
from stages.common.drafter.config import language_model_config
from stages.common.drafter.tensor_io import SafetensorsFiles

# The released names: a causal LM's, and a multimodal wrapper's language model (Kimi-K2.5's `language_model.*`, the
# `model.language_model.*` transformers writes).
LM_HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight")
EMBED_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight",
               "language_model.model.embed_tokens.weight")


@dataclass
class Verifier:
    path: Path
    vocab_size: int
    hidden_size: int
    num_layers: int
    tied: bool
    files: SafetensorsFiles
    lm_head_name: str

    @classmethod
    def open(cls, path: str | Path) -> "Verifier":
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.exists():
            raise RegraftError(path, "no config.json: not a target model folder",
                               "point verifier= at the folder save_pretrained wrote for the target")
        text = language_model_config(json.loads(config_file.read_text()))
        files = SafetensorsFiles.open_model_dir(path)
        tied = bool(text.get("tie_word_embeddings", False))
        names = EMBED_NAMES if tied else LM_HEAD_NAMES + EMBED_NAMES
        found = next((name for name in names if name in files), None)
        if found is None:
            raise RegraftError(path, "has neither lm_head.weight nor model.embed_tokens.weight",
                               "the verifier's output embedding is needed for fallback rows")
        verifier = cls(path, int(text["vocab_size"]), int(text["hidden_size"]), int(text["num_hidden_layers"]),
                       tied or found in EMBED_NAMES, files, found)
        rows = files.shape(found)[0]
        if rows < verifier.vocab_size:
            raise RegraftError(path, f"{found} has {rows} rows but vocab_size is {verifier.vocab_size}",
                               "the config does not match the weights")
        return verifier

    def lm_head_rows(self, target_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of the output embedding for `target_ids` only; the rest of the matrix is never read."""
        return self.files.gather_rows(self.lm_head_name, target_ids, out)

    @property
    def lm_head_dtype(self) -> torch.dtype:
        return self.files.dtype(self.lm_head_name)
