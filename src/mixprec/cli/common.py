"""What the ``mixprec`` subcommands share: argument types, refusals, output paths, a user's model and batch."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from mixprec.bench.workloads import WORKLOADS

__all__ = ["add_target_arguments", "check_outputs", "load", "names", "refuse", "user_task", "what"]


def names(text: str, valid: Sequence[str], what: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        shown = ", ".join(repr(n) for n in unknown) or repr(text)
        raise argparse.ArgumentTypeError(f"unknown {what} {shown}; valid: {', '.join(valid)}")
    return names


def refuse(problem: str) -> int:
    """Say why ``mixprec bench`` cannot run; the exit status of bad input."""
    print(f"mixprec bench: {problem}", file=sys.stderr)
    return 2


def check_outputs(out: str, json_path: str | None) -> str | None:
    """Why the report could not be written to ``out`` (a folder) and ``json_path``, or None: checked
    before the run, so that a bad path costs no training."""
    import pathlib
    import tempfile

    def writable(folder: pathlib.Path) -> str | None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as exc:
            return exc.strerror or str(exc)
        return None

    reason = writable(pathlib.Path(out))
    if reason:
        return f"cannot write --out {out}: {reason}; choose a folder you can write to"
    if json_path is not None:
        path = pathlib.Path(json_path)
        if path.is_dir():
            return f"--json {json_path} is a folder; give a file path, e.g. {path / 'report.json'}"
        reason = writable(path.parent)
        if reason:
            return f"cannot write --json {json_path}: {reason}; choose a file in a folder you can write to"
    return None


def add_target_arguments(parser: argparse.ArgumentParser, workload_help: str, loss_note: str) -> None:
    """--workload, or --model with --batch and --loss: what diagnose and tune run on."""
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--workload", choices=list(WORKLOADS), help=workload_help)
    target.add_argument("--model", help="module:factory, a function returning the model (e.g. mypkg.models:build)")
    parser.add_argument("--batch", help="module:function returning the inputs, or (inputs, targets) with --loss")
    parser.add_argument("--loss", help=f"module:function(output, targets) -> scalar loss{loss_note}")


def load(spec: str, what: str) -> Any:
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} must be module:function, e.g. mypkg.models:build, got {spec!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # modules in the current folder import, as under `python -m`
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {what} {spec!r}: {exc}") from exc


def what(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def user_task(args: argparse.Namespace, command: str) -> tuple[torch.nn.Module, Any, Any, Any]:
    """The model, inputs, loss and targets named by --model/--batch/--loss."""
    if not args.batch:
        raise ValueError("--model needs --batch module:function returning the model's inputs")
    model = load(args.model, "--model")()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"--model {args.model} returned {what(model)}; it must return the torch.nn.Module "
            f"to {command} (does the function end with `return model`?)"
        )
    batch = load(args.batch, "--batch")()
    if batch is None:
        raise ValueError(
            f"--batch {args.batch} returned None; it must return the model's inputs, or (inputs, targets) with --loss"
        )
    if not args.loss:
        return model, batch, None, None
    loss_fn = load(args.loss, "--loss")
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError(
            f"--batch must return (inputs, targets) when --loss is given: --loss is called "
            f"as loss(output, targets); {args.batch} returned {what(batch)}"
        )
    return model, batch[0], loss_fn, batch[1]
