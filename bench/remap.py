"""Benchmark: the remap stage on a Kimi-K2.5-sized drafter, against a plain file copy and a naive in-memory remap.

What it measures: wall time and peak memory of re-pointing a drafter's lm_head at a new draft vocab, three ways,
each in a fresh subprocess (so each peak is that method's own):

  copy   shutil.copyfile of the drafter's model.safetensors + config.json: the I/O floor
  remap  regraft's remap stage (stages.remap.run, fallback=verifier), as `python -m stages.remap` runs it
  naive  safetensors.torch.load_file of the whole drafter and the verifier's lm_head, a Python loop over the
         destination rows, then save_file

Synthetic inputs, written streaming (never held in memory): a drafter of hidden 7168, 64 heads (64 kv heads, which
gives the ~2.4 GB of a Kimi-K2.5 drafter) x head_dim 128, intermediate 18432, draft vocab 32000, target vocab 163840,
bf16; a verifier folder holding only its lm_head [163840, 7168] bf16 (~2.35 GB); and a destination vocab map
(SpecForge .pt) sharing 80% of the source's target ids.

Each method runs --repeat times with a cold page cache (when `echo 3 > /proc/sys/vm/drop_caches` works) and
--repeat times warm (after reading every input once); the fastest run of each is shown, with all run times and the
load average (other processes on the machine skew times). Wall times exclude interpreter start-up and imports;
"sync s" is the os.sync() that follows, i.e. until the written bytes are on disk. "peak RSS" is the child's VmHWM:
it includes the ~230 MB of interpreter + torch and every memory-mapped file page the method touched (safetensors
memory-maps its files). "heap +MB" is the growth of RssAnon (sampled every 2 ms), i.e. what the method allocated.
VmHWM, not ru_maxrss: Linux carries the pre-exec hiwater (this driver, forked) into a child's ru_maxrss.
Afterwards the remap and naive outputs are checked to be identical, tensor by tensor.

    .venv/bin/python bench/remap.py            # full size: ~5 GB of inputs, a few minutes
    .venv/bin/python bench/remap.py --small    # hidden 1024, quick check
    .venv/bin/python bench/remap.py --mla      # a Kimi-K2.6-eagle3.1-mla-shaped drafter (MLA, fc_norm, norm_output)
    .venv/bin/python bench/remap.py --repeat 3 --workdir /var/tmp/bench --keep
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: `stages` is importable
from stages.common.contract.runtime import set_process_defaults  # noqa: E402

set_process_defaults()

import torch  # noqa: E402

METHODS = ("copy", "remap", "naive")
TARGET_LAYERS = 61  # Kimi-K2.5's text model
SHARED_FRACTION = 0.8
CHUNK_ELEMENTS = 32 * 1024 * 1024  # 64 MB of bf16 per generated chunk
MB = 1024 * 1024


@dataclass(frozen=True)
class Sizes:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    draft_vocab: int
    target_vocab: int
    mla: bool = False  # an EAGLE-3.1 MLA drafter: Kimi-K2's attention dims (its drafters copy the target's), fc_norm

    @property
    def mla_fields(self) -> dict:
        return {"model_type": "deepseek_v2", "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64, "v_head_dim": 128} if self.mla else {}

    @property
    def lm_head_bytes(self) -> int:
        return self.draft_vocab * self.hidden * 2


FULL = Sizes(hidden=7168, heads=64, kv_heads=64, head_dim=128, intermediate=18432, draft_vocab=32000,
             target_vocab=163840)
MLA = Sizes(hidden=7168, heads=64, kv_heads=64, head_dim=128, intermediate=18432, draft_vocab=32000,
            target_vocab=163840, mla=True)
SMALL = Sizes(hidden=1024, heads=8, kv_heads=8, head_dim=128, intermediate=2816, draft_vocab=8000,
              target_vocab=32768)


# ---------------------------------------------------------------- synthetic inputs


def random_spec(name: str, shape: tuple[int, ...], seed: int):
    """A bf16 tensor of N(0, 0.02) values, generated chunk by chunk while it is written."""
    from stages.common.drafter.tensor_io import TensorSpec

    rows, cols = shape if len(shape) == 2 else (1, shape[0])
    rows_per_chunk = max(1, CHUNK_ELEMENTS // cols)

    def chunks():
        generator = torch.Generator().manual_seed(seed)
        for start in range(0, rows, rows_per_chunk):
            count = min(rows_per_chunk, rows - start)
            chunk = torch.randn((count, cols), generator=generator).mul_(0.02).to(torch.bfloat16)
            yield chunk.reshape(shape) if len(shape) == 1 else chunk

    return TensorSpec(name, torch.bfloat16, tuple(shape), chunks)


def vocab_maps(sizes: Sizes, seed: int):
    """The source drafter's map and a destination map sharing SHARED_FRACTION of its target ids."""
    from stages.common.drafter.vocab import VocabMap

    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(sizes.target_vocab, generator=generator)
    source_ids = order[:sizes.draft_vocab]
    shared = round(SHARED_FRACTION * sizes.draft_vocab)
    kept = source_ids[torch.randperm(sizes.draft_vocab, generator=generator)[:shared]]
    new = order[sizes.draft_vocab:sizes.draft_vocab + sizes.draft_vocab - shared]  # ids the source lacks
    source = VocabMap.from_target_ids(source_ids.sort().values, sizes.target_vocab).validate()
    dest = VocabMap.from_target_ids(torch.cat([kept, new]).sort().values, sizes.target_vocab).validate()
    return source, dest


def write_inputs(sizes: Sizes, root: Path, seed: int = 0) -> dict[str, Path]:
    from stages.common.drafter.checkpoint import write_drafter
    from stages.common.drafter.config import OUTPUT_OF_LAYER, DrafterConfig, default_aux_layer_ids
    from stages.common.drafter.tensor_io import spec_of, write_safetensors

    source_map, dest_map = vocab_maps(sizes, seed)
    layer = {"model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu", "hidden_size": sizes.hidden,
             "num_attention_heads": sizes.heads, "num_key_value_heads": sizes.kv_heads, "head_dim": sizes.head_dim,
             "intermediate_size": sizes.intermediate, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
             "max_position_embeddings": 131072, "vocab_size": sizes.target_vocab, **sizes.mla_fields}
    config = DrafterConfig(layer=layer, draft_vocab_size=sizes.draft_vocab, fc_norm=sizes.mla, norm_output=sizes.mla,
                           aux_layer_ids=default_aux_layer_ids(TARGET_LAYERS, OUTPUT_OF_LAYER),
                           target_num_layers=TARGET_LAYERS)
    tensors = {}
    for index, (name, shape) in enumerate(config.expected_shapes().items()):
        if name in ("d2t", "t2d"):
            tensors[name] = getattr(source_map, name)
        elif len(shape) == 1:
            tensors[name] = spec_of(name, torch.ones(shape, dtype=torch.bfloat16))
        else:
            tensors[name] = random_spec(name, shape, seed + 1 + index)
    drafter = write_drafter(root / "drafter", config, tensors, "sglang")

    verifier = root / "verifier"
    verifier.mkdir(parents=True, exist_ok=True)
    (verifier / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": sizes.target_vocab,
        "hidden_size": sizes.hidden, "num_hidden_layers": TARGET_LAYERS, "num_attention_heads": sizes.heads,
        "intermediate_size": sizes.intermediate, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}, indent=2))
    write_safetensors(verifier / "model.safetensors",
                      [random_spec("lm_head.weight", (sizes.target_vocab, sizes.hidden), seed + 1000)],
                      metadata={"format": "pt"})

    vocab_map = root / "dest_vocab_map.pt"
    torch.save({"d2t": dest_map.d2t, "t2d": dest_map.t2d}, vocab_map)
    return {"drafter": drafter, "verifier": verifier, "vocab_map": vocab_map}


# ---------------------------------------------------------------- the three methods (run in a child process)


def method_copy(drafter: Path, vocab_map: Path, verifier: Path, out: Path) -> None:
    out.mkdir(parents=True)
    for name in ("model.safetensors", "config.json"):
        shutil.copyfile(drafter / name, out / name)


def method_remap(drafter: Path, vocab_map: Path, verifier: Path, out: Path) -> None:
    from stages import remap
    from stages.common.contract.stage import compose_stage

    cfg = compose_stage("remap", [f"drafter={drafter}", f"vocab_map={vocab_map}", f"verifier={verifier}",
                                  f"out={out}", "fallback=verifier"])
    remap.run(cfg)


def method_naive(drafter: Path, vocab_map: Path, verifier: Path, out: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(drafter / "model.safetensors")
    target_lm_head = load_file(verifier / "model.safetensors")["lm_head.weight"]
    source_lm_head = tensors["lm_head.weight"]
    source_ids = tensors["d2t"] + torch.arange(tensors["d2t"].numel())
    position_of = {int(target_id): p for p, target_id in enumerate(source_ids.tolist())}
    dest = torch.load(vocab_map, weights_only=True)
    dest_ids = (dest["d2t"] + torch.arange(dest["d2t"].numel())).tolist()
    lm_head = torch.empty((len(dest_ids), source_lm_head.shape[1]), dtype=source_lm_head.dtype)
    for p, target_id in enumerate(dest_ids):
        q = position_of.get(target_id)
        lm_head[p] = source_lm_head[q] if q is not None else target_lm_head[target_id]
    tensors.update({"lm_head.weight": lm_head, "d2t": dest["d2t"], "t2d": dest["t2d"]})
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((drafter / "config.json").read_text())
    config["draft_vocab_size"] = len(dest_ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def status_kb(field: str) -> int:
    """One `kB` field of /proc/self/status (VmHWM, VmRSS, RssAnon, ...)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class AnonPeak:
    """Samples RssAnon from /proc/self/status in a thread: the heap part of the peak (file pages excluded)."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak_kb, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kb = max(self.peak_kb, status_kb("RssAnon"))
            time.sleep(self.interval)

    def __enter__(self) -> "AnonPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_kb = max(self.peak_kb, status_kb("RssAnon"))


def child(method: str, drafter: str, vocab_map: str, verifier: str, out: str) -> None:
    # every child imports the same modules before measuring, so the baselines match
    import resource

    import safetensors.torch  # noqa: F401
    from stages import remap  # noqa: F401
    from stages.common.contract.stage import compose_stage  # noqa: F401

    run = {"copy": method_copy, "remap": method_remap, "naive": method_naive}[method]
    baseline_kb, baseline_anon_kb = status_kb("VmHWM"), status_kb("RssAnon")
    before = resource.getrusage(resource.RUSAGE_SELF)
    with AnonPeak() as anon:
        start = time.perf_counter()
        run(Path(drafter), Path(vocab_map), Path(verifier), Path(out))
        seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    peak_kb = status_kb("VmHWM")
    start = time.perf_counter()
    os.sync()
    sync_seconds = time.perf_counter() - start
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)  # includes the sampler thread
    print(json.dumps({"method": method, "seconds": seconds, "cpu_seconds": cpu, "sync_seconds": sync_seconds,
                      "baseline_mb": baseline_kb / 1024, "peak_rss_mb": peak_kb / 1024,
                      "baseline_anon_mb": baseline_anon_kb / 1024, "peak_anon_mb": anon.peak_kb / 1024}))


# ---------------------------------------------------------------- driver


def drop_page_cache() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def read_through(paths: list[Path]) -> None:
    """Warm the page cache: read every input file once."""
    for path in paths:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            with open(file, "rb", buffering=0) as handle:
                while handle.read(64 * MB):
                    pass


def run_child(method: str, inputs: dict[str, Path], out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", method, str(inputs["drafter"]),
           str(inputs["vocab_map"]), str(inputs["verifier"]), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{method} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_outputs(remap_out: Path, naive_out: Path, expected_shared: int) -> str:
    """The stage and the naive loop must write the same tensors; returns a one-line verdict."""
    from safetensors import safe_open

    with safe_open(remap_out / "model.safetensors", "pt") as a, safe_open(naive_out / "model.safetensors", "pt") as b:
        if set(a.keys()) != set(b.keys()):
            raise SystemExit(f"tensor names differ: {sorted(set(a.keys()) ^ set(b.keys()))}")
        for name in sorted(a.keys()):
            if not torch.equal(a.get_tensor(name), b.get_tensor(name)):
                raise SystemExit(f"remap and naive outputs differ in {name}")
        count = len(a.keys())
    counts = json.loads((remap_out / "report.json").read_text())["counts"]
    if counts["rows_remapped"] != expected_shared:
        raise SystemExit(f"remap reports {counts['rows_remapped']} rows remapped, expected {expected_shared}")
    return (f"outputs identical: remap == naive on all {count} tensors; remap report: {counts['rows_remapped']} "
            f"rows remapped, {counts['rows_from_fallback']} from the verifier")


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def print_report(sizes: Sizes, inputs: dict[str, Path], rows: list[tuple[str, dict]], verdict: str,
                 setup_seconds: float, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=160)
    lm_head_mb = sizes.lm_head_bytes / MB
    attention = (f"MLA {sizes.heads} heads, q_lora 1536, kv_lora 512, nope/rope/v 128/64/128, fc_norm + norm_output"
                 if sizes.mla else f"heads {sizes.heads} (kv {sizes.kv_heads}) x head_dim {sizes.head_dim}")
    console.print(f"sizes: hidden {sizes.hidden}, {attention}, intermediate {sizes.intermediate}, draft vocab "
                  f"{sizes.draft_vocab}, target vocab {sizes.target_vocab}, bf16")
    console.print(f"files (MB = 2^20 bytes): drafter {dir_bytes(inputs['drafter']) / MB:,.0f} MB, verifier "
                  f"{dir_bytes(inputs['verifier']) / MB:,.0f} MB, lm_head {lm_head_mb:,.0f} MB "
                  f"({sizes.draft_vocab}x{sizes.hidden}x2 B = {sizes.lm_head_bytes / 1e6:,.0f} decimal MB), "
                  f"dest map {dir_bytes(inputs['vocab_map']) / MB:.1f} MB; inputs written in {setup_seconds:.0f} s")
    baselines = [r["baseline_mb"] for _, r in rows]
    console.print(f"baseline: a child's VmHWM after its imports, before the method runs: "
                  f"{min(baselines):.0f}-{max(baselines):.0f} MB (included in peak RSS)")
    table = Table(title="remap benchmark: best of the runs per row")
    for column in ("cache", "method", "wall s", "vs copy", "runs s", "cpu s", "sync s", "peak RSS MB",
                   "vs lm_head", "heap +MB", "vs lm_head", "load"):
        table.add_column(column, justify="left" if column in ("cache", "method", "runs s") else "right")
    heap = lambda r: r["peak_anon_mb"] - r["baseline_anon_mb"]
    copy_seconds = {cache: r["seconds"] for cache, r in rows if r["method"] == "copy"}
    for cache, r in rows:
        table.add_row(cache, r["method"], f"{r['seconds']:.2f}", f"{r['seconds'] / copy_seconds[cache]:.2f}x",
                      " ".join(f"{s:.2f}" for s in r["all_seconds"]), f"{r['cpu_seconds']:.2f}",
                      f"{r['sync_seconds']:.2f}", f"{r['peak_rss_mb']:,.0f}", f"{r['peak_rss_mb'] / lm_head_mb:.2f}x",
                      f"{heap(r):,.0f}", f"{heap(r) / lm_head_mb:.2f}x", f"{r['load']:.2f}")
    console.print(table)
    console.print("wall s: the method alone (no start-up, no imports); cpu s: user+sys of the child meanwhile; "
                  "sync s: os.sync() after it;\npeak RSS: VmHWM, counting memory-mapped file pages; heap +MB: peak "
                  "RssAnon (sampled) minus the child's RssAnon before it; load: 1-min load average at the start.")
    console.print(verdict)
    for cache in dict(rows):
        remap = next(r for c, r in rows if c == cache and r["method"] == "remap")
        time_ratio = remap["seconds"] / copy_seconds[cache]
        rss_ratio = remap["peak_rss_mb"] / lm_head_mb
        console.print(f"goals ({cache}): remap time {time_ratio:.2f}x copy (goal <= 1.5x: "
                      f"{'met' if time_ratio <= 1.5 else 'MISSED'}); remap peak RSS {rss_ratio:.2f}x lm_head "
                      f"(goal <= 2x: {'met' if rss_ratio <= 2 else 'MISSED'}; heap growth alone: "
                      f"{heap(remap) / lm_head_mb:.2f}x)")


def best_run(method: str, inputs: dict[str, Path], out: Path, repeat: int, cold: bool) -> dict:
    """Run `method` `repeat` times in fresh children; the fastest run, with every run's wall time and load."""
    runs = []
    for _ in range(repeat):
        if cold:
            drop_page_cache()
        load = os.getloadavg()[0]
        runs.append({**run_child(method, inputs, out), "load": load})
    best = min(runs, key=lambda r: r["seconds"])
    return {**best, "all_seconds": [r["seconds"] for r in runs]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="hidden 1024 / intermediate 2816 / vocab 32768 / 8000")
    parser.add_argument("--mla", action="store_true", help="a Kimi-K2.6-eagle3.1-mla-shaped drafter at full size")
    parser.add_argument("--workdir", type=Path, default=ROOT / "outputs" / "bench",
                        help="a temp folder is made under it (default: outputs/bench)")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder with inputs and outputs")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache pass")
    parser.add_argument("--repeat", type=int, default=1, help="runs per method and cache state; the fastest shows")
    parser.add_argument("--write", metavar="NAME", help="also write the report into the figure block NAME (docs/)")
    parser.add_argument("--child", nargs=5, metavar=("METHOD", "DRAFTER", "MAP", "VERIFIER", "OUT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0

    sizes = SMALL if args.small else MLA if args.mla else FULL
    args.workdir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="remap-", dir=args.workdir))
    try:
        start = time.perf_counter()
        inputs = write_inputs(sizes, root)
        setup_seconds = time.perf_counter() - start
        rows: list[tuple[str, dict]] = []
        if not args.no_cold:
            if drop_page_cache():
                for method in METHODS:
                    rows.append(("cold", best_run(method, inputs, root / f"out-{method}", args.repeat, cold=True)))
            else:
                print("cannot write /proc/sys/vm/drop_caches: cold pass skipped")
        os.sync()
        read_through(list(inputs.values()))  # warm-up read, so every method starts from the same cache
        for method in METHODS:
            rows.append(("warm", best_run(method, inputs, root / f"out-{method}", args.repeat, cold=False)))
        verdict = check_outputs(root / "out-remap", root / "out-naive", round(SHARED_FRACTION * sizes.draft_vocab))
        from rich.console import Console

        console = Console(width=160, record=True)
        print_report(sizes, inputs, rows, verdict, setup_seconds, console)
        if args.write:
            from figures import write_blocks, written  # bench/figures.py, beside this file

            command = "bench/remap.py " + " ".join(arg for arg in (argv if argv is not None else sys.argv[1:]))
            block = f"```\n{console.export_text().rstrip()}\n```\n\n{written(command)}.\n"
            print("wrote", ", ".join(str(page.relative_to(ROOT)) for page in write_blocks({args.write: block})))
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
