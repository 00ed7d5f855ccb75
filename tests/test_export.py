"""An export works away from regraft's cache: the speculators config names the verifier as the user deploys it (the
target's hub id when given, else the target folder the user gave, never a folder inside a stage output) with the
verifier's own architectures, so `vllm serve EXPORT` finds the target from the export alone."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from stages import remap
from stages.common.contract.artifacts import staged_output
from stages.common.drafter.checkpoint import DrafterCheckpoint, convert_checkpoint
from stages.common.drafter.checkpoint import main as convert_main
from tests.test_families import REFERENCE_PYTHON, ROOT
from stages.common.contract.stage import compose_stage
from stages.common.engines.vllm_engine import VllmConfig, VllmEngine, engine_available
from tests.conftest import random_map
from tests.test_dag import nodes_for

HUB_ID = "example-org/tiny-llama-b"


def cached(folder: Path, root: Path) -> Path:
    """`folder` copied into a complete stage output under `root` (as `@world/target_b` lives in outputs/cache)."""
    with staged_output(root / "cache" / "world" / "0123abcd", "world") as staged:
        shutil.copytree(folder, staged.path / folder.name)
    return root / "cache" / "world" / "0123abcd" / folder.name


def verifier(export: Path) -> dict:
    return json.loads((export / "config.json").read_text())["speculators_config"]["verifier"]


def test_the_verifier_is_the_given_folder_or_hub_id_with_its_architectures(make_drafter, vocab_size, target_dir,
                                                                           tmp_path):
    drafter = make_drafter(random_map(vocab_size, 64, seed=1))
    architectures = json.loads((target_dir / "config.json").read_text())["architectures"]
    assert architectures == ["LlamaForCausalLM"]
    by_path = convert_checkpoint(drafter, tmp_path / "by_path", "speculators", verifier=str(target_dir))
    assert verifier(by_path) == {"name_or_path": str(target_dir.absolute()), "architectures": architectures}
    assert convert_main([str(drafter), str(tmp_path / "by_name"), "--layout", "speculators",
                         "--verifier", str(target_dir), "--verifier-name", HUB_ID]) == 0
    assert verifier(tmp_path / "by_name") == {"name_or_path": HUB_ID, "architectures": architectures}
    # converted again (no --verifier), or named by hub id alone: the recorded architectures stay
    again = convert_checkpoint(tmp_path / "by_name", tmp_path / "again", "sglang")
    assert convert_main([str(again), str(tmp_path / "hub"), "--layout", "speculators", "--verifier", HUB_ID]) == 0
    assert verifier(tmp_path / "hub") == {"name_or_path": HUB_ID, "architectures": architectures}


def test_a_stage_never_names_a_target_in_the_cache(make_drafter, vocab_size, target_dir, training_map, tmp_path):
    """The built-in world's target lives in a stage output: a stage's drafter names no verifier (vLLM needs the key
    only, with the target given), unless the pipeline's target.name reaches the stage; the cache path appears in no
    stage output."""
    target = cached(target_dir, tmp_path)
    drafter = make_drafter(random_map(vocab_size, 64, seed=1))
    remapped = tmp_path / "remapped"
    remap.run(compose_stage("remap", [f"drafter={drafter}", f"vocab_map={training_map}", f"verifier={target}",
                                      f"out={remapped}", "layout=speculators"]))
    named = tmp_path / "named"
    remap.run(compose_stage("remap", [f"drafter={drafter}", f"vocab_map={training_map}", f"verifier={target}",
                                      f"out={named}", "layout=speculators", f"verifier_name={HUB_ID}"]))
    for export, name in ((remapped, None), (named, HUB_ID)):
        assert verifier(export) == {"name_or_path": name, "architectures": ["LlamaForCausalLM"]}, export
        assert str(tmp_path / "cache") not in (export / "config.json").read_text()
    # the export command given the cache folder itself names it: the user asked for it
    served = convert_checkpoint(drafter, tmp_path / "served", "speculators", verifier=str(target))
    assert verifier(served) == {"name_or_path": str(target), "architectures": ["LlamaForCausalLM"]}
    # a drafter written before exports were named records the cache path: its export drops it
    old = drafter.parent / "old"
    shutil.copytree(drafter, old)
    config = json.loads((old / "config.json").read_text())
    config["regraft"]["verifier"] = str(target)
    (old / "config.json").write_text(json.dumps(config))
    assert DrafterCheckpoint.open(old).config.verifier is None
    assert verifier(convert_checkpoint(old, tmp_path / "old_export", "speculators"))["name_or_path"] is None


def test_the_pipeline_hands_target_name_to_the_stages_that_record_the_verifier():
    name = {node.name: node.config for node in nodes_for(f"target.name={HUB_ID}")}
    assert name["remap"].verifier_name == HUB_ID
    assert name["finetune"].target_name == name["baseline_finetune"].target_name == HUB_ID
    assert name["source_drafter"].target_name is None  # trained on target A, not the new target
    assert {node.name: node.config.get("target_name") for node in nodes_for()}["finetune"] is None


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.skipif(not engine_available(), reason="no vLLM engine venv: run `make venv-vllm`")
def test_an_export_moved_away_from_the_cache_serves_on_vllm(engine_scratch_run, engine_target, tmp_path):
    """The fine-tuned drafter, exported from a cache folder that then disappears, moved to another folder and served
    by vLLM from the export alone (`LLM(model=EXPORT)`: the verifier comes from its speculators config)."""
    from stages.probe import chat_renderer, load_tokenizer

    source = cached(engine_scratch_run[0] / "drafter", tmp_path / "outputs")
    assert convert_main([str(source), str(tmp_path / "export"), "--layout", "speculators"]) == 0
    shutil.rmtree(tmp_path / "outputs")
    moved = Path(shutil.move(tmp_path / "export", tmp_path / "elsewhere" / "my-drafter"))
    named = verifier(moved)
    assert named == {"name_or_path": str(engine_target.absolute()), "architectures": ["LlamaForCausalLM"]}
    assert "outputs" not in (moved / "config.json").read_text()
    tokenizer = load_tokenizer(engine_target)
    ids = tokenizer.encode(chat_renderer(tokenizer)([{"role": "user", "content": "alpha"}]), add_special_tokens=False)
    with VllmEngine(VllmConfig(), tmp_path / "engine.log") as engine:
        engine.start(moved)
        answer = engine.generate([ids], 24)
    counters = answer["counters"]
    assert len(answer["outputs"][0]) > 0
    assert counters["vllm:spec_decode_num_drafts"] > 0 and counters["vllm:spec_decode_num_accepted_tokens"] > 0


def in_a_finetune_output(drafter: Path, target: Path, root: Path) -> Path:
    """`drafter` as the default run's fine-tune leaves it: inside a complete stage output made for `target`."""
    with staged_output(root / "cache" / "finetune" / "4567cdef", "finetune", {"target": str(target)}) as staged:
        shutil.copytree(drafter, staged.path / "drafter")
    return root / "cache" / "finetune" / "4567cdef" / "drafter"


def test_the_default_runs_export_names_the_cached_target_and_speculators_loads_it(make_drafter, vocab_size,
                                                                                   target_dir, tmp_path, capsys):
    """speculators 0.9.0's loader reads the verifier's config and embeddings by the export's name_or_path (None:
    `AutoConfig.from_pretrained(None)` fails): the default run's export names the cached target it was trained for,
    and its line says that folder is in the cache and how to name the deployed one."""
    target = cached(target_dir, tmp_path)
    drafter = in_a_finetune_output(make_drafter(random_map(vocab_size, 64, seed=1)), target, tmp_path)
    assert convert_main([str(drafter), str(tmp_path / "export"), "--layout", "speculators"]) == 0
    said = capsys.readouterr().out.strip()
    assert said == (f"wrote {tmp_path / 'export'} (speculators); its verifier is {target}, a folder in regraft's "
                    "cache on this machine: loaders here read the target's config and embeddings from it; for "
                    "another machine, name the target as deployed (--verifier-name HUB_ID, or target.name= in the run)")
    assert verifier(tmp_path / "export") == {"name_or_path": str(target), "architectures": ["LlamaForCausalLM"]}
    # named as deployed: the line says so, and a drafter outside the cache with nothing recorded names none
    assert convert_main([str(drafter), str(tmp_path / "named"), "--layout", "speculators",
                         "--verifier-name", HUB_ID]) == 0
    assert capsys.readouterr().out.strip().endswith(f"its verifier is {HUB_ID}: a loader reads the target's config "
                                                    "and embeddings from it")
    loose = make_drafter(random_map(vocab_size, 64, seed=2))
    assert convert_main([str(loose), str(tmp_path / "loose"), "--layout", "speculators"]) == 0
    assert "it names no verifier: speculators' loader needs one" in capsys.readouterr().out
    if not REFERENCE_PYTHON.exists():
        pytest.skip("no reference venv with speculators 0.9.0: run `make venv-ref`")
    for export, loads in (("export", True), ("loose", False)):
        loaded = subprocess.run([str(REFERENCE_PYTHON), str(ROOT / "tests" / "speculators_load.py"),
                                 str(tmp_path / export)], capture_output=True, text=True, timeout=300,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert (loaded.returncode == 0) is loads, loaded.stderr[-2000:]
        if loads:
            report = json.loads(loaded.stdout.strip().splitlines()[-1])
            assert report["not_in_model"] == [] and report["differ"] == [], report
