"""Trace a real ``nn.Module`` on the meta device into a ModelSpec.

``package.module:function`` (or ``file.py:function``), called with no arguments under
``torch.device("meta")``, returns a module taking token ids ``LongTensor[b, s]``; one forward on
meta tensors measures it without allocating anything. Blocks: the children of the largest (by
parameters) ModuleList/Sequential whose children share a class; what runs before them is one
``embed`` layer, what runs after one ``head`` (no such list: each top-level child is a layer).
Hooks on the blocks attribute to each layer the parameters its operations read (a tied head's
second read: ``tied_params``), its FLOPs (``FlopCounterMode``) and the distinct storages autograd
saves for backward, parameters and buffers excluded, each / (b*s). A ``[b, s, V]`` output gets an
fp32 cross-entropy loss, as in training. Full recompute of a block keeps only its input.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import itertools
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshmorph.spec.model import ActivationBytes, LayerKind, LayerSpec, ModelSpec, Recompute

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

_TARGET = re.compile(r"^(?P<module>[^:]+):(?P<function>[A-Za-z_][A-Za-z0-9_.]*)$")
_FORM = "package.module:function (or path/to/file.py:function) returning an nn.Module"
_HEAD_ATTRIBUTES = ("num_heads", "n_head", "n_heads", "num_attention_heads",
                    "num_kv_heads", "n_kv_heads", "num_key_value_heads")


def trace_factory(target: str, seq_len: int = 512, batch: int = 1) -> ModelSpec:
    """A ModelSpec measured from the module ``target`` builds, for token ids of shape
    ``[batch, seq_len]``. Floating parameters are cast to bf16 first, so that activation bytes are
    16-bit as everywhere in a ModelSpec (``dtype_bytes`` 2)."""
    import torch

    if seq_len <= 0 or batch <= 0:
        raise ValueError(f"seq_len and batch must be positive, got seq_len={seq_len} batch={batch}")
    model = build_module(target).to(torch.bfloat16)
    blocks = _find_blocks(model)
    units = blocks or [child for _, child in model.named_children()] or [model]
    if blocks:
        names = ["embed", *(f"block.{i}" for i in range(len(blocks))), "head"]
        kinds = [LayerKind.EMBEDDING, *[LayerKind.BLOCK] * len(blocks), LayerKind.HEAD]
    else:
        names = [f"layer.{n}" if n.isdigit() else n for n, _ in model.named_children()] or ["model"]
        kinds = [LayerKind.BLOCK] * len(units)
        if len(units) > 1:
            kinds[0], kinds[-1] = LayerKind.EMBEDDING, LayerKind.HEAD
    rec = _Recorder(model, units, first_unit_layer=1 if blocks else 0, num_layers=len(names))
    logits = rec.run(torch.zeros(batch, seq_len, dtype=torch.long, device="meta"), target)
    params, tied = rec.params_per_layer()
    tokens = batch * seq_len
    layers = []
    for i, (name, kind) in enumerate(zip(names, kinds, strict=True)):
        if blocks and kind != LayerKind.BLOCK and not (rec.flops[i] or rec.saved[i] or params[i]):
            continue  # nothing runs before the first or after the last block
        fwd = rec.flops[i] / tokens
        activation = {Recompute.NONE: ActivationBytes(rec.saved[i] / tokens, 0.0)}
        recompute = {Recompute.NONE: 0.0}
        if kind == LayerKind.BLOCK:
            activation[Recompute.FULL] = ActivationBytes(rec.inputs[i] / tokens, 0.0)
            recompute[Recompute.FULL] = fwd  # full recompute re-runs the forward
        layers.append(LayerSpec(
            name=name, kind=kind, params=params[i], tp_split_params=0, fwd_flops_per_token=fwd,
            recompute_flops_per_token=recompute, activation=activation, tied_params=tied[i],
        ))
    embedding = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    width = int(logits.shape[-1]) if logits is not None and logits.dim() else 0
    hidden = rec.hidden_size or (embedding.embedding_dim if embedding else width) or 1
    heads, kv_heads = _heads(units[0] if blocks else model)
    return ModelSpec(
        name=target, arch="custom", layers=tuple(layers), hidden_size=hidden, num_heads=heads,
        num_kv_heads=kv_heads, ffn_hidden_size=_ffn(units[0] if blocks else model, hidden),
        vocab_size=embedding.num_embeddings if embedding else width, seq_len=seq_len,
        tied_embeddings=any(layer.tied_params for layer in layers if layer.kind == LayerKind.HEAD),
        dtype_bytes=2, tp_splittable=False,
    )


def _resolve(target: str) -> Callable[[], Any]:
    match = _TARGET.match(target)
    if not match:
        raise ValueError(f"cannot read model factory {target!r}: expected {_FORM}")
    module_name, function_name = match["module"], match["function"]
    try:
        module = _import(module_name)
    except Exception as exc:  # a missing module, or one that fails while importing
        raise ValueError(f"cannot import {module_name!r} for model factory {target!r} ({exc}); "
                         f"expected {_FORM}") from None
    factory = functools.reduce(lambda obj, part: getattr(obj, part, None), function_name.split("."), module)
    if not callable(factory):
        raise ValueError(f"{module_name!r} has no function {function_name!r} (model factory {target!r}); "
                         f"expected {_FORM}")
    return factory


def _import(module_name: str) -> Any:
    if not module_name.endswith(".py"):
        return importlib.import_module(module_name)
    name = f"meshmorph_factory_{Path(module_name).stem}"
    spec = importlib.util.spec_from_file_location(name, module_name)
    if spec is None or spec.loader is None or not Path(module_name).is_file():
        raise ImportError(f"no file {module_name}")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def build_module(target: str, *, meta: bool = True) -> torch.nn.Module:
    """The module factory ``target`` returns, built on the meta device (or, without ``meta``,
    where the factory puts it); a ValueError naming the way out if it is not one."""
    import torch

    factory = _resolve(target)
    try:
        inspect.signature(factory).bind()
    except TypeError as exc:
        raise ValueError(f"model factory {target!r} must be callable with no arguments ({exc}); "
                         "give its parameters defaults or wrap it") from None
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model factory {target!r} returned {type(model).__name__}, not an nn.Module; "
                         f"expected {_FORM}")
    if meta and any(not t.is_meta for t in [*model.parameters(), *model.buffers()]):
        model = model.to("meta")  # the factory chose a device itself: drop the real storage
    return model


def _find_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Children of the largest ModuleList/Sequential (by parameters) whose children share a class."""
    import torch

    candidates = [(sum(p.numel() for p in c.parameters()), len(c), list(c.children()))
                  for c in model.modules() if isinstance(c, torch.nn.ModuleList | torch.nn.Sequential)
                  and len(c) >= 2 and len({type(child) for child in c.children()}) == 1]
    best = max(candidates, key=lambda cand: cand[:2], default=(0, 0, []))
    return best[2] if best[0] > 0 else []


class _Recorder:
    """One forward, with FLOPs, parameter reads and saved tensors summed per layer."""

    def __init__(self, model: torch.nn.Module, units: list[torch.nn.Module], *, first_unit_layer: int,
                 num_layers: int) -> None:
        self.model, self.units, self.offset = model, units, first_unit_layer
        self.flops = [0.0] * num_layers  # forward FLOPs counted while the layer ran
        self.saved = [0] * num_layers  # storages autograd saved for backward, first saved here
        self.inputs = [0] * num_layers  # floating input bytes: what full recompute keeps
        self.reads: list[set[int]] = [set() for _ in range(num_layers)]  # id() of params read
        self.phase, self.hidden_size, self.flops_mark = 0, 0, 0  # phase: the layer now running
        self.params = {id(p): p for p in model.parameters()}
        self.owner = {id(p): first_unit_layer + i for i, u in enumerate(units) for p in u.parameters()}
        self.state_storages = {_storage_key(t) for t in [*model.parameters(), *model.buffers()]}
        self.param_by_storage: dict[int, list[int]] = {}
        for p in self.params.values():  # several parameters may be views of one storage
            self.param_by_storage.setdefault(_storage_key(p), []).append(id(p))
        self.keep: dict[int, Any] = {}  # saved tensors stay alive so storage keys are never reused

    def run(self, tokens: torch.Tensor, target: str) -> torch.Tensor | None:
        import torch
        from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

        # the fused attention kernel: QK^T and AV over the full s x s matrix, 4*b*a*s*s*d
        flops = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
                 lambda q, k, v, *_, out_shape=None, **__: sdpa_flop_count(q, k, v)}
        self.counter = FlopCounterMode(display=False, custom_mapping=flops)
        handles = [h for i, unit in enumerate(self.units) for h in (
            unit.register_forward_pre_hook(functools.partial(self._pre_hook, i), with_kwargs=True),
            unit.register_forward_hook(functools.partial(self._post_hook, i)))]
        try:
            with torch.device("meta"), _fused_attention(), self.counter, _param_reads(self), \
                    torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                logits = next(iter(_tensors(self.model(tokens))), None)
                if logits is not None and logits.is_floating_point() and logits.dim() == 3 \
                        and tuple(logits.shape[:2]) == tuple(tokens.shape):
                    # the training loss keeps fp32 log-probabilities of every token
                    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
                self._switch(self.phase)
        except Exception as exc:
            raise ValueError(f"model factory {target!r} failed forward on token ids "
                             f"LongTensor{list(tokens.shape)} on the meta device: {exc}") from exc
        finally:
            for handle in handles:
                handle.remove()
        return logits

    def _switch(self, phase: int) -> None:
        total = self.counter.get_total_flops()
        self.flops[self.phase] += total - self.flops_mark
        self.flops_mark, self.phase = total, phase

    def _pre_hook(self, index: int, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        layer = self.offset + index
        self._switch(layer)
        inputs = [t for t in _tensors((args, kwargs)) if t.is_floating_point()]
        if inputs and not self.hidden_size and layer > 0:
            self.hidden_size = int(inputs[0].shape[-1])  # the first block's input width
        nbytes = {_storage_key(t): t.untyped_storage().nbytes() for t in inputs}.values()
        self.inputs[layer] = max(self.inputs[layer], sum(nbytes))

    def _post_hook(self, index: int, module: Any, args: Any, output: Any) -> None:
        after_last_block = self.offset and index == len(self.units) - 1
        self._switch(len(self.flops) - 1 if after_last_block else self.offset + index)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self.state_storages and key not in self.keep:
            self.keep[key] = tensor
            self.saved[self.phase] += tensor.untyped_storage().nbytes()
        return tensor

    def read(self, tensor: torch.Tensor) -> None:
        self.reads[self.phase].update(self.param_by_storage.get(_storage_key(tensor), ()))

    def params_per_layer(self) -> tuple[list[int], list[int]]:
        """Parameters each layer reads, and of those the ones an earlier layer read first."""
        first: dict[int, int] = {}
        for index, reads in enumerate(self.reads):
            for param_id in reads:
                first.setdefault(param_id, index)
        for param_id in self.params.keys() - first.keys():  # never read: its block, else the last layer
            first[param_id] = self.owner.get(param_id, len(self.reads) - 1)
            self.reads[first[param_id]].add(param_id)
        params = [sum(self.params[i].numel() for i in reads) for reads in self.reads]
        tied = [sum(self.params[i].numel() for i in reads if first[i] < index)
                for index, reads in enumerate(self.reads)]
        return params, tied


def _param_reads(recorder: _Recorder) -> Any:
    """A dispatch mode that tells ``recorder`` of every parameter an operation reads."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ParamReads(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            for tensor in _tensors((args, kwargs or {})):
                recorder.read(tensor)
            return func(*args, **(kwargs or {}))

    return ParamReads()


def _fused_attention() -> Any:
    """``F.scaled_dot_product_attention`` as the fused kernel CPUs and GPUs run (it keeps q, k, v,
    the output and fp32 log-sum-exp, no s x s scores); on meta torch would take the math path."""
    import torch
    from torch.overrides import TorchFunctionMode

    sdpa = torch.nn.functional.scaled_dot_product_attention
    flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    class FusedAttention(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
            a = dict(zip(names, args, strict=False)) | kwargs
            if func is not sdpa or a.pop("enable_gqa", False):
                return func(*args, **kwargs)  # grouped-query heads: the math path, as written
            return flash_cpu(a["query"], a["key"], a["value"], a.get("dropout_p", 0.0), a.get("is_causal", False),
                             attn_mask=a.get("attn_mask"), scale=a.get("scale"))[0]

    return FusedAttention()


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata  # the StorageImpl address: one per storage


def _tensors(tree: Any) -> list[torch.Tensor]:
    import torch
    from torch.utils._pytree import tree_leaves

    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def _heads(module: torch.nn.Module) -> tuple[int, int]:
    """Attention heads and key/value heads from common attribute names, else (1, 1)."""
    found: dict[bool, int] = {}  # is a key/value head count -> value; the outermost module wins
    for sub, name in itertools.product(reversed(list(module.modules())), _HEAD_ATTRIBUTES):
        value = getattr(sub, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found["kv" in name or "key_value" in name] = value
    heads, kv_heads = found.get(False, 1), found.get(True, found.get(False, 1))
    return heads, kv_heads if heads % kv_heads == 0 else heads


def _ffn(module: torch.nn.Module, hidden: int) -> int:
    # the widest input of a Linear back to the model width (the FFN down projection), else 4h
    widths = [m.in_features for m in module.modules()
              if getattr(m, "out_features", None) == hidden and isinstance(getattr(m, "in_features", None), int)]
    return max(widths, default=4 * hidden)
