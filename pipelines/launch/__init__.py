"""Where stage jobs run: what every launcher is (base.py), `launcher=inline|local|slurm` (inline.py, local.py,
slurm.py, picked by make.py), Slurm's job states and batch scripts (slurm_jobs.py), a node's GPUs (node_gpus.py),
and the local jobs' warm interpreter (warm/).

May import: pipelines.core.
"""
