"""Megatron-style command line: one ``_add_<topic>_args`` group per concern, ``validate_args``.

Megatron-LM flag names keep their meaning (model shape, batch, optimizer, parallelism, logging,
checkpoints). Critic, reward and reference models take role-prefixed overrides of the model-shape
and layout flags (``--critic-num-layers``, ``--reward-hidden-size``,
``--critic-tensor-model-parallel-size``); unset, they follow the actor's. The actor's generation
layout has its own flags (``--actor-gen-tensor-model-parallel-size``). Later flags override
earlier ones (argparse), abbreviations are refused.
"""

from __future__ import annotations

import argparse
import os
from typing import List, Optional

from puzzle.flag_checks import ArgumentError  # noqa: F401  (the error type of every flag check)
from puzzle.flag_checks import fail as _fail

ROLE_PREFIXED = ("critic", "reward", "ref")

# (flag, type, default, help) of model-shape flags that roles may override with a prefix
_MODEL_FLAGS = [
    ("num-layers", int, None, "Number of transformer layers."),
    ("hidden-size", int, None, "Transformer hidden size."),
    ("ffn-hidden-size", int, None, "MLP hidden size (default 4 * hidden size)."),
    ("num-attention-heads", int, None, "Number of attention heads."),
    ("num-query-groups", int, None, "Query groups for grouped-query attention."),
    ("kv-channels", int, None, "Projection size per head (default hidden / heads)."),
]


class _Parser(argparse.ArgumentParser):
    """An unknown or malformed flag raises ArgumentError (one short line, printed once by the
    caller) instead of printing the usage text and exiting on every rank."""

    def error(self, message):
        raise ArgumentError(f"{message} (see {self.prog} --help)")


def _add_model_args(parser):
    g = parser.add_argument_group("model")
    for flag, typ, default, text in _MODEL_FLAGS:
        g.add_argument(f"--{flag}", type=typ, default=default, help=f"Actor/reference: {text}")
    g.add_argument("--group-query-attention", action="store_true", help="Use grouped-query attention.")
    g.add_argument("--seq-length", type=int, default=None, help="Maximum sequence length (prompt + response).")
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (LLaMA).")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--add-qkv-bias", action="store_true", help="Biases on the q/k/v projections only (Qwen2).")
    g.add_argument("--qk-layernorm", action="store_true", help="Per-head norm of queries and keys (Qwen3).")
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama-3.x RoPE frequency scaling.")
    g.add_argument("--rope-scaling-factor", type=float, default=None, help="Llama-3.x RoPE scaling factor (default 8).")
    g.add_argument("--rope-low-freq-factor", type=float, default=None, help="Llama-3.x RoPE low_freq_factor (default 1).")
    g.add_argument("--rope-high-freq-factor", type=float, default=None, help="Llama-3.x RoPE high_freq_factor (default 4).")
    g.add_argument("--rope-original-max-position-embeddings", type=int, default=None,
                   help="Llama-3.x RoPE original_max_position_embeddings (default 8192).")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-backend", choices=["auto", "flash", "fused", "unfused", "local"],
                   default="auto", help="Core attention (Megatron-LM's names): flash/fused/unfused = "
                   "transformer-engine kernels (unfused without TE: megatron-core's own), local = "
                   "torch SDPA, auto = TE if present, else SDPA on CUDA, else unfused on CPU.")
    for role in ROLE_PREFIXED:
        rg = parser.add_argument_group(f"{role} model (overrides; default: the actor's)")
        for flag, typ, _, text in _MODEL_FLAGS:
            rg.add_argument(f"--{role}-{flag}", type=typ, default=None, help=f"{role}: {text}")


def _add_parallel_args(parser):
    g = parser.add_argument_group("parallelism (per role; D = world / (P * T))")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Actor training T (default for every role).")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="Actor training P (default for every role).")
    for role in ("actor",) + ROLE_PREFIXED:
        g.add_argument(f"--{role}-tensor-model-parallel-size", type=int, default=None)
        g.add_argument(f"--{role}-pipeline-model-parallel-size", type=int, default=None)
        g.add_argument(f"--{role}-data-parallel-size", type=int, default=None,
                       help=f"{role}: D (default: the ranks from its offset to the end / (P*T)).")
        g.add_argument(f"--{role}-rank-offset", type=int, default=0,
                       help=f"{role}: first rank of its layout (disjoint placement).")
    g.add_argument("--actor-gen-tensor-model-parallel-size", type=int, default=None,
                   help="Actor generation-layout T (default: its training layout).")
    g.add_argument("--actor-gen-pipeline-model-parallel-size", type=int, default=None,
                   help="Actor generation-layout P (default: its training layout).")
    g.add_argument("--switch-segments", type=int, default=1,
                   help="Segments of the actor's training->generation weight switch overlapped with the optimizer step.")
    g.add_argument("--ranks-per-node", type=int, default=None, help="Ranks per node (switch prefers same-node sources).")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--score-placement", choices=["sequential", "disjoint", "time-sharing"],
                   default="sequential", help="How the scoring stage's models share the devices.")
    g.add_argument("--train-placement", choices=["sequential", "disjoint", "time-sharing"],
                   default="sequential", help="How the training stage's models (actor, critic) share the devices.")


def _add_training_args(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1, help="Samples per micro-batch (scoring and training).")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Samples per optimizer step (= the PPO mini-batch; default: the rollout batch).")
    g.add_argument("--train-iters", type=int, default=10, help="PPO iterations.")
    g.add_argument("--lr", type=float, default=1e-5, help="Actor learning rate.")
    g.add_argument("--critic-lr", type=float, default=None, help="Critic learning rate (default: --lr).")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="constant")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true",
                   help="bf16 parameters and activations; fp32 main parameters and gradients in the optimizer.")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--transformer-impl", choices=["transformer_engine", "local"], default="transformer_engine",
                   help="Transformer layer implementation (Megatron-LM's flag): transformer_engine where TE "
                        "imports on a CUDA machine, else local (said once at start).")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron sequence parallelism within each model's tensor-parallel group (T > 1).")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--recompute-activations", action="store_true")


def _add_ppo_args(parser):
    g = parser.add_argument_group("PPO")
    g.add_argument("--rollout-batch-size", type=int, default=8, help="Prompts per PPO iteration.")
    g.add_argument("--ppo-mini-batch-size", type=int, default=None, help="Alias of --global-batch-size.")
    g.add_argument("--ppo-epochs", type=int, default=1, help="Passes over each rollout batch.")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--max-prompt-length", type=int, default=None, help="Prompt budget (default: seq length - max new tokens).")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--greedy", action="store_true", help="Greedy decoding (deterministic rollouts).")
    g.add_argument("--generation-micro-batch-size", type=int, default=None,
                   help="Prompts per generation micro-batch (default: all of a DP rank's prompts). "
                   "Smaller than a rank's prompts at P=1: finished rows take waiting prompts.")
    g.add_argument("--cuda-graph-generation", action="store_true",
                   help="Replay each decode step from a CUDA graph captured per batch-size bucket (GPU only).")
    g.add_argument("--kl-coef", type=float, default=0.05)
    g.add_argument("--kl-target", type=float, default=None, help="Adaptive KL controller target (Ziegler et al.).")
    g.add_argument("--kl-horizon", type=int, default=10000)
    g.add_argument("--kl-estimator", choices=["k1", "abs", "mse", "low_var_kl"], default="k1")
    g.add_argument("--gamma", type=float, default=1.0)
    g.add_argument("--lam", type=float, default=0.95)
    g.add_argument("--clip-eps", type=float, default=0.2)
    g.add_argument("--value-clip-eps", type=float, default=0.2)
    g.add_argument("--entropy-coef", type=float, default=0.0)
    g.add_argument("--reward-clip", type=float, default=None)
    g.add_argument("--no-whiten-advantages", action="store_true")
    g.add_argument("--reward-fn", type=str, default=None, help="Reward function module:function.")
    g.add_argument("--reward-model", type=str, default=None,
                   help="Reward model source: 'random' (tests/benchmarks) or a checkpoint dir.")


def _add_algorithm_args(parser):
    from puzzle.algorithms import KL_KINDS, LOSS_AGG_MODES
    from puzzle.algorithms.advantage_estimators import ESTIMATORS

    g = parser.add_argument_group("advantage estimators, GRPO family and DAPO (docs/grpo.md)")
    g.add_argument("--advantage-estimator", choices=list(ESTIMATORS), default="gae",
                   help="gae (PPO, with a critic) or a critic-free estimator.")
    g.add_argument("--n-samples-per-prompt", type=int, default=1,
                   help="Responses generated per prompt (the group of grpo/rloo); samples per iteration = "
                        "rollout batch x N.")
    g.add_argument("--grpo-std-normalization", action=argparse.BooleanOptionalAction, default=True,
                   help="grpo: divide by the group's std (--no-grpo-std-normalization: Dr. GRPO).")
    g.add_argument("--use-kl-loss", action="store_true", help="KL to the reference as a loss term of the actor.")
    g.add_argument("--kl-loss-coef", type=float, default=0.001)
    g.add_argument("--kl-loss-type", choices=list(KL_KINDS), default="low_var_kl")
    g.add_argument("--clip-eps-low", type=float, default=None, help="Lower ratio clip (default --clip-eps).")
    g.add_argument("--clip-eps-high", type=float, default=None,
                   help="Upper ratio clip (DAPO clip-higher; default --clip-eps-low).")
    g.add_argument("--loss-agg-mode", choices=list(LOSS_AGG_MODES), default="token-mean",
                   help="How the actor's per-token losses are aggregated over the mini-batch.")
    g.add_argument("--filter-groups", action="store_true",
                   help="DAPO dynamic sampling: drop groups whose rewards are all equal and generate more "
                        "until the batch is full.")
    g.add_argument("--max-num-gen-batches", type=int, default=10,
                   help="--filter-groups: at most this many generation rounds per iteration.")
    g.add_argument("--overlong-buffer-len", type=int, default=0,
                   help="DAPO overlong shaping: the last N tokens of --max-new-tokens are penalised (0: off).")
    g.add_argument("--overlong-penalty-factor", type=float, default=1.0)


def _add_reward_fn_args(parser):
    g = parser.add_argument_group("reward functions (--reward-fn; docs/grpo.md)")
    g.add_argument("--reward-workers", type=int, default=0,
                   help="Processes per rank that run the reward function (0: in the rank's process).")
    g.add_argument("--reward-timeout", type=float, default=60.0,
                   help="Seconds per sample before a reward counts as bad (0: no timeout).")
    g.add_argument("--on-bad-reward", choices=["default", "error"], default="default",
                   help="A reward that is not a number, NaN/inf, raises or times out: substitute "
                        "--bad-reward-value (counted as bad_rewards) or stop the run.")
    g.add_argument("--bad-reward-value", type=float, default=0.0)
    g.add_argument("--reward-normalization", choices=["none", "running"], default="none",
                   help="running: scores normalised by their running mean/std (checkpointed).")


def _add_data_args(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--prompt-data", type=str, default=None, help="Prompt file (JSONL/Parquet/Arrow); default: bundled tiny set.")
    g.add_argument("--prompt-key", type=str, default="prompt")
    g.add_argument("--prompt-split", type=str, default="train", help="Split of a hub dataset (--prompt-data NAME).")
    g.add_argument("--apply-chat-template", action="store_true",
                   help="Format prompts (strings or message lists) with the tokenizer's chat template.")
    g.add_argument("--skip-bad-records", action="store_true",
                   help="Skip (and count) malformed prompt records instead of stopping at the first.")
    g.add_argument("--prompt-overflow", choices=["truncate_left", "truncate_right", "drop"],
                   default="truncate_left", help="Prompts longer than the prompt budget: keep the end, "
                                                 "keep the start, or drop them (counted in the metrics).")
    g.add_argument("--tokenizer-type", type=str, default="ByteLevelTokenizer")
    g.add_argument("--tokenizer-model", type=str, default=None)
    g.add_argument("--hf-actor-path", type=str, default=None,
                   help="HF checkpoint dir (Llama-2/3.x, Mistral, Qwen2/2.5, Qwen3) for the actor and the "
                        "reference; its config.json sets their shape.")
    g.add_argument("--hf-critic-path", type=str, default=None,
                   help="HF checkpoint dir for the critic backbone (+ score/v_head when present).")
    g.add_argument("--hf-reward-path", type=str, default=None,
                   help="HF checkpoint dir of the reward model (backbone + score head).")


def _add_logging_args(parser):
    g = parser.add_argument_group("logging and checkpoints")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--log-dir", type=str, default=None, help="Writes DIR/metrics.jsonl (and TensorBoard events).")
    g.add_argument("--save", type=str, default=None,
                   help="Checkpoint directory to save to (dist-checkpoint of every role; see docs/ppo.md).")
    g.add_argument("--load", type=str, default=None,
                   help="Checkpoint directory to resume from (its latest iteration; may be --save's).")
    g.add_argument("--save-interval", type=int, default=None,
                   help="Save every N iterations (and at the end); default: only at the end.")
    g.add_argument("--no-load-optim", action="store_true",
                   help="Resume weights, schedulers and counters but not the optimizer states.")
    g.add_argument("--no-load-rng", action="store_true", help="Do not restore the per-rank RNG states.")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="Resume this iteration of --load instead of its latest one.")
    g.add_argument("--keep-last-checkpoints", type=int, default=None,
                   help="Delete all but the newest N checkpoints under --save after each save "
                        "(default: keep all).")
    g.add_argument("--tensorboard-dir", type=str, default=None,
                   help="Write the metrics of metrics.jsonl as TensorBoard scalars (extra 'tb').")
    g.add_argument("--wandb-project", type=str, default=None,
                   help="Log the metrics of metrics.jsonl to this Weights & Biases project (extra "
                        "'wandb'; WANDB_MODE=offline works without network).")
    g.add_argument("--wandb-exp-name", type=str, default=None, help="The W&B run name.")
    g.add_argument("--wandb-save-dir", type=str, default=None,
                   help="Local W&B directory (default: --log-dir, else wandb's own).")


def _add_operations_args(parser):
    g = parser.add_argument_group("preemption, time limits, hangs and non-finite steps")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On SIGTERM: finish the current iteration, save (--save), exit 0. All ranks "
                        "agree on the iteration to stop at.")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="Save (--save) and exit 0 after the iteration that ends past this many minutes.")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="Save (--save) and exit 0 at the first iteration divisible by N.")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="Timeout of every process group's collectives (minutes; fractions allowed): "
                        "a stuck rank ends the job instead of hanging it.")
    g.add_argument("--skip-nonfinite-iterations", type=int, default=0,
                   help="Skip up to N optimizer steps whose loss or gradient norm is NaN/inf "
                        "(counted in the metrics); past N, or with 0, such a step stops the run.")


def _add_plan_args(parser):
    g = parser.add_argument_group("plan")
    g.add_argument("--dry-run", action="store_true",
                   help="Validate every flag, print the layouts and a per-device memory estimate, exit "
                        "without allocating.")
    g.add_argument("--plan-file", type=str, default=None,
                   help="Use the layouts and placements of a plan written by search_plan.py --save-plan "
                        "(they replace layout flags given on the command line).")
    g.add_argument("--plan", choices=["auto", "flags"], default="flags",
                   help="auto: search the plan at start with --profile; flags: the layout flags as given.")
    g.add_argument("--profile", type=str, default=None,
                   help="Device profile for planning and memory estimates: a JSON file from "
                        "python -m puzzle.tools.profile, or a bundled name (default a100_80gb).")
    g.add_argument("--world-size", type=int, default=None,
                   help="World size to plan for in --dry-run / search_plan.py (default: $WORLD_SIZE).")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="Vocabulary size when the tokenizer files are not at hand (dry runs, planning).")


def build_parser(prog: Optional[str] = None, raise_errors: bool = False) -> argparse.ArgumentParser:
    """``raise_errors``: an unknown or malformed flag raises ArgumentError instead of exiting."""
    cls = _Parser if raise_errors else argparse.ArgumentParser
    parser = cls(prog=prog, description="PPO on megatron-core (puzzle)", allow_abbrev=False)
    for add in (_add_model_args, _add_parallel_args, _add_training_args, _add_ppo_args,
                _add_algorithm_args, _add_reward_fn_args, _add_data_args, _add_logging_args,
                _add_operations_args, _add_plan_args):
        add(parser)
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse train_ppo.py's flags; an unknown or malformed one raises ArgumentError."""
    parser = build_parser(prog="train_ppo.py", raise_errors=True)
    args = parser.parse_args(argv)
    return args


def role_value(args, role: str, flag: str):
    """``--<role>-<flag>`` when given, else the actor's ``--<flag>``."""
    attr = flag.replace("-", "_")
    if role != "actor":
        v = getattr(args, f"{role}_{attr}", None)
        if v is not None:
            return v
    return getattr(args, attr)


def _arch_for(args, role: str, vocab_size: int):
    """The role's ModelArch: from its HF ``config.json`` when one is at hand (flags may only
    repeat it; a critic/reward without a checkpoint of its own takes the actor's shape, as its
    model flags default to the actor's, unless role-prefixed shape flags describe it), else from
    the model flags."""
    from puzzle.config import ModelArch

    own = _hf_dir_for(args, role)
    hf, source_flag = (own, f"--hf-{'actor' if role == 'ref' else role}-path") if own else \
        (args.hf_actor_path, "--hf-actor-path")
    own_shape_flags = role != "actor" and any(getattr(args, f"{role}_{f.replace('-', '_')}", None) is not None
                                              for f, *_ in _MODEL_FLAGS)
    if hf and os.path.isfile(os.path.join(hf, "config.json")) and (own or not own_shape_flags):
        return _arch_from_hf(args, role, vocab_size, hf, source_flag)

    def v(flag):
        return role_value(args, role, flag)

    num_layers, hidden, heads = v("num-layers"), v("hidden-size"), v("num-attention-heads")
    for flag, value in (("num-layers", num_layers), ("hidden-size", hidden), ("num-attention-heads", heads)):
        if value is None:
            _fail(f"--{flag}", "is required (or --hf-actor-path/--hf-critic-path/--hf-reward-path DIR "
                               "with a config.json)")
    groups = v("num-query-groups") if args.group_query_attention else None
    if args.group_query_attention and groups is None:
        _fail("--num-query-groups", "is required with --group-query-attention")
    prefix = "" if role in ("actor", "ref") else f"{role}-"
    if _rope_scaling_kwargs(args) and not args.use_rope_scaling:
        _fail("--rope-scaling-factor", "the llama3 RoPE parameters need --use-rope-scaling")
    try:
        return ModelArch(
            num_layers=num_layers, hidden_size=hidden, ffn_hidden_size=v("ffn-hidden-size"),
            num_attention_heads=heads, num_query_groups=groups, vocab_size=vocab_size,
            kv_channels=v("kv-channels"), add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm,
            use_rope_scaling=args.use_rope_scaling, **_rope_scaling_kwargs(args),
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings,
            normalization=args.normalization, norm_epsilon=args.norm_epsilon, swiglu=args.swiglu,
            position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
            untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
            add_bias_linear=not args.disable_bias_linear, attention_dropout=args.attention_dropout,
            hidden_dropout=args.hidden_dropout, init_method_std=args.init_method_std,
            attention_backend=args.attention_backend,
        )
    except ValueError as e:
        _fail(f"--{prefix}num-layers/--{prefix}hidden-size/--{prefix}num-attention-heads", f"{role}: {e}")


def _check_generation_device(args, transformer_impl: str) -> None:
    """--attention-backend and --cuda-graph-generation against this machine (before any group)."""
    from puzzle.models.attention_backend import resolve_attention_backend
    from puzzle.parallel.device import accelerator_available

    try:
        resolve_attention_backend(args.attention_backend, te=transformer_impl == "transformer_engine",
                                  cuda=accelerator_available())
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    if args.cuda_graph_generation and not accelerator_available():
        _fail("--cuda-graph-generation", "needs a CUDA device (this run uses the CPU)")


# Megatron-LM's rope-scaling flags and ours for the other three llama3 parameters -> ModelArch fields
_ROPE_FLAGS = (("rope_scaling_factor", "rope_scaling_factor"), ("rope_low_freq_factor", "rope_low_freq_factor"),
               ("rope_high_freq_factor", "rope_high_freq_factor"),
               ("rope_original_max_position_embeddings", "rope_original_max_position_embeddings"))
# model-shape flag -> (ModelArch field, HF config.json field)
_SHAPE_FIELDS = {"num-layers": ("num_layers", "num_hidden_layers"), "hidden-size": ("hidden_size", "hidden_size"),
                 "ffn-hidden-size": ("ffn_hidden_size", "intermediate_size"),
                 "num-attention-heads": ("num_attention_heads", "num_attention_heads"),
                 "num-query-groups": ("num_query_groups", "num_key_value_heads"),
                 "kv-channels": ("kv_channels", "head_dim")}


def _rope_scaling_kwargs(args) -> dict:
    return {field: getattr(args, attr) for attr, field in _ROPE_FLAGS if getattr(args, attr) is not None}


def _hf_dir_for(args, role: str) -> Optional[str]:
    return {"actor": args.hf_actor_path, "ref": args.hf_actor_path, "critic": args.hf_critic_path,
            "reward": args.hf_reward_path}[role]


def _arch_from_hf(args, role: str, vocab_size: int, hf_dir: str, flag_of_role: str):
    """The checkpoint's architecture; a shape flag that disagrees with it is an error naming both."""
    from puzzle.models.hf_llama import arch_from_hf_dir

    cfg_path = os.path.join(hf_dir, "config.json")
    try:
        arch = arch_from_hf_dir(hf_dir, seq_length=args.seq_length,
                                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    except (ValueError, OSError) as e:
        _fail(flag_of_role, str(e))
    prefix = "" if role in ("actor", "ref") else f"{role}-"
    for flag, (field, hf_field) in _SHAPE_FIELDS.items():
        given = role_value(args, role, flag)
        if given is not None and given != getattr(arch, field):
            _fail(f"--{prefix}{flag}", f"{given} conflicts with {cfg_path} ({hf_field}={getattr(arch, field)}); "
                                       f"drop the flag: {flag_of_role} sets the {role} shape")
    for attr in ("add_qkv_bias", "qk_layernorm", "use_rope_scaling"):
        if getattr(args, attr) and not getattr(arch, attr):
            _fail("--" + attr.replace("_", "-"), f"conflicts with {cfg_path}, whose model has no {attr}")
    for attr, field in _ROPE_FLAGS:
        given = getattr(args, attr)
        if given is not None and (not arch.use_rope_scaling or given != getattr(arch, field)):
            _fail("--" + attr.replace("_", "-"), f"{given} conflicts with {cfg_path} "
                                                 f"(use_rope_scaling={arch.use_rope_scaling}, {field}="
                                                 f"{getattr(arch, field)})")
    if vocab_size > arch.vocab_size:
        _fail("--tokenizer-model", f"the tokenizer has {vocab_size} tokens, more than the {arch.vocab_size} "
                                   f"rows of {cfg_path} (vocab_size)")
    return arch


def _plan_for(args, role: str, world_size: int, P: int, T: int, flags: str, *,
              offset: int = 0, D=None, size=None):
    """The role's plan on ranks offset.. (D given, or all the ranks of ``size`` / the rest)."""
    from puzzle.parallel.plan import ParallelPlan, PlanError

    if P < 1 or T < 1:
        _fail(flags, f"{role} parallel sizes must be >= 1 (P={P}, T={T})")
    if offset < 0 or offset >= world_size:
        _fail(flags, f"{role} rank offset {offset} is outside the world of {world_size} ranks")
    avail = size if size is not None else world_size - offset
    if D is None:
        if avail % (P * T):
            _fail(flags, f"{role} layout P*T={P * T} does not divide its {avail} ranks "
                         f"(world size {world_size}, offset {offset})")
        D = avail // (P * T)
    try:
        plan = ParallelPlan(P=P, D=D, T=T, offset=offset)
        plan.check_world(world_size, what=role)
    except PlanError as e:
        _fail(flags, str(e))
    return plan


def _describe_plans(plans) -> str:
    return ", ".join(f"{r} {p} on ranks {p.ranks[0]}..{p.ranks[-1]}" for r, p in plans.items())


def _check_placement(flag: str, placement: str, plans) -> None:
    """Models of one stage either share exactly the same ranks or use disjoint ones; time-sharing
    needs identical layouts on shared ranks; disjoint needs at least two disjoint groups."""
    ranges = {r: set(p.ranks) for r, p in plans.items()}
    roles = list(plans)
    for i, a in enumerate(roles):
        for b in roles[i + 1:]:
            shared = ranges[a] & ranges[b]
            if shared and ranges[a] != ranges[b] and placement != "sequential":
                _fail(flag, f"{placement} placement needs the models of a stage on the same or on "
                            f"disjoint ranks; {a} and {b} partly overlap ({_describe_plans(plans)})")
            if placement == "time-sharing" and shared and plans[a] != plans[b]:
                _fail(flag, "time-sharing requires equal P (and the same D, T) for the models that share "
                            f"devices in a stage; got {_describe_plans(plans)} (use sequential, or give "
                            "them the same layout)")
    if placement == "disjoint" and len({frozenset(v) for v in ranges.values()}) < 2:
        _fail(flag, "disjoint placement needs models on disjoint rank ranges (e.g. --critic-rank-offset "
                    f"with --critic-data-parallel-size); got {_describe_plans(plans)}")


def _check_hf_shape(arch, hf_dir: str, role: str) -> None:
    """The flags' model shape must be the checkpoint's (Megatron style: flags describe the model)."""
    from puzzle.models.hf_llama import arch_from_hf_dir

    try:
        ckpt = arch_from_hf_dir(hf_dir)
    except (ValueError, OSError) as e:
        _fail(f"--hf-{'actor' if role == 'ref' else role}-path", str(e))
    fields = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups")
    diff = [f"{f}: flags {getattr(arch, f)} vs checkpoint {getattr(ckpt, f)}" for f in fields
            if getattr(arch, f) != getattr(ckpt, f)]
    if arch.vocab_size < ckpt.vocab_size:
        diff.append(f"vocab: tokenizer {arch.vocab_size} < checkpoint {ckpt.vocab_size}")
    if diff:
        _fail(f"--hf-{'actor' if role == 'ref' else role}-path",
              f"{hf_dir}/config.json does not match the {role} model flags: " + "; ".join(diff))


def role_set(args) -> List[str]:
    """The roles a run builds: no critic unless the estimator needs one (gae), no reference when
    KL enters neither the reward (--kl-coef 0) nor the loss, a reward model only when given."""
    from puzzle.algorithms.advantage_estimators import ESTIMATORS

    roles = ["actor"]
    if ESTIMATORS[args.advantage_estimator].needs_critic:
        roles.append("critic")
    if args.kl_coef > 0 or args.use_kl_loss:
        roles.append("ref")
    if args.reward_model:
        roles.append("reward")
    return roles


def validate_args(args, world_size: int, vocab_size: int, check_paths: bool = True):
    """Derive and check every flag; returns a RunConfig. Raises ArgumentError naming the flag.

    Runs before any model is allocated. ``check_paths=False`` (dry runs, planning on a laptop)
    skips the checks that need checkpoint files to be present.
    """
    from puzzle import flag_checks
    from puzzle.config import Operations, PPOParams, RoleSpec, RunConfig
    from puzzle.models.builders import check_layout
    from puzzle.parallel.plan import PlanError
    from puzzle.training.engine import OptimConfig

    if args.seq_length is None:
        _fail("--seq-length", "is required")
    flag_checks.check_values(args)
    if args.bf16 and args.fp16:
        _fail("--bf16/--fp16", "choose one")
    if check_paths:  # this machine: writable outputs, a GPU for --fp16, optional logging packages
        flag_checks.check_environment(args)
    if args.max_new_tokens < 1:
        _fail("--max-new-tokens", f"must be >= 1 (got {args.max_new_tokens})")
    max_prompt = args.max_prompt_length or args.seq_length - args.max_new_tokens
    if max_prompt < 1 or max_prompt + args.max_new_tokens > args.seq_length:
        _fail("--max-new-tokens", f"prompt budget {max_prompt} + max new tokens {args.max_new_tokens} "
                                  f"exceeds --seq-length {args.seq_length}")
    if args.hf_reward_path and not args.reward_model:
        args.reward_model = args.hf_reward_path
    if not args.reward_fn and not args.reward_model:
        _fail("--reward-fn", "no reward source: pass --reward-fn module:function, --hf-reward-path DIR "
                             "or --reward-model (an HF checkpoint directory, or 'random' for tests)")
    if args.reward_model and args.reward_model != "random" and not args.hf_reward_path:
        args.hf_reward_path = args.reward_model
    for flag in ("hf_actor_path", "hf_critic_path", "hf_reward_path") if check_paths else ():
        path = getattr(args, flag)
        if path and not os.path.isfile(os.path.join(path, "config.json")):
            _fail("--" + flag.replace("_", "-"), f"{path!r} is not an HF checkpoint directory (no config.json)")
    if args.reward_fn and args.reward_model:
        _fail("--reward-fn", f"give one reward source, not both --reward-fn and a reward model "
                             f"({args.reward_model})")
    if args.reward_fn and ":" not in args.reward_fn:
        _fail("--reward-fn", f"expected module:function, got {args.reward_fn!r}")
    flag_checks.check_algorithm_args(args)
    if not 0.0 < args.top_p <= 1.0:
        _fail("--top-p", f"must be in (0, 1] (got {args.top_p})")
    if args.top_k < 0:
        _fail("--top-k", f"must be >= 0 (got {args.top_k})")
    if args.temperature <= 0 and not args.greedy:
        _fail("--temperature", f"must be > 0 (got {args.temperature}); use --greedy for argmax decoding")
    for flag in ("ppo_epochs", "train_iters", "micro_batch_size", "rollout_batch_size", "log_interval"):
        if getattr(args, flag) < 1:
            _fail("--" + flag.replace("_", "-"), f"must be >= 1 (got {getattr(args, flag)})")
    if args.switch_segments < 1:
        _fail("--switch-segments", f"must be >= 1 (got {args.switch_segments})")
    if not 0.0 <= args.gamma <= 1.0 or not 0.0 <= args.lam <= 1.0:
        _fail("--gamma/--lam", "must lie in [0, 1]")
    if args.kl_coef < 0:
        _fail("--kl-coef", f"must be >= 0 (got {args.kl_coef})")
    if args.kl_target is not None and args.kl_target <= 0:
        _fail("--kl-target", f"must be > 0 (got {args.kl_target})")
    if args.save_interval is not None and (args.save_interval < 1 or not args.save):
        _fail("--save-interval", f"needs --save DIR and must be >= 1 (got {args.save_interval})")
    for flag in ("save", "load"):
        path = getattr(args, flag)
        if path is not None and (not path or os.path.exists(path) and not os.path.isdir(path)):
            _fail(f"--{flag}", f"{path!r} is not a directory")
    for flag in ("no_load_optim", "no_load_rng", "ckpt_step"):
        if getattr(args, flag) not in (None, False) and not args.load:
            _fail("--" + flag.replace("_", "-"), "needs --load DIR")
    if args.ckpt_step is not None and args.ckpt_step < 1:
        _fail("--ckpt-step", f"must be >= 1 (got {args.ckpt_step})")
    if args.ranks_per_node is not None and (args.ranks_per_node < 1 or world_size % args.ranks_per_node):
        _fail("--ranks-per-node", f"{args.ranks_per_node} must be >= 1 and divide the world size {world_size}")

    roles = {}
    present = role_set(args)
    for role in ("actor", "critic", "ref", "reward"):
        if role not in present:
            continue
        arch = _arch_for(args, role, vocab_size)
        P = role_value(args, role, "pipeline-model-parallel-size")
        T = role_value(args, role, "tensor-model-parallel-size")
        if role == "actor":
            P = args.actor_pipeline_model_parallel_size or P
            T = args.actor_tensor_model_parallel_size or T
        flags = (f"--{role}-tensor-model-parallel-size/--{role}-pipeline-model-parallel-size"
                 if role != "actor" else "--tensor-model-parallel-size/--pipeline-model-parallel-size")
        offset = getattr(args, f"{role}_rank_offset")
        D = getattr(args, f"{role}_data_parallel_size")
        if offset or D:
            flags += f"/--{role}-rank-offset/--{role}-data-parallel-size"
        plan = _plan_for(args, role, world_size, P, T, flags, offset=offset, D=D)
        try:
            check_layout(arch, plan, role)
        except PlanError as e:
            _fail(flags, str(e))
        gen_plan = None
        if role == "actor":
            gP = args.actor_gen_pipeline_model_parallel_size or P
            gT = args.actor_gen_tensor_model_parallel_size or T
            gflags = "--actor-gen-tensor-model-parallel-size/--actor-gen-pipeline-model-parallel-size"
            gen_plan = _plan_for(args, "actor generation", world_size, gP, gT, gflags,
                                 offset=plan.offset, size=plan.size)
            try:
                check_layout(arch, gen_plan, "actor (generation layout)")
            except PlanError as e:
                _fail(gflags, str(e))
        trainable = role in ("actor", "critic")
        lr = args.lr if role == "actor" else (args.critic_lr if args.critic_lr is not None else args.lr)
        hf = _hf_dir_for(args, role)
        roles[role] = RoleSpec(role=role, arch=arch, plan=plan, gen_plan=gen_plan,
                               trainable=trainable, lr=lr, hf_path=hf)
    N = args.n_samples_per_prompt
    samples = args.rollout_batch_size * N
    what = (f"rollout batch {args.rollout_batch_size}" if N == 1 else
            f"rollout batch {args.rollout_batch_size} prompts x {N} samples = {samples}")
    mini = args.ppo_mini_batch_size or args.global_batch_size or samples
    if samples % mini:
        _fail("--global-batch-size", f"the {what} is not divisible by the PPO mini-batch (global batch) {mini}")
    for role, spec in roles.items():
        D = spec.plan.D
        unit = args.micro_batch_size * D
        if role in ("actor", "critic") and mini % unit:
            _fail("--global-batch-size", f"global batch {mini} is not divisible by micro-batch size "
                                         f"{args.micro_batch_size} x {role} data-parallel size {D}")
        if samples % unit:
            _fail("--rollout-batch-size", f"{what} is not divisible by micro-batch size "
                                          f"{args.micro_batch_size} x {role} data-parallel size {D}")
    gen_D = roles["actor"].gen_plan.D
    if samples % gen_D:
        _fail("--rollout-batch-size", f"{what} is not divisible by the actor generation data-parallel "
                                      f"size {gen_D}")
    gmb = args.generation_micro_batch_size
    if gmb is not None and (gmb < 1 or (samples // gen_D) % gmb):
        _fail("--generation-micro-batch-size", f"{gmb} must divide the samples per generation DP rank "
                                               f"({samples // gen_D})")

    if args.cuda_graph_generation and roles["actor"].gen_plan.P > 1:
        _fail("--cuda-graph-generation", f"needs an actor generation layout with P=1 "
                                         f"(got P={roles['actor'].gen_plan.P})")

    for flag, placement, members in (("--score-placement", args.score_placement, list(roles)),
                                     ("--train-placement", args.train_placement,
                                      [r for r in ("actor", "critic") if r in roles])):
        _check_placement(flag, placement, {r: roles[r].plan for r in members})

    from puzzle.models.builders import resolve_transformer_impl

    impl, impl_note = resolve_transformer_impl(args.transformer_impl)
    _check_generation_device(args, impl)
    if args.sequence_parallel and impl == "local" and any(r.plan.T > 1 for r in roles.values()):
        _fail("--sequence-parallel", "needs --transformer-impl transformer_engine (TE on a CUDA machine): "
                                     "megatron-core's local layer spec normalises with torch norms, which "
                                     "refuse sequence parallelism" + (f" ({impl_note})" if impl_note else ""))
    ppo = PPOParams(
        rollout_batch_size=args.rollout_batch_size, mini_batch_size=mini,
        micro_batch_size=args.micro_batch_size, generation_micro_batch_size=gmb,
        cuda_graph_generation=args.cuda_graph_generation,
        ppo_epochs=args.ppo_epochs, max_new_tokens=args.max_new_tokens, max_prompt_length=max_prompt,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, greedy=args.greedy,
        kl_coef=args.kl_coef, kl_target=args.kl_target, kl_horizon=args.kl_horizon,
        kl_estimator=args.kl_estimator, gamma=args.gamma, lam=args.lam,
        clip_eps=args.clip_eps_low if args.clip_eps_low is not None else args.clip_eps,
        value_clip_eps=args.value_clip_eps, entropy_coef=args.entropy_coef,
        reward_clip=args.reward_clip, whiten_advantages=not args.no_whiten_advantages,
        advantage_estimator=args.advantage_estimator, n_samples_per_prompt=N,
        grpo_std_normalization=args.grpo_std_normalization, use_kl_loss=args.use_kl_loss,
        kl_loss_coef=args.kl_loss_coef, kl_loss_type=args.kl_loss_type,
        clip_eps_high=args.clip_eps_high if args.clip_eps_high is not None else args.clip_eps_low,
        loss_agg_mode=args.loss_agg_mode, filter_groups=args.filter_groups,
        max_num_gen_batches=args.max_num_gen_batches, overlong_buffer_len=args.overlong_buffer_len,
        overlong_penalty_factor=args.overlong_penalty_factor, reward_normalization=args.reward_normalization,
    )
    optim = OptimConfig(
        lr=args.lr, min_lr=args.min_lr, lr_decay_style=args.lr_decay_style,
        lr_warmup_iters=args.lr_warmup_iters,
        lr_decay_iters=args.train_iters * args.ppo_epochs * (samples // mini),
        weight_decay=args.weight_decay, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        use_distributed_optimizer=args.use_distributed_optimizer, bf16=args.bf16, fp16=args.fp16,
    )
    return RunConfig(
        world_size=world_size, roles=roles, ppo=ppo, optim=optim, train_iters=args.train_iters,
        seed=args.seed, tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
        prompt_data=args.prompt_data, prompt_key=args.prompt_key, reward_fn=args.reward_fn,
        reward_model=args.reward_model, reward_workers=args.reward_workers,
        reward_timeout=args.reward_timeout or None, on_bad_reward=args.on_bad_reward,
        bad_reward_value=args.bad_reward_value, log_interval=args.log_interval, log_dir=args.log_dir,
        save=args.save, load=args.load, save_interval=args.save_interval, bf16=args.bf16,
        fp16=args.fp16, recompute=args.recompute_activations, switch_segments=args.switch_segments,
        ranks_per_node=args.ranks_per_node,
        score_placement=args.score_placement, train_placement=args.train_placement,
        transformer_impl=impl, transformer_impl_note=impl_note,
        sequence_parallel=args.sequence_parallel,
        ops=Operations(
            exit_signal_handler=args.exit_signal_handler,
            exit_duration_in_mins=args.exit_duration_in_mins, exit_interval=args.exit_interval,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
            skip_nonfinite_iterations=args.skip_nonfinite_iterations,
            keep_last_checkpoints=args.keep_last_checkpoints, tensorboard_dir=args.tensorboard_dir,
            wandb_project=args.wandb_project, wandb_exp_name=args.wandb_exp_name,
            wandb_save_dir=args.wandb_save_dir),
    )


def resolve_world_size(args) -> int:
    if args.world_size is not None:
        if args.world_size < 1:
            _fail("--world-size", f"must be >= 1 (got {args.world_size})")
        return args.world_size
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_vocab_size(args) -> int:
    """The tokenizer's vocabulary; --vocab-size when its files are not at hand."""
    from puzzle.data.tokenizers import build_tokenizer

    try:
        return build_tokenizer(args.tokenizer_type, args.tokenizer_model).vocab_size
    except (ValueError, OSError) as e:
        if args.vocab_size:
            return args.vocab_size
        _fail("--tokenizer-model", f"{e} (for a dry run or plan search, --vocab-size N stands in)")


def config_for_planning(args):
    """A RunConfig for planning and dry runs: no files needed, a reward model assumed if none given."""
    if not args.reward_fn and not args.reward_model and not args.hf_reward_path:
        args.reward_model = "random"
    return validate_args(args, resolve_world_size(args), resolve_vocab_size(args), check_paths=False)


def plan_flags(doc: dict, strict: bool = False) -> List[str]:
    """Layout and placement flags of a plan document (search_plan.py --save-plan / SearchResult.to_dict).

    The trainer time-shares only models with identical layouts on the same ranks (the search's
    Eq. (1) needs equal P only): a 'time-sharing' stage whose co-located plans differ becomes
    'sequential' (``strict``: an ArgumentError instead)."""
    from puzzle.parallel.plan import ParallelPlan, PlanError

    flags: List[str] = []
    try:
        plans = {m: {s: ParallelPlan.parse(p) for s, p in st.items()} for m, st in doc["plans"].items()}
    except (KeyError, AttributeError, PlanError) as e:
        _fail("--plan-file", f"not a plan document ({e})")
    for role, stages in plans.items():
        home = stages.get("training") or stages.get("scoring")
        if home is None:
            continue
        flags += [f"--{role}-tensor-model-parallel-size", str(home.T),
                  f"--{role}-pipeline-model-parallel-size", str(home.P),
                  f"--{role}-data-parallel-size", str(home.D), f"--{role}-rank-offset", str(home.offset)]
        if role == "actor" and "generation" in stages:
            gen = stages["generation"]
            if (gen.offset, gen.size) != (home.offset, home.size):
                _fail("--plan-file", f"the actor generates on {gen} but trains on {home}: the switch moves "
                                     "weights between layouts of the same ranks only")
            flags += ["--actor-gen-tensor-model-parallel-size", str(gen.T),
                      "--actor-gen-pipeline-model-parallel-size", str(gen.P)]
    placements = doc.get("placements", {})
    for stage, flag in (("scoring", "--score-placement"), ("training", "--train-placement")):
        placement = placements.get(stage)
        if placement not in ("sequential", "disjoint", "time-sharing"):
            continue
        members = {r: st[stage] for r, st in plans.items() if stage in st}
        if placement == "time-sharing":
            items = list(members.items())
            clash = [(a, pa, b, pb) for i, (a, pa) in enumerate(items) for b, pb in items[i + 1:]
                     if set(pa.ranks) & set(pb.ranks) and pa != pb]
            if clash and strict:
                a, pa, b, pb = clash[0]
                _fail("--plan-file", f"{stage}: time-sharing needs equal layouts on shared ranks; {a} {pa} vs {b} {pb}")
            if clash:
                placement = "sequential"
        flags += [flag, placement]
    return flags
