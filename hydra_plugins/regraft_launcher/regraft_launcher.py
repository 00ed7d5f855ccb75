"""Hydra's launcher for `regraft -m ...`: the whole sweep as one DAG (pipelines/sweep.py).

Hydra instantiates launchers only from the `hydra_plugins` package; the work is in pipelines/sweep.py.
`hydra/launcher=basic` gives Hydra's own launcher back: members one after another, each a whole run.
"""

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, configure_log, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict


@dataclass
class RegraftLauncherConf:
    _target_: str = "hydra_plugins.regraft_launcher.regraft_launcher.RegraftLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="regraft", node=RegraftLauncherConf, provider="regraft")


class RegraftLauncher(Launcher):
    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from rich.console import Console

        from pipelines.config_errors import check_group_choices
        from pipelines.core.runner import Interrupts
        from pipelines.regraft import report_and_exit
        from pipelines.sweep import plan_member, run_sweep
        from stages.common.contract.runtime import compute_as_every_cpu

        compute_as_every_cpu()  # before planning checks anything: the members' jobs compute as a single run's do
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        for number in (signal.SIGINT, signal.SIGTERM):
            signal.signal(number, Interrupts.handler)
        console = Console()
        returns: List[JobReturn] = []
        try:
            for index, overrides in enumerate(job_overrides, start=initial_job_idx):
                member_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
                check_group_choices(member_config.hydra.runtime.choices, self.hydra_context.config_loader)
                with open_dict(member_config):
                    member_config.hydra.job.id = index
                    member_config.hydra.job.num = index
                returns.append(run_job(hydra_context=self.hydra_context, task_function=plan_member,
                                       config=member_config, job_dir_key="hydra.sweep.dir",
                                       job_subdir_key="hydra.sweep.subdir"))
            members = [job.return_value for job in returns]  # a member that fails its checks raises here
            console.print(f"sweep: {len(members)} members as one DAG", highlight=False)
            run_sweep(members, sweep_dir, console)
        except BaseException as exc:  # noqa: BLE001 (KeyboardInterrupt and SystemExit included: one line, an exit code)
            report_and_exit(exc, console, sweep_dir)
        for job, member in zip(returns, members):
            job.return_value = member.summary
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return returns
