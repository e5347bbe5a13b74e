"""Reading a plan file for a command: every way a file can be wrong becomes one PlanError.

``Plan.load`` reads well-formed plans; a file that is empty, binary, not an object, or whose
values have the wrong types would otherwise surface as a TypeError or KeyError from deep inside.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from meshmorph.files import read_document
from meshmorph.spec.plan import Plan, PlanError

_INTEGERS = ("seq_len", "global_batch", "tp", "pp", "dp", "cp", "zero", "micro_batch",
             "num_microbatches", "vpp", "world_size")

_WAY_OUT = ("write it with 'meshmorph plan --json' or 'meshmorph estimate --json', or fix it by "
            f"hand (keys: {', '.join(f.name for f in fields(Plan) if f.name != 'predicted')})")


def _plan_data(path: Path) -> dict[str, Any]:
    data = read_document(path, what="plan file", way_out=_WAY_OUT, fmt="json", error=PlanError)
    if "plans" in data:  # `meshmorph plan --json`: the best plan first
        plans = data["plans"]
        if not isinstance(plans, list) or not plans:
            raise PlanError(f"plan file {path} lists no plans under 'plans'; {_WAY_OUT}")
        data = plans[0]
    if not isinstance(data, dict):
        raise PlanError(f"plan file {path} must hold a JSON object in 'plans', got "
                        f"{type(data).__name__}; {_WAY_OUT}")
    for key in _INTEGERS:
        value = data.get(key)
        if key in data and (not isinstance(value, int) or isinstance(value, bool)):
            raise PlanError(f"plan file {path}: {key} must be an integer, got {value!r}")
    return data


def load_plan(path: str | Path) -> Plan:
    """The plan in ``path`` (the best one of a ``meshmorph plan --json`` file)."""
    path = Path(path)
    if path.is_dir():
        raise PlanError(f"plan file {path} is a folder; pass the path of a plan JSON file")
    if not path.is_file():
        raise PlanError(f"plan file {path} does not exist; {_WAY_OUT}")
    data = _plan_data(path)
    try:
        return Plan.from_dict(data)
    except PlanError as exc:
        raise PlanError(f"plan file {path}: {exc}") from None
    except (TypeError, KeyError, IndexError, AttributeError, ValueError) as exc:
        what = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        raise PlanError(f"plan file {path} does not hold a valid plan ({what}); {_WAY_OUT}") from None
