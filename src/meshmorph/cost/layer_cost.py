"""Time and memory of one layer on one GPU type for one micro-batch shape.

Identical layers (all the blocks of a catalog model) share one entry, so a 126-layer model
costs as little to evaluate as a 3-layer one.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple

from meshmorph.cost import comm, context_parallel
from meshmorph.cost.coefficients import CostCoefficients
from meshmorph.cost.fp8 import (
    block_linears,
    cast_seconds,
    saved_input_elements,
    weight_grad_in_fp8,
)
from meshmorph.cost.gemm import layer_efficiency
from meshmorph.spec.gpus import GPUSpec, flops_dtype
from meshmorph.spec.model import ActivationBytes, LayerKind, LayerSpec, ModelSpec, Recompute

if TYPE_CHECKING:  # the CostModel builds its LayerCosters: no import cycle at run time
    from meshmorph.cost.model import CostModel


class PieceCost(NamedTuple):
    """What a piece of one rank's model costs per micro-batch on one tensor-parallel rank: one
    layer (``LayerCoster.layer``), a segment of layers under one strategy or a whole model chunk
    (``CostModel.chunk_time``, ``CostModel.stage_time``). A tuple: the planner prices millions."""

    fwd_s: float
    """Forward, exposed TP, ZeRO-3 and context-parallel communication included."""
    bwd_s: float
    """Backward (input and weight gradients), recompute and exposed communication included."""
    bgrad_s: float
    """The input-gradient part of bwd_s (zero-bubble B op), recompute included."""
    wgrad_s: float
    """The weight-gradient part of bwd_s (zero-bubble W op)."""
    compute_s: float
    """Forward + backward compute without recompute and communication."""
    recompute_s: float
    """Recomputed forward compute."""
    tp_comm_s: float
    """Exposed tensor-parallel communication, forward + backward + recompute."""
    cp_comm_s: float = 0.0
    """Exposed context-parallel ring exchange (cost/context_parallel.py), forward + backward +
    recompute; included in fwd_s and bgrad_s."""
    zero3_comm_s: float = 0.0
    """Exposed per-micro-batch ZeRO gathers and reduce-scatters (ZeRO-3; ZeRO-2's scatters);
    in fwd_s and bwd_s. 0 for one layer priced alone by ``LayerCoster``."""
    params: float = 0.0
    """Parameters on one tensor-parallel rank (before ZeRO sharding); 0 from ``LayerCoster``."""
    activation_bytes: float = 0.0
    """Bytes kept for backward per micro-batch (a layer's; a chunk's memory is added up per
    rank by ``CostModel.segments_memory``, so ``chunk_time`` leaves it 0)."""
    working_bytes: float = 0.0
    """Extra bytes while the layer's backward rematerialises activations (a layer's, as
    ``activation_bytes``)."""
    flops: float = 0.0
    """Hardware FLOPs on this rank, recompute included (a layer's, as ``activation_bytes``)."""
    transition_s: float = 0.0
    """Forward + backward redistribution between layers of different tp (a layerwise chunk,
    cost/transition.py); in fwd_s, bwd_s and bgrad_s."""


def loss_bytes_per_logit(element_bytes: float) -> tuple[float, float]:
    """(forward, backward) bytes per logit that the training loss (run/model/loss.py) moves for
    logits of ``element_bytes`` bytes: forward reads the logits and writes their fp32
    log-probabilities; backward writes nll's fp32 gradient (4), reads it with the
    log-probabilities (8) and writes the fp32 input gradient (4), which 16-bit logits then cast
    to their dtype (4 read, ``element_bytes`` written)."""
    cast = 4.0 + element_bytes if element_bytes < 4 else 0.0
    return element_bytes + 4.0, 16.0 + cast


def layer_classes(model: ModelSpec) -> tuple[int, ...]:
    """For each layer, the index of the first layer with the same figures."""
    figures = [(a.kind, a.params, a.tp_split_params, a.fwd_flops_per_token,
                a.recompute_flops_per_token, a.activation, a.tp_allreduces_fwd, a.tied_params,
                a.runtime) for a in model.layers]  # a list: dicts in them cannot be hashed
    return tuple(figures.index(key) for key in figures)


def matmul_efficiency(coef: CostCoefficients, ceiling: float, width: float, tokens: float) -> float:
    """Achieved fraction of peak: eff = ceiling * w/(w + w_half) * n/(n + n_half)."""
    if width <= 0 or tokens <= 0:
        return ceiling
    return ceiling * width / (width + coef.efficiency_half_width) * tokens / (
        tokens + coef.efficiency_half_tokens)


class LayerCoster:
    """Per-layer costs for one model on a CostModel's cluster (its GPU ceilings, links and
    Profile: measured layer times replace FLOPs / (peak x efficiency)), cached by (layer class,
    GPU, shape, parallelism); ``CostModel.layer_coster`` says what the flags mean."""

    def __init__(self, cost: CostModel, *, dtype: str, cp: int, tp_comm_overlap: bool,
                 compiled: bool, stream32: bool, fp8_scaling: str):
        self.model, self.coef, self.profile = cost.model, cost.coef, cost.profile
        self.efficiency = cost.efficiency  # GPU name -> ceiling
        self.tp_link = cost.intra  # GPU name -> intra-node link
        self.inter_link = cost.inter  # the cp ring's link once tp x cp spans nodes
        self.gpus_per_node = cost.cluster.gpus_per_node
        self.dtype, self.cp, self.fp8_scaling = dtype, cp, fp8_scaling
        self.tp_comm_overlap, self.compiled, self.stream32 = tp_comm_overlap, compiled, stream32
        self.passes = self.coef.elementwise_passes if compiled \
            else self.coef.eager_elementwise_passes
        self.act_scale = 2.0 if dtype == "fp32" else 1.0  # ModelSpec counts 16-bit activations
        self.classes = layer_classes(self.model)
        self.gpus: dict[str, GPUSpec] = {}
        self.cost = lru_cache(maxsize=None)(self._cost)

    def attention_efficiency(self, gpu_name: str) -> float:
        """Share of the GEMM ceiling a causal flash-attention kernel reaches on this GPU."""
        return dict(self.coef.gpu_flash_attention_efficiency).get(
            gpu_name, self.coef.flash_attention_efficiency)

    def cp_link(self, gpu_name: str, tp: int) -> comm.Link:
        """The context-parallel ring's link: the node's while the tp x cp ranks it spans (tp
        innermost, then cp) fit in one node, else the NIC's."""
        if tp * self.cp <= self.gpus_per_node:
            return self.tp_link[gpu_name]
        return self.inter_link

    def _runtime_bytes(self, layer: LayerSpec, recompute: Recompute, tp: int, sp: bool) -> float:
        """Bytes per token one tensor-parallel rank keeps beyond (or short of) the layer's fused
        count when meshmorph's decoder block runs it (``LayerSpec.runtime``): eager or compiled
        (``Plan.compile``), over an fp32 or a 16-bit residual stream."""
        runtime, h = layer.runtime, self.model.hidden_size
        if runtime is None:
            return 0.0
        if recompute == Recompute.FULL:  # only the layer's input is kept: fp32 under autocast
            return ActivationBytes(2.0 * h if self.stream32 else 0.0, 0.0).per_rank(tp, sp)
        selective = layer.activation.get(Recompute.SELECTIVE)
        if recompute == Recompute.SELECTIVE and selective is not None and \
                selective.shared != layer.activation[Recompute.NONE].shared:
            return 0.0  # a per-op policy (torchtitan's) keeps its own list of tensors
        norms = (1 if self.compiled else runtime.norm_inputs) if self.stream32 else 0
        casts = runtime.norm_readers if self.stream32 and not self.compiled else 0
        fewer = runtime.recomputed_pointwise * self.act_scale if self.compiled else 0.0
        shared, split = saved_input_elements(self.model) if (  # kept as float8: 1 byte less
            self.compiled and self.dtype == "fp8" and weight_grad_in_fp8(self.fp8_scaling)
        ) else (0.0, 0.0)
        return ActivationBytes(2.0 * h * (norms + casts) - shared,
                               -fewer - split).per_rank(tp, sp)

    def layer(self, index: int, gpu: GPUSpec, micro_batch: int, tp: int, sp: bool,
              recompute: Recompute) -> PieceCost:
        self.gpus.setdefault(gpu.name, gpu)
        return self.cost(self.classes[index], gpu.name, micro_batch, tp, sp, recompute)

    def _rates(self, layer: LayerSpec, gpu: GPUSpec, tokens: int, tp: int
               ) -> tuple[float, float, float, float, float, float]:
        """(peak FLOP/s, the layer's forward efficiency, the same in 16-bit, the weight
        gradient's, float8 casts' forward and backward seconds). GEMMs at their roofline rate
        with wave quantisation (cost/gemm.py), times the optional thin-GEMM and small-batch curve
        (off when its half points are 0); a block's GEMMs in float8 under dtype fp8, with their
        casts (cost/fp8.py); fp8 plans run all but the blocks' GEMMs in bf16."""
        flops16 = flops_dtype(self.dtype)
        element_bytes = self.model.dtype_bytes * self.act_scale
        fp8 = self.dtype == "fp8" and layer.kind == LayerKind.BLOCK

        def efficiency(gemm_dtype: str | None) -> float:
            eff = layer_efficiency(self.model, layer, tp, tokens, gpu, flops16, element_bytes,
                                   self.efficiency[gpu.name], self.coef.gemm_tile, gemm_dtype,
                                   self.attention_efficiency(gpu.name))
            return matmul_efficiency(self.coef, eff, self.model.hidden_size / tp, tokens)

        eff16 = efficiency(None)
        if not fp8:
            return gpu.peak_flops(flops16), eff16, eff16, eff16, 0.0, 0.0
        eff = efficiency("fp8")
        cast_f, cast_b = cast_seconds(
            block_linears(self.model, tp), tokens, gpu, self.fp8_scaling, stream32=self.stream32,
            bandwidth_efficiency=self.coef.fp8_autocast_cast_bandwidth_efficiency
            if self.stream32 else self.coef.fp8_cast_bandwidth_efficiency,
            eager_factor=1.0 if self.compiled else
            self.coef.eager_elementwise_passes / self.coef.elementwise_passes)
        eff_w = eff if weight_grad_in_fp8(self.fp8_scaling) else eff16
        return gpu.peak_flops(flops16), eff, eff16, eff_w, cast_f, cast_b

    def _tp_comm(self, layer: LayerSpec, gpu: GPUSpec, tokens: int, tp: int,
                 recompute: Recompute, fwd_s: float, bwd_s: float) -> tuple[float, float]:
        """Exposed tensor-parallel communication (forward, backward) beside ``fwd_s`` and
        ``bwd_s`` of compute. Each forward all-reduce (or reduce-scatter + all-gather with SP,
        the same volume) moves the b*s*h hidden state; backward has as many; full recompute
        repeats the forward's."""
        if tp == 1:
            return 0.0, 0.0
        nbytes = tokens * self.model.hidden_size * self.model.dtype_bytes * self.act_scale
        one = comm.all_reduce(tp, nbytes, self.tp_link[gpu.name])
        n_fwd = layer.tp_allreduces_fwd
        n_re = n_fwd if recompute == Recompute.FULL else 0
        fwd_comm, bwd_comm = n_fwd * one, (n_fwd + n_re) * one
        if not self.tp_comm_overlap:
            return fwd_comm, bwd_comm
        # Megatron's --tp-comm-overlap: each collective split over the ring's tp steps, each
        # step's transfer beside the GEMM of the chunk before it (the first never hides);
        # forward beside the forward, backward beside both gradient GEMMs and the recompute
        share = self.coef.tp_overlap * (tp - 1) / tp
        return (comm.overlapped([(fwd_comm, share)], fwd_s, self.coef.overlap_slowdown),
                comm.overlapped([(bwd_comm, share)], bwd_s, self.coef.overlap_slowdown))

    def _cost(self, index: int, gpu_name: str, micro_batch: int, tp: int, sp: bool,
              recompute: Recompute) -> PieceCost:
        layer = self.model.layers[index]
        gpu = self.gpus[gpu_name]
        tokens = context_parallel.local_tokens(micro_batch, self.model.seq_len, self.cp)
        peak, eff, eff16, eff_w, cast_f, cast_b = self._rates(layer, gpu, tokens, tp)
        element_bytes = self.model.dtype_bytes * self.act_scale
        fwd_flops = layer.fwd_flops_per_token * tokens / tp
        re_flops = layer.recompute_flops_per_token.get(recompute, 0.0) * tokens / tp
        # memory-bound kernels: passes over the saved activations at HBM bandwidth (with SP the
        # LayerNorm/dropout share is this rank's 1/t, as its activations are)
        act_none = layer.activation[Recompute.NONE].per_rank(tp, sp) * tokens * self.act_scale
        hbm = gpu.hbm_gbps * 1e9
        # the head's vocabulary share is the loss's log-probabilities: priced by its own bytes
        logits = layer.activation[Recompute.NONE].split / 4.0 / tp * tokens \
            if layer.kind == LayerKind.HEAD else 0.0
        loss_f, loss_b = (logits * moved / (hbm * self.coef.loss_bandwidth_efficiency)
                          for moved in loss_bytes_per_logit(element_bytes))
        mem_pass = self.passes / 3 * (act_none - 4.0 * logits * self.act_scale) / hbm
        fwd_c = fwd_flops / (peak * eff) + mem_pass
        igrad_c = fwd_c  # backward = 2x forward FLOPs: input gradient ~ forward, weight ~ forward
        wgrad_c = fwd_flops / (peak * eff_w) + mem_pass
        # a recompute rewrites what it did not keep: selective the attention core's softmax and
        # dropout over the scores (the 5as/h term), full everything but the layer input
        act_kept = layer.activation[recompute].per_rank(tp, sp) * tokens * self.act_scale
        re_mem = self.passes / 3 * max(act_none - act_kept, 0.0) / hbm \
            if recompute != Recompute.NONE else 0.0
        re_c = re_flops / (peak * eff) + re_mem + (cast_f * re_flops / fwd_flops if fwd_flops
                                                   else 0.0)
        measured = self.profile.layer_time(self.model.name, self.model.seq_len, micro_batch,
                                           self.dtype, index)
        if measured is not None:
            # measured at tp = 1: tensor parallelism splits every GEMM of the layer tp ways;
            # recompute repeats the share of the forward its FLOPs say
            fwd_c = measured.fwd_s / tp / self.cp
            re_c = fwd_c * re_flops / fwd_flops if fwd_flops else 0.0
            igrad_c = wgrad_c = measured.bwd_s / tp / self.cp / 2
            loss_f = loss_b = 0.0  # the measured head's times hold its loss
            cast_f = cast_b = 0.0
        fwd_comm, bwd_comm = self._tp_comm(layer, gpu, tokens, tp, recompute, fwd_c,
                                           igrad_c + wgrad_c + re_c)
        ring_f = ring_b = 0.0
        if self.cp > 1 and layer.kind == LayerKind.BLOCK:  # the ring's K/V exchange beyond each
            # step's attention block, again in backward under recompute
            ring = context_parallel.ring_time(
                self.model, micro_batch=micro_batch, tp=tp, cp=self.cp,
                element_bytes=element_bytes, flops_per_s=peak * eff16,
                link=self.cp_link(gpu.name, tp))
            ring_f = ring.fwd_exposed_s
            ring_b = ring.bwd_exposed_s + (ring_f if recompute != Recompute.NONE else 0.0)
        bgrad = igrad_c + cast_b + re_c + bwd_comm + ring_b + loss_b
        act = (layer.activation[recompute].per_rank(tp, sp) * self.act_scale
               + self._runtime_bytes(layer, recompute, tp, sp)) * tokens
        full = (layer.activation[Recompute.NONE].per_rank(tp, sp) * self.act_scale
                + self._runtime_bytes(layer, Recompute.NONE, tp, sp)) * tokens
        return PieceCost(
            fwd_s=fwd_c + cast_f + loss_f + fwd_comm + ring_f,
            bwd_s=bgrad + wgrad_c,
            bgrad_s=bgrad,
            wgrad_s=wgrad_c,
            compute_s=fwd_c + cast_f + loss_f + igrad_c + cast_b + wgrad_c + loss_b,
            recompute_s=re_c,
            tp_comm_s=fwd_comm + bwd_comm,
            activation_bytes=act,
            working_bytes=max(0.0, full - act),
            flops=3 * fwd_flops + re_flops,
            cp_comm_s=ring_f + ring_b,
        )
