"""The target model as the drafter sees it: frozen token embeddings, aux hidden states and next-token logits.

Aux hidden states are captured with forward hooks on the decoder layers (never all L hidden states at once), in
either convention: "output of layer i" hooks layer i's output; "input of layer i" is layer i-1's output.

Training needs only two things from the target's logits (`TargetSignals`): the argmax over the full vocab and the
logits at the draft vocab's ids. Both come from the final hidden state times the lm_head in vocab chunks, so no
[B, T, V] tensor exists (Kimi-K2.5's 163,840 ids: 1.3 GB in fp32 for one 2,048-token row).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from stages.common.drafter.config import OUTPUT_OF_LAYER, convert_aux_layer_ids, raw_target_config, target_config
from stages.common.contract.errors import RegraftError


HEAD_CHUNK_ELEMENTS = 2 ** 24  # logits per vocab chunk (64 MB in fp32): tokens x chunk rows


@dataclass
class TargetSignals:
    """What TTT reads from the target's next-token logits, once per batch: the argmax over the full vocab (is the
    target's next token in the draft vocab?) and the logits at the draft vocab's ids, in draft order."""

    argmax: torch.Tensor  # [B, T] int64: the target's full-vocab argmax at each position
    draft_logits: torch.Tensor  # [B, T, N]: logits[..., draft_ids], in the target's dtype

    @classmethod
    def from_logits(cls, logits: torch.Tensor, draft_ids: torch.Tensor) -> "TargetSignals":
        """From full [B, T, V] logits (reference, tests, small vocabularies)."""
        return cls(argmax=logits.argmax(-1), draft_logits=logits[..., draft_ids])

    @classmethod
    @torch.no_grad()
    def from_hidden(cls, hidden: torch.Tensor, lm_head_weight: torch.Tensor, draft_ids: torch.Tensor,
                    lm_head_bias: torch.Tensor | None = None,
                    chunk_elements: int = HEAD_CHUNK_ELEMENTS) -> "TargetSignals":
        """From the final hidden state [B, T, H] (after the final norm) and the lm_head [V, H]: the logits are
        computed a vocab chunk at a time, keeping a running max/argmax (the first maximum wins, as in argmax) and
        copying out the draft vocab's columns, so the head's matmul runs once and [B, T, V] never exists. No step
        depends on the values (no `nonzero`, no host sync): the loop runs ahead of a GPU, and on the meta device."""
        *lead, width = hidden.shape
        flat = hidden.reshape(-1, width).to(lm_head_weight.dtype)
        vocab, tokens = lm_head_weight.shape[0], flat.shape[0]
        chunk = min(vocab, max(256, chunk_elements // max(tokens, 1)))
        draft_ids = draft_ids.to(flat.device)
        best = torch.full((tokens,), float("-inf"), dtype=flat.dtype, device=flat.device)
        argmax = torch.zeros(tokens, dtype=torch.int64, device=flat.device)
        draft_logits = flat.new_empty(tokens, draft_ids.numel())
        for start in range(0, vocab, chunk):
            stop = min(start + chunk, vocab)
            bias = None if lm_head_bias is None else lm_head_bias[start:stop]
            logits = torch.nn.functional.linear(flat, lm_head_weight[start:stop], bias)  # [tokens, chunk]
            values, indices = logits.max(-1)
            better = values > best
            best = torch.where(better, values, best)
            argmax = torch.where(better, indices + start, argmax)
            inside = (draft_ids >= start) & (draft_ids < stop)  # the draft ids this chunk holds
            columns = (draft_ids - start).clamp(0, stop - start - 1)
            draft_logits = torch.where(inside, logits[:, columns], draft_logits)
        return cls(argmax=argmax.view(*lead), draft_logits=draft_logits.view(*lead, -1))


@dataclass
class TargetFeatures:
    aux_hidden: torch.Tensor  # [B, T, 3 * H_target], the aux layers concatenated in id order
    logits: torch.Tensor | None = None  # [B, T, V] next-token logits (`features`); batch_features leaves it None
    last_hidden: torch.Tensor | None = None  # [B, T, H_target] after the final norm: logits = lm_head(last_hidden)
    signals: TargetSignals | None = None  # batch_features with draft ids: what TTT reads from the logits


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
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        raw = raw_target_config(path)
        # A multimodal wrapper (Kimi-K2.5) is no causal LM to transformers: it loads as image-text-to-text, and
        # text-only input runs its language model alone.
        causal = raw.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or \
            "AutoModelForCausalLM" in raw.get("auto_map", {})
        loader = AutoModelForCausalLM if causal else AutoModelForImageTextToText
        model = loader.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
        return cls(model, aux_layer_ids, convention)

    def to(self, device: str | torch.device) -> "TargetModel":
        """The model moved to `device` (the drafter's), in place; the hooks stay."""
        self.model.to(device)
        return self

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

    def plain_head(self) -> tuple[nn.Module, nn.Linear] | None:
        """The decoder body and the lm_head, where the logits are exactly lm_head(decoder output); None for a model
        that transforms them further (softcapping, a logit scale) or does not expose the two parts."""
        config = self.model.config
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else None
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        if decoder is None or not isinstance(head, nn.Linear) or getattr(config, "final_logit_softcapping", None) \
                or getattr(config, "logit_scale", None) not in (None, 1, 1.0):
            return None
        return decoder, head

    @torch.no_grad()
    def batch_features(self, batch: dict[str, torch.Tensor], draft_ids: torch.Tensor | None = None) -> TargetFeatures:
        """Online: run the target on the batch; with `draft_ids` also the TTT signals. Where the logits are the
        lm_head's alone (`plain_head`), only the decoder body runs and its final hidden state meets the lm_head a
        vocab chunk at a time (`TargetSignals.from_hidden`): no full logits are built and `logits` stays None."""
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        parts = self.plain_head()
        if parts is None:  # the whole model, full logits and all
            features = self.features(input_ids, attention_mask)
            if draft_ids is not None:
                features.signals = TargetSignals.from_logits(features.logits, draft_ids)
            return features
        decoder, head = parts
        self._captured.clear()
        last = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        aux = torch.cat([self._captured[i] for i in self.output_layer_ids], dim=-1)
        self._captured.clear()
        signals = None if draft_ids is None else TargetSignals.from_hidden(last, head.weight, draft_ids, head.bias)
        return TargetFeatures(aux_hidden=aux, last_hidden=last, signals=signals)


class TargetHead:
    """Only the target's token embeddings and lm_head, read from its folder: enough to train on cached features.
    Both live where the drafter trains (`device`), in `dtype`: the lm_head's vocab-chunked matmul runs there too."""

    def __init__(self, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        from stages.common.drafter.verifier import EMBED_NAMES, Verifier

        verifier = Verifier.open(path)
        files = verifier.files
        embed_name = next(name for name in EMBED_NAMES if name in files)
        self.embedding = nn.Embedding.from_pretrained(files.get(embed_name).to(device, dtype), freeze=True)
        self.lm_head = files.get(verifier.lm_head_name).to(device, dtype)

    @classmethod
    def of(cls, embedding: torch.Tensor, lm_head: torch.Tensor) -> "TargetHead":
        """A head from its two tensors, read from no folder (a memory estimate's, on the meta device)."""
        head = cls.__new__(cls)
        head.embedding, head.lm_head = nn.Embedding.from_pretrained(embedding, freeze=True), lm_head
        return head

    def to(self, device: str | torch.device) -> "TargetHead":
        """Both tensors moved to `device` (the drafter's), in place."""
        self.embedding, self.lm_head = self.embedding.to(device), self.lm_head.to(device)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.dtype

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(input_ids)

    @torch.no_grad()
    def batch_features(self, batch: dict[str, torch.Tensor], draft_ids: torch.Tensor | None = None) -> TargetFeatures:
        """Offline: the batch carries the cached aux and final hidden states; only the lm_head runs. With
        `draft_ids`: the TTT signals, the lm_head a vocab chunk at a time (no [B, T, V] logits); without: the full
        logits."""
        aux, last = batch["aux_hidden"].to(self.dtype), batch["last_hidden"].to(self.dtype)
        if draft_ids is None:
            return TargetFeatures(aux_hidden=aux, logits=last @ self.lm_head.T, last_hidden=last)
        return TargetFeatures(aux_hidden=aux, last_hidden=last,
                              signals=TargetSignals.from_hidden(last, self.lm_head, draft_ids))


class FinalNorm:
    """The target's final RMSNorm, read from its folder: an engine hands out the state after the last layer, the
    shards store it normed (logits = lm_head(last_hidden)), as the hf path's `last_hidden` is."""

    NAMES = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight", "norm.weight")

    def __init__(self, weight: torch.Tensor, eps: float, num_layers: int):
        self.weight, self.eps, self.num_layers = weight.float(), eps, num_layers

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[0]

    @classmethod
    def load(cls, path: str | Path) -> "FinalNorm":
        from stages.common.drafter.verifier import Verifier

        config = target_config(path)
        files = Verifier.open(path).files
        name = next((name for name in cls.NAMES if name in files), None)
        if name is None:
            raise RegraftError(path, f"no final norm weight ({', '.join(cls.NAMES)})",
                               "give a Llama-style target folder, or features.backend=hf")
        return cls(files.get(name), config.get("rms_norm_eps", 1e-6), config["num_hidden_layers"])

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        states = states.float()
        return states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
