"""Where two CPUs part: a world build traced op by op, to compare between machines (docs/world.md).

    .venv/bin/python bench/cpu_trace.py record [--env K=V]  # world=tiny traced, under 1 minute on 2 cores
    .venv/bin/python bench/cpu_trace.py compare A B         # where two records differ
    .venv/bin/python bench/cpu_trace.py moves --write       # what each setting moves here, and the kept records

`record` builds world=tiny in a fresh interpreter under the settings every stage computes under
(stages/common/contract/runtime.py::same_on_every_cpu, one thread), with a TorchDispatchMode that hashes the output
of each of the first `--ops` aten ops the build runs (the tokenizer is Rust, outside it; target A's training comes
first). After the build it replays every distinct op call it saw (op, input shapes and dtypes, the other
arguments) on inputs drawn from numpy's seeded generator, the same bits on every machine, and hashes each output:
the battery, which names an op that computes otherwise even where the builds have parted before it. The record
(gzipped JSON, `bench/traces/<vendor>-<cpu>.json.gz` by default) holds the machine, the settings, each world
file's sha256, the world's digest, the op sequence and the battery.

`compare` reads two records and prints the world files that differ, the first op of the sequence whose output
differs (with the ops before it that agreed), and every battery op that gives other bits on the two machines.
`moves` records here under the project's settings and under each setting that moves an op on one CPU (MKL's
branch, ATen's build), compares each, and every kept record of another CPU, with the first: the table in
docs/world.md (block `cpu-trace`). A kept record's parting is read against the settings': ops that only MKL's
branch moves point at MKL, ops that only ATen's build moves point at ATen.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRACES = ROOT / "bench" / "traces"
OTHER_SETTINGS = "REGRAFT_TRACE_SETTINGS"  # set by `record --env`: the child keeps the settings it was started with
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
UNINITIALISED = re.compile(r"^aten\.(new_)?empty|^aten\.resize_|^profiler\.")  # outputs whose bits are not computed


def cpu_info() -> dict:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    field = lambda name: next((line.split(":", 1)[1].strip() for line in text.splitlines()  # noqa: E731
                               if line.startswith(name)), "")
    flags = set(field("flags").split())
    return {"model": field("model name") or platform.processor(), "vendor": field("vendor_id"),
            "flags": sorted(flag for flag in FLAGS if flag in flags)}


def short(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def hash_value(value) -> str:
    """The bits of an op's output: every tensor's bytes (with its dtype and shape), every other leaf's repr."""
    import torch
    from torch.utils._pytree import tree_flatten

    total = hashlib.sha256()
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            total.update(f"{leaf.dtype}{tuple(leaf.shape)}{leaf.device}".encode())
            if leaf.device.type == "cpu" and leaf.numel():  # meta tensors (a model built empty) have no bits
                total.update(leaf.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        elif " at 0x" not in repr(leaf):  # an object's address is no output
            total.update(repr(leaf).encode())
    return total.hexdigest()[:16]


def hash_output(name: str, value) -> str:
    return "uninitialised" if UNINITIALISED.match(name) else hash_value(value)


def describe(leaf) -> object:
    """A JSON-able stand-in for one argument: a tensor by its dtype, shape and (for integers) its range."""
    import torch

    if isinstance(leaf, torch.Tensor):
        spec = {"dtype": str(leaf.dtype).removeprefix("torch."), "shape": list(leaf.shape)}
        if not leaf.dtype.is_floating_point and leaf.dtype != torch.bool and leaf.numel():
            spec["range"] = [int(leaf.min()), int(leaf.max())]
        return {"tensor": spec}
    if isinstance(leaf, (bool, int, float, str)) or leaf is None:
        return leaf
    return {"repr": repr(leaf)}


def settings_in_effect() -> dict:
    """What this process computes under when the caller asked for other settings than the project's (`--env`)."""
    import torch

    from stages.common.contract.runtime import _MKL_CBWR_AUTO, _MKL_CBWR_COMPATIBLE, _mkl_cbwr

    names = {None: "no MKL", 1: "OFF", _MKL_CBWR_AUTO: "AUTO", _MKL_CBWR_COMPATIBLE: "COMPATIBLE"}
    return {"in_effect": False, "cpu_capability": torch._C._get_cpu_capability(),
            "mkl_cbwr": names.get(_mkl_cbwr(set_compatible=False), "other"), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "asked": os.environ[OTHER_SETTINGS]}


def trace_build(out: Path, op_limit: int) -> dict:
    """In the fresh interpreter: world=tiny built under a mode that records the op sequence and the calls."""
    from stages.common.contract.runtime import same_on_every_cpu, torch_threads

    cpu = settings_in_effect() if os.environ.get(OTHER_SETTINGS) else same_on_every_cpu()
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from stages.common.contract.stage import compose_stage
    from stages.world import DIGESTED, build, digest

    sequence: list[list[str]] = []
    calls: dict[str, dict] = {}

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            result = func(*args, **kwargs)
            name = str(func)
            if len(sequence) < op_limit:
                sequence.append([name, hash_output(name, result)])
            leaves = [describe(leaf) for leaf in tree_flatten((args, kwargs))[0]]
            key = name + json.dumps(leaves, sort_keys=True)
            on_meta = any(isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu"
                          for leaf in tree_flatten((args, kwargs))[0])
            if key not in calls and not on_meta and not name.startswith(("aten._local_scalar_dense",
                                                                          "aten.lift_fresh")):
                calls[key] = {"op": name, "args": tree_to_json(args), "kwargs": tree_to_json(kwargs)}
            return result

    cfg = compose_stage("world", [f"out={out}"], option="tiny")
    with torch_threads(cfg.threads), Recorder():  # as stages/world/__init__.py::run builds it
        cpu = {**cpu, "threads": torch.get_num_threads()}
        build(cfg, cpu)
    files = {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in DIGESTED}
    return {"cpu_settings": cpu, "digest": digest(out), "files": files, "sequence": sequence,
            "calls": list(calls.values())}


def tree_to_json(value) -> object:
    import torch

    if isinstance(value, torch.Tensor):
        return describe(value)
    if isinstance(value, (list, tuple)):
        return [tree_to_json(item) for item in value]
    if isinstance(value, dict):
        return {key: tree_to_json(item) for key, item in value.items()}
    return describe(value)


def rebuild(spec, seed: int):
    """The argument a call's description stands for: tensors drawn from numpy's generator, seeded by the call."""
    import numpy as np
    import torch

    if isinstance(spec, list):
        return [rebuild(item, seed + index) for index, item in enumerate(spec)]
    if isinstance(spec, dict) and "tensor" in spec:
        tensor, rng = spec["tensor"], np.random.default_rng(seed)
        shape, dtype = tuple(tensor["shape"]), getattr(torch, tensor["dtype"])
        if dtype == torch.bool:
            return torch.from_numpy(rng.random(shape) < 0.5)
        if dtype.is_floating_point:
            return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(dtype)
        low, high = tensor.get("range", [0, 0])
        return torch.from_numpy(rng.integers(low, high + 1, shape)).to(dtype)
    if isinstance(spec, dict) and "repr" in spec:
        return eval(spec["repr"], {"torch": torch})  # noqa: S307 (dtypes, devices, layouts: what torch's reprs name)
    if isinstance(spec, dict):
        return {key: rebuild(item, seed + index) for index, (key, item) in enumerate(spec.items())}
    return spec


def run_battery(calls: list[dict]) -> dict[str, str]:
    """Each distinct call replayed on the generator's inputs: its output's hash, or why it could not run."""
    import torch

    results = {}
    for call in calls:
        key = call["op"] + json.dumps([call["args"], call["kwargs"]], sort_keys=True)
        seed = zlib.crc32(key.encode())
        namespace, name, overload = call["op"].split(".", 2) if call["op"].count(".") >= 2 else \
            (*call["op"].split("."), "default")
        try:
            op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
            torch.manual_seed(seed)
            results[key] = hash_output(call["op"], op(*rebuild(call["args"], seed),
                                                      **rebuild(call["kwargs"], seed + 7919)))
        except Exception as error:  # a call whose arguments must agree in ways random ones do not
            results[key] = f"error: {type(error).__name__}"
    return results


def record_here(out_file: Path, op_limit: int) -> None:
    """The fresh interpreter's whole job: trace, replay, write."""
    import torch

    with tempfile.TemporaryDirectory() as folder:
        traced = trace_build(Path(folder) / "world", op_limit)
    from stages.common.contract.runtime import torch_threads

    with torch_threads(1):  # MKL's results depend on its thread count: one, on every machine
        battery = run_battery(traced.pop("calls"))
    record = {"machine": {**cpu_info(), "python": platform.python_version(), "torch": torch.__version__,
                          "mkl": torch.backends.mkl.is_available(), "commit": commit()},
              **traced, "battery": battery}
    out_file.parent.mkdir(parents=True, exist_ok=True)
    partial = out_file.with_name(out_file.name + ".partial")
    with gzip.open(partial, "wt") as file:
        json.dump(record, file)
    partial.replace(out_file)
    errors = sum(value.startswith("error") for value in battery.values())
    print(f"{out_file}: world {record['digest'][:12]}, {len(record['sequence'])} ops traced, "
          f"{len(battery)} distinct calls replayed ({errors} could not run on random inputs)")


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip()


def default_name() -> Path:
    info = cpu_info()
    vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(info["vendor"], info["vendor"].lower() or "cpu")
    words = re.sub(r"\((r|tm)\)|\b(intel|amd|cpu|processor)\b", " ", info["model"].lower())
    model = re.sub(r"[^a-z0-9]+", "-", words).strip("-")[:40] or "cpu"
    return TRACES / f"{vendor}-{model}.json.gz"


def load(path: Path) -> dict:
    try:
        with gzip.open(path, "rt") as file:
            return json.load(file)
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: {path}: not a record ({type(error).__name__}: {error}) (fix: name a file "
                         "`bench/cpu_trace.py record` wrote, e.g. one in bench/traces/)") from None


@dataclass
class Parting:
    """Where two records differ: world files, the first op of the build, and the battery's ops."""
    files: list[str]
    agreed: int  # ops of the sequence that agree before the first that does not
    first: str | None  # that op (None: every traced op agrees)
    shared: int  # battery calls that ran on both
    differ: dict[str, tuple[int, int]]  # op -> (calls with other bits, calls run on both)


def parting(a: dict, b: dict) -> Parting:
    files = [name for name in a["files"] if a["files"][name] != b["files"].get(name)]
    agreed, first = 0, None
    for (op_a, hash_a), (op_b, hash_b) in zip(a["sequence"], b["sequence"]):
        if op_a != op_b or hash_a != hash_b:
            first = op_a if op_a == op_b else f"{op_a} vs {op_b}"
            break
        agreed += 1
    shared = [key for key in a["battery"] if key in b["battery"] and not a["battery"][key].startswith("error")
              and not b["battery"][key].startswith("error")]
    op_of = lambda key: key.split("[", 1)[0]  # noqa: E731
    differ = {op_of(key) for key in shared if a["battery"][key] != b["battery"][key]}
    counts = {op: (sum(op_of(k) == op and a["battery"][k] != b["battery"][k] for k in shared),
                   sum(op_of(k) == op for k in shared)) for op in sorted(differ)}
    return Parting(files, agreed, first, len(shared), counts)


def compare(first: Path, second: Path) -> str:
    a, b = load(first), load(second)
    found = parting(a, b)
    lines = [f"{'':<28}{first.name:<44}{second.name}",
             f"{'cpu':<28}{a['machine']['model'][:42]:<44}{b['machine']['model'][:42]}",
             f"{'flags':<28}{' '.join(a['machine']['flags'])[:42]:<44}{' '.join(b['machine']['flags'])[:42]}",
             f"{'settings':<28}{settings(a):<44}{settings(b)}",
             f"{'world digest':<28}{a['digest'][:16]:<44}{b['digest'][:16]}", ""]
    lines += [f"world file {name}: {'DIFFERS' if name in found.files else 'same'}" for name in a["files"]]
    if found.first is None:
        lines += ["", f"op sequence: all {found.agreed:,} traced ops agree"]
    else:
        lines += ["", f"op sequence: the first {found.agreed:,} ops agree; op {found.agreed + 1:,} "
                  f"({found.first}) gives other bits",
                  "  the ops before it: " + ", ".join(op for op, _ in a["sequence"][max(0, found.agreed - 5):
                                                                                    found.agreed])]
    lines += ["", f"battery: {found.shared} calls run on both, {sum(n for n, _ in found.differ.values())} give "
              "other bits"]
    lines += [f"  {op}: {n} of {total} calls" for op, (n, total) in found.differ.items()]
    return "\n".join(lines)


def settings(record: dict) -> str:
    cpu = record["cpu_settings"]
    return f"ATen {cpu['cpu_capability']}, MKL {cpu['mkl_cbwr']}, {cpu['threads']} thread(s)"


ALTERNATIVES = {  # settings that move ops on one CPU: what another CPU's parting can be held against
    "MKL_CBWR=AUTO": ["MKL_CBWR=AUTO"],
    "ATEN_CPU_CAPABILITY=avx512": ["ATEN_CPU_CAPABILITY=avx512"],
}


def record_to(out: Path, settings_asked: list[str], op_limit: int) -> Path:
    """`record` in a fresh interpreter, under the project's settings and then `settings_asked`."""
    from stages.common.contract.runtime import SAME_ON_EVERY_CPU

    other = dict(setting.split("=", 1) for setting in settings_asked)
    marker = {OTHER_SETTINGS: " ".join(settings_asked)} if other else {}
    subprocess.run([sys.executable, __file__, "record", "--here", "--out", str(out), "--ops", str(op_limit)],
                   env={**os.environ, **SAME_ON_EVERY_CPU, **other, **marker}, check=True, timeout=1800,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def moves_row(label: str, found: Parting) -> str:
    first = "none" if found.first is None else f"op {found.agreed + 1:,}: `{found.first}`"
    ops = "; ".join(f"`{op.removeprefix('aten.')}` {n} of {total}" for op, (n, total) in found.differ.items())
    return f"| {label} | {', '.join(found.files) or 'none'} | {first} | {ops or 'none'} |"


def moves(op_limit: int) -> str:
    """Here, under the project's settings, against each alternative setting and against every kept record of
    another CPU: which world files, which first op and which battery ops part."""
    info = cpu_info()
    with tempfile.TemporaryDirectory() as folder:
        base = load(record_to(Path(folder) / "base.json.gz", [], op_limit))
        rows = [moves_row(label, parting(base, load(record_to(Path(folder) / f"{index}.json.gz", asked, op_limit))))
                for index, (label, asked) in enumerate(ALTERNATIVES.items())
                if "ATEN_CPU_CAPABILITY=avx512" not in asked or "avx512f" in info["flags"]]
    for kept in sorted(TRACES.glob("*.json.gz")):
        other = load(kept)
        if other["machine"]["model"] != info["model"]:
            rows.append(moves_row(f"{other['machine']['model']} (`{kept.name}`)", parting(base, other)))
    header = ["| against this CPU under the project's settings | world files that differ | first op of the build "
              "that differs | battery: ops with other bits (calls) |", "|---|---|---|---|"]
    from bench.figures import written

    return "\n".join([*header, *rows, "", f"On {info['model']} ({' '.join(info['flags'])}), world=tiny, the first "
                      f"{op_limit:,} ops and {len(base['battery']):,} distinct calls; "
                      f"{written('bench/cpu_trace.py moves --write')}."])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    record = commands.add_parser("record", help="trace world=tiny here, in a fresh interpreter")
    record.add_argument("--out", type=Path, default=None)
    record.add_argument("--ops", type=int, default=20000, help="how many ops of the sequence to hash")
    record.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="build under another setting than the project's (MKL_CBWR=AUTO, ATEN_CPU_CAPABILITY="
                        "avx512): which ops that setting moves, to compare with what another CPU moves")
    record.add_argument("--here", action="store_true", help=argparse.SUPPRESS)  # the fresh interpreter's flag
    table = commands.add_parser("moves", help="what each setting moves here, and where kept records of other "
                                "CPUs part from this one")
    table.add_argument("--ops", type=int, default=20000)
    table.add_argument("--write", action="store_true", help="into docs/world.md (block cpu-trace)")
    against = commands.add_parser("compare", help="where two records differ")
    against.add_argument("first", type=Path)
    against.add_argument("second", type=Path)
    args = parser.parse_args()
    if args.command == "compare":
        print(compare(args.first, args.second))
    elif args.command == "moves":
        block = moves(args.ops)
        print(block)
        if args.write:
            from bench.figures import write_blocks

            write_blocks({"cpu-trace": block})
    elif args.here:
        record_here(args.out, args.ops)
    else:
        print(f"recorded {record_to(args.out or default_name(), args.env, args.ops)}")


if __name__ == "__main__":
    main()
