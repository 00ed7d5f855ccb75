"""`launcher=NAME` as a launcher: inline, local or slurm."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from pipelines.launch.base import Launcher
from pipelines.launch.inline import InlineLauncher
from pipelines.launch.local import LocalLauncher
from pipelines.launch.slurm import SlurmLauncher

LAUNCHERS = {"inline": InlineLauncher, "local": LocalLauncher, "slurm": SlurmLauncher}


def make_launcher(cfg: DictConfig, folder: Path) -> Launcher:
    return LAUNCHERS[cfg.name](cfg, folder)
