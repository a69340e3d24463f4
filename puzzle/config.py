"""Frozen configuration dataclasses built from the command line (see puzzle/arguments.py).

Nothing below this layer reads argparse namespaces or globals: builders take these objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from puzzle.config_flags import check, check_at_least, fail, flag



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
    def flag_prefix(self) -> str:
        """Prefix of the model-shape flags that name this role in messages ('' = the actor's)."""
        return "" if self.weights_from == "actor" else f"{self.name}-"


#: the four roles (in the order the scoring stage runs them)
ROLES = {r.name: r for r in (
    Role("actor", head="lm", seed_offset=0, trainable=True, weights_from="actor"),
    Role("ref", head="lm", seed_offset=0, trainable=False, weights_from="actor"),
    Role("critic", head="value", seed_offset=1, trainable=True, weights_from="critic",
         allow_missing_head=True),
    Role("reward", head="score", seed_offset=2, trainable=False, weights_from="reward"),
)}
#: --attention-backend values (Megatron-LM's names; see puzzle/models/attention_backend.py)
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
#: RunConfig.precision: fp32 (default), bf16 or fp16 parameters and activations, as Megatron-LM's
#: --bf16/--fp16 (the optimizer keeps fp32 main parameters and gradients for bf16/fp16)
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class ModelArch:
    """Architecture of one role model (LLaMA options by default)."""

    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: Optional[int] = None  # default 4 * hidden_size, as in Megatron-LM
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # None = multi-head attention (groups = heads)
    vocab_size: int = 256
    make_vocab_size_divisible_by: int = 128
    seq_length: int = 128
    max_position_embeddings: Optional[int] = None
    normalization: str = "RMSNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = True
    position_embedding_type: str = "rope"
    rotary_base: int = 10000
    untie_embeddings_and_output_weights: bool = True
    add_bias_linear: bool = False
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    init_method_std: float = 0.02
    kv_channels: Optional[int] = None  # projection size per head; None = hidden / heads
    add_qkv_bias: bool = False         # q/k/v biases only (Qwen2); add_bias_linear adds them all
    qk_layernorm: bool = False         # per-head norm of queries and keys (Qwen3)
    # Llama-3.x RoPE frequency scaling (HF rope_type "llama3"); defaults are Megatron-LM's
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    sliding_window: Optional[int] = None  # attention window of the checkpoint (None = full)
    hf_model_type: str = "llama"       # the HF family an export writes (llama, qwen2, qwen3, mistral)
    attention_backend: str = "auto"  # auto | flash | fused | unfused | local (--attention-backend)

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        explicit_kv_channels = self.kv_channels is not None
        if not explicit_kv_channels:
            object.__setattr__(self, "kv_channels", self.hidden_size // max(self.num_attention_heads, 1))
        errors = []
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "vocab_size", "seq_length"):
            if getattr(self, name) < 1:
                errors.append(f"{name} must be >= 1 (got {getattr(self, name)})")
        if not explicit_kv_channels and self.hidden_size % self.num_attention_heads:
            errors.append(f"hidden_size={self.hidden_size} is not divisible by "
                          f"num_attention_heads={self.num_attention_heads}")
        if self.num_attention_heads % self.num_query_groups:
            errors.append(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                          f"num_query_groups={self.num_query_groups}")
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            errors.append(f"normalization must be RMSNorm or LayerNorm (got {self.normalization!r})")
        if self.position_embedding_type not in ("rope", "learned_absolute"):
            errors.append("position_embedding_type must be rope or learned_absolute "
                          f"(got {self.position_embedding_type!r})")
        if self.attention_backend not in ATTENTION_BACKENDS:
            errors.append(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)} "
                          f"(got {self.attention_backend!r})")
        if self.kv_channels < 1:
            errors.append(f"kv_channels must be >= 1 (got {self.kv_channels})")
        if self.use_rope_scaling and (self.rope_scaling_factor <= 0 or self.rope_original_max_position_embeddings < 1
                                      or self.rope_high_freq_factor <= self.rope_low_freq_factor):
            errors.append("rope scaling needs factor > 0, original_max_position_embeddings >= 1 and "
                          f"high_freq_factor > low_freq_factor (got {self.rope_scaling_factor}, "
                          f"{self.rope_original_max_position_embeddings}, {self.rope_high_freq_factor}, "
                          f"{self.rope_low_freq_factor})")
        if self.use_rope_scaling and self.position_embedding_type != "rope":
            errors.append("use_rope_scaling needs position_embedding_type rope")
        if self.sliding_window is not None and self.sliding_window < self.seq_length:
            errors.append(f"sliding_window={self.sliding_window} is shorter than seq_length={self.seq_length}: "
                          "sliding-window attention is not implemented (use a seq_length <= the window)")
        if errors:
            raise ValueError("invalid model architecture: " + "; ".join(errors))

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary padded to a multiple of make_vocab_size_divisible_by.

        Unlike Megatron-LM (which pads to a multiple of divisible_by * T), the padding does not
        depend on the layout: every model shape is the same at every (P, D, T), so weights move
        between layouts without re-padding. A plan whose T does not divide it is rejected.
        Logits of the padding ids are masked out wherever probabilities are formed.
        """
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple


@dataclass(frozen=True)
class RoleSpec:
    """One role model of a run: its shape, its layout(s), its learning rate and weights."""

    role: str
    arch: ModelArch
    plan: "object"                 # ParallelPlan for scoring and training
    gen_plan: "object" = None      # actor only: generation layout (None = same as plan)
    lr: float = 0.0
    hf_path: Optional[str] = None  # HF checkpoint to load the weights from

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
    mini_batch_size: int = 8  # --global-batch-size / --ppo-mini-batch-size (default: the samples)
    micro_batch_size: int = flag(1, "training", "Samples per micro-batch (scoring and training).")
    generation_micro_batch_size: Optional[int] = flag(
        None, _PPO, "Prompts per generation micro-batch (default: all of a DP rank's prompts). Smaller than "
        "a rank's prompts at P=1: finished rows take waiting prompts.", type=int)
    cuda_graph_generation: bool = flag(
        False, _PPO, "Replay each decode step from a CUDA graph captured per batch-size bucket (GPU only).")
    compile_generation: bool = flag(
        False, _PPO, "With --cuda-graph-generation: run the captured decode steps through torch.compile "
        "(fused elementwise kernels; compiled once per run, ~30 s for 1B; bf16 tokens may differ from "
        "the eager kernels').")
    ppo_epochs: int = flag(1, _PPO, "Passes over each rollout batch.")
    max_new_tokens: int = flag(16, _PPO)
    max_prompt_length: int = 32  # --max-prompt-length (default: seq length - max new tokens)
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
    clip_eps: float = 0.2  # --clip-eps-low, else --clip-eps
    value_clip_eps: Optional[float] = flag(0.2, _PPO)
    entropy_coef: float = flag(0.0, _PPO)
    reward_clip: Optional[float] = flag(None, _PPO, type=float)
    whiten_advantages: bool = flag(True, _PPO, name="--no-whiten-advantages", kind="negated")
    # the GRPO family (docs/grpo.md); defaults are PPO's
    advantage_estimator: str = "gae"  # --advantage-estimator (its choices are puzzle.algorithms')
    n_samples_per_prompt: int = flag(
        1, _ALGO, "Responses generated per prompt (the group of grpo/rloo); samples per iteration = "
        "rollout batch x N.")
    grpo_std_normalization: bool = flag(
        True, _ALGO, "grpo: divide by the group's std (--no-grpo-std-normalization: Dr. GRPO).",
        kind="boolean_optional")
    use_kl_loss: bool = flag(False, _ALGO, "KL to the reference as a loss term of the actor.")
    kl_loss_coef: float = flag(0.001, _ALGO)
    kl_loss_type: str = "low_var_kl"  # --kl-loss-type
    clip_eps_high: Optional[float] = None  # None: clip_eps (symmetric); --clip-eps-high
    loss_agg_mode: str = "token-mean"  # --loss-agg-mode
    filter_groups: bool = flag(
        False, _ALGO, "DAPO dynamic sampling: drop groups whose rewards are all equal and generate more "
        "until the batch is full.")
    max_num_gen_batches: int = flag(10, _ALGO, "--filter-groups: at most this many generation rounds per iteration.")
    overlong_buffer_len: int = flag(
        0, _ALGO, "DAPO overlong shaping: the last N tokens of --max-new-tokens are penalised (0: off).")
    overlong_penalty_factor: float = flag(1.0, _ALGO)
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
        check_at_least(cls, self, 0, "kl_target", "reward_clip", strict=True, optional=True)
        check_at_least(cls, self, 0, "value_clip_eps", strict=True)
        check(cls, self, "overlong_buffer_len", 0 <= self.overlong_buffer_len <= self.max_new_tokens,
              f"must be in [0, --max-new-tokens {self.max_new_tokens}] (got {self.overlong_buffer_len})")
        check(cls, self, "compile_generation", self.cuda_graph_generation or not self.compile_generation,
              "needs --cuda-graph-generation")

    @property
    def num_samples(self) -> int:
        """Samples per iteration: prompts x samples per prompt."""
        return self.rollout_batch_size * self.n_samples_per_prompt


_TRAINING = "training"
_PARALLEL = "parallelism (per role; D = world / (P * T))"


@dataclass(frozen=True)
class OptimConfig:
    """Adam, its learning-rate schedule and gradient clipping (Megatron-LM's flags and defaults,
    but --adam-beta2 0.95); the actor's, and the critic's with its own --critic-lr."""

    lr: float = flag(1e-5, _TRAINING, "Actor learning rate.")
    min_lr: float = flag(0.0, _TRAINING)
    lr_decay_style: str = flag("constant", _TRAINING, choices=("constant", "linear", "cosine"))
    lr_warmup_iters: int = flag(0, _TRAINING)
    lr_decay_iters: int = 1  # derived: every optimizer step of the run (train iters x epochs x mini-batches)
    weight_decay: float = flag(0.0, _TRAINING)
    adam_beta1: float = flag(0.9, _TRAINING)
    adam_beta2: float = flag(0.95, _TRAINING)
    adam_eps: float = flag(1e-8, _TRAINING)
    clip_grad: float = flag(1.0, _TRAINING)
    use_distributed_optimizer: bool = flag(False, _PARALLEL)

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

    def __post_init__(self):
        cls = Operations
        check_at_least(cls, self, 0, "skip_nonfinite_iterations")
        check_at_least(cls, self, 0, "distributed_timeout_minutes", strict=True)
        check_at_least(cls, self, 0, "exit_duration_in_mins", strict=True, optional=True)
        check_at_least(cls, self, 1, "exit_interval", "keep_last_checkpoints", optional=True)
        for name in ("wandb_exp_name", "wandb_save_dir"):
            check(cls, self, name, not getattr(self, name) or bool(self.wandb_project), "needs --wandb-project")


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
    optim: "object"                # puzzle.training.engine.OptimConfig (actor; critic lr in RoleSpec)
    train_iters: int = flag(10, "training", "PPO iterations.")
    seed: int = flag(1234, "training")
    tokenizer_type: str = flag("ByteLevelTokenizer", _DATA)
    tokenizer_model: Optional[str] = flag(None, _DATA, type=str)
    prompt_data: Optional[str] = flag(
        None, _DATA, "Prompt file (JSONL/Parquet/Arrow); default: bundled tiny set.", type=str)
    prompt_key: str = flag("prompt", _DATA)
    prompt_split: str = flag("train", _DATA, "Split of a hub dataset (--prompt-data NAME).")
    prompt_overflow: str = flag(
        "truncate_left", _DATA, "Prompts longer than the prompt budget: keep the end, keep the start, or drop "
        "them (counted in the metrics).", choices=("truncate_left", "truncate_right", "drop"))
    apply_chat_template: bool = flag(
        False, _DATA, "Format prompts (strings or message lists) with the tokenizer's chat template.")
    skip_bad_records: bool = flag(
        False, _DATA, "Skip (and count) malformed prompt records instead of stopping at the first.")
    reward_fn: Optional[str] = flag(None, _PPO, "Reward function module:function.", type=str)
    reward_model: Optional[str] = flag(
        None, _PPO, "Reward model source: 'random' (tests/benchmarks) or a checkpoint dir.", type=str)
    reward_workers: int = flag(
        0, _REWARD_FN, "Processes per rank that run the reward function (0: in the rank's process).")
    reward_timeout: Optional[float] = flag(
        60.0, _REWARD_FN, "Seconds per sample before a reward counts as bad (0: no timeout).")
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
    load_optim: bool = flag(
        True, _LOGGING, "Resume weights, schedulers and counters but not the optimizer states.",
        name="--no-load-optim", kind="negated")
    load_rng: bool = flag(True, _LOGGING, "Do not restore the per-rank RNG states.", name="--no-load-rng",
                          kind="negated")
    ckpt_step: Optional[int] = flag(
        None, _LOGGING, "Resume this iteration of --load instead of its latest one.", type=int)
    precision: str = "fp32"      # the one precision setting (--bf16 / --fp16): parameters, activations, optimizer
    recompute: bool = flag(False, "training", name="--recompute-activations")
    switch_segments: int = flag(
        1, _PARALLEL, "Segments of the actor's training->generation weight switch overlapped with the "
        "optimizer step.")
    ranks_per_node: Optional[int] = flag(
        None, _PARALLEL, "Ranks per node (switch prefers same-node sources).", type=int)
    score_placement: str = flag(
        "sequential", _PARALLEL, "How the scoring stage's models share the devices.", choices=PLACEMENTS)
    train_placement: str = flag(
        "sequential", _PARALLEL, "How the training stage's models (actor, critic) share the devices.",
        choices=PLACEMENTS)
    transformer_impl: str = "local"            # resolved --transformer-impl: "transformer_engine" only where TE runs
    transformer_impl_note: Optional[str] = None  # why the requested impl was replaced, if it was
    sequence_parallel: bool = flag(
        False, "training", "Megatron sequence parallelism within each model's tensor-parallel group (T > 1).")
    ops: Operations = Operations()
    faults: FaultInjection = FaultInjection()

    def __post_init__(self):
        cls = RunConfig
        if self.precision not in PRECISIONS:
            fail("--bf16/--fp16", f"precision must be one of {', '.join(PRECISIONS)} (got {self.precision!r})")
        check_at_least(cls, self, 1, "train_iters", "log_interval", "switch_segments")
        check_at_least(cls, self, 0, "reward_workers")
        check_at_least(cls, self, 0, "reward_timeout", optional=True)
        check(cls, self, "bad_reward_value", math.isfinite(self.bad_reward_value),
              f"must be a finite number (got {self.bad_reward_value})")
        check(cls, self, "reward_fn", not self.reward_fn or ":" in self.reward_fn,
              f"expected module:function, got {self.reward_fn!r}")
        check(cls, self, "save_interval", self.save_interval is None or self.save_interval >= 1 and bool(self.save),
              f"needs --save DIR and must be >= 1 (got {self.save_interval})")
        for name, given in (("load_optim", not self.load_optim), ("load_rng", not self.load_rng),
                            ("ckpt_step", self.ckpt_step is not None)):
            check(cls, self, name, not given or bool(self.load), "needs --load DIR")
        check_at_least(cls, self, 1, "ckpt_step", optional=True)
        check(cls, self, "ranks_per_node", self.ranks_per_node is None or self.ranks_per_node >= 1
              and self.world_size % self.ranks_per_node == 0,
              f"{self.ranks_per_node} must be >= 1 and divide the world size {self.world_size}")

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"

    @property
    def fp16(self) -> bool:
        return self.precision == "fp16"
