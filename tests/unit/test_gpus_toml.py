"""GPUs and links described in TOML: ``meshmorph gpus --gpus FILE`` and a cluster file's own GPUs."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshmorph.cli import main
from meshmorph.spec import gpus as gpus_module
from meshmorph.spec.cluster_toml import load_cluster_toml
from meshmorph.spec.gpus import GPU_CATALOG, LINKS, gpu, load_gpus_toml

USER_GPUS = '''
[links.roce-400g]
bandwidth_gbps = 50
latency_us = 6

[gpus.h100]
spot_price_per_hour = 2.25
price_date = "2026-11"
price_source = "quote"

[gpus.my-accel]
description = "an accelerator not in the catalog"
memory_gib = 96
hbm_gbps = 4000
peak_tflops = { bf16 = 800, fp32 = 60 }
intra_node_link = "nvlink4"
inter_node_link = "roce-400g"
price_per_hour = 5.0
'''


@pytest.fixture(autouse=True)
def restore_catalog() -> Iterator[None]:
    gpus, links = dict(GPU_CATALOG), dict(LINKS)
    yield
    GPU_CATALOG.clear(), GPU_CATALOG.update(gpus)
    LINKS.clear(), LINKS.update(links)


def test_a_gpu_file_adds_a_gpu_and_a_link_and_dates_a_catalog_price(tmp_path: Path) -> None:
    path = tmp_path / "gpus.toml"
    path.write_text(USER_GPUS)
    defined = load_gpus_toml(path)
    assert set(defined) == {"h100", "my-accel"}
    h100 = gpu("h100")
    assert (h100.spot_price_per_hour, h100.price_date, h100.memory_gib) == (2.25, "2026-11", 80)
    mine = gpu("my-accel")
    assert (mine.memory_gib, mine.peak_flops("bf16"), mine.inter_node_link) == (96, 800e12, "roce-400g")
    assert gpus_module.link("roce-400g").bandwidth_gbps == 50


def test_gpus_command_lists_the_file_entries_with_prices_and_links(tmp_path: Path) -> None:
    path, out_json = tmp_path / "gpus.toml", tmp_path / "gpus.json"
    path.write_text(USER_GPUS)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["gpus", "--gpus", str(path), "--json", str(out_json)]) == 0
    rows = {r["name"]: r for r in json.loads(out_json.read_text())["gpus"]}
    assert rows["my-accel"]["inter_node"] == {"name": "roce-400g", "bandwidth_gbps": 50.0,
                                              "latency_us": 6.0}
    assert (rows["h100"]["spot_price_per_hour"], rows["h100"]["price_date"]) == (2.25, "2026-11")
    assert (rows["k80"]["price_per_hour"], rows["k80"]["spot_price_per_hour"],
            rows["k80"]["price_date"]) == (0.44, 0.22, "2017-12")
    assert "my-accel" in out.getvalue() and "roce-400g" in out.getvalue()


def test_a_cluster_file_may_define_its_own_gpu_without_touching_the_catalog(tmp_path: Path) -> None:
    path = tmp_path / "lab.toml"
    path.write_text('provider = "aws-spot"\n' + USER_GPUS.replace("[gpus.h100]", "[gpus.h100x]")
                    .replace('spot_price_per_hour = 2.25', 'memory_gib = 80\nhbm_gbps = 3350\n'
                             'peak_tflops = { bf16 = 989.4 }') +
                    '\n[[groups]]\ngpu = "my-accel"\nnodes = 2\ngpus_per_node = 8\n')
    cluster = load_cluster_toml(path)
    assert cluster.provider == "aws-spot"
    assert (cluster.groups[0].gpu.memory_gib, cluster.inter_link.name) == (96, "roce-400g")
    assert "my-accel" not in GPU_CATALOG and "roce-400g" not in LINKS


@pytest.mark.parametrize(("text", "message"), [
    ("[gpus.new]\nmemory_gib = 10\n", "new GPU 'new' needs hbm_gbps, peak_tflops"),
    ("[gpus.h100]\nmemory = 10\n", "unknown key 'memory' in \\[gpus.h100\\]; valid keys"),
    ("[gpus.h100]\nmemory_gib = -1\n", "memory_gib must be a number >= 0"),
    ("[gpus.h100]\nintra_node_link = \"warp\"\n", "unknown intra_node_link 'warp'"),
    ("[gpu.h100]\n", "unknown table 'gpu'"),
    ("[gpus.h100]\npeak_tflops = { bf16 = 0 }\n", r"peak_tflops.bf16 must be a finite number > 0"),
    ("[gpus.h100]\nhbm_gbps = 0\n", "hbm_gbps must be a finite number > 0"),
    ("[gpus.h100]\nmemory_gib = 0\n", "memory_gib must be a finite number > 0"),
    ("[links.slow]\nbandwidth_gbps = 0\nlatency_us = 5\n", "bandwidth_gbps must be a finite number > 0"),
])
def test_bad_gpu_files_name_the_failed_constraint(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_gpus_toml(path)


@pytest.mark.parametrize("table", ['[gpus.h100]\npeak_tflops = { bf16 = 0 }',
                                   '[links.ib-ndr]\nbandwidth_gbps = 0\nlatency_us = 5'])
def test_a_zero_rate_in_a_cluster_file_is_one_line_not_a_division_by_zero(
        tmp_path: Path, capsys: pytest.CaptureFixture, table: str) -> None:
    path = tmp_path / "zero.toml"
    path.write_text(table + '\n\n[[groups]]\ngpu = "h100"\nnodes = 2\ngpus_per_node = 8\n')
    code = main(["plan", "--model", "gpt3-1.3b", "--cluster", str(path), "--global-batch", "64"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("meshmorph: error: ") and err.count("\n") == 1, err
    assert "must be a finite number > 0" in err
