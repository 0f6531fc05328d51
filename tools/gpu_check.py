"""``make gpu-check``: what this project tests and measures only on a CUDA GPU, in one run and one report.

Seven pieces, each a process of its own with a time limit (one that fails or runs over leaves the
others' results; the limits and the grace a piece gets after its Ctrl-C add up to 19 minutes, more than
one device session lends: run the pieces an issue needs first, e.g. ``--only llama,fp8-gemm,step-cost``):

* ``tests``: the tests skipped without CUDA (``pytest -m cuda``: ``tests/helpers.py``'s
  ``requires_cuda`` marks them), with their pass/fail counts and failures;
* ``bench``: ``mixprec bench --quick`` eager, the default modes and every ``prepare`` level
  (``mixprec-tuned`` is left out: its tuning alone would take minutes of the nine);
* ``bench-compile``: ``mixprec bench --quick --compile``: torch.amp, mixprec and the levels
  eager and compiled (the compiled-vs-eager table) and the kernels inductor generates per fp8
  linear, mixprec against torchao. At its limit it is interrupted as Ctrl-C interrupts the bench,
  and the workloads that finished are reported;
* ``fp8-gemm``: ``benchmarks/bench_fp8.py --quick --aten-casts``: fp8 GEMMs against bf16 per shape and recipe
  (the tensorwise recipes also with the ATen ops' casts: the fused cast's gain; each call taken apart in its log:
  the host's time to issue it, the device's kernels), and training steps of the transformer with fp8 linears;
* ``step-cost``: ``mixprec bench --step-cost --size tiny``: each level's and state precision's step against
  torch.amp's, ops per ``optimizer.step()``, host reads;
* ``llama``: ``mixprec bench --llama``: a config-built 1.1B Llama at sequence 2048 and the batch that fits,
  each level, torch.amp and fp8 linears eager: tokens/s, the ratio to torch.amp (fp8: to O1), peak memory;
* ``llama-compile``: the same with ``--compile`` for torch.amp, O1, O2, bf16-sr and O1+fp8 (each also eager,
  in the same process). Rows are printed as they finish: at its limit, those finished are reported.

Writes ``report.md`` and ``report.json`` (and each piece's own output and log) to ``--out``.
Without CUDA it refuses (exit status 2). ``--device cpu`` runs the same pieces on the CPU, which is
how the test suite exercises this script (``--size tiny --llama-size tiny``). Exit status 1 if a piece failed
or ran over its limit (the compiled benches excepted: what finished is reported).

    python tools/gpu_check.py                       # on a CUDA machine: make gpu-check
    python tools/gpu_check.py --only llama,fp8-gemm,step-cost   # the step's and fp8's figures first
    python tools/gpu_check.py --device cpu --size tiny --only bench,fp8-gemm --out /tmp/check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

import torch

from mixprec.bench import runner

ROOT = Path(__file__).resolve().parent.parent
PIECES = ("tests", "bench", "bench-compile", "fp8-gemm", "step-cost", "llama", "llama-compile")
#: seconds; 1080 in all
LIMITS = {"tests": 180, "bench": 60, "bench-compile": 150, "fp8-gemm": 90, "step-cost": 90, "llama": 150,
          "llama-compile": 360}  # fmt: skip
GRACE = {"bench-compile": 30}  # seconds after the Ctrl-C, to write what finished (10 for the others): 1140 in all
#: where the compiled benches stop at their limit, the rows they finished are the result
INTERRUPTIBLE = ("bench-compile", "llama-compile")
LLAMA_COMPILED = "O1+fp8,O2,bf16-sr"  # after torch-amp and O1 (the baselines), in this order
EAGER_MODES = "fp32,torch-amp,mixprec,mixprec-cl,O1,O2,bf16-sr,bf16-pure"
COMPILE_MODES = ",".join(runner.COMPILE_MODES)


@dataclasses.dataclass
class Piece:
    """One piece's process: what ran, how it ended, where its output went."""

    name: str
    command: list[str]
    limit_s: float
    status: str = "not run"  # ok, failed, timed out, not run
    returncode: int | None = None
    seconds: float = 0.0
    log: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def refusal(device: str) -> str | None:
    """Why the check cannot run on ``device`` here, or None."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return (
            f"gpu-check: no CUDA GPU is available (torch {torch.__version__}, {build}); run it on a machine with an "
            "NVIDIA GPU and a CUDA build of torch, or pass --device cpu to run its pieces on the CPU"
        )
    return None


def commands(args: argparse.Namespace, out: Path) -> dict[str, list[str]]:
    """The command of each piece."""
    python = sys.executable
    bench = [python, "-m", "mixprec.cli", "bench", "--device", args.device, "--quiet"]
    bench += ["--size", args.size] if args.size else ["--quick"]
    bench += ["--steps", str(args.steps)] if args.steps else []
    bench += ["--workloads", args.workloads] if args.workloads else []
    compiled = [*bench, "--modes", args.compile_modes, "--compile-modes", args.compile_modes]
    compiled += [] if args.fp8_kernels else ["--no-fp8-kernels"]
    fp8 = [python, str(ROOT / "benchmarks" / "bench_fp8.py"), "--quick", "--aten-casts", "--profile", "--device",
           args.device]  # fmt: skip
    fp8 += ["--shapes", args.shapes] if args.shapes else []
    fp8 += ["--recipes", args.fp8_recipes] if args.fp8_recipes else []
    fp8 += ["--steps", str(args.steps)] if args.steps else []
    tests = [python, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
    step_cost = [python, "-m", "mixprec.cli", "bench", "--step-cost", "--size", "tiny", "--device", args.device,
                 "--quiet", *(["--steps", str(args.steps)] if args.steps else [])]  # fmt: skip
    llama = [python, "-m", "mixprec.cli", "bench", "--llama", "--size", args.llama_size, "--device", args.device,
             "--quiet", *(["--steps", str(args.steps)] if args.steps else [])]  # fmt: skip
    return {
        "tests": [*tests, "--junitxml", str(out / "tests.xml"), *cuda_test_files()],
        "bench": [*bench, "--modes", args.modes, "--out", str(out / "bench")],
        "bench-compile": [*compiled, "--out", str(out / "bench-compile")],
        "fp8-gemm": [*fp8, "--json", str(out / "fp8-gemm.json")],
        "step-cost": step_cost,  # its table is in its log
        "llama": llama,  # so too these two
        "llama-compile": [*llama, "--compile", "--recipes", args.llama_compiled],  # recipes last: the report names them
    }


def cuda_test_files() -> list[str]:
    """The test modules that hold CUDA tests (``requires_cuda`` or ``pytest.mark.cuda``): collecting only them
    saves the other modules' imports, most of a minute on an H100 machine."""
    found = [path for path in sorted((ROOT / "tests").rglob("test_*.py"))
             if "requires_cuda" in (text := path.read_text()) or "mark.cuda" in text]  # fmt: skip
    return [str(path) for path in found]


def run_piece(piece: Piece, out: Path) -> None:
    """Run ``piece`` with its log in ``out``; at its limit, Ctrl-C it (the bench writes what finished), then kill."""
    log = out / f"{piece.name}.log"
    piece.log = log.name
    paths = [str(ROOT / "src"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    begin = time.perf_counter()
    with open(log, "w") as fh:
        process = subprocess.Popen(piece.command, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env)
        try:
            piece.returncode = process.wait(timeout=piece.limit_s)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGINT)
            try:
                piece.returncode = process.wait(timeout=GRACE.get(piece.name, 10))
            except subprocess.TimeoutExpired:
                process.kill()
                piece.returncode = process.wait()
            piece.status = "timed out"
    piece.seconds = time.perf_counter() - begin
    if piece.status != "timed out":
        piece.status = "ok" if piece.returncode == 0 else "failed"


def read_tests(path: Path) -> dict[str, Any] | None:
    """pytest's JUnit XML as counts and the failures (node id and first line of the message)."""
    if not path.exists():
        return None
    root = ElementTree.parse(path).getroot()
    cases = root.iter("testcase")
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures, skips = [], []
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            counts["failed"] += 1
            failures.append({"test": name, "message": (failed.get("message") or "").splitlines()[:1]})
        elif skipped is not None:
            counts["skipped"] += 1
            skips.append({"test": name, "reason": skipped.get("message") or ""})
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures, "skips": skips}


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _section(markdown: str, start: str, stop: str | None = None) -> list[str]:
    """The lines of ``markdown`` from the line starting with ``start`` up to the one starting with ``stop``."""
    lines = markdown.splitlines()
    begin = next((i for i, line in enumerate(lines) if line.startswith(start)), None)
    if begin is None:
        return []
    end = next((i for i in range(begin + 1, len(lines)) if stop and lines[i].startswith(stop)), len(lines))
    return [line for line in lines[begin:end] if not line.startswith("![")]


def fp8_gemm_table(data: dict[str, Any]) -> list[str]:
    """bench_fp8.py's JSON as Markdown: per shape the ms of bf16 and each recipe (speed-up), then the steps."""
    recipes = list(dict.fromkeys(r for row in data["gemm"] for r in [*row["ms"], *row["errors"]] if r != "bf16"))
    lines = [f"Device: {data['device']}; torch {data['torch']}. Linear forward+backward, median ms "
             "(speed-up over bf16; TFLOPS):", "",
             "| M x K x N | bf16 | " + " | ".join(recipes) + " |", "|---|---|" + "---|" * len(recipes)]  # fmt: skip
    for row in data["gemm"]:
        cells = [f"{row['ms']['bf16']:.3f} ({row['tflops']['bf16']:.1f})"]
        for r in recipes:
            cells.append(f"{row['ms'][r]:.3f} ({row['speedup'][r]:.2f}x; {row['tflops'][r]:.1f})" if r in row["ms"]
                         else row["errors"].get(r, "not run"))  # fmt: skip
        lines.append(f"| {row['m']}x{row['k']}x{row['n']} | " + " | ".join(cells) + " |")
    steps = data["steps"]
    lines += ["", f"Training steps, {steps['workload']} ({steps['size']}), O1 bf16 against O1 + fp8: ms per step "
              "(speed-up over bf16):", ""]  # fmt: skip
    for mode, ms in steps["ms"].items():
        ratio = f" ({steps['speedup'][mode]:.2f}x)" if mode in steps["speedup"] else ""
        lines.append(f"- {mode}: {ms:.2f} ms{ratio}, last loss {steps['last_loss'][mode]:.4f}")
    lines += [f"- {mode}: {error}" for mode, error in steps["errors"].items()]
    return lines


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        major, minor = torch.cuda.get_device_capability(index)
        return f"{torch.cuda.get_device_name(index)} (sm_{major}{minor}), CUDA {torch.version.cuda}"
    return f"CPU {runner.cpu_name()}"


def write_report(out: Path, pieces: dict[str, Piece], device: str, seconds: float) -> dict[str, Any]:
    """Gather the pieces' outputs into ``out/report.json`` and ``out/report.md``; returns the JSON."""
    tests = read_tests(out / "tests.xml") if pieces["tests"].status != "not run" else None
    data: dict[str, Any] = {
        "device": device_name(device),
        "torch": torch.__version__,
        "seconds": seconds,
        "pieces": {name: piece.to_dict() for name, piece in pieces.items()},
        "tests": tests,
        "bench": _json(out / "bench" / "report.json"),
        "bench_compile": _json(out / "bench-compile" / "report.json"),
        "fp8_gemm": _json(out / "fp8-gemm.json"),
        "step_cost": _table_lines(out / "step-cost.log"),
        "llama": _table_lines(out / "llama.log"),
        "llama_compile": _table_lines(out / "llama-compile.log"),
    }
    (out / "report.json").write_text(json.dumps(data, indent=2) + "\n")
    lines = ["# mixprec gpu-check", "", f"Device: {data['device']}; torch {data['torch']}; took {seconds:.0f} s.", "",
             "| piece | status | seconds | limit | log |", "|---|---|---|---|---|"]  # fmt: skip
    for piece in pieces.values():
        code = f" (exit {piece.returncode})" if piece.status == "failed" else ""
        lines.append(f"| {piece.name} | {piece.status}{code} | {piece.seconds:.0f} | {piece.limit_s:.0f} | "
                     f"{piece.log or ''} |")  # fmt: skip
    lines += ["", "## CUDA tests (`pytest -m cuda`)", ""]
    if tests is None:
        lines.append("Not run." if pieces["tests"].status == "not run" else "No results: see tests.log.")
    else:
        lines.append(f"{tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped.")
        lines += [f"- FAILED {f['test']}: {' '.join(f['message'])}" for f in tests["failures"]]
        reasons = sorted({s["reason"] for s in tests["skips"]})
        lines += [f"- skipped: {reason}" for reason in reasons]
    lines += ["", "## Bench, eager (`mixprec bench --quick`)", ""]
    eager_md = out / "bench" / "report.md"
    lines += _section(eager_md.read_text(), "| workload |", "steps/s:") if eager_md.exists() else ["No report."]
    lines += ["", "## Bench, compiled against eager (`mixprec bench --quick --compile`)", ""]
    compiled_md = out / "bench-compile" / "report.md"
    text = compiled_md.read_text() if compiled_md.exists() else ""
    if "**Interrupted**" in text:
        lines += [next(line for line in text.splitlines() if line.startswith("**Interrupted**")), ""]
    compiled = _section(text, "## Compiled")
    lines += [line.replace("## ", "### ", 1) if line.startswith("## ") else line for line in compiled] or [
        "No report." if not text else "No compiled table in the report."
    ]
    lines += ["", "## fp8 GEMMs (`benchmarks/bench_fp8.py --quick`)", ""]
    lines += fp8_gemm_table(data["fp8_gemm"]) if data["fp8_gemm"] else ["No results."]
    if data["fp8_gemm"] and not device.startswith("cuda"):
        lines += ["", "fp8 GEMMs are emulated in fp32 on a CPU (torch._scaled_mm): these times say nothing about "
                  "fp8 speed on a GPU."]  # fmt: skip
    lines += ["", "## What a step costs (`mixprec bench --step-cost --size tiny`)", ""]
    lines += data["step_cost"] or ["Not run." if pieces["step-cost"].status == "not run" else
                                   "No table: see step-cost.log."]  # fmt: skip
    lines += ["", "## A config-built Llama, eager (`mixprec bench --llama`)", ""]
    lines += _llama_lines(data["llama"], pieces["llama"])
    command = pieces["llama-compile"].command
    lines += ["", f"## The Llama compiled (`mixprec bench --llama --compile --recipes {command[-1]}`)", ""]
    lines += _llama_lines(data["llama_compile"], pieces["llama-compile"])
    (out / "report.md").write_text("\n".join(lines).rstrip() + "\n")
    return data


def _llama_lines(rows: list[str], piece: Piece) -> list[str]:
    """A Llama piece's table, said to be partial where the piece ran over its limit."""
    if not rows:
        return ["Not run." if piece.status == "not run" else f"No table: see {piece.log}."]
    if piece.status == "timed out":
        return [f"Stopped at its limit ({piece.limit_s:.0f} s): the rows it finished.", "", *rows]
    return rows


def _table_lines(path: Path) -> list[str]:
    """The Markdown table rows a piece printed into its log (none where it did not run)."""
    return [line for line in path.read_text().splitlines() if line.startswith("|")] if path.exists() else []


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default; refused without CUDA) or cpu")
    p.add_argument("--out", default="mixprec-gpu-check", help="folder for the report (default ./mixprec-gpu-check/)")
    p.add_argument("--only", help=f"comma-separated pieces to run (default all: {','.join(PIECES)})")
    p.add_argument("--size", choices=["tiny", "quick", "default"], help="the benches' workload size (default quick)")
    p.add_argument("--steps", type=int, help="the benches' steps per run")
    p.add_argument("--workloads", help="the benches' workloads (default all)")
    p.add_argument("--modes", default=EAGER_MODES, help=f"the eager bench's modes (default {EAGER_MODES})")
    p.add_argument("--compile-modes", default=COMPILE_MODES, help=f"modes compiled (default {COMPILE_MODES})")
    p.add_argument("--fp8-kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="count inductor's kernels per fp8 linear in the compiled bench (default on)")  # fmt: skip
    p.add_argument("--shapes", help="bench_fp8.py's GEMM shapes, MxKxN,... (default its --quick shapes)")
    p.add_argument("--fp8-recipes", help="bench_fp8.py's recipes, comma-separated (default all four)")
    p.add_argument("--llama-size", choices=["tiny", "quick", "default"], default="default",
                   help="the Llama pieces' size (default: 1.1B parameters, sequence 2048)")  # fmt: skip
    p.add_argument("--llama-compiled", default=LLAMA_COMPILED,
                   help=f"the recipes llama-compile compiles (default {LLAMA_COMPILED}; torch-amp always)")  # fmt: skip
    p.add_argument("--limit-scale", type=float, default=1.0, help="multiply every piece's time limit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    problem = refusal(args.device)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    only = PIECES if not args.only else tuple(p.strip() for p in args.only.split(",") if p.strip())
    if unknown := [p for p in only if p not in PIECES]:
        print(f"gpu-check: unknown piece(s) {', '.join(unknown)}; valid: {', '.join(PIECES)}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    begin = time.perf_counter()
    pieces = {name: Piece(name, command, LIMITS[name] * args.limit_scale)
              for name, command in commands(args, out).items()}  # fmt: skip
    for name in PIECES:
        if name in only:
            print(f"gpu-check: {name}: {' '.join(pieces[name].command)}", flush=True)
            run_piece(pieces[name], out)
            print(f"gpu-check: {name}: {pieces[name].status} in {pieces[name].seconds:.0f} s", flush=True)
    write_report(out, pieces, args.device, time.perf_counter() - begin)
    print(f"gpu-check: wrote {out / 'report.md'} and {out / 'report.json'}", flush=True)
    # The compiled benches may run over their limits on a slow machine: what finished is reported, and it is no failure.
    failed = [p.name for p in pieces.values()
              if p.status == "failed" or (p.status == "timed out" and p.name not in INTERRUPTIBLE)]  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
