"""What a run does besides running its DAG: the race of transfer and scratch under one budget (race.py), the plan
(plan.py: `pipeline.plan=true`, with what each node will cost, estimates.py), and every check before any work
(preflight.py, which checks the composed config against pipelines/schema.py).

May import: pipelines.core, pipelines.launch, pipelines.schema.
"""
