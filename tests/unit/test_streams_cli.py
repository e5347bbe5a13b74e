"""``meshmorph streams``: its JSON, its picture, user factories and errors; the overlap reader."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshmorph.cli import main
from meshmorph.cli.streams import CATALOG_NETS
from meshmorph.streams.overlap import kernel_overlap

FACTORY = '''
import torch
from torch import nn


class TwoBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.left(x)) + torch.tanh(self.right(x))


def build():
    return TwoBranch()
'''


def test_streams_subcommand_registers_without_importing_torch() -> None:
    code = ("import argparse, sys; from meshmorph.cli.streams import register; "
            "register(argparse.ArgumentParser().add_subparsers()); print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
    from meshmorph.demos.nets import NETS

    assert tuple(NETS) == CATALOG_NETS


def test_streams_cli_writes_json_and_png_for_resnet_stack(tmp_path: Path, capsys) -> None:
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    code = main(["streams", "--model", "resnet-stack", "--batch", "2", "--json", str(out_json),
                 "--png", str(out_png)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "30 ops" in printed and "width 2" in printed and "4 syncs" in printed
    report = json.loads(out_json.read_text())
    assert {"nodes", "edges", "assignment", "syncs", "width"} <= set(report)
    assert (len(report["nodes"]), report["width"], report["num_streams"]) == (30, 2, 2)
    assert set(report["assignment"]) == set(report["nodes"])
    assert len(report["syncs"]) == 4
    assert all(report["assignment"][u] != report["assignment"][v] for u, v in report["syncs"])
    assert all([u, v] in report["edges"] for u, v in report["syncs"])
    assert (report["executor_equals_eager"], report["races"]) == (True, 0)
    assert report["makespan_s"] < report["serial_time_s"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_streams_cli_loads_a_user_factory_with_an_input_shape(tmp_path: Path, capsys) -> None:
    factory = tmp_path / "two_branch.py"
    factory.write_text(FACTORY)
    out_json = tmp_path / "t.json"
    assert main(["streams", "--model", f"{factory}:build", "--json", str(out_json)]) == 2
    assert "--input-shape" in capsys.readouterr().err
    assert main(["streams", "--model", f"{factory}:build", "--input-shape", "8",
                 "--max-streams", "1", "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    assert (report["width"], report["num_streams"], report["syncs"]) == (2, 1, [])
    assert report["method"] == "width+cap 1"


@pytest.mark.parametrize("argv, message", [
    (["--model", "vgg"], "unknown net 'vgg'"),
    (["--model", "resnet-stack", "--max-streams", "0"], "--max-streams must be at least 1"),
    (["--model", "resnet-stack", "--input-shape", "3,x"], "comma-separated integers"),
])
def test_streams_cli_refuses_bad_input_with_a_way_out(argv: list[str], message: str, capsys) -> None:
    assert main(["streams", *argv]) == 2
    assert message in capsys.readouterr().err


def test_kernel_overlap_counts_time_with_two_streams_busy() -> None:
    trace = {"traceEvents": [
        {"cat": "kernel", "ts": 0, "dur": 10, "args": {"stream": 7}},
        {"cat": "kernel", "ts": 4, "dur": 10, "args": {"stream": 13}},   # overlaps 4..10
        {"cat": "kernel", "ts": 20, "dur": 5, "args": {"stream": 7}},
        {"cat": "kernel", "ts": 22, "dur": 2, "args": {"stream": 7}},    # same stream: no overlap
        {"cat": "cpu_op", "ts": 0, "dur": 100},
    ]}
    result = kernel_overlap(trace)
    assert (result.kernels, result.streams) == (4, 2)
    assert (result.busy_us, result.overlapped_us) == (19.0, 6.0)
