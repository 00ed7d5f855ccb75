"""python -m stages.world out=DIR [key=value ...]: build the built-in example world alone."""
from stages.common.contract.stage import stage_main
from stages.world import run

raise SystemExit(stage_main("world", run))
