"""What a plan's ``measured`` record holds: the schema of the tuner's figures, owned by the runtime.

The tuner writes these (``passes/tuning.TuningContext.record``, confirmation, the passes' own extras); the
runtime, ``inspect``, ``bench`` and the server read them. Each field has one type and one meaning here, and
``check_measured`` refuses a manifest whose known fields have the wrong type (one line, before any work),
so a reader may trust ``measured["confirmed_speedup"]`` to be a number or None. A pass or draft kind may add
fields of its own (``per_exit_layer``, ``adapter``, ...): any JSON value, not checked beyond that.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ArtifactError

NUMBER = (int, float)
OPTIONAL_NUMBER = (int, float, type(None))

MEASURED_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "method": (
        (str,),
        "the tuning method that made the plan (lookup, cosine, early-exit, bayes, adapter, hybrid, ...)",
    ),
    "device": ((str,), "where it was tuned: processor and backend"),
    "calibration_sequences": ((int,), "calibration sequences its estimate was made on"),
    "acceptance_rate": (NUMBER, "estimated share of drafted tokens accepted"),
    "mean_accepted": (NUMBER, "estimated tokens per round (accepted drafts + the verifier's own)"),
    "expected_speedup": (NUMBER, "the cost model's speedup over plain decoding on the tuning backend"),
    "tuning_seconds": (NUMBER, "seconds the pass spent on it"),
    "round_mix": ((dict,), "share of estimated rounds drafted by each source"),
    "confirmed_speedup": (OPTIONAL_NUMBER, "timed speedup over plain decoding in confirmation (None: not timed)"),
    "confirmed_interval": ((list,), "95% interval of that speedup [low, high] (None where unbounded)"),
    "confirmed_vs_best": (
        (dict,),
        "in a race of several plans: the fastest plan's name and the 95% interval of this "
        "plan's speedup over it, paired per turn ({plan, interval})",
    ),
    "confirmation_turns": ((int,), "turns timed in confirmation"),
    "confirmation_stopped": ((str,), "why confirmation stopped (sure, budget, max turns, slower than plain, ...)"),
    "confirmed_mean_accepted": (NUMBER, "tokens per round in confirmation"),
    "confirmed_tokens_per_s": (NUMBER, "speculative tokens/s in confirmation"),
    "plain_tokens_per_s": (NUMBER, "plain tokens/s in confirmation"),
    "confirmed_identical": ((bool,), "whether every confirmation output equalled plain decoding"),
    "confirmed_round_mix": ((dict,), "share of confirmation rounds drafted by each source"),
    "prediction_error": (NUMBER, "(expected - confirmed) / confirmed"),
    "drafted_per_round": (NUMBER, "estimated tokens verified per round beside the input token (a tree's nodes)"),
    "trees": ((dict,), "the lookup tuner's best chain and best token tree: tokens per round, nodes, expected speedup"),
}


def check_measured(measured: Any, where: str) -> dict[str, Any]:
    """``measured`` if it is a dict whose known fields have their schema's types, else a one-line error."""
    if not isinstance(measured, dict):
        raise ArtifactError(
            f"manifest {where}.measured must be an object, not {type(measured).__name__}; rebuild the artifact"
        )
    for name, (types, _) in MEASURED_FIELDS.items():
        if name in measured and (
            not isinstance(measured[name], types) or isinstance(measured[name], bool) and bool not in types
        ):
            raise ArtifactError(
                f"manifest {where}.measured.{name} must be {' or '.join(t.__name__ for t in types)}, not "
                f"{type(measured[name]).__name__}; rebuild the artifact"
            )
    return measured


def check_call_costs(data: Any, where: str = "the manifest's tuning.call_costs") -> dict[str, Any]:
    """The batched call costs a build stored (``passes/call_costs.py``) as typed parts: ``batched`` and ``alone``
    ({rows or tokens: seconds}, every count >= 1, every time finite and positive), ``one_call`` (stored as
    ``pad_to_widest`` by earlier builds), ``machine`` and the optional draft-step curve (``draft``, ``draft_segment``); a one-line ``ArtifactError`` naming ``where`` otherwise (``runtime/decoding/load.CallCosts``)."""
    shape = 'need {"batched": {rows: seconds}, "alone": {tokens: seconds}}'
    if not isinstance(data, dict):
        raise ArtifactError(f"{where} are malformed ({shape}, got {type(data).__name__}); rebuild the artifact")
    parts: dict[str, Any] = {}
    for name in ("batched", "alone"):
        points = data.get(name)
        if not isinstance(points, dict) or not points:
            raise ArtifactError(f"{where} are malformed ({shape}; {name} is missing or empty); rebuild the artifact")
        try:
            parts[name] = {int(k): float(v) for k, v in points.items()}
        except (TypeError, ValueError):
            raise ArtifactError(f"{where}.{name} are malformed ({shape}); rebuild the artifact") from None
        if any(k < 1 or not math.isfinite(v) or v <= 0 for k, v in parts[name].items()):
            raise ArtifactError(f"{where}.{name} need positive times for counts >= 1; rebuild the artifact")
    parts["one_call"] = bool(data.get("one_call", data.get("pad_to_widest", False)))
    parts["machine"] = str(data.get("machine", ""))
    parts["draft"], parts["draft_segment"] = _draft_curve(data.get("draft"), where)
    return parts


def _draft_curve(data: Any, where: str) -> tuple[dict[int, float], str]:
    """The optional ``draft`` part: ``{"segment": str, "batched": {rows: seconds}}`` (the plan's draft step timed
    at n one-token rows); absent in builds that did not time it."""
    if data is None:
        return {}, ""
    shape = 'need draft = {"segment": str, "batched": {rows: seconds}}'
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("segment"), str)
        or not isinstance(data.get("batched"), dict)
    ):
        raise ArtifactError(f"{where}.draft is malformed ({shape}); rebuild the artifact")
    try:
        points = {int(k): float(v) for k, v in data["batched"].items()}
    except (TypeError, ValueError):
        raise ArtifactError(f"{where}.draft is malformed ({shape}); rebuild the artifact") from None
    if not points or any(k < 1 or not math.isfinite(v) or v <= 0 for k, v in points.items()):
        raise ArtifactError(f"{where}.draft needs positive times for counts >= 1; rebuild the artifact")
    return points, data["segment"]


__all__ = ["MEASURED_FIELDS", "check_call_costs", "check_measured"]
