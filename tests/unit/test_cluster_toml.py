"""Cluster TOML files: the same Cluster as the shorthand for the same layout, and clear errors."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from meshmorph.spec import LINKS, LinkSpec, gpu, parse_cluster
from meshmorph.spec.cluster_toml import load_cluster_toml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"


def _write(tmp_path: Path, text: str, name: str = "cluster.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_mixed_example_equals_the_shorthand_for_the_same_layout():
    shorthand = parse_cluster("h100:4x8+a100-80g:4x8")
    from_file = load_cluster_toml(EXAMPLES / "mixed-h100-a100.toml")
    assert from_file == replace(shorthand, name="mixed-h100-a100")
    assert (from_file.world_size, from_file.num_nodes, from_file.homogeneous) == (64, 8, False)
    assert from_file.inter_link == LINKS["ib-hdr"]  # the slower default NIC of h100 (ndr) and a100 (hdr)


def test_minimal_toml_uses_the_same_defaults_as_the_shorthand(tmp_path):
    path = _write(tmp_path, '[[groups]]\ngpu = "A100-40G"\nnodes = 2\ngpus_per_node = 4\n', "lab.toml")
    cluster = load_cluster_toml(path)
    assert cluster == replace(parse_cluster("a100-40g:2x4"), name="lab")
    assert parse_cluster(str(path)) == cluster  # the shorthand parser reads .toml files too


def test_spot_example_has_custom_inter_node_link_prices_and_transient_nodes():
    cluster = load_cluster_toml(EXAMPLES / "h100-spot.toml")
    assert cluster.inter_link == LinkSpec(name="ib-ndr-custom", bandwidth_gbps=12.5, latency_us=8.0)
    reserved, spot = cluster.groups
    assert (reserved.transient, reserved.price_per_gpu_hour, reserved.num_gpus) == (False, 6.98, 16)
    assert (spot.transient, spot.price_per_gpu_hour, spot.num_gpus) == (True, 2.5, 48)
    assert spot.intra_link == LINKS["nvlink4"] and cluster.world_size == 64


def test_custom_intra_node_figures_override_the_named_link(tmp_path):
    cluster = load_cluster_toml(_write(tmp_path, """
name = "pcie-box"
inter_node_link = "eth-100g"
[inter_node]
latency_us = 40
[[groups]]
gpu = "l4"
nodes = 1
gpus_per_node = 8
intra_node_link = "pcie5"
intra_node_bandwidth_gbps = 32
"""))
    assert cluster.groups[0].intra_link == LinkSpec(name="pcie5-custom", bandwidth_gbps=32.0, latency_us=8.0)
    assert cluster.inter_link == LinkSpec(name="eth-100g-custom", bandwidth_gbps=100 / 64, latency_us=40.0)
    assert (cluster.name, cluster.groups[0].gpu) == ("pcie-box", gpu("l4"))


GROUP = '[[groups]]\ngpu = "h100"\nnodes = 2\ngpus_per_node = 8\n'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[groups]]\ngpu = "h1000"\nnodes = 1\ngpus_per_node = 8\n',
         r"unknown gpu 'h1000' in \[\[groups\]\] #1; valid GPUs: k80, .*h100, h200, mi300x"),
        ('[[groups]]\ngpu = "h100"\ngpus_per_node = 8\n', r"\[\[groups\]\] #1 is missing nodes \(every group needs gpu, nodes, gpus_per_node\)"),
        (GROUP.replace("nodes = 2", "nodes = 0"), "nodes in .* must be a positive integer, got 0"),
        (GROUP.replace("nodes = 2", "nodes = 2.5"), "nodes in .* must be a positive integer, got 2.5"),
        (GROUP.replace("= 8", "= true"), "gpus_per_node in .* must be a positive integer, got True"),
        (GROUP + 'intra_node_link = "nvlink9"\n',
         r"unknown intra_node_link 'nvlink9' in \[\[groups\]\] #1; valid links: pcie3, .*nvlink4"),
        ('inter_node_link = "fast"\n' + GROUP, "unknown inter_node_link 'fast' in the top level"),
        (GROUP + "intra_node_bandwidth_gbps = -3\n", "intra_node_bandwidth_gbps .* must be a positive number"),
        (GROUP + "price_per_gpu_hour = 'cheap'\n", "price_per_gpu_hour .* must be a number >= 0"),
        (GROUP + 'transient = "yes"\n', "transient in .* must be true or false"),
        (GROUP + "gpu_count = 8\n", r"unknown key 'gpu_count' in \[\[groups\]\] #1; valid keys: gpu, nodes"),
        ("[inter_node]\nbandwidth = 5\n" + GROUP, r"unknown key 'bandwidth' in \[inter_node\]; valid keys: bandwidth_gbps"),
        ("[inter_node]\nbandwidth_gbps = 0\n" + GROUP, "bandwidth_gbps in .* must be a positive number, got 0"),
        ('name = "empty"\n', r"needs at least one \[\[groups\]\] table"),
        ("groups = [1, 2]\n", r"\[\[groups\]\] #1 must be a table"),
        ("name = \n", "is not valid TOML"),
    ],
)
def test_bad_cluster_files_name_the_key_the_file_and_the_choices(tmp_path, text, message):
    path = _write(tmp_path, text, "bad.toml")
    with pytest.raises(ValueError, match=message) as info:
        load_cluster_toml(path)
    assert str(path) in str(info.value)


def test_missing_cluster_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"cluster file .*absent.toml does not exist"):
        parse_cluster(str(tmp_path / "absent.toml"))
