"""The parameter tensors of each layer of a gpt/llama decoder, with how tensor parallelism splits
them: what the runtime allocates (run/model/decoder.py), as pure Python, so the cost model can predict
byte-exact sharded and padded sizes (FSDP2 and ZeRO-1 shard every tensor by dim 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshmorph.spec.model import LayerKind, ModelSpec


@dataclass(frozen=True, slots=True)
class ParamTensor:
    """One parameter tensor of a layer."""

    name: str
    """Name inside its layer (``attn.wq.weight``)."""
    shape: tuple[int, ...]
    """Whole shape (one device)."""
    tp_dim: int | None
    """Dim tensor parallelism splits (0 column-parallel rows, 1 row-parallel columns), None if
    every tensor-parallel rank holds it whole."""

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """Shape on one tensor-parallel rank."""
        if self.tp_dim is None or tp == 1:
            return self.shape
        dims = list(self.shape)
        dims[self.tp_dim] //= tp
        return tuple(dims)

    def local_numel(self, tp: int) -> int:
        return math.prod(self.local_shape(tp))


def vocab_split(model: ModelSpec, tp: int) -> bool:
    """Whether tensor parallelism splits the embedding and head by vocabulary rows (it does
    where tp divides the padded vocabulary; otherwise both stay whole on every rank)."""
    return tp > 1 and model.padded_vocab_size % tp == 0


def layer_tensors(model: ModelSpec, index: int, tp: int) -> list[ParamTensor]:
    """Parameter tensors of layer ``index`` (a tied head's weight included: callers drop it
    where the embedding is on the same rank)."""
    h, f, vocab = model.hidden_size, model.ffn_hidden_size, model.padded_vocab_size
    gpt = model.arch == "gpt"
    kind = model.layers[index].kind
    by_vocab = 0 if vocab_split(model, tp) else None

    def norm(prefix: str) -> list[ParamTensor]:
        return [ParamTensor(f"{prefix}.weight", (h,), None)] + \
            ([ParamTensor(f"{prefix}.bias", (h,), None)] if gpt else [])

    def linear(name: str, out: int, inp: int, tp_dim: int) -> list[ParamTensor]:
        weight = ParamTensor(f"{name}.weight", (out, inp), tp_dim)
        if not gpt:
            return [weight]
        # a column-parallel bias is split with its rows; a row-parallel one stays whole
        return [weight, ParamTensor(f"{name}.bias", (out,), 0 if tp_dim == 0 else None)]

    if kind == LayerKind.EMBEDDING:
        tensors = [ParamTensor("tok.weight", (vocab, h), by_vocab)]
        if gpt:
            tensors.append(ParamTensor("pos.weight", (model.seq_len, h), None))
        return tensors
    if kind == LayerKind.HEAD:
        return norm("norm") + [ParamTensor("out.weight", (vocab, h), by_vocab)]
    kv = model.num_kv_heads * model.head_dim
    tensors = norm("attn_norm") + linear("attn.wq", h, h, 0) + linear("attn.wk", kv, h, 0) \
        + linear("attn.wv", kv, h, 0) + linear("attn.wo", h, h, 1) + norm("mlp_norm")
    if gpt:
        return tensors + linear("mlp.fc1", f, h, 0) + linear("mlp.fc2", h, f, 1)
    return tensors + linear("mlp.w1", f, h, 0) + linear("mlp.w3", f, h, 0) \
        + linear("mlp.w2", h, f, 1)


def rank_tensors(model: ModelSpec, ranges: list[tuple[int, int]], tp: int) -> list[ParamTensor]:
    """Every distinct parameter tensor a rank holding the layer ``ranges`` (one per model chunk)
    allocates. A tied head weight is the embedding's when both are in one chunk; in two chunks
    of one rank (the V schedules' rank 0) the head keeps its own copy (run/engine/train_engine.py sums the
    two gradients on the rank)."""
    tensors = []
    for start, stop in ranges:
        for index in range(start, stop):
            for tensor in layer_tensors(model, index, tp):
                tied = model.layers[index].kind == LayerKind.HEAD and tensor.name == "out.weight"
                if tied and model.tied_embeddings and start == 0:
                    continue
                tensors.append(tensor)
    return tensors
