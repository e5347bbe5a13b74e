"""The model catalog and the one entry point that turns a name, a config file or a factory
into a ModelSpec."""

from __future__ import annotations

from pathlib import Path

from meshmorph.spec.model import ModelSpec
from meshmorph.spec.transformer import TransformerShape, build_transformer


def _gpt(name: str, layers: int, hidden: int, heads: int, *, vocab: int = 50257, seq: int = 2048,
         **kw: object) -> TransformerShape:
    return TransformerShape(name=name, arch="gpt", num_layers=layers, hidden_size=hidden,
                            num_heads=heads, vocab_size=vocab, seq_len=seq, **kw)  # type: ignore[arg-type]


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int,
           seq: int, **kw: object) -> TransformerShape:
    return TransformerShape(name=name, arch="llama", num_layers=layers, hidden_size=hidden,
                            num_heads=heads, num_kv_heads=kv, ffn_hidden_size=ffn,
                            vocab_size=vocab, seq_len=seq, **kw)  # type: ignore[arg-type]


# GPT-3 sizes from Brown et al. 2020, Table 2.1 (13B's d_model printed as 5140 is 5120 = 40 x 128).
# Llama 2 from Touvron et al. 2023; Llama 3 / 3.1 from the Llama 3 herd paper (Table 3).
MODEL_CATALOG: dict[str, TransformerShape] = {
    shape.name: shape
    for shape in (
        _gpt("gpt3-125m", 12, 768, 12),
        _gpt("gpt3-350m", 24, 1024, 16),
        _gpt("gpt3-760m", 24, 1536, 16),
        _gpt("gpt3-1.3b", 24, 2048, 16),
        _gpt("gpt3-2.7b", 32, 2560, 32),
        _gpt("gpt3-6.7b", 32, 4096, 32),
        _gpt("gpt3-13b", 40, 5120, 40),
        _gpt("gpt3-175b", 96, 12288, 96),
        _gpt("bert-large", 24, 1024, 16, vocab=30522, seq=512),
        _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
        _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
        _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
        # Qwen2.5-32B's shape (Hugging Face Qwen2.5-32B config.json: 64 layers, hidden 5120,
        # 40 heads / 8 kv heads, intermediate 27648, vocab 152064, untied head, 32K context);
        # its q/k/v biases (0.01% of the parameters) are left out
        _llama("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, 32768),
        # Llama 3.2 1B (Hugging Face Llama-3.2-1B config.json): the head shares the embedding
        # (tie_word_embeddings true), so 1,235,814,400 parameters
        _llama("llama3.2-1b", 16, 2048, 32, 8, 8192, 128256, 8192, tied_embeddings=True),
        # small models that train on CPU: tests, the demo and examples
        _gpt("gpt-tiny", 4, 64, 4, vocab=256, seq=32),
        _gpt("gpt-small", 6, 256, 8, vocab=256, seq=128),
        _llama("llama-tiny", 4, 64, 4, 2, 192, 256, 32),
    )
}


def catalog_model(name: str, seq_len: int | None = None) -> ModelSpec:
    """A catalog model, at its own context length or at ``seq_len``."""
    try:
        shape = MODEL_CATALOG[name]
    except KeyError:
        known = ", ".join(MODEL_CATALOG)
        raise ValueError(f"unknown model {name!r}; known models: {known} "
                         "(or pass a config.json path or a package.module:function)") from None
    spec = build_transformer(shape)
    return spec.with_seq_len(seq_len) if seq_len else spec


def load_model(source: str, seq_len: int | None = None) -> ModelSpec:
    """A ModelSpec from a catalog name, a Hugging Face ``config.json`` path, or a factory
    ``package.module:function`` that returns an ``nn.Module`` (traced on the meta device)."""
    if source in MODEL_CATALOG:
        return catalog_model(source, seq_len)
    if source.endswith(".json") or Path(source).is_file() or (source and Path(source).is_dir()):
        from meshmorph.spec.hf_config import from_hf_config

        return from_hf_config(Path(source), seq_len=seq_len)
    if ":" in source:
        from meshmorph.spec.trace import trace_factory

        return trace_factory(source, seq_len=seq_len or 512)
    return catalog_model(source, seq_len)
