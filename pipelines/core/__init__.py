"""The pipeline's core: every stage registered once (registry.py), stages as nodes of a DAG (dag.py), their cache
keys and outputs (cache.py), what one job runs (jobs.py), the scheduler that reuses, dispatches and tracks each node
(runner.py), the running jobs' lines on the terminal (progress.py), and the data a run reads, named sets made chat
files before any stage (data_sets.py). It knows nothing of where jobs run or of MLflow: the runner takes a launcher
and a tracker through the protocols in runner.py.

May import: nothing else of pipelines.
"""
