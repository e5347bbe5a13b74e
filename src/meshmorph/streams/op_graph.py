"""The operator DAG of a module's forward, with an estimated or measured time for each operator.

``torch.fx.symbolic_trace`` turns the module into a flat graph of leaf modules (Conv2d, ReLU, ...),
functions (``torch.cat``, ``operator.add``) and methods. Every such call is one node of a
``networkx.DiGraph`` named as fx names it; an edge u -> v means v reads u's output. Placeholders
(the inputs), ``get_attr`` constants and the output node are not operators: they are ready before
the first operator runs and are left out of the DAG.

With ``training=True`` the graph is the aten-level training step instead (forward and backward,
see training_graph.py); its nodes are aten operators and the parameters lead its inputs.

Times: ``estimate`` runs each operator once under ``torch.utils.flop_counter.FlopCounterMode`` and
prices it as ``launch_s + max(flops / peak_flops, bytes_out / bytes_per_s)``; ``profile`` runs it
``repeats`` times on the inputs' device and keeps the median wall time.
"""

from __future__ import annotations

import operator
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import networkx as nx
import torch
import torch.fx
from torch.utils.flop_counter import FlopCounterMode

from meshmorph.streams.fold import add_write_edges, fold_free_ops

OP_KINDS = ("call_module", "call_function", "call_method")
"""fx node kinds that are operators (nodes of the DAG)."""


@dataclass(frozen=True, slots=True)
class TimeModel:
    """Roofline price of one operator when times are estimated rather than measured."""

    peak_flops: float = 2e13
    """Achieved floating-point operations per second (default: a mid-range GPU in fp32)."""
    bytes_per_s: float = 1e12
    """Memory bandwidth for writing the operator's outputs, bytes per second."""
    launch_s: float = 5e-6
    """Fixed cost of issuing one operator (kernel launch and framework dispatch), seconds."""

    def __post_init__(self) -> None:
        if self.peak_flops <= 0 or self.bytes_per_s <= 0 or self.launch_s < 0:
            raise ValueError(f"TimeModel needs peak_flops > 0, bytes_per_s > 0, launch_s >= 0; got {self}")


@dataclass(slots=True)
class OpGraph:
    """A traced module and the DAG of its operators."""

    module: torch.fx.GraphModule
    """The traced module; its nodes carry the names used in ``dag``."""
    dag: nx.DiGraph
    """Operators (fx node names) with ``time_s``, ``flops`` and ``target`` attributes."""
    order: list[str] = field(default_factory=list)
    """The operators in fx program order, a topological order of ``dag``."""
    members: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """For each operator of ``dag``, the fx nodes it runs in order: itself, plus the free
    operators (views, getitems) folded into it (see fold.py)."""
    leading_inputs: tuple[torch.Tensor, ...] = ()
    """Tensors the graph takes before the user's inputs (a training step's live parameters and
    buffers); the executors pass them."""
    training: bool = False
    """True for a forward-backward training-step graph (see training_graph.py)."""
    loss_index: int | None = None
    """Training graphs: position of the loss among the outputs (updated buffers come first, then
    the loss, then one gradient per parameter in ``named_parameters`` order)."""

    def interpreter(self, inputs: tuple[torch.Tensor, ...]) -> torch.fx.Interpreter:
        """An fx interpreter of ``module`` with the inputs (``leading_inputs`` first) and the
        constants in place, every value kept until the caller drops it."""
        placeholders = [n for n in self.module.graph.nodes if n.op == "placeholder"]
        inputs = (*self.leading_inputs, *inputs)
        if len(placeholders) != len(inputs):
            given = len(inputs) - len(self.leading_inputs)
            raise ValueError(f"{type(self.module).__name__}.forward takes "
                             f"{len(placeholders) - len(self.leading_inputs)} inputs, {given} given")
        interp = torch.fx.Interpreter(self.module, garbage_collect_values=False)
        interp.env = dict(zip(placeholders, inputs, strict=True))
        for node in self.module.graph.nodes:
            if node.op == "get_attr":
                interp.env[node] = interp.run_node(node)
        return interp

    def output(self, interp: torch.fx.Interpreter) -> Any:
        """The module's output from an interpreter that has run every operator."""
        return interp.run_node(next(n for n in self.module.graph.nodes if n.op == "output"))


def _target_name(node: torch.fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def _aliases(value: Any, inputs: dict[Any, torch.Tensor]) -> bool:
    """True when ``value`` is a tensor sharing storage with one of ``inputs`` (a view)."""
    if not isinstance(value, torch.Tensor) or value.untyped_storage().data_ptr() == 0:
        return False
    ptr = value.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == ptr for t in inputs.values())


def _bytes_of(value: Any) -> int:
    tensors = [value] if isinstance(value, torch.Tensor) else [
        v for v in (value if isinstance(value, tuple | list) else []) if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _median_time_s(interp: torch.fx.Interpreter, node: torch.fx.Node, repeats: int) -> float:
    cuda = any(isinstance(v, torch.Tensor) and v.is_cuda for v in interp.env.values())
    samples = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        interp.run_node(node)
        if cuda:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def build_op_graph(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], *,
                   timing: Literal["estimate", "profile"] = "estimate",
                   time_model: TimeModel | None = None, repeats: int = 5,
                   training: bool = False, fold: bool = True) -> OpGraph:
    """Trace ``module`` (its forward with fx; with ``training`` the aten-level forward-backward
    step) and time each operator on ``inputs``, running the graph once under no_grad. With
    ``fold``, views and getitems join a neighbour's group (fold.py)."""
    if timing not in ("estimate", "profile"):
        raise ValueError(f"timing must be 'estimate' or 'profile', got {timing!r}")
    leading: tuple[torch.Tensor, ...] = ()
    loss_index = None
    if training:
        from meshmorph.streams.training_graph import leading_inputs, trace_training_step

        step = trace_training_step(module, inputs)
        gm, leading = step.module, leading_inputs(step, module)
        loss_index = step.mutated_buffers
    else:
        try:
            gm = torch.fx.symbolic_trace(module)
        except Exception as exc:  # fx cannot trace data-dependent control flow
            raise ValueError(f"torch.fx cannot trace {type(module).__name__} ({exc}); streams "
                             "need a module without data-dependent Python control flow") from None
    prices = time_model or TimeModel()
    graph = OpGraph(module=gm, dag=nx.DiGraph(), leading_inputs=leading, training=training,
                    loss_index=loss_index)
    interp = graph.interpreter(inputs)
    dag, order = graph.dag, graph.order
    free: set[str] = set()
    writes: dict[str, list[list[str]]] = {}
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node.op not in OP_KINDS:  # inputs, constants (in place already) and the output
                continue
            tensors_in = {p: interp.env[p] for p in node.all_input_nodes
                          if isinstance(interp.env.get(p), torch.Tensor)}
            versions = {p: t._version for p, t in tensors_in.items()}
            counter = FlopCounterMode(display=False)
            with counter:
                value = interp.run_node(node)
            interp.env[node] = value
            flops = counter.get_total_flops()
            written = [p for p, t in tensors_in.items() if t._version != versions[p]]
            if written:  # an in-place operator: order it against the other readers
                writes[node.name] = [[u.name for u in p.users] for p in written]
            elif flops == 0 and (node.target is operator.getitem or _aliases(value, tensors_in)):
                free.add(node.name)
            if timing == "profile":
                time_s = _median_time_s(interp, node, repeats)
            else:  # roofline: compute- or bandwidth-bound, plus the launch
                time_s = prices.launch_s + max(flops / prices.peak_flops,
                                               _bytes_of(value) / prices.bytes_per_s)
            dag.add_node(node.name, time_s=0.0 if node.name in free else time_s, flops=flops,
                         target=_target_name(node))
            order.append(node.name)
            for parent in node.all_input_nodes:
                if parent.op in OP_KINDS:
                    dag.add_edge(parent.name, node.name)
    add_write_edges(dag, order, writes)
    graph.members = {op: (op,) for op in order}
    if fold:
        graph.order, graph.members = fold_free_ops(dag, order, free)
    return graph
