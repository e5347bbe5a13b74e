"""Hugging Face config.json import: parameter counts equal to the published models, and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshmorph.spec import LayerKind, catalog_model, load_model
from meshmorph.spec.hf_config import from_hf_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"

LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
}
LLAMA3_8B = {**LLAMA2_7B, "intermediate_size": 14336, "num_key_value_heads": 8,
             "vocab_size": 128256, "max_position_embeddings": 8192}
GPT2_SMALL = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
              "n_positions": 1024, "n_inner": None}


def _write(tmp_path: Path, config: dict, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def test_llama2_7b_config_counts_exactly_the_catalog_parameters(tmp_path):
    spec = from_hf_config(_write(tmp_path, LLAMA2_7B, "llama2-7b.json"))
    assert spec.num_params == catalog_model("llama2-7b").num_params == 6_738_415_616
    assert (spec.arch, spec.name, spec.seq_len, spec.num_blocks) == ("llama", "llama2-7b", 4096, 32)
    assert spec.layers == catalog_model("llama2-7b").layers


def test_llama3_8b_gqa_config_counts_8_030_261_248_parameters(tmp_path):
    spec = from_hf_config(_write(tmp_path, LLAMA3_8B))
    assert spec.num_params == 8_030_261_248
    assert (spec.num_heads, spec.num_kv_heads, spec.ffn_hidden_size) == (32, 8, 14336)
    # per block: q, o 2h^2 + k, v 2*h*(8*128) + SwiGLU 3*h*f + two RMSNorms 2h
    h, kv, f = 4096, 8 * 128, 14336
    assert spec.layers[1].params == 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h == 218_112_000
    assert spec.name == tmp_path.name  # a file named config.json is named after its folder


def test_gpt2_small_config_counts_124_439_808_with_tied_embeddings_and_learned_positions(tmp_path):
    spec = from_hf_config(_write(tmp_path, GPT2_SMALL, "gpt2.json"))
    v, s, h, L = 50257, 1024, 768, 12
    pad = (50304 - v) * h  # the runtime pads the vocabulary to a multiple of 128: 47 rows
    # token + position embeddings, 12 blocks of 12h^2 + 13h, final LayerNorm 2h; head tied
    assert spec.num_params - pad == v * h + s * h + L * (12 * h * h + 13 * h) + 2 * h == 124_439_808
    head = spec.layers[-1]
    assert (spec.vocab_size, spec.padded_vocab_size) == (50257, 50304)
    assert (head.kind, head.tied_params, spec.tied_embeddings) == (LayerKind.HEAD, 50304 * h, True)
    assert (spec.arch, spec.seq_len, spec.ffn_hidden_size, spec.name) == ("gpt", 1024, 3072, "gpt2")


def test_untied_gpt2_counts_the_head_separately(tmp_path):
    spec = from_hf_config(_write(tmp_path, {**GPT2_SMALL, "tie_word_embeddings": False}, "g.json"))
    assert spec.num_params == 124_439_808 + 50257 * 768 + 2 * 47 * 768  # + padded rows, twice


def test_n_inner_and_seq_len_are_honoured(tmp_path):
    spec = from_hf_config(_write(tmp_path, {**GPT2_SMALL, "n_inner": 2048}, "g.json"), seq_len=256)
    assert (spec.ffn_hidden_size, spec.seq_len) == (2048, 256)
    assert spec.layers[1].params == 4 * 768 * 768 + 2 * 768 * 2048 + 9 * 768 + 2048
    llama = from_hf_config(_write(tmp_path, LLAMA3_8B, "l.json"), seq_len=2048)
    assert llama.seq_len == 2048 and llama.num_params == 8_030_261_248


def test_name_or_path_names_the_model(tmp_path):
    spec = from_hf_config(_write(tmp_path, {**LLAMA2_7B, "_name_or_path": "meta-llama/Llama-2-7b-hf"}))
    assert spec.name == "meta-llama/Llama-2-7b-hf"


def test_example_configs_load_through_load_model():
    gpt2 = load_model(str(EXAMPLES / "gpt2-config.json"))
    llama = load_model(str(EXAMPLES / "llama-config.json"), seq_len=4096)
    assert (gpt2.name, gpt2.num_params) == ("gpt2", 124_439_808 + 47 * 768)  # vocab padded to 128
    assert (llama.name, llama.num_params, llama.seq_len) == ("llama3-8b", 8_030_261_248, 4096)


def test_missing_keys_are_named_with_both_layouts(tmp_path):
    config = {k: v for k, v in LLAMA2_7B.items() if k not in ("intermediate_size", "vocab_size")}
    with pytest.raises(ValueError, match=r"Llama style config is missing intermediate_size, vocab_size; "
                       r"meshmorph reads GPT-2 style \(n_layer.*or Llama style \(num_hidden_layers"):
        from_hf_config(_write(tmp_path, config))
    with pytest.raises(ValueError, match="GPT-2 style config is missing n_head"):
        from_hf_config(_write(tmp_path, {k: v for k, v in GPT2_SMALL.items() if k != "n_head"}))


def test_unknown_layout_names_both_accepted_layouts(tmp_path):
    with pytest.raises(ValueError, match=r"unknown config layout; meshmorph reads GPT-2 style .* or Llama style"):
        from_hf_config(_write(tmp_path, {"d_model": 512, "num_layers": 6}))


def test_bad_values_and_files_get_clear_errors(tmp_path):
    cases = [
        ({**LLAMA2_7B, "num_key_value_heads": 5}, "num_key_value_heads 5 must be a positive divisor"),
        ({**LLAMA2_7B, "hidden_act": "gelu"}, "hidden_act 'gelu' is not a SwiGLU activation"),
        ({**GPT2_SMALL, "n_embd": "768"}, "n_embd must be a positive integer, got '768'"),
        ({**GPT2_SMALL, "n_head": 7}, "hidden_size 768 is not divisible by num_heads 7"),
    ]
    for config, message in cases:
        with pytest.raises(ValueError, match=message):
            from_hf_config(_write(tmp_path, config))
    with pytest.raises(ValueError, match="seq_len 2048 exceeds n_positions 1024"):
        from_hf_config(_write(tmp_path, GPT2_SMALL), seq_len=2048)
    with pytest.raises(FileNotFoundError, match="model config .*nope.json does not exist"):
        from_hf_config(tmp_path / "nope.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json is not valid JSON"):
        from_hf_config(tmp_path / "broken.json")


def _block_bytes(spec) -> dict:
    block = next(layer for layer in spec.layers if layer.kind == LayerKind.BLOCK)
    return {mode: (a.shared, a.split) for mode, a in block.activation.items()}


def test_eager_attention_keeps_the_scores_and_sdpa_matches_the_default(tmp_path):
    plain = from_hf_config(_write(tmp_path, LLAMA2_7B, "a.json"))
    sdpa = from_hf_config(_write(tmp_path, {**LLAMA2_7B, "attn_implementation": "sdpa"}, "b.json"))
    eager = from_hf_config(_write(tmp_path, {**LLAMA2_7B, "_attn_implementation": "eager"},
                                  "c.json"))
    assert _block_bytes(sdpa) == _block_bytes(plain)
    none, selective = (_block_bytes(eager)[m][1] for m in ("none", "selective"))
    # the s x s softmax output (2 a s bytes per token at 16 bits) is what selective recompute drops
    assert none - selective == 2.0 * 32 * 4096
    assert _block_bytes(plain)["none"][1] == selective


def test_a_dropout_probability_keeps_megatrons_masks(tmp_path):
    plain = _block_bytes(from_hf_config(_write(tmp_path, GPT2_SMALL, "a.json")))
    dropped = _block_bytes(from_hf_config(_write(
        tmp_path, {**GPT2_SMALL, "resid_pdrop": 0.1, "attn_pdrop": 0.0}, "b.json")))
    assert dropped["none"][0] - plain["none"][0] == 2.0 * 768  # two 1-byte residual masks
    zero = _block_bytes(from_hf_config(_write(
        tmp_path, {**GPT2_SMALL, "resid_pdrop": 0.0, "embd_pdrop": None}, "c.json")))
    assert zero == plain


@pytest.mark.parametrize(("key", "value", "match"), [
    ("attn_implementation", "paged", "is not one of eager, sdpa"),
    ("attention_dropout", 1.5, r"attention_dropout must be a probability in \[0, 1\)"),
    ("resid_pdrop", "0.1", "resid_pdrop must be a probability"),
])
def test_bad_attention_and_dropout_fields_name_the_key(tmp_path, key, value, match):
    with pytest.raises(ValueError, match=match):
        from_hf_config(_write(tmp_path, {**GPT2_SMALL, key: value}))


def test_a_billion_layers_is_refused_at_once_not_built(tmp_path):
    with pytest.raises(ValueError, match=r"num_layers 1,000,000,000 is above meshmorph's limit"):
        from_hf_config(_write(tmp_path, {**LLAMA2_7B, "num_hidden_layers": 10**9}))
