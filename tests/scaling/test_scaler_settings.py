"""GradScaler's settings and state dict: checked, interchangeable with torch's, round-tripped."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

import mixprec
from helpers import (
    SCALERS,
    bitwise_equal,
    scaled_backward,
    scaler_model,
    small_scaler,
    train_some,
)


@pytest.mark.parametrize(("first", "second"), [("torch", "mixprec"), ("mixprec", "torch"), ("mixprec", "mixprec")])
def test_state_dicts_interchange(first: str, second: str) -> None:
    model, reference = scaler_model(), scaler_model()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    scaler_a, ref_scaler = small_scaler(first), small_scaler("torch")
    train_some(scaler_a, model, opts[0], range(0, 5))
    train_some(ref_scaler, reference, opts[1], range(0, 5))
    scaler_b = SCALERS[second]("cpu")  # default settings: everything comes from the state dict
    scaler_b.load_state_dict(scaler_a.state_dict())
    assert scaler_b.get_scale() == ref_scaler.get_scale()
    assert scaler_b.get_growth_interval() == 3
    train_some(scaler_b, model, opts[0], range(5, 11))
    train_some(ref_scaler, reference, opts[1], range(5, 11))
    assert scaler_b.get_scale() == ref_scaler.get_scale()
    assert bitwise_equal(list(model.parameters()), list(reference.parameters()))


def test_state_dict_round_trips_every_field() -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=8.0, min_scale=0.5, max_scale=2.0**20, hysteresis=3, fail_after=7)
    model = scaler_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_some(scaler, model, opt, range(0, 9))
    saved = scaler.state_dict()
    restored = mixprec.GradScaler("cpu")
    restored.load_state_dict(saved)
    assert restored.state_dict() == saved
    assert set(saved) >= {"scale", "_growth_tracker", "min_scale", "max_scale", "hysteresis", "_hysteresis_tracker",
                          "fail_after", "updates", "skipped_iterations", "consecutive_skipped"}  # fmt: skip
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == saved


def test_load_state_dict_rejects_bad_dicts() -> None:
    scaler = mixprec.GradScaler("cpu")
    with pytest.raises(RuntimeError, match="disabled GradScaler"):
        scaler.load_state_dict({})
    good = mixprec.GradScaler("cpu").state_dict()
    with pytest.raises(ValueError, match=r"unknown \['typo'\]"):
        scaler.load_state_dict({**good, "typo": 1})
    with pytest.raises(ValueError, match=r"missing \['_growth_tracker'\]"):
        scaler.load_state_dict({k: v for k, v in good.items() if k != "_growth_tracker"})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"growth_factor": 1.0}, "growth_factor must be > 1.0"),
        ({"backoff_factor": 1.5}, "backoff_factor must be in \\(0, 1\\)"),
        ({"growth_interval": 0}, "growth_interval must be a positive"),
        ({"init_scale": 0.0}, "init_scale must be positive"),
        ({"min_scale": 4.0, "max_scale": 2.0}, "must not exceed max_scale"),
        ({"hysteresis": 0}, "hysteresis must be >= 1"),
        ({"fail_after": 0}, "fail_after must be a positive count or None"),
    ],
)
def test_bad_settings(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        mixprec.GradScaler("cpu", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"init_scale": float("inf")}, ValueError, r"init_scale must be positive and finite .*got inf"),
        ({"init_scale": float("nan")}, ValueError, r"init_scale must be positive and finite .*got nan"),
        ({"init_scale": -2.0}, ValueError, r"init_scale must be positive and finite .*got -2.0"),
        ({"init_scale": "banana"}, TypeError, r"init_scale must be positive and finite .*got 'banana' \(str\)"),
        ({"init_scale": None}, TypeError, r"init_scale must be positive and finite .*got None \(NoneType\)"),
        ({"growth_factor": float("inf")}, ValueError, r"growth_factor must be > 1.0 and finite .*got inf"),
        ({"backoff_factor": float("nan")}, ValueError, r"backoff_factor must be in \(0, 1\) .*got nan"),
        ({"growth_interval": 2.5}, ValueError, r"growth_interval must be a positive number .*got 2.5 \(not an integer"),
        ({"growth_interval": "10"}, TypeError, r"growth_interval must be a positive number .*got '10' \(str\)"),
        ({"min_scale": float("inf")}, ValueError, r"min_scale must be positive and finite, or None .*got inf"),
        ({"max_scale": -1.0}, ValueError, r"max_scale must be positive, or None .*got -1.0"),
        ({"hysteresis": True}, TypeError, r"hysteresis must be >= 1 .*got True \(bool\)"),
        ({"fail_after": 1.5}, ValueError, r"fail_after must be a positive count or None, got 1.5"),
        ({"history": -1}, ValueError, r"history must be a count of scale changes, >= 0, got -1"),
        ({"on_event": "print"}, TypeError, r"on_event must be a callable"),
    ],
)
def test_bad_arguments_say_what_was_given_and_what_is_valid(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        mixprec.GradScaler("cpu", **kwargs)


def test_setters_check_their_values() -> None:
    scaler = mixprec.GradScaler("cpu")
    with pytest.raises(ValueError, match=r"new_factor must be > 1.0 and finite .*got inf"):
        scaler.set_growth_factor(float("inf"))
    with pytest.raises(TypeError, match=r"new_interval must be a positive number of iterations.*\(str\)"):
        scaler.set_growth_interval("100")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"new_scale must be positive and finite .*got inf"):
        scaled_backward(scaler)
        scaler.update(float("inf"))
    assert (scaler.get_growth_factor(), scaler.get_growth_interval(), scaler.get_scale()) == (2.0, 2000, 2.0**16)


@pytest.mark.parametrize(
    ("key", "value", "error", "match"),
    [
        ("scale", "banana", TypeError, r"state_dict\['scale'\] must be positive and finite .*got 'banana' \(str\)"),
        ("scale", None, TypeError, r"state_dict\['scale'\] must be positive and finite .*got None"),
        ("scale", float("inf"), ValueError, r"state_dict\['scale'\] must be positive and finite .*got inf"),
        ("growth_interval", -5, ValueError, r"state_dict\['growth_interval'\] must be a positive number .*got -5"),
        ("growth_interval", "10", TypeError, r"state_dict\['growth_interval'\] must be a positive number"),
        ("growth_factor", 0.5, ValueError, r"state_dict\['growth_factor'\] must be > 1.0"),
        ("backoff_factor", [0.5], TypeError, r"state_dict\['backoff_factor'\] must be in \(0, 1\)"),
        ("_growth_tracker", None, TypeError, r"state_dict\['_growth_tracker'\] must be a count"),
        ("_growth_tracker", -1, ValueError, r"state_dict\['_growth_tracker'\] must be a count"),
        ("min_scale", "x", TypeError, r"state_dict\['min_scale'\] must be positive and finite, or None"),
        ("max_scale", 0.0, ValueError, r"state_dict\['max_scale'\] must be positive, or None"),
        ("hysteresis", None, TypeError, r"state_dict\['hysteresis'\] must be >= 1"),
        ("_hysteresis_tracker", 0.5, ValueError, r"state_dict\['_hysteresis_tracker'\] must be an integer"),
        ("fail_after", 0, ValueError, r"state_dict\['fail_after'\] must be a positive count or None"),
        ("updates", -1, ValueError, r"state_dict\['updates'\] must be a count, >= 0"),
        ("consecutive_skipped", 2.5, ValueError, r"state_dict\['consecutive_skipped'\] must be a count"),
    ],
)
def test_load_state_dict_names_the_bad_key(key: str, value: Any, error: type[Exception], match: str) -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=8.0)
    before = scaler.state_dict()
    good = mixprec.GradScaler("cpu", min_scale=1.0, max_scale=2.0**20).state_dict()
    with pytest.raises(error, match=match):
        scaler.load_state_dict({**good, key: value})
    assert scaler.state_dict() == before  # checked before anything is loaded


def test_load_state_dict_checks_bounds_and_missing_keys() -> None:
    scaler = mixprec.GradScaler("cpu")
    good = scaler.state_dict()
    with pytest.raises(
        ValueError, match=r"state_dict\['min_scale'\] \(4.0\) must not exceed state_dict\['max_scale'\]"
    ):
        scaler.load_state_dict({**good, "min_scale": 4.0, "max_scale": 2.0})
    with pytest.raises(ValueError, match=r"missing \['scale'\]"):
        scaler.load_state_dict({k: v for k, v in good.items() if k != "scale"})
    with pytest.raises(TypeError, match="takes the dict from state_dict"):
        scaler.load_state_dict([("scale", 1.0)])  # type: ignore[arg-type]
