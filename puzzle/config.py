"""Frozen configuration dataclasses built from the command line (see puzzle/arguments.py).

Nothing below this layer reads argparse namespaces or globals: builders take these objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from puzzle.config_flags import check, check_at_least, fail, flag
from puzzle.config_checks import check_checkpoint_flags, check_turn_flags
from puzzle.lora_config import LoRAConfig
from puzzle.memory_levers import MemoryLevers, Recompute
from puzzle.model_arch import ModelArch


@dataclass(frozen=True)
class Role:
    """What a role model is, written once: its head, its seed offset, whether it trains and where
    its weights come from. Every rule that depends on the role name reads it from here."""

    name: str
    head: str              # "lm" (vocabulary logits), "value" (critic) or "score" (reward model)
    seed_offset: int       # weights initialise from --seed + this (the reference equals the actor)
    trainable: bool
    weights_from: str      # whose HF checkpoint flag gives its weights: --hf-<weights_from>-path
    allow_missing_head: bool = False  # an HF checkpoint without a value/score head keeps a fresh one

    @property
    def lm_head(self) -> bool:
        """Whether the model ends in the vocabulary logits (else a scalar value / score head)."""
        return self.head == "lm"

    @property
    def hf_path_flag(self) -> str:
        return f"--hf-{self.weights_from}-path"

    @property
    def pretrained_flag(self) -> str:
        """Its Megatron-LM checkpoint flag (--pretrained-checkpoint for the actor and reference)."""
        return PRETRAINED_CHECKPOINT_FLAGS[self.weights_from]

    @property
    def flag_prefix(self) -> str:
        """Prefix of the model-shape flags that name this role in messages ('' = the actor's)."""
        return "" if self.weights_from == "actor" else f"{self.name}-"


#: the Megatron-LM checkpoint flag of each weights_from role (RoleSpec.pretrained_checkpoint)
PRETRAINED_CHECKPOINT_FLAGS = {"actor": "--pretrained-checkpoint", "critic": "--critic-pretrained-checkpoint",
                               "reward": "--reward-pretrained-checkpoint"}
#: the four roles (in the order the scoring stage runs them)
ROLES = {r.name: r for r in (
    Role("actor", head="lm", seed_offset=0, trainable=True, weights_from="actor"),
    Role("ref", head="lm", seed_offset=0, trainable=False, weights_from="actor"),
    Role("critic", head="value", seed_offset=1, trainable=True, weights_from="critic",
         allow_missing_head=True),
    Role("reward", head="score", seed_offset=2, trainable=False, weights_from="reward"),
)}
#: RunConfig.precision: fp32 (default), bf16 or fp16 parameters and activations, as Megatron-LM's
#: --bf16/--fp16 (the optimizer keeps fp32 main parameters and gradients for bf16/fp16)
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class RoleSpec:
    """One role model of a run: its shape, its layout(s), its learning rate and weights."""

    role: str
    arch: ModelArch
    plan: "object"                 # ParallelPlan for scoring and training
    gen_plan: "object" = None      # actor only: generation layout (None = same as plan)
    lr: float = 0.0
    hf_path: Optional[str] = flag(  # HF checkpoint to load the weights from: --hf-<weights_from>-path
        None, "data", type=str, roles=("actor", "critic", "reward"), role_only=True, role_name="--hf-{role}-path",
        role_help={"actor": "HF checkpoint dir (Llama-2/3.x, Mistral, Qwen2/2.5, Qwen3) for the actor and the "
                            "reference; its config.json sets their shape.",
                   "critic": "HF checkpoint dir for the critic backbone (+ score/v_head when present).",
                   "reward": "HF checkpoint dir of the reward model (backbone + score head)."})
    # a Megatron-LM (megatron-core torch_dist) checkpoint root: puzzle/models/megatron_checkpoint.py
    pretrained_checkpoint: Optional[str] = flag(
        None, "data", type=str, roles=("actor", "critic", "reward"), role_only=True,
        role_name=PRETRAINED_CHECKPOINT_FLAGS,
        role_help={"actor": "Megatron-LM checkpoint (torch_dist, as pretrain_gpt.py saves it) of the actor and the "
                            "reference, at any layout; its args set their shape. As Megatron-LM's flag, it is read "
                            "when --load holds no checkpoint of this run (there: the run resumes).",
                   "critic": "Megatron-LM checkpoint of the critic: a value model (puzzle.tools.make_value_model) "
                             "or an LM, whose trunk is read and whose head starts fresh.",
                   "reward": "Megatron-LM checkpoint of the reward model (with a scalar head: "
                             "puzzle.tools.make_value_model)."})

    @property
    def description(self) -> Role:
        """The role's fixed properties (head, seed offset, whether it trains, weight source)."""
        return ROLES[self.role]

    @property
    def trainable(self) -> bool:
        return self.description.trainable

    def init_seed(self, seed: int) -> int:
        """The seed of this model's initial weights under --seed ``seed``."""
        return seed + self.description.seed_offset


_PPO = "PPO"
_ALGO = "advantage estimators, GRPO family and DAPO (docs/grpo.md)"


@dataclass(frozen=True)
class PPOParams:
    """The algorithm: batch sizes, sampling, KL, clipping, advantages (PPO's defaults; the GRPO
    family and DAPO in docs/grpo.md). Fields without a flag are derived by validate_args."""

    rollout_batch_size: int = flag(8, _PPO, "Prompts per PPO iteration.")
    mini_batch_size: int = flag(
        8, "training", "Samples per optimizer step (= the PPO mini-batch; default: the rollout batch); "
        "--ppo-mini-batch-size: its alias.", name="--global-batch-size", aliases=("--ppo-mini-batch-size",),
        type=int, flag_default=None)
    micro_batch_size: int = flag(1, "training", "Samples per micro-batch (scoring and training).")
    use_remove_padding: bool = flag(
        True, "training", "Scoring and training micro-batches as packed sequences (THD, cu_seqlens): each "
        "micro-batch's sequences concatenated without padding, attention causal within each sequence "
        "(--no-use-remove-padding: right-padded [micro-batch, seq] rows, for comparison).",
        kind="boolean_optional")
    use_dynamic_bsz: bool = flag(
        False, "training", "Token-budget micro-batches (verl's use_dynamic_bsz): each scoring and training "
        "micro-batch holds as many packed sequences as fit --ppo-max-token-len-per-gpu (training) or "
        "--log-prob-max-token-len-per-gpu (scoring) tokens, instead of --micro-batch-size rows, and the "
        "rows are balanced over the data-parallel ranks by token count before sharding. Needs --use-remove-padding.")
    ppo_max_token_len_per_gpu: Optional[int] = flag(
        None, "training", "With --use-dynamic-bsz: tokens (prompt + response, summed over the packed "
        "sequences) per training micro-batch; at least the longest sequence (max prompt + max new tokens).",
        type=int)
    log_prob_max_token_len_per_gpu: Optional[int] = flag(
        None, "training", "With --use-dynamic-bsz: tokens per scoring micro-batch (old and reference "
        "log-probs, values, reward scores; forward only). Default: --ppo-max-token-len-per-gpu.", type=int)
    generation_micro_batch_size: Optional[int] = flag(
        None, _PPO, "Prompts per generation micro-batch (default: all of a DP rank's prompts). Smaller than "
        "a rank's prompts at P=1: finished rows take waiting prompts.", type=int)
    cuda_graph_generation: bool = flag(
        False, _PPO, "Replay each decode step from a CUDA graph captured per batch-size bucket (GPU only).")
    compile_generation: bool = flag(
        False, _PPO, "With --cuda-graph-generation: run the captured decode steps through torch.compile "
        "(fused elementwise kernels; compiled once per run, ~30 s for 1B; bf16 tokens may differ from "
        "the eager kernels').")
    batch_invariant_mode: bool = flag(
        False, _PPO, "Megatron-LM's name: the actor's generation and its scoring compute bitwise the same "
        "log-probs of the sampled tokens (row-invariant products, attention and sums; docs/ppo.md 'True "
        "on-policy'), so gen_score_logprob_diff_max is 0. CPU; the actor's training and generation layouts "
        "at the same T; costs time (puzzle.bench.generation, puzzle.bench.packing).")
    ppo_epochs: int = flag(1, _PPO, "Passes over each rollout batch.")
    max_new_tokens: int = flag(16, _PPO)
    max_prompt_length: int = flag(32, _PPO, "Prompt budget (default: seq length - max new tokens).", type=int,
                                  flag_default=None)
    temperature: float = flag(1.0, _PPO)
    top_k: int = flag(0, _PPO)
    top_p: float = flag(1.0, _PPO)
    greedy: bool = flag(False, _PPO, "Greedy decoding (deterministic rollouts).")
    kl_coef: float = flag(0.05, _PPO)
    kl_target: Optional[float] = flag(None, _PPO, "Adaptive KL controller target (Ziegler et al.).", type=float)
    kl_horizon: int = flag(10000, _PPO)
    kl_estimator: str = flag("k1", _PPO, choices=("k1", "abs", "mse", "low_var_kl"))
    gamma: float = flag(1.0, _PPO)
    lam: float = flag(0.95, _PPO)
    clip_eps: float = flag(0.2, _PPO, "Ratio clip; --clip-eps-low: its name as the lower clip of DAPO's "
                           "clip-higher (--clip-eps-high).", aliases=("--clip-eps-low",))
    value_clip_eps: Optional[float] = flag(0.2, _PPO)
    entropy_coef: float = flag(0.0, _PPO)
    reward_clip: Optional[float] = flag(None, _PPO, type=float)
    whiten_advantages: bool = flag(True, _PPO, name="--no-whiten-advantages", kind="negated")
    # the GRPO family (docs/grpo.md); defaults are PPO's
    # choices of these three: the registries of puzzle.algorithms (given when the parser is built)
    advantage_estimator: str = flag("gae", _ALGO, "gae (PPO, with a critic) or a critic-free estimator.")
    n_samples_per_prompt: int = flag(
        1, _ALGO, "Responses generated per prompt (the group of grpo/rloo); samples per iteration = rollout batch x N.")
    grpo_std_normalization: bool = flag(
        True, _ALGO, "grpo: divide by the group's std (--no-grpo-std-normalization: Dr. GRPO).",
        kind="boolean_optional")
    use_kl_loss: bool = flag(False, _ALGO, "KL to the reference as a loss term of the actor.")
    kl_loss_coef: float = flag(0.001, _ALGO)
    kl_loss_type: str = flag("low_var_kl", _ALGO)
    clip_eps_high: Optional[float] = flag(
        None, _ALGO, "Upper ratio clip (DAPO clip-higher; default --clip-eps-low).", type=float)
    loss_agg_mode: str = flag(
        "token-mean", _ALGO, "How the actor's per-token losses are aggregated over the mini-batch.")
    filter_groups: bool = flag(
        False, _ALGO, "DAPO dynamic sampling: drop groups whose rewards are all equal and generate more "
        "until the batch is full.")
    max_num_gen_batches: int = flag(10, _ALGO, "--filter-groups: at most this many generation rounds per iteration.")
    overlong_buffer_len: int = flag(
        0, _ALGO, "DAPO overlong shaping: the last N tokens of --max-new-tokens are penalised (0: off).")
    overlong_penalty_factor: float = flag(1.0, _ALGO)
    # Megatron-LM RL's names (verl: tis_imp_ratio_cap; slime: --use-tis --tis-clip); docs/ppo.md
    rl_inference_logprobs_is_correction: bool = flag(
        False, _ALGO, "Importance-sampling correction of the actor's loss for the generation-vs-scoring "
        "mismatch: each token's loss weighted by exp(old log-prob - generation log-prob).",
        kind="boolean_optional")
    rl_importance_sampling_truncation_coef: Optional[float] = flag(
        None, _ALGO, "Truncate the importance weights of --rl-inference-logprobs-is-correction at this value "
        "(TIS; peers use 2 to 10).", type=float)
    # Megatron-LM RL's --rl-partial-rollouts; puzzle/rollout/partial.py, docs/ppo.md
    rl_partial_rollouts: bool = flag(
        False, _ALGO, "Partial rollouts: generation serves more prompts than the batch needs "
        "(--rl-partial-rollouts-oversample), stops once the batch's quota of whole finished groups is met and "
        "carries the unfinished samples to the next iteration, which resumes them under its weights. Unlike "
        "Megatron-LM RL, generation stays synchronous (no lag, no overlap with training): only the tail is cut. "
        "Needs --rl-inference-logprobs-is-correction (carried tokens are trained with the log-probs they were "
        "sampled under; truncate its weights, e.g. --rl-importance-sampling-truncation-coef 2: docs/ppo.md) "
        "and an actor generating in one share at P=1.", kind="boolean_optional")
    rl_partial_rollouts_oversample: float = flag(
        2.0, _ALGO, "--rl-partial-rollouts: the groups served per iteration, as a multiple (>= 1) of "
        "--rollout-batch-size; carried groups first, then fresh prompts. Megatron-LM RL sizes this by "
        "--rl-max-inflight-requests (its lag) instead.")
    rl_partial_rollouts_max_staleness: Optional[int] = flag(
        None, _ALGO, "--rl-partial-rollouts: carried tokens sampled more than K policy versions before the "
        "batch's own stay as context (scored, in the advantages and the critic's targets) but get no actor loss; "
        "a mini-batch left without actor tokens skips the actor's step. Unset: every token trains. K = 0 is "
        "slime's --mask-offpolicy-in-partial-rollout; ours bounds in versions (slime's --max-weight-staleness "
        "drops whole groups instead).", type=int)
    # the long tail's expected response lengths: the plan search prices generation's tail from them
    # (puzzle/plan_search/long_tail.py: a log-normal through both; neither: every response at the cap)
    expected_response_length_p50: Optional[int] = flag(
        None, _PPO, "Median response length in tokens the run expects (with --expected-response-length-p99): "
        "--dry-run and search_plan.py price generation's long tail from it and advise synchronous, partial "
        "rollouts or the lag-1 overlap. Advisory: it changes nothing the run does.", type=int)
    expected_response_length_p99: Optional[int] = flag(
        None, _PPO, "99th percentile of the response lengths the run expects, in [p50, --max-new-tokens] "
        "(see --expected-response-length-p50).", type=int)
    # Megatron-LM RL's --rl-desired-lag (there: partial rollouts' in-flight steps on the same ranks);
    # puzzle/dataflow/overlap_stage.py
    rl_desired_lag: int = flag(
        0, _ALGO, "One-step off-policy overlap: batch k is generated with the weights after optimizer step "
        "max(0, k-1-L) by a generation pool on its own ranks (--actor-gen-rank-offset) while the training pool "
        "scores and trains the batches before it; 0: synchronous (today's run). Unlike Megatron-LM RL (same "
        "ranks, in-flight requests, -1 allowed, autotuned when omitted) the lag here is whole batches on "
        "disjoint pools; needs --rl-inference-logprobs-is-correction. Checkpoints hold the batches in flight "
        "(a resume trains them first, at this lag, a longer one or 0); evaluation generates on the generation "
        "pool with each evaluated iteration's weights.")
    reward_normalization: str = flag(
        "none", "reward functions (--reward-fn; docs/grpo.md)",
        "running: scores normalised by their running mean/std (checkpointed).", choices=("none", "running"))

    def __post_init__(self):
        cls = PPOParams
        check_at_least(cls, self, 1, "max_new_tokens", "ppo_epochs", "micro_batch_size", "rollout_batch_size",
                       "kl_horizon", "n_samples_per_prompt", "max_num_gen_batches")
        check(cls, self, "top_p", 0.0 < self.top_p <= 1.0, f"must be in (0, 1] (got {self.top_p})")
        check_at_least(cls, self, 0, "top_k", "kl_coef", "kl_loss_coef", "overlong_penalty_factor")
        check(cls, self, "temperature", self.temperature > 0 or self.greedy,
              f"must be > 0 (got {self.temperature}); use --greedy for argmax decoding")
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            fail("--gamma/--lam", "must lie in [0, 1]")
        check_at_least(cls, self, 0, "rl_desired_lag")
        check_at_least(cls, self, 0, "kl_target", "reward_clip", strict=True, optional=True)
        check_at_least(cls, self, 0, "value_clip_eps", "clip_eps", strict=True)
        check_at_least(cls, self, 0, "clip_eps_high", strict=True, optional=True)
        check_at_least(cls, self, 0, "rl_importance_sampling_truncation_coef", strict=True, optional=True)
        check(cls, self, "overlong_buffer_len", 0 <= self.overlong_buffer_len <= self.max_new_tokens,
              f"must be in [0, --max-new-tokens {self.max_new_tokens}] (got {self.overlong_buffer_len})")
        self._check_expected_lengths()
        check(cls, self, "compile_generation", self.cuda_graph_generation or not self.compile_generation,
              "needs --cuda-graph-generation")
        check(cls, self, "batch_invariant_mode", not (self.batch_invariant_mode and self.cuda_graph_generation),
              "not with --cuda-graph-generation: graphed and compiled decode steps fuse differently from "
              "scoring's forward")

    def _check_expected_lengths(self) -> None:
        cls, p50, p99 = PPOParams, self.expected_response_length_p50, self.expected_response_length_p99
        check(cls, self, "expected_response_length_p99" if p99 is None else "expected_response_length_p50",
              (p50 is None) == (p99 is None), "missing: --expected-response-length-p50 and -p99 go together")
        if p50 is not None:
            check_at_least(cls, self, 0, "expected_response_length_p50", "expected_response_length_p99", strict=True)
            check(cls, self, "expected_response_length_p50", p50 <= p99,
                  f"must be <= --expected-response-length-p99 (got {p50} > {p99})")
            check(cls, self, "expected_response_length_p99", p99 <= self.max_new_tokens,
                  f"must be <= --max-new-tokens {self.max_new_tokens} (got {p99})")

    @property
    def num_samples(self) -> int:
        """Samples per iteration: prompts x samples per prompt."""
        return self.rollout_batch_size * self.n_samples_per_prompt


_TRAINING = "training"
PARALLEL_GROUP = "parallelism (per role; D = world / (P * T))"


@dataclass(frozen=True)
class OptimConfig:
    """Adam, its learning-rate schedule and gradient clipping (Megatron-LM's flags and defaults,
    but --adam-beta2 0.95); the actor's, and the critic's with its own --critic-lr."""

    lr: float = flag(1e-5, _TRAINING, "Actor learning rate.", roles=("critic",),
                     role_help="Critic learning rate (default: --lr).")
    min_lr: float = flag(0.0, _TRAINING)
    lr_decay_style: str = flag("constant", _TRAINING, choices=("constant", "linear", "cosine"))
    lr_warmup_iters: int = flag(0, _TRAINING)
    lr_decay_iters: int = 1  # derived: every optimizer step of the run (train iters x epochs x mini-batches)
    weight_decay: float = flag(0.0, _TRAINING)
    adam_beta1: float = flag(0.9, _TRAINING)
    adam_beta2: float = flag(0.95, _TRAINING)
    adam_eps: float = flag(1e-8, _TRAINING)
    clip_grad: float = flag(1.0, _TRAINING)
    use_distributed_optimizer: bool = flag(False, PARALLEL_GROUP)

    def __post_init__(self):
        cls = OptimConfig
        check_at_least(cls, self, 0, "lr", "min_lr", "weight_decay", "clip_grad", "lr_warmup_iters")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            check(cls, self, name, 0.0 <= value < 1.0, f"must lie in [0, 1) (got {value})")
        check_at_least(cls, self, 0, "adam_eps", strict=True)


_OPS = "preemption, time limits, hangs and non-finite steps"
_LOGGING = "logging and checkpoints"
_DATA = "data"
_REWARD_FN = "reward functions (--reward-fn; docs/grpo.md)"
_ENV = "environments (--env; docs/grpo.md)"
#: --score-placement / --train-placement: how the models of one stage share the devices
PLACEMENTS = ("sequential", "disjoint", "time-sharing")


@dataclass(frozen=True)
class Operations:
    """Preemption, time limits, hangs, non-finite steps, checkpoint retention, metric sinks."""

    exit_signal_handler: bool = flag(
        False, _OPS, "On SIGTERM: finish the current iteration, save (--save), exit 0. All ranks agree on "
        "the iteration to stop at.")
    exit_duration_in_mins: Optional[float] = flag(
        None, _OPS, "Save (--save) and exit 0 after the iteration that ends past this many minutes.", type=float)
    exit_interval: Optional[int] = flag(
        None, _OPS, "Save (--save) and exit 0 at the first iteration divisible by N.", type=int)
    distributed_timeout_minutes: float = flag(
        10.0, _OPS, "Timeout of every process group's collectives (minutes; fractions allowed): a stuck "
        "rank ends the job instead of hanging it.")
    distributed_backend: Optional[str] = flag(
        None, _OPS, "The collectives' backend: nccl (the default on GPUs) or gloo (the default on CPU). "
        "gloo on GPUs lets several ranks share one device (NCCL refuses that), e.g. to run a multi-rank "
        "layout on a one-GPU machine; tensors stay on the GPU and are staged through host memory.",
        type=str, choices=("nccl", "gloo"))
    skip_nonfinite_iterations: int = flag(
        0, _OPS, "Skip up to N optimizer steps whose loss or gradient norm is NaN/inf (counted in the "
        "metrics); past N, or with 0, such a step stops the run.")
    keep_last_checkpoints: Optional[int] = flag(
        None, _LOGGING, "Delete all but the newest N checkpoints under --save after each save (default: "
        "keep all).", type=int)
    tensorboard_dir: Optional[str] = flag(
        None, _LOGGING, "Write the metrics of metrics.jsonl as TensorBoard scalars (extra 'tb').", type=str)
    wandb_project: Optional[str] = flag(
        None, _LOGGING, "Log the metrics of metrics.jsonl to this Weights & Biases project (extra 'wandb'; "
        "WANDB_MODE=offline works without network).", type=str)
    wandb_exp_name: Optional[str] = flag(None, _LOGGING, "The W&B run name.", type=str)
    wandb_save_dir: Optional[str] = flag(
        None, _LOGGING, "Local W&B directory (default: --log-dir, else wandb's own).", type=str)
    log_samples: int = flag(
        0, _LOGGING, "Write N prompt/response/reward rows of every iteration's rollout to DIR/samples.jsonl "
        "(needs --log-dir).")

    def __post_init__(self):
        cls = Operations
        check_at_least(cls, self, 0, "skip_nonfinite_iterations")
        check_at_least(cls, self, 0, "distributed_timeout_minutes", strict=True)
        check_at_least(cls, self, 0, "exit_duration_in_mins", strict=True, optional=True)
        check_at_least(cls, self, 1, "exit_interval", "keep_last_checkpoints", optional=True)
        for name in ("wandb_exp_name", "wandb_save_dir"):
            check(cls, self, name, not getattr(self, name) or bool(self.wandb_project), "needs --wandb-project")
        check_at_least(cls, self, 0, "log_samples")


_EVAL = "evaluation on held-out prompts (metrics under eval/)"


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation during training (Megatron-LM's --eval-interval / --eval-iters): the actor's
    responses to held-out prompts, scored by the run's reward, at iteration 0, every interval and
    at the end (puzzle.dataflow.evaluation)."""

    prompts: Optional[str] = flag(
        None, _EVAL, "Held-out prompt file (the formats of --prompt-data): turns evaluation on; its "
        "samples go to DIR/eval_samples.jsonl with --log-dir.", name="--eval-prompts", type=str)
    interval: Optional[int] = flag(
        None, _EVAL, "Evaluate every N iterations (always at iteration 0 and at the end).",
        name="--eval-interval", type=int)
    iters: Optional[int] = flag(
        None, _EVAL, "Evaluation batches of --rollout-batch-size prompts per evaluation (default: every "
        "prompt of --eval-prompts); 0 turns evaluation off, as in Megatron-LM.", name="--eval-iters", type=int)
    n_samples: Optional[int] = flag(
        None, _EVAL, "Samples per eval prompt: 1 (default) is greedy; N > 1 samples at the run's "
        "--temperature/--top-k/--top-p and logs pass@k.", name="--eval-n-samples-per-prompt", type=int)

    def __post_init__(self):
        cls = EvalConfig
        check_at_least(cls, self, 1, "interval", "n_samples", optional=True)
        check_at_least(cls, self, 0, "iters", optional=True)
        for name in ("interval", "iters", "n_samples"):
            check(cls, self, name, getattr(self, name) is None or bool(self.prompts), "needs --eval-prompts")

    @property
    def enabled(self) -> bool:
        """--eval-prompts given and --eval-iters not 0."""
        return bool(self.prompts) and self.iters != 0

    @property
    def samples_per_prompt(self) -> int:
        return self.n_samples or 1


@dataclass(frozen=True)
class FaultInjection:
    """Faults a test injects into a real run; not a flag, empty in every ordinary run. The
    command-line layer fills it from the test environment (puzzle.cli.fault_injection_from_env)."""

    nonfinite_grads: Tuple[Tuple[str, int], ...] = ()  # (role, iteration): a NaN gradient of that role
    fail_save_at: Optional[Tuple[int, int]] = None     # (rank, iteration): that rank raises half way
    #                                                    through saving that iteration


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs below the command line (the trainer, checkpointing, the data
    loading of the CLI); built by puzzle.arguments.validate_args."""

    world_size: int
    roles: dict                    # role -> RoleSpec
    ppo: PPOParams
    optim: "object"                # puzzle.engine.model_engine.OptimConfig (actor; critic lr in RoleSpec)
    train_iters: int = flag(10, "training", "PPO iterations.")
    seed: int = flag(1234, "training")
    tokenizer_type: str = flag("ByteLevelTokenizer", _DATA)
    tokenizer_model: Optional[str] = flag(None, _DATA, type=str)
    prompt_data: Optional[str] = flag(
        None, _DATA, "Prompt file (JSONL/Parquet/Arrow); default: bundled tiny set.", type=str)
    prompt_key: str = flag("prompt", _DATA, "The prompt's field in each record; a dotted path names a nested field.")
    answer_key: Optional[str] = flag(
        None, _DATA, "The ground truth's field in each record (the reward functions' 'answer'); a dotted path "
        "names a nested field, e.g. reward_model.ground_truth in verl's parquet files.", type=str)
    prompt_split: str = flag("train", _DATA, "Split of a hub dataset (--prompt-data NAME).")
    prompt_overflow: str = flag(
        "truncate_left", _DATA, "Prompts longer than the prompt budget: keep the end, keep the start, or drop "
        "them (counted in the metrics).", choices=("truncate_left", "truncate_right", "drop"))
    apply_chat_template: bool = flag(
        False, _DATA, "Format prompts (strings or message lists) with the tokenizer's chat template.")
    skip_bad_records: bool = flag(
        False, _DATA, "Skip (and count) malformed prompt records instead of stopping at the first.")
    reward_fn: Optional[str] = flag(None, _PPO, "Reward function module:function.", type=str)
    env: Optional[str] = flag(
        None, _PPO, "Environment that answers the model's turns and gives the reward: module:Class or a built-in "
        "(calculator; calculator_tiny: its byte-level syntax for the tiny tool run; single_turn: --reward-fn as an "
        "episode of one turn). Its steps run in the reward workers, each under --reward-timeout.", type=str)
    max_turns: int = flag(
        1, _ENV, "Turns per sample: above 1 the turns run in the decode loop (P=1), the environment answering "
        "each turn that ends at one of its turn_stops (with --apply-chat-template: the chat family's tool-call end, "
        "the observation in its tool-response format) with an observation; --max-new-tokens bounds the whole "
        "response, observations included.")
    max_observation_tokens: int = flag(
        64, _ENV, "Tokens of one observation; a longer one is cut, ending in a truncation marker.")
    env_step_overlap_calls: int = flag(
        4, _ENV, "Model calls the other rows run while a row's environment step is out: the step is joined (waited "
        "for if not done) and its observation inserted after that many calls, never earlier, so runs do not depend "
        "on the step's timing (0: every row waits for the steps before the next call).")
    reward_model: Optional[str] = flag(
        None, _PPO, "Reward model source: 'random' (tests/benchmarks) or a checkpoint dir.", type=str)
    reward_workers: int = flag(
        0, _REWARD_FN, "Processes per rank that run the reward function (0: one when --reward-timeout is "
        "set, else the rank's own process).")
    reward_timeout: Optional[float] = flag(
        60.0, _REWARD_FN, "Seconds per sample (per-sample functions, the built-in checkers; a batched call: "
        "per call, S x its samples) before the call is killed and its rewards are bad (0: no timeout).")
    on_bad_reward: str = flag(
        "default", _REWARD_FN, "A reward that is not a number, NaN/inf, raises or times out: substitute "
        "--bad-reward-value (counted as bad_rewards) or stop the run.", choices=("default", "error"))
    bad_reward_value: float = flag(0.0, _REWARD_FN)
    log_interval: int = flag(1, _LOGGING)
    log_dir: Optional[str] = flag(None, _LOGGING, "Writes DIR/metrics.jsonl (and TensorBoard events).", type=str)
    save: Optional[str] = flag(
        None, _LOGGING, "Checkpoint directory to save to (dist-checkpoint of every role; see docs/ppo.md).",
        type=str)
    load: Optional[str] = flag(
        None, _LOGGING, "Checkpoint directory to resume from (its latest iteration; may be --save's).", type=str)
    save_interval: Optional[int] = flag(
        None, _LOGGING, "Save every N iterations (and at the end); default: only at the end.", type=int)
    finetune: bool = flag(
        False, _LOGGING, "Megatron-LM's --finetune: read only the model weights of --load (a puzzle run's trainable "
        "models, or a Megatron-LM checkpoint as the actor and reference): no optimizer, RNG or run state; the "
        "iteration starts at 0.")
    init_random: bool = flag(
        False, _LOGGING, "Let a trainable actor or critic without a checkpoint (--hf-*-path, --pretrained-checkpoint, "
        "--load) start from random weights (tests, benchmarks); without it such a run is refused.")
    load_optim: bool = flag(
        True, _LOGGING, "Resume weights, schedulers and counters but not the optimizer states.",
        name="--no-load-optim", kind="negated")
    load_rng: bool = flag(True, _LOGGING, "Do not restore the per-rank RNG states.", name="--no-load-rng",
                          kind="negated")
    ckpt_step: Optional[int] = flag(
        None, _LOGGING, "Resume this iteration of --load instead of its latest one.", type=int)
    precision: str = flag(  # the one precision setting: parameters, activations, optimizer
        "fp32", "training", kind="switches", switches=(
            ("--bf16", "bf16", "bf16 parameters and activations; fp32 main parameters and gradients in the "
                               "optimizer."),
            ("--fp16", "fp16", None)))
    switch_segments: int = flag(
        1, PARALLEL_GROUP, "Segments of the actor's training->generation weight switch overlapped with the "
        "optimizer step.")
    ranks_per_node: Optional[int] = flag(
        None, PARALLEL_GROUP, "Ranks per node (switch prefers same-node sources).", type=int)
    score_placement: str = flag(
        "sequential", PARALLEL_GROUP, "How the scoring stage's models share the devices.", choices=PLACEMENTS)
    train_placement: str = flag(
        "sequential", PARALLEL_GROUP, "How the training stage's models (actor, critic) share the devices.",
        choices=PLACEMENTS)
    transformer_impl: str = flag(  # resolved: "transformer_engine" only where TE runs
        "local", "training", "Transformer layer implementation (Megatron-LM's flag): transformer_engine where "
        "TE imports on a CUDA machine, else local (said once at start).", choices=("transformer_engine", "local"),
        flag_default="transformer_engine")
    transformer_impl_note: Optional[str] = None  # why the requested impl was replaced, if it was
    sequence_parallel: bool = flag(
        False, "training", "Megatron sequence parallelism within each model's tensor-parallel group (T > 1).")
    ops: Operations = Operations()
    evaluation: EvalConfig = EvalConfig()
    levers: MemoryLevers = MemoryLevers()
    lora: LoRAConfig = LoRAConfig()  # the actor's adapters (off by default)
    critic_lora: LoRAConfig = LoRAConfig()  # the critic's own (--critic-lora-*; off by default)
    faults: FaultInjection = FaultInjection()

    def __post_init__(self):
        cls = RunConfig
        if self.precision not in PRECISIONS:
            fail("--bf16/--fp16", f"precision must be one of {', '.join(PRECISIONS)} (got {self.precision!r})")
        check_at_least(cls, self, 1, "train_iters", "log_interval", "switch_segments")
        check_at_least(cls, self, 0, "reward_workers")
        check(cls, self, "reward_workers", not self.reward_workers or bool(self.reward_fn or self.env),
              "needs --reward-fn (a reward model scores in the scoring stage, in the rank's process)")
        check_at_least(cls, self, 0, "reward_timeout", optional=True)
        check_turn_flags(cls, self)
        check(cls, self, "bad_reward_value", math.isfinite(self.bad_reward_value),
              f"must be a finite number (got {self.bad_reward_value})")
        check(cls, self, "reward_fn", not self.reward_fn or ":" in self.reward_fn,
              f"expected module:function, got {self.reward_fn!r}")
        check_checkpoint_flags(cls, self)
        if self.ops.log_samples and not self.log_dir:
            fail("--log-samples", "needs --log-dir (the rows go to DIR/samples.jsonl)")
        check(cls, self, "ranks_per_node", self.ranks_per_node is None or self.ranks_per_node >= 1
              and self.world_size % self.ranks_per_node == 0,
              f"{self.ranks_per_node} must be >= 1 and divide the world size {self.world_size}")

    @property
    def recompute(self) -> Recompute:
        return self.levers.recompute

    def role_lora(self, role: str) -> LoRAConfig:
        """The LoRA adapters of ``role``: the actor's (--lora-*), the critic's (--critic-lora-*), none."""
        return {"actor": self.lora, "critic": self.critic_lora}.get(role, LoRAConfig())

    @property
    def reference_is_actor_base(self) -> bool:
        """A LoRA actor with a KL term: its reference is its base (the actor with its adapters off,
        scored in the actor's slot), so the run builds no reference model (arguments.role_set)."""
        return self.lora.enabled and (self.ppo.kl_coef > 0 or self.ppo.use_kl_loss)

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"

    @property
    def fp16(self) -> bool:
        return self.precision == "fp16"
