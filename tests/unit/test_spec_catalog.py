"""Model and GPU catalogs against the published figures, and the cluster shorthand."""

from __future__ import annotations

import pytest

from meshmorph.spec import (
    GPU_CATALOG,
    MODEL_CATALOG,
    LayerKind,
    Recompute,
    TransformerShape,
    build_transformer,
    catalog_model,
    gpu,
    link,
    parse_cluster,
)


@pytest.mark.parametrize("name", sorted(MODEL_CATALOG))
def test_every_catalog_model_builds_with_one_block_per_layer(name):
    shape, spec = MODEL_CATALOG[name], catalog_model(name)
    assert spec.num_blocks == shape.num_layers and spec.num_layers == shape.num_layers + 2
    assert [layer.kind for layer in spec.layers] == (
        [LayerKind.EMBEDDING] + [LayerKind.BLOCK] * shape.num_layers + [LayerKind.HEAD])
    assert spec.num_params > 0 and spec.seq_len == shape.seq_len
    assert spec.with_seq_len(spec.seq_len * 2).with_seq_len(spec.seq_len) == spec


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("llama2-7b", 6_738_415_616),  # Hugging Face Llama-2-7b-hf
        ("llama2-13b", 13_015_864_320),
        ("llama2-70b", 68_976_648_192),
        ("llama3-8b", 8_030_261_248),  # Hugging Face Meta-Llama-3-8B
        ("llama3-70b", 70_553_706_496),
        ("llama3-405b", 405_853_388_800),
    ],
)
def test_llama_catalog_parameters_equal_the_released_checkpoints(name, params):
    assert catalog_model(name).num_params == params


def test_gpt3_175b_has_174_6_billion_parameters():
    assert catalog_model("gpt3-175b").num_params == pytest.approx(174.6e9, rel=1e-3)


def test_narayanan_eq2_parameter_count_differs_only_by_the_final_layernorm():
    L, h, V, s = 128, 25600, 51200, 2048
    spec = build_transformer(TransformerShape(name="1t", arch="gpt", num_layers=L, hidden_size=h,
                                              num_heads=160, vocab_size=V, seq_len=s))
    eq2 = 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))  # Narayanan et al. 2021 Eq. 2
    assert round(eq2 / 1e9, 1) == 1008.0
    # Eq. 2 = 12Lh^2 + 13Lh + (V + s)h exactly; we also count the final LayerNorm's weight and bias
    assert spec.num_params - round(eq2) == 2 * h == 51_200


def _korthikanti_block(seq: int = 2048, hidden: int = 12288, heads: int = 96):
    shape = TransformerShape(name="k", arch="gpt", num_layers=1, hidden_size=hidden, num_heads=heads,
                             vocab_size=51200, seq_len=seq, flash_attention=False, dropout=True)
    return build_transformer(shape).layers[1]


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_block_activation_bytes_equal_korthikanti_table_2(t):
    s, b, h, a = 2048, 1, 12288, 96
    act = _korthikanti_block(s, h, a).activation
    tokens = s * b

    def per_layer(mode: Recompute, sp: bool) -> float:
        return act[mode].per_rank(t, sp) * tokens

    assert per_layer(Recompute.NONE, False) == s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert per_layer(Recompute.NONE, True) == s * b * h / t * (34 + 5 * a * s / h)
    assert per_layer(Recompute.SELECTIVE, False) == s * b * h * (10 + 24 / t)
    assert per_layer(Recompute.SELECTIVE, True) == 34 * s * b * h / t
    assert per_layer(Recompute.FULL, False) == 2 * s * b * h
    assert per_layer(Recompute.FULL, True) == 2 * s * b * h / t
    if t == 1:  # no parallelism: s*b*h*(34 + 5as/h) = 2.67 GiB per GPT-3 175B layer at s = 2048
        assert per_layer(Recompute.NONE, False) == s * b * h * (34 + 5 * a * s / h) == 2_868_903_936


# dense 16-bit tensor peaks, TFLOP/s, from the vendors' data sheets (never the with-sparsity figure)
DENSE_16BIT_TFLOPS = {
    "k80": 4.37, "p100": 21.2, "v100-16g": 125.0, "v100-32g": 125.0, "t4": 65.0, "a10": 125.0,
    "l4": 121.0, "a100-40g": 312.0, "a100-80g": 312.0, "h100": 989.4, "h200": 989.4, "mi300x": 1307.4,
}
MEMORY_GIB = {"k80": 12, "p100": 16, "v100-16g": 16, "v100-32g": 32, "t4": 16, "a10": 24, "l4": 24,
              "a100-40g": 40, "a100-80g": 80, "h100": 80, "h200": 141, "mi300x": 192}


@pytest.mark.parametrize("name", sorted(DENSE_16BIT_TFLOPS))
def test_gpu_catalog_has_the_dense_16bit_peak_and_memory_of_the_data_sheet(name):
    spec = gpu(name)
    assert spec.peak_flops("bf16") == DENSE_16BIT_TFLOPS[name] * 1e12  # falls back to fp16 pre-Ampere
    assert spec.peak_flops("fp16") == DENSE_16BIT_TFLOPS[name] * 1e12
    assert spec.memory_gib == MEMORY_GIB[name]
    assert link(spec.intra_node_link) and link(spec.inter_node_link)


def test_gpu_names_are_case_insensitive_and_unknown_ones_list_the_catalog():
    assert gpu("H100") is GPU_CATALOG["h100"]
    with pytest.raises(ValueError, match=r"unknown GPU 'b300'; known: k80, p100, .*mi300x"):
        gpu("b300")


def test_shorthand_mixed_cluster_numbers_ranks_and_picks_the_slowest_nic():
    cluster = parse_cluster("h100:4x8+a100-80g:2x4")
    assert (cluster.world_size, cluster.num_nodes, cluster.gpus_per_node) == (40, 6, 4)
    assert cluster.inter_link == link("ib-hdr") and not cluster.homogeneous
    assert [g.intra_link.name for g in cluster.groups] == ["nvlink4", "nvlink3"]
    assert cluster.describe() == "h100:4x8+a100-80g:2x4"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("h100", r"cannot read cluster 'h100': expected GPU:NODESxPER_NODE such as 'h100:8x8'"),
        ("h100:4x8+", "cannot read cluster"),
        ("h100:4by8", "cannot read cluster"),
        ("tpu:1x8", r"unknown GPU 'tpu'; known: k80"),
        ("h100:0x8", "a node group needs at least one node of at least one GPU, got 0x8"),
    ],
)
def test_parse_cluster_errors_say_what_was_expected(text, message):
    with pytest.raises(ValueError, match=message):
        parse_cluster(text)
