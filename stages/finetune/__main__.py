"""python -m stages.finetune key=value ...: the stage alone; `--rank-config FILE`: one rank started by torchrun or
DeepSpeed's launcher (finetune.spawn), on the launching stage's resolved config."""
import sys

from stages.common.contract.stage import stage_main
from stages.finetune import RANK_FLAG, rank_main, run

if sys.argv[1:2] == [RANK_FLAG]:
    raise SystemExit(rank_main(sys.argv[2]))
raise SystemExit(stage_main("finetune", run))
