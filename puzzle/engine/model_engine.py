"""ModelEngine: one role model in its layout, run through megatron-core's schedules.

Trainable models are wrapped in megatron DDP with a megatron optimizer (optionally the
DistributedOptimizer) and OptimizerParamScheduler; frozen models run forward-only. Losses use
megatron's per-token convention (``calculate_per_token_loss``): a loss_func returns
``(loss_sum, num_tokens, report)`` and gradients are divided by the total token count of the
global batch, so a token-mean loss is the same at every (P, D, T).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterator, List, Optional

import torch
import torch.distributed as dist

from puzzle.config import ModelArch, OptimConfig, Recompute  # noqa: F401  (OptimConfig: imported from here too)
from puzzle.lora_config import LoRAConfig
from puzzle.models.builders import build_role_model
from puzzle.models.init import is_expert_param
from puzzle.parallel.groups import Layout


class ModelEngine:
    """A role model on this rank: ``model`` is None when the rank is outside the layout."""

    def __init__(self, role: str, arch: ModelArch, layout: Layout, *, trainable: bool,
                 optim: Optional[OptimConfig] = None, seed: int = 1234, recompute: Optional[Recompute] = None,
                 bf16: bool = False, fp16: bool = False, transformer_impl: str = "local",
                 sequence_parallel: bool = False, layout_independent_init: bool = True,
                 lora: Optional[LoRAConfig] = None):
        """``lora`` (enabled): the base weights are frozen and rank-dim adapters train
        (puzzle/models/lora.py)."""
        self.role, self.arch, self.layout, self.trainable = role, arch, layout, trainable
        self.lora = lora if lora is not None and lora.enabled else None
        self.optimizer = None
        self.scheduler = None
        self.adapter_specs = {}  # LoRA: local adapter parameter name -> its global ParamSpec
        self.transformer_impl = transformer_impl
        self.module = build_role_model(role, arch, layout, bf16=bf16, fp16=fp16,
                                       recompute=recompute, head_seed=seed,
                                       transformer_impl=transformer_impl,
                                       sequence_parallel=sequence_parallel,
                                       layout_independent_init=layout_independent_init)
        self.model = self.module
        if self.module is None:
            self.config = None
            return
        self.config = self.module.config
        if self.lora is not None:
            from puzzle.models.lora import apply_lora

            self.adapter_specs = apply_lora(self.module, arch, role, self.lora, seed)
        self.p2p = layout.p2p_communicator(self.config)
        if trainable:
            self._wrap_for_training(optim or OptimConfig(), bf16=bf16, fp16=fp16)
        else:
            for p in self.module.parameters():
                p.requires_grad_(False)

    # ------------------------------------------------------------------------------------
    @property
    def member(self) -> bool:
        return self.module is not None

    def _wrap_for_training(self, optim: OptimConfig, *, bf16: bool, fp16: bool) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        pgc = self.layout.pg_collection
        # read by DDP at construction: gradients are summed, then divided by the global token count
        self.config.calculate_per_token_loss = True
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=optim.use_distributed_optimizer,
            check_for_nan_in_grad=False,  # puzzle.engine.nonfinite checks, names and may skip
        )
        _experts_in_their_own_optimizer(self.module)
        self.model = DistributedDataParallel(self.config, ddp_config, self.module,
                                             pg_collection=pgc)
        opt_config = OptimizerConfig(
            optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
            adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
            clip_grad=optim.clip_grad, bf16=bf16, fp16=fp16,  # the model's precision
            params_dtype=self.config.params_dtype,
            use_distributed_optimizer=optim.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt_config, [self.model], pg_collection=pgc,
                                                use_gloo_process_groups=False)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if optim.lr_warmup_iters else optim.lr, max_lr=optim.lr,
            min_lr=optim.min_lr, lr_warmup_steps=optim.lr_warmup_iters,
            lr_decay_steps=max(optim.lr_decay_iters, optim.lr_warmup_iters + 1),
            lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay,
            end_wd=optim.weight_decay, wd_incr_steps=1, wd_incr_style="constant",
        )
        self.config.no_sync_func = self.model.no_sync
        self.config.finalize_model_grads_func = partial(finalize_model_grads)
        self.config.grad_scale_func = self.optimizer.scale_loss

    # ------------------------------------------------------------------------------------
    def forward_backward(self, forward_step_func: Callable, data_iterator: Iterator,
                         num_microbatches: int, seq_length: int, micro_batch_size: int,
                         forward_only: bool) -> List[Any]:
        """Run megatron's (1F1B or no-pipelining) schedule; returns the last stage's outputs."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        fb = get_forward_backward_func(pp_size=self.layout.plan.P)
        if forward_only:
            self.model.eval()
        else:
            self.model.train()
        out = fb(forward_step_func=forward_step_func, data_iterator=data_iterator,
                 model=[self.model], num_microbatches=num_microbatches, seq_length=seq_length,
                 micro_batch_size=micro_batch_size, forward_only=forward_only,
                 p2p_communicator=self.p2p, pg_collection=self.layout.pg_collection)
        return out

    def zero_grad(self) -> None:
        if not self.trainable:
            raise RuntimeError(f"{self.role} is frozen; it has no gradients")
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def grads_finite(self) -> bool:
        """Whether this rank's gradient buffers hold only finite values (one norm per buffer)."""
        norms = [b.grad_data.float().norm() for b in self.model.buffers + self.model.expert_parallel_buffers]
        return bool(torch.isfinite(torch.stack(norms).sum())) if norms else True

    def optimizer_step(self) -> dict:
        """megatron optimizer step (grad clipping inside) then LR scheduler step."""
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        return {"update_successful": bool(ok),
                "grad_norm": float(grad_norm) if grad_norm is not None else float("nan")}

    def train_step(self, forward_step_func: Callable, data_iterator: Iterator,
                   num_microbatches: int, seq_length: int, micro_batch_size: int) -> dict:
        """zero grads -> forward/backward -> optimizer step -> LR step. Returns step stats."""
        self.zero_grad()
        outputs = self.forward_backward(forward_step_func, data_iterator, num_microbatches,
                                        seq_length, micro_batch_size, forward_only=False)
        return {"outputs": outputs, **self.optimizer_step()}



def build_role_engines(cfg) -> dict:
    """Every role of the run (``cfg.roles``: a RunConfig's) on this rank, in its layout; HF
    checkpoints (``--hf-*-path``) are read shard by shard into the ranks that hold them, Megatron-LM
    checkpoints (``--*pretrained-checkpoint``) resharded by dist_checkpointing."""
    from dataclasses import replace

    from puzzle.parallel.groups import layout_for

    engines = {}
    me = dist.get_rank() if dist.is_initialized() else 0
    trains = any(spec.trainable and spec.plan.contains(me) for spec in cfg.roles.values())
    world = dist.get_world_size() if dist.is_initialized() else 1
    idle_ranks = set(range(world)) - {r for spec in cfg.roles.values() if spec.trainable for r in spec.plan.ranks}
    for role, spec in cfg.roles.items():
        optim = replace(cfg.optim, lr=spec.lr) if spec.trainable else None
        # the reference starts as the actor: same shape and seed -> the same weights
        engines[role] = ModelEngine(role, spec.arch, layout_for(spec.plan), trainable=spec.trainable,
                                    optim=optim, seed=spec.init_seed(cfg.seed), recompute=cfg.recompute,
                                    bf16=cfg.bf16, fp16=cfg.fp16, transformer_impl=cfg.transformer_impl,
                                    sequence_parallel=cfg.sequence_parallel,
                                    lora=cfg.role_lora(role))
        if spec.trainable and idle_ranks:  # a generation pool holds no trainable model
            _param_groups_gathers(joining=not trains)
        if spec.hf_path and engines[role].member:
            from puzzle.models.hf_checkpoint import load_hf_into_model

            # a critic from an LM keeps its fresh head
            load_hf_into_model(engines[role].module, spec.arch, role, spec.hf_path,
                               allow_missing_head=spec.description.allow_missing_head)
        elif spec.pretrained_checkpoint:  # collective: every rank takes part in the dist-checkpoint load
            from puzzle.models.megatron_checkpoint import load_megatron_into_model

            load_megatron_into_model(engines[role].module, role, spec.pretrained_checkpoint,
                                     allow_missing_head=spec.description.allow_missing_head)
    return engines


_BUILT = "optimizer built"


def _param_groups_gathers(joining: bool) -> None:
    """get_megatron_optimizer gathers the param-group keys over the whole world (each call to its
    _get_param_groups: dense and expert groups). A rank holding no trainable model (the generation
    pool of --rl-desired-lag) joins those gathers with no keys of its own, until the training
    ranks, their optimizer built, gather ``_BUILT`` (``joining`` False)."""
    while True:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [] if joining else _BUILT)
        if not joining or _BUILT in gathered:
            return


def _experts_in_their_own_optimizer(module) -> None:
    """megatron marks expert parameters as not all-reduced over the data-parallel group only when
    E > 1: their gradients then live in buffers of their own, reduced over the expert
    data-parallel group, and get_megatron_optimizer gives them an optimizer of their own. Marked
    at E = 1 too (the expert data-parallel group then spans the ranks holding the same experts),
    a MoE model's optimizer has the same parts at every E, so its state resumes across E = 1.
    Dense models have no expert parameters: nothing changes for them."""
    for name, param in module.named_parameters():
        if is_expert_param(name):
            param.allreduce = False

