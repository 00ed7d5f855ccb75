"""The orchestration: how stages are chained, cached, dispatched and tracked (no stage knows of it; docs/code.md).

Here: the command and its config (regraft.py, the command; pipeline.py, one run; sweep.py, a sweep as one DAG;
schema.py, the typed root config; config_errors.py, a config that does not compose). Below them, one package each:
core/ (the DAG, the cache, a job, the runner), launch/ (where jobs run), tracking/ (MLflow), modes/ (the race, the
plan and the checks before any work), report/ (the summary). Each package's docstring says what it may import
(tests/test_layout.py holds the rules: no circle, no import up).

May import: pipelines.core, pipelines.launch, pipelines.tracking, pipelines.modes, pipelines.report.
"""
