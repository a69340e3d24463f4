"""4-rank world: a Megatron-LM checkpoint written as pretrain_gpt.py writes it (megatron's global
parallel state at T=2, D=2, its local layer spec, dist_checkpointing.save of {'model':
model.sharded_state_dict(), 'iteration', 'args', 'checkpoint_version'}) loads into puzzle's
models at other layouts with the same log-probs; the export loads back into a plain megatron
GPTModel and into puzzle; a value model made from it carries its head.

Runs last in its shared world: it initialises and then destroys megatron's global parallel state
(puzzle never uses it), restoring the global memory buffer the other checks rely on."""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist

from puzzle.parallel.groups import layout_for
from puzzle.parallel.plan import ParallelPlan
from puzzle.engine.model_engine import ModelEngine
from tests.harness import world_main

B, S, V = 2, 12, 200  # V: the valid ids; Megatron-LM pads the rows to 128 * T = 256
ROWS, H, HEADS, GROUPS, FFN, LAYERS = 256, 64, 4, 2, 128, 2
_DIRS = {}


def _shared_dir():
    obj = [tempfile.mkdtemp(prefix="puzzle-megatron-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def _tokens():
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))


def _megatron_args():
    """The model args of Megatron-LM's pretrain_gpt.py for this model (its flags' names)."""
    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=HEADS, group_query_attention=True,
        num_query_groups=GROUPS, kv_channels=H // HEADS, padded_vocab_size=ROWS, make_vocab_size_divisible_by=128,
        seq_length=S, max_position_embeddings=64, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True,
        position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0, untie_embeddings_and_output_weights=True,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False, init_method_std=0.2,
        tensor_model_parallel_size=2, pipeline_model_parallel_size=1, world_size=4, data_parallel_size=2,
        tokenizer_type="NullTokenizer", ckpt_format="torch_dist", iteration=7)


def _plain_megatron_model(seed=11):
    """GPTModel on megatron's global parallel state (T=2, D=2), as pretrain_gpt.py builds it."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()  # puzzle's global memory buffer; initialize makes its own
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        normalization="RMSNorm", layernorm_epsilon=1e-5, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, init_method_std=0.2,
        tensor_model_parallel_size=2, use_cpu_initialization=True, perform_initialization=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=ROWS, max_sequence_length=64,
                    parallel_output=False, share_embeddings_and_output_weights=False,
                    position_embedding_type="rope", rotary_base=10000)


def _plain_logprobs(model):
    tok = _tokens()
    pos = torch.arange(S).unsqueeze(0).expand_as(tok)
    with torch.no_grad():
        logits = model.eval()(tok, pos, None).float()[..., :V]
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tok[:, 1:, None]).squeeze(-1)


def _end_parallel_state():
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state._set_global_memory_buffer()  # puzzle's models use it without the global state


def _write_as_pretrain_gpt(root):
    """Megatron-LM's save of iteration 7: the tracker, iter_0000007/ with the model under 'model'."""
    from megatron.core import dist_checkpointing

    model = _plain_megatron_model()
    ref = _plain_logprobs(model)
    d = os.path.join(root, "iter_0000007")
    if dist.get_rank() == 0:
        os.makedirs(d)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": 7, "args": _megatron_args(),
                             "checkpoint_version": 3.0}, d)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("7")
    dist.barrier()
    _end_parallel_state()
    return ref


def _puzzle_engine(role, plan, root, **kw):
    from puzzle.models.megatron_checkpoint import (arch_from_megatron_args, find_megatron_checkpoint,
                                                   load_megatron_into_model, read_common_state)

    arch = arch_from_megatron_args(read_common_state(find_megatron_checkpoint(root))["args"], root, seq_length=S)
    eng = ModelEngine(role, arch, layout_for(plan), trainable=False, seed=3)
    load_megatron_into_model(eng.module, role, root, **kw)
    return eng, arch


def _logprobs(eng, with_values=False):
    from tests.distributed.worlds.hf_import import _gather_one, _run

    out = _run(eng, with_values=with_values)
    return torch.tensor(_gather_one(None if out is None else out.tolist()))


def check_load_megatron_written_checkpoint():
    """Written at (P,D,T) = (1,2,2) by megatron itself, read at (2,1,2) and (1,1,1): same log-probs."""
    _DIRS["root"] = _shared_dir()
    _DIRS["lm"] = os.path.join(_DIRS["root"], "lm")
    ref = _write_as_pretrain_gpt(_DIRS["lm"])
    _DIRS["ref"] = ref
    res = {"ref_std": ref.std().item()}
    for plan in (ParallelPlan(2, 1, 2), ParallelPlan(1, 1, 1)):
        eng, arch = _puzzle_engine("actor", plan, _DIRS["lm"])
        res[str(plan)] = (_logprobs(eng) - ref).abs().max().item()
    res["arch"] = [arch.num_layers, arch.hidden_size, arch.num_query_groups, arch.padded_vocab_size, arch.swiglu]
    try:  # an LM checkpoint has no scalar head: a reward model from it is refused (negative control)
        _puzzle_engine("reward", ParallelPlan(1, 1, 1), _DIRS["lm"])
        res["reward_from_lm"] = None
    except ValueError as e:
        res["reward_from_lm"] = str(e)
    return res


def check_export_round_trip():
    """puzzle (2,1,2) -> export -> a plain megatron GPTModel (T=2, D=2) loads it with megatron's own
    dist_checkpointing.load, and puzzle at (1,1,1) too: the same log-probs."""
    from megatron.core import dist_checkpointing

    from puzzle.models.megatron_checkpoint import (arch_from_megatron_args, find_megatron_checkpoint,
                                                   save_megatron_checkpoint)

    eng, arch = _puzzle_engine("actor", ParallelPlan(2, 1, 2), _DIRS["lm"])
    out = os.path.join(_DIRS["root"], "export")
    save_megatron_checkpoint(eng.module, arch, out)
    ckpt = find_megatron_checkpoint(out)
    model = _plain_megatron_model(seed=12)
    before = _plain_logprobs(model)  # its own random init: far from the reference
    # Megatron-LM's load: {'model': ...} with megatron-core's default strictness and common-state reader
    common = dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt.dir)
    model.load_state_dict(common["model"])
    after = _plain_logprobs(model)
    _end_parallel_state()
    back, _ = _puzzle_engine("actor", ParallelPlan(1, 1, 1), out)
    return {"release": ckpt.release, "tracker": open(os.path.join(out, "latest_checkpointed_iteration.txt")).read(),
            "megatron_err": (after - _DIRS["ref"]).abs().max().item(),
            "megatron_before_err": (before - _DIRS["ref"]).abs().max().item(),
            "puzzle_err": (_logprobs(back) - _DIRS["ref"]).abs().max().item(),
            "args_round_trip": arch_from_megatron_args(common["args"], out, seq_length=S) == arch,
            "checkpoint_version": common["checkpoint_version"]}


def check_value_model():
    """make_value_model's head on the Megatron LM: saved at (1,1,2), read as a reward model (its
    scalar head is required) at (2,1,2); the values equal those of a critic made in memory."""
    from puzzle.models.megatron_checkpoint import save_megatron_checkpoint
    from puzzle.tools.make_value_model import init_scalar_head

    made, arch = _puzzle_engine("critic", ParallelPlan(1, 1, 2), _DIRS["lm"], allow_missing_head=True)
    init_scalar_head(made.module, arch.hidden_size, "normal", None, seed=5)
    out = os.path.join(_DIRS["root"], "critic")
    save_megatron_checkpoint(made.module, arch, out)
    in_memory = _logprobs(made, with_values=True)
    reward, _ = _puzzle_engine("reward", ParallelPlan(2, 1, 2), out)
    read = _logprobs(reward, with_values=True)
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(_DIRS["root"], ignore_errors=True)
    return {"values_err": (read - in_memory).abs().max().item(), "values_std": in_memory.std().item()}


if __name__ == "__main__":
    world_main([("load", check_load_megatron_written_checkpoint), ("export", check_export_round_trip),
                ("value_model", check_value_model)])
