"""What a cache key knows of the code: every project module a stage runs, and the layout rule that keeps it honest
(stages/common is a library of no stage; no stage imports another)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.core import cache

STAGES = sorted(p.stem for p in (cache.ROOT / "stages").iterdir()
                if p.name not in ("common", "schemas", "__init__.py", "__pycache__") and (p.suffix == ".py" or p.is_dir()))
COMMON = sorted(".".join(p.relative_to(cache.ROOT).with_suffix("").parts)
                for p in (cache.ROOT / "stages" / "common").rglob("*.py") if p.stem != "__init__")


def test_the_stages_are_the_ones_the_pipeline_runs():
    assert STAGES == ["compare", "diagnose", "features", "finetune", "probe", "regenerate", "remap", "vocab_map", "world"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_runs_no_other_stages_code(stage):
    others = {name for name in cache.project_modules(f"stages.{stage}")
              if name not in ("stages", "stages.schemas", f"stages.schemas.{stage}")
              and name.split(".")[1] not in ("common", stage)}
    assert not others, f"stages.{stage} imports {sorted(others)}: move what they share into stages/common"


@pytest.mark.parametrize("stage", STAGES)
def test_a_schema_imports_only_the_library_and_never_torch(stage):
    """The pipeline composes, checks and plans from the schemas alone: none pulls in a stage's code or torch."""
    module = f"stages.schemas.{stage}"
    outside = {name for name in cache.project_modules(module)
               if name not in ("stages", "stages.schemas", module) and not name.startswith("stages.common")}
    assert not outside, f"{module} imports {sorted(outside)}"
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=cache.ROOT).returncode == 0, f"{module} imports torch"


@pytest.mark.parametrize("module", COMMON)
def test_the_library_imports_no_stage(module):
    outside = {name for name in cache.project_modules(module) if name not in ("stages", "stages.common")
               and not name.startswith("stages.common.")}
    assert not outside, f"{module} imports {sorted(outside)}"


PIPELINES = sorted((cache.ROOT / "pipelines").rglob("*.py"))


@pytest.mark.parametrize("path", PIPELINES, ids=lambda path: str(path.relative_to(cache.ROOT / "pipelines")))
def test_no_pipeline_module_but_the_schema_registry_imports_a_stage(path):
    """A stage's own checks are its hook (check_before_work, check_ranks), not a pipelines/ import of it (the rules
    between pipelines/' own packages: tests/test_layout.py)."""
    if path == cache.ROOT / "pipelines" / "schema.py":  # the registry: one line per stage's config
        return
    parts = path.relative_to(cache.ROOT).with_suffix("").parts
    direct = cache.imported_names(path, ".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    stages = {name for name in direct if name.startswith("stages.") and name.split(".")[1] in STAGES}
    assert not stages, f"{path.name} imports {sorted(stages)}"


def test_lazy_and_relative_imports_count(tmp_path):
    package = tmp_path / "stages"
    (package / "common").mkdir(parents=True)
    for name in ("__init__.py", "common/__init__.py", "common/a.py", "common/b.py", "common/c.py"):
        (package / name).write_text("")
    (package / "demo.py").write_text("def f():\n    from stages.common import a\n    from .common.b import thing\n")
    (package / "common" / "a.py").write_text("from . import c\n")
    original = cache.ROOT
    cache.ROOT = tmp_path
    cache.project_modules.cache_clear()
    try:
        assert set(cache.project_modules("stages.demo")) == {"stages", "stages.demo", "stages.common",
                                                              "stages.common.a", "stages.common.b", "stages.common.c"}
    finally:
        cache.ROOT = original
        cache.project_modules.cache_clear()


@pytest.fixture
def copy_of_the_code(tmp_path):
    """The project's stages/ in a temp root, with the code-version caches pointed at it."""
    shutil.copytree(cache.ROOT / "stages", tmp_path / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    original = cache.ROOT
    cache.ROOT = tmp_path
    for cached in (cache.project_modules, cache.code_version):
        cached.cache_clear()
    yield tmp_path
    cache.ROOT = original
    for cached in (cache.project_modules, cache.code_version):
        cached.cache_clear()


def versions() -> dict[str, str]:
    cache.code_version.cache_clear()
    return {stage: cache.code_version(stage) for stage in STAGES}


@pytest.mark.parametrize("edited", ["stages/common/drafter/spec_decode.py", "stages/common/drafter/ttt.py",
                                    "stages/world/toy.py", "stages/common/drafter/vocab.py", "stages/finetune/guard.py",
                                    "stages/common/contract/errors.py"])
def test_editing_a_module_changes_exactly_the_keys_of_the_stages_that_run_it(copy_of_the_code, edited):
    before = versions()
    module = ".".join(Path(edited).with_suffix("").parts)
    runs_it = {stage for stage in STAGES if module in cache.project_modules(f"stages.{stage}")}
    with (copy_of_the_code / edited).open("a") as source:
        source.write("\n# an edit\n")
    after = versions()
    assert {stage for stage in STAGES if before[stage] != after[stage]} == runs_it
    expected = {"stages/common/drafter/spec_decode.py": {"probe", "finetune"},  # finetune: eval_every
                "stages/common/drafter/ttt.py": {"diagnose", "finetune"},
                "stages/world/toy.py": {"world"}, "stages/finetune/guard.py": {"finetune"},
                "stages/common/contract/errors.py": set(STAGES)}
    if edited in expected:
        assert runs_it == expected[edited]
    else:
        assert {"vocab_map", "compare", "remap"} <= runs_it
