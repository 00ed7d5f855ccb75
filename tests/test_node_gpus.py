"""The GPUs of a node (pipelines/launch/node_gpus.py): launcher.node_gpus, this machine's count, sinfo's gres of a
partition (a fake `sinfo` on PATH here), and the pool that hands a local job's GPU ids out and takes them back."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from pipelines.launch.node_gpus import GpuPool, gres_gpus, partition_gpus, slurm_node, this_machine

SINFO = "debug*|(null)\ngpu|gpu:h100:8(S:0-1)\ngpu|gpu:h100:4(S:0)\nmixed|gpu:a100:4,gpu:v100:2,shard:16\n"


def fake_sinfo(folder: Path, output: str, code: int = 0) -> None:
    """A `sinfo` on PATH that prints `output` and exits with `code`, as Slurm's would for `-h -o %P|%G`."""
    script = folder / "sinfo"
    script.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write({output!r})\nsys.exit({code})\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def test_gres_fields_count_every_gpu_of_a_node():
    assert [gres_gpus(gres) for gres in ("gpu:8", "gpu:b200:8", "gpu:h100:8(S:0-1)", "gpu:a100:4,gpu:v100:2",
                                         "gpu:8(S:0,1),shard:16", "(null)", "shard:16", "")] == [8, 8, 8, 6, 8, 0, 0, 0]


def test_a_partition_is_read_by_its_largest_node_and_the_default_one_when_none_is_named():
    assert partition_gpus(SINFO, "gpu") == (8, "sinfo: partition gpu, gres gpu:h100:8(S:0-1)")
    assert partition_gpus(SINFO, "mixed") == (6, "sinfo: partition mixed, gres gpu:a100:4,gpu:v100:2,shard:16")
    assert partition_gpus(SINFO, None) == (0, "sinfo: partition debug, gres (null)")  # the default: CPU nodes
    assert partition_gpus(SINFO, "nowhere") is None
    assert partition_gpus(SINFO.replace("debug*", "debug"), None) is None  # no default partition listed


def test_slurm_node_is_the_setting_else_sinfo_else_zero_and_not_known(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert slurm_node(4, "gpu") == slurm_node(4, None)  # the setting, sinfo never asked
    assert (slurm_node(4, "gpu").count, slurm_node(4, "gpu").known, slurm_node(4, "gpu").said) == \
        (4, True, "launcher.node_gpus")
    absent = slurm_node(None, "gpu")  # no sinfo on PATH
    assert (absent.count, absent.known) == (0, False) and "sinfo did not answer for partition gpu" in absent.said
    fake_sinfo(tmp_path, SINFO)
    read = slurm_node(None, "gpu")
    assert (read.count, read.known, read.said) == (8, True, "sinfo: partition gpu, gres gpu:h100:8(S:0-1)")
    assert (slurm_node(None, None).count, slurm_node(None, None).known) == (0, True)  # default partition: CPU nodes
    fake_sinfo(tmp_path, "", code=1)  # sinfo there, no controller to ask
    failed = slurm_node(None, None)
    assert (failed.count, failed.known) == (0, False) and "the default partition" in failed.said


def test_this_machine_counts_what_cuda_visible_devices_shows_or_takes_the_setting(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,GPU-8a1f")
    counted = this_machine(None)
    assert (counted.count, counted.ids, counted.said) == (3, ("2", "3", "GPU-8a1f"),
                                                         "counted here by CUDA_VISIBLE_DEVICES")
    assert (this_machine(2).count, this_machine(2).ids, this_machine(2).said) == (2, ("2", "3"), "launcher.node_gpus")
    assert this_machine(5).ids == ("2", "3", "GPU-8a1f")  # fewer than said: the launcher's check_machine refuses it
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert (this_machine(None).count, this_machine(None).ids) == (0, ())


class Job:
    def __init__(self):
        self.ended = False

    def done(self) -> bool:
        return self.ended


def test_the_pool_gives_each_job_free_ids_and_takes_them_back_when_it_ends():
    pool, first, second = GpuPool(("0", "1", "2")), Job(), Job()
    pool.hold(first, ("0", "1"))
    assert pool.free() == ["2"]
    pool.hold(second, ("2",))
    assert pool.free() == []
    first.ended = True
    assert pool.free() == ["0", "1"]
    pool.hold(Job(), ())  # a job that holds none takes nothing
    assert pool.free() == ["0", "1"]


@pytest.mark.skipif(os.environ.get("CUDA_VISIBLE_DEVICES") is not None, reason="counts /dev/nvidia* only without it")
def test_without_cuda_visible_devices_the_device_nodes_are_counted(monkeypatch):
    from stages.common.contract.hardware import visible_gpu_ids

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    counted = this_machine(None)
    assert counted.count == len(visible_gpu_ids()) and counted.said == "counted here by /dev/nvidia*"
