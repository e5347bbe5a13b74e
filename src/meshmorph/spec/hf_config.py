"""Import a Hugging Face ``config.json`` as a ModelSpec.

Two layouts are read:

- GPT-2 style (``n_layer, n_embd, n_head, vocab_size, n_positions``; optional ``n_inner``,
  ``tie_word_embeddings``): LayerNorm, GeLU MLP, learned positions -> arch ``gpt``.
- Llama style (``num_hidden_layers, hidden_size, num_attention_heads, intermediate_size,
  vocab_size, max_position_embeddings``; optional ``num_key_value_heads``,
  ``tie_word_embeddings``): RMSNorm, SwiGLU, RoPE, grouped-query attention -> arch ``llama``.
  Mistral, Qwen2 and other configs that use the same keys and a SiLU activation read the same way
  (attention biases, where a model has them, are not counted).

Both layouts also read how the run computed attention and whether it dropped out, so a published
run is expressible as it ran: ``attn_implementation`` (or ``_attn_implementation``) ``"eager"``
keeps the s x s attention scores for backward (as Megatron did before flash attention), while
``"sdpa"``, ``"flash_attention_2"``, ``"flash_attention_3"`` and ``"flex_attention"`` keep none
(the default: meshmorph's runtime runs ``scaled_dot_product_attention``); a dropout probability
above zero in ``attention_dropout``, ``hidden_dropout``, ``attn_pdrop``, ``resid_pdrop`` or
``embd_pdrop`` keeps Megatron's dropout masks (``TransformerShape.dropout``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshmorph.files import read_document
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.transformer import TransformerShape, build_transformer

_GPT_KEYS = ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions")
_LLAMA_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
               "vocab_size", "max_position_embeddings")
_LAYOUTS = (
    f"GPT-2 style ({', '.join(_GPT_KEYS)}; optional n_inner, tie_word_embeddings) or "
    f"Llama style ({', '.join(_LLAMA_KEYS)}; optional num_key_value_heads, tie_word_embeddings)"
)
_SWIGLU_ACTIVATIONS = ("silu", "swish", "swiglu")
_FUSED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
"""``attn_implementation`` values whose kernels keep no s x s scores for backward."""
_EAGER_ATTENTION = "eager"
_DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop")


def from_hf_config(path: Path | str, seq_len: int | None = None) -> ModelSpec:
    """A ModelSpec from a Hugging Face ``config.json``, at the config's context length
    (``n_positions`` / ``max_position_embeddings``) or at ``seq_len``."""
    path = Path(path)
    config = read_document(path, what="model config", fmt="json", way_out=(
        "pass the path of a Hugging Face config.json, a catalog name (meshmorph models) or a "
        "package.module:function factory"))
    if "n_layer" in config:
        read = _gpt_shape
    elif "num_hidden_layers" in config:
        read = _llama_shape
    else:
        raise ValueError(f"{path}: unknown config layout; meshmorph reads {_LAYOUTS}")
    try:
        shape = read(config, path, seq_len)
    except ValueError as exc:  # TransformerShape's own checks (heads dividing the width, ...)
        message = str(exc)
        raise ValueError(message if message.startswith(str(path)) else f"{path}: {message}") from None
    return build_transformer(shape)


def _name(config: dict[str, Any], path: Path) -> str:
    """``_name_or_path`` if the config has one, else the file stem (the folder for ``config.json``)."""
    name = config.get("_name_or_path")
    if isinstance(name, str) and name:
        return name
    if path.stem == "config" and path.resolve().parent.name:
        return path.resolve().parent.name
    return path.stem


def _require(config: dict[str, Any], keys: tuple[str, ...], path: Path, layout: str,
             optional: tuple[str, ...] = ()) -> None:
    missing = [key for key in keys if key not in config and key not in optional]
    if missing:
        raise ValueError(
            f"{path}: {layout} config is missing {', '.join(missing)}; meshmorph reads {_LAYOUTS}"
        )
    for key in keys:
        value = config.get(key)
        if key in config and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{path}: {key} must be a positive integer, got {value!r}")


def _tied(config: dict[str, Any], path: Path, default: bool) -> bool:
    value = config.get("tie_word_embeddings", default)
    if not isinstance(value, bool):
        raise ValueError(f"{path}: tie_word_embeddings must be true or false, got {value!r}")
    return value


def _flash(config: dict[str, Any], path: Path) -> bool | None:
    """Whether the run's attention kept no s x s scores (None: not stated, the runtime's)."""
    keys = [key for key in ("attn_implementation", "_attn_implementation") if key in config]
    if not keys or config[keys[0]] is None:
        return None
    value = config[keys[0]]
    if value == _EAGER_ATTENTION:
        return False
    if value in _FUSED_ATTENTION:
        return True
    raise ValueError(f"{path}: {keys[0]} {value!r} is not one of "
                     f"{', '.join((_EAGER_ATTENTION, *_FUSED_ATTENTION))}; use 'eager' for a run that "
                     "kept the attention scores, 'sdpa' for one that did not")


def _dropout(config: dict[str, Any], path: Path) -> bool:
    """Whether any dropout probability of the config is above zero."""
    for key in _DROPOUT_KEYS:
        value = config.get(key, 0.0)
        if value is None:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < 1:
            raise ValueError(f"{path}: {key} must be a probability in [0, 1), got {value!r}")
        if value > 0:
            return True
    return False


def _context(config: dict[str, Any], key: str, seq_len: int | None) -> int:
    if seq_len is None:
        return int(config[key])
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    return seq_len


def _gpt_shape(config: dict[str, Any], path: Path, seq_len: int | None) -> TransformerShape:
    _require(config, _GPT_KEYS, path, "GPT-2 style", optional=("n_positions",) if seq_len else ())
    s = _context(config, "n_positions", seq_len)
    if "n_positions" in config and s > config["n_positions"]:
        raise ValueError(
            f"{path}: seq_len {s} exceeds n_positions {config['n_positions']} (GPT-2 style models "
            "learn one embedding per position); use seq_len <= n_positions"
        )
    inner = config.get("n_inner")  # None (the usual value) means 4 * n_embd
    if inner is not None and (not isinstance(inner, int) or isinstance(inner, bool) or inner <= 0):
        raise ValueError(f"{path}: n_inner must be a positive integer or null, got {inner!r}")
    return TransformerShape(
        name=_name(config, path), arch="gpt", num_layers=config["n_layer"],
        hidden_size=config["n_embd"], num_heads=config["n_head"], vocab_size=config["vocab_size"],
        seq_len=s, ffn_hidden_size=inner,
        tied_embeddings=_tied(config, path, True),  # HF's GPT-2 default
        flash_attention=_flash(config, path), dropout=_dropout(config, path))


def _llama_shape(config: dict[str, Any], path: Path, seq_len: int | None) -> TransformerShape:
    optional = ("max_position_embeddings",) if seq_len else ()
    _require(config, _LLAMA_KEYS, path, "Llama style", optional=optional)
    activation = config.get("hidden_act", "silu")
    if activation not in _SWIGLU_ACTIVATIONS:
        raise ValueError(
            f"{path}: hidden_act {activation!r} is not a SwiGLU activation; Llama style configs "
            f"must use one of {', '.join(_SWIGLU_ACTIVATIONS)} (for a GeLU MLP write a GPT-2 style "
            "config, or trace the model with package.module:function)"
        )
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else kv_heads  # absent or null: no GQA
    if not isinstance(kv_heads, int) or isinstance(kv_heads, bool) or kv_heads <= 0 \
            or heads % kv_heads:
        raise ValueError(f"{path}: num_key_value_heads {kv_heads!r} must be a positive divisor of "
                         f"num_attention_heads {heads}")
    return TransformerShape(
        name=_name(config, path), arch="llama", num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"], num_heads=heads, num_kv_heads=kv_heads,
        ffn_hidden_size=config["intermediate_size"], vocab_size=config["vocab_size"],
        seq_len=_context(config, "max_position_embeddings", seq_len),
        tied_embeddings=_tied(config, path, False),  # HF's Llama default
        flash_attention=_flash(config, path), dropout=_dropout(config, path))
