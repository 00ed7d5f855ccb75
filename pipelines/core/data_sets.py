"""The run's data as chat JSONL paths before anything else reads the config: every named set of `data.train` and
`data.eval_sets` (stages/common/data/named.py) resolved, and, for a run, materialised once into the cache.

    listed = settle_data(cfg, fetch=True)   # cfg.data.* now paths; listed: each named set, its source and its file

A name no registry knows, or a dataset that cannot be loaded (not in `datasets`' cache under HF_DATASETS_OFFLINE=1),
stops here with one line, before any stage runs. `pipeline.plan=true` fetches nothing: it lists each set by name,
and a set not materialised yet is fetched at the run's start.
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from stages.common.data.chat_prompts import EvalSet
from stages.common.data.named import SetSpec, describe, materialise, target


def settle_data(cfg: DictConfig, fetch: bool = True) -> list[dict]:
    """Rewrite cfg.data.train and cfg.data.eval_sets to paths (`{name, path}` for each eval set); returns the named
    sets, each as plan.json lists it. Every entry is described first, so an unknown name stops before any load."""
    cache = Path(str(cfg.paths.cache))
    train = describe(cfg.data.train, "data.train")
    sets = [describe(entry, "data.eval_sets") for entry in cfg.data.eval_sets]
    listed: list[dict] = []

    def path_of(spec: SetSpec, eval_set: bool, key: str) -> str:
        if spec.path is not None:
            return spec.path
        path = materialise(spec, cache, eval_set, key) if fetch else target(spec, cache, eval_set)
        listed.append({"setting": key, "name": spec.name, "dataset": spec.dataset, "subset": spec.subset,
                       "split": spec.split, "format": spec.format, "column": spec.column, "limit": spec.limit,
                       "source": spec.source, "path": str(path), "materialised": path.exists()})
        return str(path)

    if train.path is None:
        with open_dict(cfg):
            cfg.data.train = path_of(train, False, "data.train")
    with open_dict(cfg):
        # typed entries: probe.eval_sets (list[EvalSet]) takes them through ${data.eval_sets} when a sweep member's
        # config is resolved in place, where the plain mappings data.eval_sets (list[Any]) holds are refused
        cfg.data.eval_sets = [OmegaConf.structured(EvalSet(spec.name, path_of(spec, True, "data.eval_sets")))
                              for spec in sets]
    return listed


def unfetched(value: str, cfg: DictConfig) -> bool:
    """A named set's file that a plan lists but the run makes first (pipelines/modes/preflight.py does not ask for
    it)."""
    path = Path(str(value))
    return path.parent.parent == Path(str(cfg.paths.cache)) / "datasets" and not path.exists()


def dataset_line(entry: dict) -> str:
    """`data.eval_sets gsm8k: openai/gsm8k main/test, question -> user turns (materialised)`: what plan prints."""
    subset = f"{entry['subset']}/" if entry["subset"] else ""
    reads = entry["column"] or {"turns": "prompt/turns", "sharegpt": "conversations", "messages": "messages"}.get(
        entry["format"], entry["format"])
    limit = f", first {entry['limit']} rows" if entry["limit"] else ""
    state = "materialised" if entry["materialised"] else "fetched at the run's start"
    return f"{entry['setting']} {entry['name']}: {entry['dataset']} {subset}{entry['split']}, {reads}{limit} ({state})"
