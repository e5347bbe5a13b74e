"""bench/gpu_suite.py's CPU smoke test runs every section end to end and writes a complete JSON
(the GPU figures themselves need CUDA; this checks the script, not the numbers)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_gpu_suite_cpu_smoke_runs_every_section(tmp_path: Path) -> None:
    out = tmp_path / "gpu_suite.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_suite.py"), "--device", "cpu",
         "--models", "gpt-tiny", "--micro-batches", "1", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=110, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "== summary" in done.stdout

    result = json.loads(out.read_text())
    assert result["complete"] and result["meta"]["device_type"] == "cpu"
    sections = result["sections"]
    assert {name: section["status"] for name, section in sections.items()} == {
        "ceilings": "ok", "step": "ok", "streams": "ok"}
    (case,) = sections["step"]["cases"]
    assert case["status"] == "ok" and case["mode"] == "eager" and case["model"] == "gpt-tiny"
    assert all(math.isfinite(loss) for loss in case["losses"])
    assert case["measured_step_s"] > 0 and case["predicted_step_s"] > 0
    assert case["fwd_bwd_s"] > 0 and case["optimizer_s"] > 0
    ceilings = sections["ceilings"]["cases"]
    assert ceilings and all(c["status"] in ("ok", "skipped: budget") for c in ceilings), ceilings
    assert [c["status"] for c in sections["streams"]["cases"]] == ["ok"]
