"""diagnose stage: how far did the target move for this drafter, and the closed-form fix before any gradient step.

In: the remapped drafter (`drafter`, a remap output: the source drafter with its lm_head on the new map), the
target it was trained for (`target_a`, optional), the new target (`target`), B-domain chats (`data`) and the
training map (`vocab_map`). Both targets run on the same tokens.
Out: `diagnose.json`, `diagnose.png`, `realigned/` (the drafter re-aligned to read B; needs target A) and a
manifest whose metrics are the headline numbers.

What it measures (`stages/common/drafter/drift.py`), on the first `fit_share` of the rows' tokens fitted and the rest held
out:
- per aux layer: linear CKA(A, B), relative shift ||h_B - h_A|| / ||h_A||, held-out R^2 of the ridge map B -> A
  (and of B's states as they are);
- step 0 of TTT on the held-out rows, B's labels, for four starting points: `as_is` (the source drafter read
  through the new map, unremapped), `remap`, `realign` (remap + the maps folded in), `scratch` (a fresh drafter);
- the transfer gap: the remapped drafter's step-0 loss fed B's states minus fed A's (same tokens, same labels):
  the part of the loss that comes from the features, not the vocab.
Without target A it says which numbers it cannot give (drift, realign, gap) and gives the rest.

Where the targets run (`backend`): `hf` loads each in transformers here (float32); `vllm` never does. There each
target's aux and final states come from vLLM's offline engine, extracted as the features stage extracts them
(stages/common/engines/vllm_states.py; its log is `engine_b.log`, `engine_a.log`), and its token embeddings and
lm_head are read from its folder, the TTT signals computed from the final states a vocab chunk at a time, as a
fine-tune on cached features computes them.

    python -m stages.diagnose drafter=REMAPPED target=B target_a=A data=CHATS vocab_map=MAP out=DIR
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch
from omegaconf import DictConfig

from stages.common.drafter import drift
from stages.common.contract.artifacts import StagedOutput, read_manifest, staged_output
from stages.common.data.chat import load_tokenizer, tokenized_chats
from stages.common.drafter.eagle3 import Eagle3Drafter
from stages.common.contract.errors import RegraftError
from stages.common.contract.stage import StageResult, stage_main
from stages.common.drafter.config import OUTPUT_OF_LAYER, convert_aux_layer_ids
from stages.common.drafter.target import TargetFeatures, TargetHead, TargetModel, TargetSignals
from stages.common.drafter.ttt import draft_vocab_ids, ttt_forward
from stages.common.drafter.verifier import Verifier
from stages.common.drafter.vocab import VocabMap, load_vocab_map
from stages.common.engines.vllm_states import OfflineStates
from stages.schemas.diagnose import Backend

INITS = ("as_is", "remap", "realign", "scratch")


def source_drafter(remapped: str, training_map: VocabMap) -> Optional[Eagle3Drafter]:
    """The remap's own source drafter, read through the training map as it is (what init=as_is trains)."""
    source = ((read_manifest(remapped) or {}).get("config") or {}).get("drafter")
    if not source or not Path(source).exists():
        return None
    drafter = Eagle3Drafter.from_checkpoint(source, dtype=torch.float32)
    if drafter.config.draft_vocab_size != training_map.draft_vocab_size:
        return None
    drafter.set_vocab_map(training_map)
    return drafter.eval()


def scratch_drafter(template: Eagle3Drafter, training_map: VocabMap, target: str, seed: int) -> Eagle3Drafter:
    """A fresh drafter of the same shape, lm_head rows from the verifier, as finetune's init=scratch starts."""
    drafter = Eagle3Drafter.initialised(replace(template.config), training_map, seed=seed)
    verifier = Verifier.open(target)
    if verifier.hidden_size == drafter.config.hidden_size:
        with torch.no_grad():
            drafter.lm_head.weight.copy_(verifier.lm_head_rows(training_map.target_ids).float())
    return drafter.eval()


@dataclass
class Measured:
    """A target as diagnose reads it: its states over the rows (with the TTT signals where draft ids were given), and
    its token embeddings (what the drafter reads, and the table the embedding map is fitted on)."""

    features: TargetFeatures
    embed: Callable[[torch.Tensor], torch.Tensor]
    embeddings: torch.Tensor  # [V, H]


def measured(cfg: DictConfig, path: str, ids: list[int], convention: str, rows: dict,
             draft_ids: Optional[torch.Tensor], staged: StagedOutput, name: str) -> Measured:
    """One target over the rows, where `backend` runs it (the module docstring)."""
    if Backend(cfg.backend) is Backend.hf:
        target = TargetModel.load(path, ids, convention, trust_remote_code=cfg.trust_remote_code)
        return Measured(target.batch_features(rows, draft_ids=draft_ids), target.embed,
                        target.model.get_input_embeddings().weight)
    head = TargetHead(path)
    with OfflineStates(cfg.vllm, path, convert_aux_layer_ids(ids, convention, OUTPUT_OF_LAYER),
                       connector=cfg.vllm_connector, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code,
                       max_length=cfg.max_length, log_path=staged.path / f"engine_{name}.log",
                       spill=staged.path / f"engine_states_{name}") as states:
        aux, last = states.batch_states(rows)
        staged.update(**states.engine.provenance())
    signals = None if draft_ids is None else TargetSignals.from_hidden(last, head.lm_head, draft_ids)
    return Measured(TargetFeatures(aux_hidden=aux.float(), last_hidden=last.float(), signals=signals), head.embed,
                    head.embedding.weight)


def step0(drafter: Eagle3Drafter, embed, rows: dict, features: TargetFeatures, aux: torch.Tensor,
          cfg: DictConfig) -> dict[str, float]:
    with torch.no_grad():
        stats = ttt_forward(drafter, embed, rows["input_ids"], rows["loss_mask"], aux, features.signals,
                            cfg.ttt_steps, cfg.loss_mask)
    metrics = stats.metrics()
    return {"loss": metrics["loss_0"], "acc": metrics["full_acc_0"]}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (layers, starts) = plt.subplots(1, 2, figsize=(9, 3.4))
    if report["layers"]:
        names = [str(row["layer"]) for row in report["layers"]]
        width = 0.27
        for offset, key in enumerate(("cka", "r2_identity", "r2_linear")):
            layers.bar([i + (offset - 1) * width for i in range(len(names))],
                       [row[key] for row in report["layers"]], width, label=key)
        layers.set(xticks=range(len(names)), xticklabels=names, xlabel="aux layer", ylim=(min(0, *[
            row["r2_identity"] for row in report["layers"]]), 1.05), title="target drift, per aux layer")
        layers.legend(fontsize=7)
    else:
        layers.text(0.5, 0.5, "no target A: no drift numbers", ha="center")
    inits = [name for name in INITS if name in report["step0"]]
    starts.bar(inits, [report["step0"][name]["loss"] for name in inits], color="tab:orange")
    starts.set(ylabel="step-0 loss (held-out rows)", title="where a fine-tune would start")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def run(cfg: DictConfig) -> StageResult:
    training_map = load_vocab_map(cfg.vocab_map)
    remapped = Eagle3Drafter.from_checkpoint(cfg.drafter, dtype=torch.float32).eval()
    if remapped.vocab_map().draft_vocab_size != training_map.draft_vocab_size:
        raise RegraftError(cfg.drafter, "the drafter's draft vocab is not the training map's size",
                           "give diagnose the remap stage's output")
    rows = tokenized_chats(load_tokenizer(cfg.target, cfg.trust_remote_code), Path(cfg.data), cfg.max_length)
    rows = {name: tensor[: cfg.max_rows] for name, tensor in rows.items()}
    with staged_output(cfg.out, "diagnose", cfg) as staged:
        report, realigned = diagnosed(cfg, remapped, training_map, rows, staged)
        metrics = headline_metrics(report)
        (staged.path / "diagnose.json").write_text(json.dumps(report, indent=2))
        plot(report, staged.path / "diagnose.png")
        if realigned is not None:
            realigned.save(staged.path / "realigned", layout="sglang")
        staged.update(metrics=metrics, headline=headline(report))
    return StageResult(Path(cfg.out), metrics, headline(report))


def diagnosed(cfg: DictConfig, remapped: Eagle3Drafter, training_map: VocabMap, rows: dict,
              staged: StagedOutput) -> tuple[dict, Optional[Eagle3Drafter]]:
    """The report (drift per layer, step-0 starts, the transfer gap) and the re-aligned drafter (None without A)."""
    ids, convention = remapped.config.aux_layer_ids, remapped.config.aux_convention
    split = max(1, int(rows["input_ids"].shape[0] * cfg.fit_share))
    held = {name: tensor[split:] for name, tensor in rows.items()}
    b = measured(cfg, cfg.target, ids, convention, rows, draft_vocab_ids(remapped), staged, "b")
    fb = b.features
    held_b = TargetFeatures(aux_hidden=fb.aux_hidden[split:], signals=type(fb.signals)(
        fb.signals.argmax[split:], fb.signals.draft_logits[split:]))
    drafters = {"remap": remapped, "scratch": scratch_drafter(remapped, training_map, cfg.target, cfg.seed)}
    if (as_is := source_drafter(cfg.drafter, training_map)) is not None:
        drafters["as_is"] = as_is
    report: dict = {"family": remapped.config.describe(), "layers": [], "step0": {}, "missing": []}
    realigned = None
    if cfg.target_a:
        a = measured(cfg, cfg.target_a, ids, convention, rows, None, staged, "a")
        fa = a.features
        fitted = rows["attention_mask"][:split].bool()
        real = rows["attention_mask"].bool()
        layer_drift, _ = drift.measure(fa.aux_hidden[real], fb.aux_hidden[real], ids, ridge=cfg.ridge,
                                       fit_share=int(fitted.sum()) / int(real.sum()))
        _, maps = drift.measure(*(drift.as_maps_read(remapped, f.aux_hidden[:split][fitted]) for f in (fa, fb)), ids,
                                ridge=cfg.ridge)
        embed_map = drift.fit_embedding_map(a.embeddings, b.embeddings, remapped.config.rms_norm_eps,
                                            cfg.ridge) if cfg.realign_embeddings else None
        realigned = drafters["realign"] = drift.realigned(remapped, maps, embed_map)
        report["layers"] = [d.as_dict() for d in layer_drift]
        report["remap_on_target_a"] = step0(remapped, a.embed, held, held_b, fa.aux_hidden[split:], cfg)
    else:
        report["missing"] = ["per-layer drift (CKA, shift, R^2)", "realign", "transfer gap"]
    for name in INITS:
        if name in drafters:
            report["step0"][name] = step0(drafters[name], b.embed, held, held_b, held_b.aux_hidden, cfg)
    if "remap_on_target_a" in report:
        report["transfer_gap"] = report["step0"]["remap"]["loss"] - report["remap_on_target_a"]["loss"]
    return report, realigned


def headline_metrics(report: dict) -> dict[str, float]:
    # held-out rows, before any training: not the guard's `preflight/loss_0` (TTT step 0 on the first training batch)
    metrics = {f"heldout_loss_0_{name}": values["loss"] for name, values in report["step0"].items()}
    metrics.update({f"heldout_full_acc_0_{name}": values["acc"] for name, values in report["step0"].items()})
    for row in report["layers"]:
        metrics.update({f"cka_layer{row['layer']}": row["cka"], f"r2_linear_layer{row['layer']}": row["r2_linear"]})
    if report["layers"]:
        metrics["cka_mean"] = sum(row["cka"] for row in report["layers"]) / len(report["layers"])
    if "transfer_gap" in report:
        metrics["transfer_gap"] = report["transfer_gap"]
    return metrics


def headline(report: dict) -> str:
    loss = report["step0"]
    starts = ", ".join(f"{name} {loss[name]['loss']:.2f}" for name in INITS if name in loss)
    family = f"{report['family']}: " if "family" in report else ""
    if "transfer_gap" not in report:
        return f"{family}step-0 loss {starts}; no target A: no drift numbers"
    cka = sum(row["cka"] for row in report["layers"]) / len(report["layers"])
    return f"{family}step-0 loss {starts}; CKA(A,B) {cka:.2f}, transfer gap {report['transfer_gap']:+.2f}"


if __name__ == "__main__":
    raise SystemExit(stage_main("diagnose", run))
