"""The target model as the drafter sees it: frozen token embeddings, aux hidden states and next-token logits.

Aux hidden states are captured with forward hooks on the decoder layers (never all L hidden states at once), in
either convention: "output of layer i" hooks layer i's output; "input of layer i" is layer i-1's output.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from stages.common.drafter_config import OUTPUT_OF_LAYER, convert_aux_layer_ids
from stages.common.errors import RegraftError


@dataclass
class TargetFeatures:
    aux_hidden: torch.Tensor  # [B, T, 3 * H_target], the aux layers concatenated in id order
    logits: torch.Tensor  # [B, T, V], the target's next-token logits at every position
    last_hidden: torch.Tensor | None = None  # [B, T, H_target] after the final norm: logits = lm_head(last_hidden)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise RegraftError(None, f"cannot find the decoder layers of {type(model).__name__}",
                           "regraft reads Llama-style models (model.model.layers)")
    return layers


class TargetModel:
    """A frozen HF causal LM with hooks on the aux layers."""

    def __init__(self, model: nn.Module, aux_layer_ids: list[int], convention: str = OUTPUT_OF_LAYER):
        self.model = model.eval().requires_grad_(False)
        self.output_layer_ids = convert_aux_layer_ids(list(aux_layer_ids), convention, OUTPUT_OF_LAYER)
        layers = decoder_layers(model)
        if min(self.output_layer_ids) < 0 or max(self.output_layer_ids) >= len(layers):
            raise RegraftError(None, f"aux layers {aux_layer_ids} ({convention}) are outside the target's "
                               f"{len(layers)} layers", "check the drafter's eagle_aux_hidden_state_layer_ids")
        self._captured: dict[int | str, torch.Tensor] = {}
        # transformers 5.2x renamed `past_key_values` to `cache` (the old name warns, then goes in 5.40).
        self._cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters \
            else "past_key_values"
        for layer_id in set(self.output_layer_ids):
            layers[layer_id].register_forward_hook(self._capture(layer_id))
        final_norm = getattr(self.model.get_decoder(), "norm", None)
        if final_norm is not None:
            final_norm.register_forward_hook(self._capture("last"))

    @classmethod
    def load(cls, path: str | Path, aux_layer_ids: list[int], convention: str = OUTPUT_OF_LAYER,
             dtype: torch.dtype = torch.float32, trust_remote_code: bool = False) -> "TargetModel":
        from transformers import AutoModelForCausalLM

        if not (Path(path) / "config.json").exists():
            raise RegraftError(path, "no config.json: not a target model folder", "point at a save_pretrained folder")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
        return cls(model, aux_layer_ids, convention)

    def _capture(self, layer_id: int | str):
        def hook(module, inputs, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    @property
    def num_layers(self) -> int:
        return len(decoder_layers(self.model))

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(input_ids)

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 past_key_values=None) -> TargetFeatures:
        """The target on new tokens; with `past_key_values` (an HF cache) they follow the cached ones."""
        self._captured.clear()
        cached = {} if past_key_values is None else {self._cache_argument: past_key_values, "use_cache": True}
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, **cached).logits
        aux = torch.cat([self._captured[i] for i in self.output_layer_ids], dim=-1)
        last = self._captured.get("last")
        self._captured.clear()
        return TargetFeatures(aux_hidden=aux, logits=logits, last_hidden=last)

    def batch_features(self, batch: dict[str, torch.Tensor]) -> TargetFeatures:
        """Online: run the target on the batch."""
        return self.features(batch["input_ids"], batch["attention_mask"])


class TargetHead:
    """Only the target's token embeddings and lm_head, read from its folder: enough to train on cached features."""

    def __init__(self, path: str | Path):
        from stages.common.verifier import EMBED_NAMES, Verifier

        verifier = Verifier.open(path)
        files = verifier.files
        embed_name = next(name for name in EMBED_NAMES if name in files)
        self.embedding = nn.Embedding.from_pretrained(files.get(embed_name).float(), freeze=True)
        self.lm_head = files.get(verifier.lm_head_name).float()

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(input_ids)

    @torch.no_grad()
    def batch_features(self, batch: dict[str, torch.Tensor]) -> TargetFeatures:
        """Offline: the batch carries the cached aux and final hidden states; only the lm_head runs."""
        return TargetFeatures(aux_hidden=batch["aux_hidden"].float(), logits=batch["last_hidden"].float() @ self.lm_head.T)
