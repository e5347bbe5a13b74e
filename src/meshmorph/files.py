"""Reading a user's JSON or TOML file: one reader for every file format meshmorph takes (job,
plan, cluster, GPU, cloud catalog, Hugging Face config, profile, trace), so every failure reads
alike: the file, what it should have been, what is wrong, and a way out.

A leaf module: it imports nothing of meshmorph, so every package may use it.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

_PARSERS = {"json": (json.loads, json.JSONDecodeError, "JSON", "a JSON object"),
            "toml": (tomllib.loads, tomllib.TOMLDecodeError, "TOML", "TOML tables")}


def read_document(path: str | Path, *, what: str, way_out: str, fmt: str | None = None,
                  error: type[Exception] = ValueError) -> dict[str, Any]:
    """The top-level table of the JSON or TOML file ``path`` (``fmt``, or by its suffix: ``.toml``
    is TOML, anything else JSON). ``what`` names the file for the user ("job file"), ``way_out``
    says what to do ("pass a job TOML ..."); a missing file is a FileNotFoundError, anything else
    that stops the read (unreadable, not text, empty, not valid, not a table) is ``error``."""
    path = Path(path)
    fmt = fmt or ("toml" if path.suffix == ".toml" else "json")
    parse, decode_error, name, table = _PARSERS[fmt]
    if not path.is_file():
        if path.is_dir():
            raise error(f"{what} {path} is a folder; {way_out}")
        raise FileNotFoundError(f"{what} {path} does not exist; {way_out}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise error(f"{what} {path} is not text (binary data) and so is not valid {name}; "
                    f"{way_out}") from None
    except OSError as exc:
        raise error(f"{what} {path} cannot be read ({exc.strerror}); {way_out}") from None
    if fmt == "json" and not text.strip():  # (an empty TOML file is an empty table)
        raise error(f"{what} {path} is empty; {way_out}")
    try:
        data = parse(text)
    except (decode_error, ValueError) as exc:  # ValueError: an integer of over 4,300 digits
        raise error(f"{what} {path} is not valid {name}: {exc}; {way_out}") from None
    except RecursionError:
        raise error(f"{what} {path} is not valid {name}: it nests deeper than Python can read; "
                    f"{way_out}") from None
    if not isinstance(data, dict):
        raise error(f"{what} {path} must hold {table}, got {type(data).__name__}; {way_out}")
    return data
