"""The switch overlapped with the optimizer step (PUZZLE §5.2, ``--switch-segments K``).

Design
------
megatron's ``optimizer.step()`` is ``prepare_grads -> grad norm -> clip -> (count zeros) ->
step_with_ready_grads``; only the last part changes parameters. We keep megatron's ``step()``
and its pre-processing untouched and, for the duration of one call, replace the optimizer's
``step_with_ready_grads`` (an instance attribute on the top-level optimizer; nothing in
megatron is patched) by a segmented one:

    post every receive of the switch (non-blocking)
    for k in 0..K-1:
        for each leaf optimizer: restrict its param groups (and its main<->model param lists)
            to the parameters of segment k, run the leaf's OWN step_with_ready_grads
            machinery (inner Adam step; main->model copy; for the DistributedOptimizer the
            DP all-gather of the updated shards), restore the groups
        start segment k of the switch: local copies + isend of its buckets (non-blocking)
    wait for all messages, unpack the receives into the shadow model

Segments are contiguous runs of parameters in routing-op (= spec) order, balanced by bytes,
identical on every rank (:func:`puzzle.switch.routing_executor.segment_of_params`), so the sender of
segment k and its receiver agree on the buckets.

What overlaps with what (honestly): on gloo, ``isend``/``irecv`` return at once and gloo's
transport threads move the bytes of segment k (and the peers' segment k) while the main thread
runs the Adam update (+ main->model copy, + DO all-gather) of segments k+1..K-1. NOT
overlapped: gradient pre-processing, the global grad norm and clipping (they need every
gradient, so they run before segment 0), packing send buffers and unpacking receives (main
thread), and the transfer of the last segment. On a GPU the same structure applies with
NCCL's own stream for P2P (not measured here).

Numbers do not change: Adam (torch.optim.AdamW, megatron's CPU/fallback choice) updates each
parameter from its own state only, every group keeps its hyper-parameters, clipping used the
global norm before any segment, so stepping in K restricted calls is bitwise the same as one
call; the transfer reads each segment after its final update. K=1 is a plain step followed by
a plain switch. Tested bitwise for K=1 vs K=8 vs plain step + switch, with and without the
DistributedOptimizer.

Cost caveat (DistributedOptimizer): megatron's param all-gather works on whole DDP buckets,
so each segment re-runs it (K x the all-gather volume; values are the same because shards of
later segments are simply re-gathered unchanged). A per-segment range all-gather would remove
that; not done.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Dict, List, Mapping, Tuple

import torch

from puzzle.switch.routing_executor import DEFAULT_BUCKET_BYTES, RoutingExecutor, SwitchStats, fast_dispatch
from puzzle.models.param_names import table_params
from puzzle.switch.routing import RoutingTable, local_params

# (model-param list attribute, main-param list attribute) pairs of megatron's optimizers,
# aligned group by group and index by index
_PARAM_LIST_PAIRS = (
    ("float16_groups", "fp32_from_float16_groups"),                      # Float16Optimizer...
    ("model_float16_groups", "shard_fp32_from_float16_groups"),          # DistributedOptimizer
    ("model_fp32_groups", "shard_fp32_groups"),                          # DistributedOptimizer
)


def _leaves(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _is_distributed(leaf) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(leaf, DistributedOptimizer)


class _LeafSegments:
    """One leaf optimizer, steppable one segment at a time."""

    def __init__(self, leaf, segment_of_model_param: Mapping[int, int]):
        self.leaf = leaf
        self.stub = getattr(leaf, "is_stub_optimizer", False)
        if self.stub:
            return
        seg = dict(segment_of_model_param)
        # main param (inner optimizer's) -> segment, through the megatron main<->model lists
        main_seg: Dict[int, int] = {}
        self.pairs: List[Tuple[str, str]] = []
        for model_attr, main_attr in _PARAM_LIST_PAIRS:
            model_groups, main_groups = getattr(leaf, model_attr, None), getattr(leaf, main_attr, None)
            if model_groups is None or main_groups is None:
                continue
            self.pairs.append((model_attr, main_attr))
            for mg, sg in zip(model_groups, main_groups):
                for mp, sp in zip(mg, sg):
                    main_seg[id(sp)] = seg[id(mp)]
                    seg.setdefault(id(sp), seg[id(mp)])
        for group in leaf.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in main_seg and id(p) not in seg:
                    raise RuntimeError("optimizer parameter not found in the model's parameters; "
                                       "cannot segment the optimizer step")
        self.seg = {**seg, **main_seg}

    @contextmanager
    def restricted(self, k: int):
        leaf = self.leaf
        groups = leaf.optimizer.param_groups
        saved_params = [g["params"] for g in groups]
        saved_lists = {}
        try:
            for g in groups:
                g["params"] = [p for p in g["params"] if self.seg[id(p)] == k]
            for model_attr, main_attr in self.pairs:
                model_groups, main_groups = getattr(leaf, model_attr), getattr(leaf, main_attr)
                saved_lists[model_attr], saved_lists[main_attr] = model_groups, main_groups
                new_model, new_main = [], []
                for mg, sg in zip(model_groups, main_groups):
                    keep = [i for i, mp in enumerate(mg) if self.seg[id(mp)] == k]
                    new_model.append([mg[i] for i in keep])
                    new_main.append([sg[i] for i in keep])
                setattr(leaf, model_attr, new_model)
                setattr(leaf, main_attr, new_main)
            yield
        finally:
            for g, params in zip(groups, saved_params):
                g["params"] = params
            for attr, value in saved_lists.items():
                setattr(leaf, attr, value)

    def step_segment(self, k: int) -> bool:
        """The leaf's own step_with_ready_grads on segment k (DO: then its param all-gather)."""
        if self.stub:
            return True
        leaf = self.leaf
        if _is_distributed(leaf):
            from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

            with self.restricted(k):
                ok = MixedPrecisionOptimizer.step_with_ready_grads(leaf)
            # megatron's synchronous bucket all-gather (the rest of DO.step_with_ready_grads)
            if leaf.ddp_config.use_megatron_fsdp or leaf.ddp_config.overlap_param_gather:
                raise NotImplementedError("segmented step: megatron FSDP / overlap_param_gather unsupported")
            for chunk in leaf.model_chunks:
                chunk.start_param_sync()
            return ok
        with self.restricted(k):
            return type(leaf).step_with_ready_grads(leaf)


def _segment_of_model_params(engine, table: RoutingTable, segment_of: Mapping[str, int]) -> Dict[int, int]:
    """id(model parameter) -> segment, via the source layout's local names."""
    layout = engine.layout
    local_to_spec = {local: spec.name for local, spec in local_params(table.specs, layout.plan, layout.rank)}
    by_data = {p.data_ptr(): name for name, p in table_params(engine.module, engine.role).items()}
    out = {}
    for _, p in engine.module.named_parameters():
        spec = local_to_spec.get(by_data[p.data_ptr()])
        if spec is not None:  # (not in the table: a LoRA actor's frozen base, which no optimizer holds)
            out[id(p)] = segment_of[spec]
    return out


def step_and_switch(engine, table: RoutingTable, dst_params: Mapping[str, torch.Tensor], *,
                    segments: int = 1, group=None,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Tuple[dict, SwitchStats]:
    """megatron optimizer step of ``engine`` (+ LR scheduler step) overlapped with the switch
    ``table`` into ``dst_params`` (collective). Gradients must be ready (after forward_backward).

    Returns (step result like ModelEngine.train_step's without outputs, this rank's SwitchStats
    with extra timings: step_s, segment_step_s)."""
    if engine.member and (engine.optimizer is None or not engine.trainable):
        raise RuntimeError(f"{engine.role}: step_and_switch needs a trainable engine")
    with fast_dispatch():
        src = table_params(engine.module, engine.role)
    ex = RoutingExecutor(table, src, dst_params, group=group, bucket_bytes=bucket_bytes,
                         num_segments=segments)
    result = {"update_successful": True, "grad_norm": float("nan")}
    seg_times: List[float] = []
    t0 = time.perf_counter()
    ex.post_recvs()
    if engine.member:
        opt = engine.optimizer
        if getattr(opt.config, "overlap_param_gather_with_optimizer_step", False):
            raise NotImplementedError("segmented step: overlap_param_gather_with_optimizer_step unsupported")
        with fast_dispatch():
            seg_map = _segment_of_model_params(engine, table, ex.segment_of)
        leaves = [_LeafSegments(leaf, seg_map) for leaf in _leaves(opt)]

        def segmented_step_with_ready_grads() -> bool:
            ok = True
            for k in range(segments):
                ts = time.perf_counter()
                for leaf in leaves:
                    ok &= bool(leaf.step_segment(k))
                seg_times.append(time.perf_counter() - ts)
                ex.run_segment(k)
            return ok

        opt.step_with_ready_grads = segmented_step_with_ready_grads
        try:
            ok, grad_norm, _ = opt.step()
        finally:
            del opt.step_with_ready_grads
        if ok:
            engine.scheduler.step(increment=1)
        result = {"update_successful": bool(ok),
                  "grad_norm": float(grad_norm) if grad_norm is not None else float("nan")}
    t_step = time.perf_counter() - t0
    stats = ex.finish()  # runs any segment not run (e.g. a skipped fp16 step), waits, unpacks
    stats.extra.update(step_s=t_step, segment_step_s=sum(seg_times))
    return result, stats
