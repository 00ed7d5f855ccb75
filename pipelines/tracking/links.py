"""Links into MLflow's UI: the runs table of every pipeline's parent run (or one sweep's), filtered, sorted and with
the headline columns set, and a run's page, both in the classic (machine learning) view; the UI's port."""
from __future__ import annotations

import hashlib
import json
from typing import Any

from omegaconf import DictConfig

from pipelines.tracking.store import set_experiment_tag


# The runs table's columns for "which member won": the accept lengths beside the run's name and overrides
WINNER_COLUMNS = ("phase1/accept_len", "phase0/accept_len", "scratch/accept_len", "gain/over_scratch")
SHARED_VIEW_TAG = "mlflow.sharedViewState."  # MLflow's UI reads a shared view (filter, sort, columns) from this tag
UI_PORT = 5000  # `mlflow ui`'s default, said in the printed command so that the command and the links name one address
UI_ADDRESS = f"http://127.0.0.1:{UI_PORT}"


# MLflow's table gives a metric column 100 px, about 12 characters of its name (`phase1/accep`); the shared view
# widens the link's columns to their whole name: 9 px a character and room for the column's menu
COLUMN_PX_PER_CHARACTER, COLUMN_PX_MENU = 9, 24
# MLflow 3's UI opens a page in GenAI mode unless its URL says otherwise or the browser's sidebar switch was set to
# "Model training" (remembered in the browser's local storage); the experiment's kind tag is not read for it
CLASSIC = "workflowType=machine_learning"


def runs_view(sweep: str | None) -> dict[str, Any]:
    """What MLflow's runs table opens on: the parent runs (of one sweep), best phase 1 first, the headline columns
    first and wide enough for their names."""
    where = "tags.kind = 'pipeline'" + (f" and tags.sweep = '{sweep}'" if sweep else "")
    columns = [f"metrics.`{name}`" for name in WINNER_COLUMNS]
    return {"searchFilter": where, "orderByKey": "metrics.`phase1/accept_len`", "orderByAsc": False,
            "startTime": "ALL", "lifecycleFilter": "Active", "datasetsFilter": [], "modelVersionFilter": "All Runs",
            "selectedColumns": ["attributes.`Run Name`", *columns],
            "columnOrder": ["attributes.`Run Name`", *columns],
            "columnWidths": {column: COLUMN_PX_PER_CHARACTER * len(name) + COLUMN_PX_MENU
                             for column, name in zip(columns, WINNER_COLUMNS)},
            "runsExpanded": {}, "runsPinned": [], "runsHidden": []}


def runs_link(client: Any, experiment_id: str, cfg: DictConfig, sweep: str | None) -> str:
    """One link to the runs table filtered, sorted and with columns set: the view is kept as an experiment tag that
    the UI reads by its key (MLflow's own "share view"), as filter and sort alone could be in the URL but the
    columns cannot."""
    key = "regraft-" + hashlib.sha256((sweep or "all").encode()).hexdigest()[:12]
    set_experiment_tag(client, experiment_id, SHARED_VIEW_TAG + key, json.dumps(runs_view(sweep)))
    base = cfg.uri.rstrip("/") if cfg.uri.startswith(("http://", "https://")) else UI_ADDRESS
    return f"{base}/#/experiments/{experiment_id}/runs?{CLASSIC}&viewStateShareKey={key}"


def run_link(runs: str, run_id: str) -> str:
    """A run's page, from the runs table's link (same address and experiment), in the classic (machine learning)
    view: MLflow's own links to a run page carry no `workflowType`, so they open it in GenAI mode."""
    return f"{runs.split('/runs?', 1)[0]}/runs/{run_id}?{CLASSIC}"
