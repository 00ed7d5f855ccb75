"""`regraft ... pipeline.plan=true`: the run as it would go, checked and costed, with no stage run.

Every check the pipeline makes before any work, all of them (not the first problem only); the DAG with each node's
cache state (hit: a complete output is there; run: it would be computed), what its stage holds (GPUs, ranks, a
server) on a node of `launcher.node_gpus` GPUs (and where that count came from) and its job's resources on the
chosen launcher; and per node the estimates of pipelines/modes/estimates.py, with their totals. It writes `plan.json` in
the run folder and, with `launcher=slurm`, `plan/<node>.sbatch`: the batch script each job would be submitted with
(its `--dependency` left out, as the upstream jobs have no ids yet; plan.json lists them). No stage output, no
MLflow run. It needs no Slurm here: the batch scripts are written on any machine. Exit 0 when every check passes, 1
when any does not.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from pipelines.core.cache import keys_for, output_dir
from pipelines.core.dag import Node, build_nodes, resolve, training_data
from pipelines.core.runner import pending
from pipelines.launch.base import Launcher
from pipelines.launch.make import make_launcher
from pipelines.launch.slurm import SlurmLauncher
from pipelines.modes import estimates
from pipelines.modes.estimates import Estimate, PlanContext, device_rate, estimate
from pipelines.modes.preflight import problems_before_any_work
from pipelines.core.data_sets import dataset_line, settle_data
from stages.common.contract.errors import RegraftError
from stages.common.contract.hardware import MEMORY_HEADROOM, Holds


def plan_context(cfg: DictConfig, outputs: dict[str, Path]) -> tuple[PlanContext, str]:
    rate, rate_note = None, f"no device rate: plan.device={cfg.plan.device} is not one of plan.devices"
    if cfg.plan.device in cfg.plan.devices:  # else a problem the checks listed
        rate, rate_note = device_rate(cfg.plan, cfg.launcher.threads)
    paths = resolve(OmegaConf.create({"data": training_data(cfg), "source": cfg.source.path}), outputs)
    gpu = cfg.plan.device in cfg.plan.devices and bool(cfg.plan.devices[cfg.plan.device].get("memory_gb"))
    return PlanContext(rate=rate, data=paths.data, source=paths.source,
                       draft_vocab_size=int(cfg.vocab_map.draft_vocab_size),
                       sample_rows=int(cfg.plan.sample_rows), on_gpus=gpu), rate_note


def resources_of(launcher: Launcher, node: Node) -> dict[str, Any]:
    """The job's submitit parameters (inline: none, it runs in this process)."""
    if launcher.cfg.name == "inline":
        return {}
    return {key: value for key, value in launcher.resources(node).items() if value not in (None, {}, [])}


def job_shape(launcher_name: str, resources: dict[str, Any]) -> str:
    """A job's resources in a few characters: `2x8 8g 12c 24h` is 2 nodes x 8 tasks, 8 GPUs a node and 12 CPUs a
    task, 24 h; locally `local 8g`: a job on 8 of this machine's GPUs."""
    gpus = f" {resources['gpus_per_node']}g" if resources.get("gpus_per_node") else ""
    if launcher_name != "slurm":
        return {"inline": "inline", "local": "local" + gpus}.get(launcher_name, launcher_name)
    shape = f"{resources.get('nodes', 1)}x{resources.get('tasks_per_node', 1)}" + gpus
    if resources.get("cpus_per_task"):
        shape += f" {resources['cpus_per_task']}c"
    minutes = resources.get("timeout_min")
    return shape + (f" {minutes / 60:g}h" if minutes else "")


def batch_script(launcher: SlurmLauncher, node: Node, config: dict[str, Any]) -> str:
    """The sbatch script submitit would write for this node's job (what `submit` hands to sbatch, but for the
    dependency, which needs the upstream jobs' ids)."""
    from pipelines.core.jobs import resumable

    resources = launcher.resources(node)
    if resumable(config):
        resources["additional_parameters"] = {"requeue": True, **(resources.get("additional_parameters") or {})}
    executor = launcher.executor(node, [], resources)
    return executor._make_submission_file_text("<submitit's python -m submitit.core._submit FOLDER>",
                                               "plan")  # noqa: SLF001 (submitit has no public form)


def slurm_notes() -> list[str]:
    from pipelines.launch.slurm_jobs import missing_commands

    missing = missing_commands()
    return [f"Slurm's commands are not on this machine ({', '.join(missing)}): the batch scripts are written here, "
            "the run must start where sbatch is"] if missing else []


def node_row(node: Node, hit: bool, holds: Holds, resources: dict[str, Any], figures: Estimate) -> dict[str, Any]:
    return {"node": node.name, "stage": node.stage, "phase": node.phase, "cached": hit, "after": node.upstream,
            "holds": asdict(holds), "resources": resources, **figures.as_dict()}


def node_gpus_line(launcher: Launcher) -> str:
    gpus = launcher.node_gpus()
    return f"node GPUs: {gpus.count} ({gpus.said})"


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Sums over the nodes that would run (a hit costs nothing); a figure is a lower bound when a node's is unknown."""
    running = [row for row in rows if not row["cached"]]
    out: dict[str, Any] = {}
    for key, name in (("gpu_hours", "gpu_hours"), ("feature_bytes", "feature_bytes"),
                      ("checkpoint_bytes", "checkpoint_bytes")):
        known = [row[key] for row in running if row[key] is not None]
        out[name] = sum(known)
        out[f"{name}_unknown_for"] = [row["node"] for row in running if row[key] is None and
                                      (key == "gpu_hours" or row["stage"] in BYTES_OF[key])]
    out["bytes"] = out["feature_bytes"] + out["checkpoint_bytes"]
    return out


RACE_NOTE = ("pipeline.race: the rungs are decided as the race runs, so this is the DAG before it, with one "
             "fine-tune; the race trains len(race.inits) x len(race.lrs) candidates, at most race.budget_steps each")
BYTES_OF = {"feature_bytes": {"features"}, "checkpoint_bytes": {"finetune"}}


def human_bytes(value: int | None) -> str:
    if value is None:
        return "?"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value} B"


def device_time(value: float | None) -> str:
    """Hours as a reader budgets them: `9.02 h`, `41 s`, `0`; `?` when unknown."""
    if value is None:
        return "?"
    if not value:
        return "0"
    return f"{value:.3g} h" if value >= 0.1 else f"{value * 3600:.2g} s"


def plan_table(rows: list[dict[str, Any]], total: dict[str, Any], device: str, launcher: str) -> Table:
    table = Table(title="plan: nothing has run", title_justify="left")
    for column in ("node", "cache", "job", "tokens", "features", "ckpts", f"on {device}"):
        table.add_column(column, overflow="fold", justify="left" if column in ("node", "cache", "job") else "right",
                         no_wrap=column in ("node", "job"))  # what a reader looks a row up by stays whole
    for row in rows:
        table.add_row(row["node"], "hit" if row["cached"] else "run", job_shape(launcher, row["resources"]),
                      f"{row['tokens']:,}" if row["tokens"] is not None else "",
                      human_bytes(row["feature_bytes"]) if row["stage"] == "features" else "",
                      human_bytes(row["checkpoint_bytes"]) if row["stage"] == "finetune" else "",
                      device_time(row["gpu_hours"]))
    def at_least(key: str, shown: str) -> str:  # a sum with unknown parts is a lower bound
        if not total[f"{key}_unknown_for"]:
            return shown
        return "?" if not total[key] else f">= {shown}"

    table.add_row("to run", "", "", "", at_least("feature_bytes", human_bytes(total["feature_bytes"])),
                  at_least("checkpoint_bytes", human_bytes(total["checkpoint_bytes"])),
                  at_least("gpu_hours", device_time(total["gpu_hours"])), end_section=True)
    return table


def print_whole(console: Console, table: Table) -> None:
    """A table at its natural width where the output is no terminal (a log, a pipe: rich would fold it into 80
    columns); a terminal gets it at the terminal's width."""
    from rich.measure import Measurement

    natural = Measurement.get(console, console.options.update_width(10 ** 4), table).maximum
    if console.is_terminal or natural <= console.width:
        console.print(table)
    else:  # a console prints no wider than its own width
        Console(file=console.file, width=natural, no_color=console.no_color).print(table)


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    temporary.replace(path)


def gpu_bytes_for_training(config: DictConfig, memory_gb: float) -> tuple[float, str]:
    """What a fine-tune rank may use of one GPU: all of it, less an online server's share where the stage starts
    that server on the same GPUs (engine.vllm.gpu_memory_utilization)."""
    engine = config.get("engine")
    if engine is not None and engine.enabled and not engine.server_url:
        share = float(engine.vllm.gpu_memory_utilization)
        return memory_gb * 1e9 * (1 - share), f", less the online server's {share:g}"
    return memory_gb * 1e9, ""


def memory_problems(node: Node, config: DictConfig, figures: Estimate, plan: DictConfig) -> list[str]:
    """A fine-tune whose rank's peak (stages/common/drafter/memory.py) does not fit one GPU of plan.device."""
    memory_gb = plan.devices[plan.device].get("memory_gb") if plan.device in plan.devices else None
    if not memory_gb or not figures.rank_memory:
        return []
    usable, less = gpu_bytes_for_training(config, float(memory_gb))
    needed = figures.rank_memory["total"]
    if needed <= (1 - MEMORY_HEADROOM) * usable:
        return []
    parts = ", ".join(f"{name.replace('_', ' ')} {value / 1e9:.1f}" for name, value in figures.rank_memory.items()
                      if name != "total")
    return [str(RegraftError(node.name, f"a rank needs {needed / 1e9:.1f} GB at its peak ({parts} GB), over one "
                             f"{plan.device}'s {memory_gb:g} GB{less}, {MEMORY_HEADROOM:.0%} kept free",
                             f"lower {node.stage}.micro_batch_size or {node.stage}.max_length, or raise "
                             f"{node.stage}.deepspeed.zero_stage"))]


def plan_pipeline(cfg: DictConfig, run_dir: Path, console: Console) -> dict[str, Any]:
    """The plan of this config: checked, its DAG with cache states, resources and estimates; written to
    `run_dir/plan.json` (and the Slurm batch scripts). Returns what plan.json holds."""
    estimates.COUNTS_FOLDER = Path(cfg.paths.outputs) / "estimates"
    datasets = settle_data(cfg, fetch=False)  # by name; fetched by the run, not the plan
    nodes = build_nodes(cfg)
    launcher = make_launcher(cfg.launcher, run_dir / "jobs")
    problems = problems_before_any_work(cfg, nodes, launcher)
    keys = keys_for(nodes)
    cache = Path(cfg.paths.cache)
    outputs = {node.name: output_dir(cache, node.stage, keys[node.name]) for node in nodes}
    will_run = {node.name for node in pending(nodes, keys, cache)}
    context, rate_note = plan_context(cfg, outputs)
    rows, scripts = [], {}
    for node in nodes:
        config = resolve(node.config, outputs)
        config.out = str(outputs[node.name])
        figures = estimate(node.stage, config, context)
        rows.append(node_row(node, node.name not in will_run, launcher.holds(node), resources_of(launcher, node),
                             figures))
        if node.name in will_run:
            problems += memory_problems(node, config, figures, cfg.plan)
        if isinstance(launcher, SlurmLauncher) and node.name in will_run:
            scripts[node.name] = batch_script(launcher, node, OmegaConf.to_container(config, resolve=True))
    gpus = launcher.node_gpus()
    plan = {"problems": problems, "device": cfg.plan.device, "rate": rate_note,
            "node_gpus": {"count": gpus.count, "known": gpus.known, "from": gpus.said}, "nodes": rows,
            "totals": totals(rows), "datasets": datasets, "batch_scripts": {}, "notes": []}
    if cfg.pipeline.race:
        plan["notes"].append(RACE_NOTE)
    if isinstance(launcher, SlurmLauncher):
        plan["notes"] += slurm_notes()
    for name, text in scripts.items():
        path = run_dir / "plan" / f"{name}.sbatch"
        write_atomically(path, text)
        plan["batch_scripts"][name] = str(path)
    write_atomically(run_dir / "plan.json", json.dumps(plan, indent=2))
    print_whole(console, plan_table(rows, plan["totals"], cfg.plan.device, cfg.launcher.name))
    for entry in datasets:
        console.print(f"data: {dataset_line(entry)}", highlight=False, soft_wrap=True)
    console.print(node_gpus_line(launcher), highlight=False, soft_wrap=True)
    console.print(f"device time: FLOPs over {rate_note}; plan.json has GPU-hours per node", highlight=False,
                  soft_wrap=True)
    unknown = sorted({name for key in ("gpu_hours", "feature_bytes", "checkpoint_bytes")
                      for name in plan["totals"][f"{key}_unknown_for"]})
    if unknown:
        console.print(f"not known before they run ({', '.join(unknown)}): plan.json says why", highlight=False,
                      soft_wrap=True)
    for note in plan["notes"]:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
    if scripts:
        console.print(f"batch scripts: {run_dir / 'plan'} ({len(scripts)})", highlight=False)
    for problem in problems:
        console.print(f"[red]problem:[/red] {problem}", highlight=False, soft_wrap=True)
    console.print(f"plan: {run_dir / 'plan.json'}", highlight=False)
    return plan
