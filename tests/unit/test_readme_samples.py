"""The README's sample outputs are what the commands print today: scripts/readme_samples.py
reruns every sample not marked ``not regenerated`` (plan, estimate, reshape, timeline, simulate,
streams, the refusals) and none may be stale; its masks and elisions are checked too."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("readme_samples",
                                                  ROOT / "scripts" / "readme_samples.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["readme_samples"] = module
    spec.loader.exec_module(module)
    return module


def test_every_regenerated_readme_sample_is_up_to_date() -> None:
    script = _script()
    samples = script.find_samples((ROOT / "README.md").read_text().split("\n"))
    regenerated = [s for s in samples if s.skip_reason is None]
    assert len(regenerated) >= 10 and all(s.skip_reason for s in samples if s not in regenerated)
    stale = [s.title for s in regenerated if script.regenerate(s)]
    assert not stale, ("README samples no longer match the commands; run "
                       f"python scripts/readme_samples.py: {stale}")


def test_elisions_and_masks_match_and_realign() -> None:
    script = _script()
    out = ["head", "a 1.0 s", "x", "y", "tail"]
    assert script.matches(["head", "a ... s", "...", "tail"], out)
    assert not script.matches(["head", "...", "z"], out)
    assert script.mask("searched 9, in 0.42 s CPU; gap 0%  \n") == ["searched 9, in ... s CPU; gap 0%"]
    # a changed line inside a shown run is taken from the output, the elision kept
    assert script.realign(["head", "a ... s", "...", "tail 2"], out) == \
        ["head", "a ... s", "...", "tail"]
    assert script.realign(["old"], out) == out  # nothing elided: the whole output
