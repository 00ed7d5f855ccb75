"""Every stage's typed config, with its rules and the checks a stage asks of the machine it will run on, one module
per stage (conf/<stage>/ composes onto it). They import neither torch nor the stages' own code: the pipeline
composes, checks and plans a run from these alone (pipelines/schema.py), and each stage imports its own."""
