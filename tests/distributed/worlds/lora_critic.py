"""A critic with LoRA (issue #39, --critic-lora-*): checked by tests/distributed/worlds/tiny_runs.py in
its world of one, not a world of its own.

At (1,1,1): the LoRA critic's values with B zero equal the plain critic's bitwise; one backward of a
squared value error (B non-zero) through megatron's DDP gives the adapters' and the value head's
gradients of a plain PyTorch LoRA on the plain critic (``W x + s B A x`` hooks, the head a leaf);
the optimizer holds those only, and a step moves the head and the adapters, no base weight.
"""

from functools import partial

import torch

from puzzle.config import ModelArch
from puzzle.dataflow.steps import _run
from puzzle.dataflow.micro_batching import MicroBatch
from puzzle.engine.model_engine import ModelEngine, OptimConfig
from puzzle.lora_config import LoRAConfig
from puzzle.models.lora import adapter_init_value, target_linears
from puzzle.models.param_names import HEAD_LOCAL_NAME
from puzzle.parallel.groups import layout_for
from puzzle.parallel.plan import ParallelPlan

LORA = LoRAConfig(dim=4, alpha=8.0)
ARCH = ModelArch.llama(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
                       vocab_size=100, make_vocab_size_divisible_by=64, seq_length=16)
ROWS, LEN, SEED, B_STD = 2, 8, 7, 0.05


def _data():
    g = torch.Generator().manual_seed(4)
    return torch.randint(0, ARCH.vocab_size, (ROWS, LEN), generator=g), torch.randn(ROWS, LEN, generator=g)


def _values(output):
    return output.float().reshape(output.shape[0], output.shape[1])


def _value_loss_step(targets, store):
    """The squared value error summed over a row's tokens (per-token convention); ``store`` gets the values."""

    def loss_func(row, output):
        values = _values(output)
        store.append(values.detach().clone())
        err = (values - targets[row:row + 1]) ** 2
        return err.sum(), torch.tensor(err.numel(), dtype=torch.int), {}

    def forward_step(data_iterator, model):
        row, tokens = next(data_iterator)
        return _run(model, MicroBatch.of_tokens(tokens)), partial(loss_func, row)

    return forward_step


def _reference(specs: dict, tokens, targets) -> dict:
    """Plain PyTorch LoRA on the plain critic: hooks on every target linear, the head a leaf; the mean
    squared value error's gradients in A, B and the head."""
    eng = ModelEngine("critic", ARCH, layout_for(ParallelPlan(1, 1, 1)), trainable=False, seed=SEED)
    leaves = {name: adapter_init_value(spec, SEED, B_STD).requires_grad_(True)
              for name, spec in specs.items() if ".adapter." in name}
    for local, _, linear in target_linears(eng.module, LORA):
        a, b = leaves[f"{local}.adapter.linear_in.weight"], leaves[f"{local}.adapter.linear_out.weight"]
        linear.register_forward_hook(lambda m, args, out, a=a, b=b: (out[0] + LORA.scale * args[0] @ a.T @ b.T, out[1]))
    head = dict(eng.module.named_parameters())[HEAD_LOCAL_NAME].requires_grad_(True)
    values = _values(eng.module(tokens, torch.arange(LEN).unsqueeze(0).expand_as(tokens), None))
    ((values - targets) ** 2).mean().backward()
    return {**{name: leaf.grad for name, leaf in leaves.items()}, HEAD_LOCAL_NAME: head.grad}


def check_lora_critic():
    """(A world of one) the LoRA critic at (1,1,1) against plain PyTorch (see the module docstring)."""
    layout = layout_for(ParallelPlan(1, 1, 1))
    plain = ModelEngine("critic", ARCH, layout, trainable=False, seed=SEED)
    eng = ModelEngine("critic", ARCH, layout, trainable=True, optim=OptimConfig(lr=1e-2), seed=SEED, lora=LORA)
    tokens, targets = _data()
    rows = list(enumerate(tokens.split(1)))
    values = []
    for e in (plain, eng):
        store = []
        with torch.no_grad():
            e.forward_backward(_value_loss_step(targets, store), iter(rows), ROWS, LEN, 1, forward_only=True)
        values.append(torch.cat(store))
    params = dict(eng.module.named_parameters())
    with torch.no_grad():
        for local, spec in eng.adapter_specs.items():
            if local.endswith("linear_out.weight"):
                params[local].copy_(adapter_init_value(spec, SEED, B_STD))
    base = {n: p.detach().clone() for n, p in params.items() if n not in eng.adapter_specs}
    trained = {n: params[n].detach().clone() for n in eng.adapter_specs}
    eng.zero_grad()
    eng.forward_backward(_value_loss_step(targets, []), iter(rows), ROWS, LEN, 1, forward_only=False)
    grads = {n: params[n].main_grad.detach().clone() for n in eng.adapter_specs}
    ref = _reference(eng.adapter_specs, tokens, targets)
    eng.optimizer_step()
    return {"equal_bitwise": torch.equal(values[0], values[1]),
            "trained": sorted(eng.adapter_specs) == sorted(ref) and HEAD_LOCAL_NAME in ref,
            "worst_relative_grad_error": max((grads[n] - ref[n]).abs().max().item() / ref[n].abs().max().item()
                                             for n in ref),
            "min_grad_max": min(ref[n].abs().max().item() for n in ref),
            "optimizer_numel": sum(p.numel() for g in eng.optimizer.param_groups for p in g["params"]),
            "trained_numel": sum(p.numel() for p in trained.values()),
            "base_frozen": all(not params[n].requires_grad for n in base),
            "base_unchanged": all(torch.equal(v, params[n]) for n, v in base.items()),
            "head_moved": not torch.equal(trained[HEAD_LOCAL_NAME], params[HEAD_LOCAL_NAME]),
            "adapters_moved": sum(not torch.equal(v, params[n]) for n, v in trained.items() if ".adapter." in n),
            "adapters": sum(".adapter." in n for n in trained)}
