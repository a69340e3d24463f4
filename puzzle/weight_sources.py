"""Where every role's weights come from, said once at the start and checked before anything is built.

A role starts from one of:

    hf        an HF directory                 --hf-actor-path / --hf-critic-path / --hf-reward-path
                                              (--reward-model DIR)
    megatron  a Megatron-LM checkpoint        --pretrained-checkpoint / --critic-pretrained-checkpoint /
                                              --reward-pretrained-checkpoint, or --load DIR --finetune
    random    random initialisation           (--seed); a trainable actor or critic needs --init-random

and the trainable roles (actor, critic) resume from a puzzle checkpoint when ``--load`` holds one
(Megatron-LM's rule: ``--pretrained-checkpoint`` is read only when ``--load`` has no checkpoint).
The reference is the actor's initial model; frozen roles are rebuilt from their source on resume.

``resolve_checkpoint_flags`` turns the checkpoint flags into each role's source before the
models' shapes are read (a Megatron-LM checkpoint at ``--load`` with ``--finetune`` is the
actor's, one given to ``--reward-model`` the reward model's); ``check`` refuses a trainable role
left at random weights without ``--init-random``; ``source_lines`` are printed by ``--dry-run``
and at the start of a run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional

from puzzle.config import ROLES
from puzzle.config_flags import ArgumentError
from puzzle.models.megatron_checkpoint import find_megatron_checkpoint

_KINDS = {"hf": "HF directory", "megatron": "Megatron-LM checkpoint", "puzzle": "puzzle checkpoint",
          "random": "random init"}


@dataclass(frozen=True)
class WeightSource:
    """One role's initial weights: kind (hf, megatron, random), path, and the flag that chose it."""

    kind: str
    path: Optional[str]
    flag: str

    def describe(self) -> str:
        where = f" {self.path}" if self.path else ""
        return f"{_KINDS[self.kind]}{where} ({self.flag})"


def _initial_source(cfg, role: str) -> WeightSource:
    spec, desc = cfg.roles[role], ROLES[role]
    if spec.pretrained_checkpoint:
        flag = "--load --finetune" if spec.pretrained_checkpoint == cfg.load else desc.pretrained_flag
        return WeightSource("megatron", spec.pretrained_checkpoint, flag)
    if spec.hf_path:
        return WeightSource("hf", spec.hf_path, desc.hf_path_flag)
    flag = "--reward-model random" if role == "reward" else f"seed {spec.init_seed(cfg.seed)}"
    if desc.trainable and getattr(cfg, "init_random", False):
        flag += ", --init-random"
    return WeightSource("random", None, flag)


def initial_sources(cfg) -> Dict[str, WeightSource]:
    """{role: its initial weights} of a RunConfig's roles (the reference's: the actor's)."""
    return {role: _initial_source(cfg, role) for role in cfg.roles}


def holds_run_checkpoint(root: Optional[str]) -> bool:
    """Whether ``root`` holds a checkpoint of a puzzle run (to resume), not a Megatron-LM one."""
    if not root or not os.path.isdir(root) or find_megatron_checkpoint(root) is not None:
        return False
    return os.path.isfile(os.path.join(root, "latest_checkpointed_iteration.txt")) or any(
        name.startswith("iter_") and not name.endswith(".tmp") for name in os.listdir(root))


def check(cfg) -> None:
    """ArgumentError naming every trainable role that would start from random weights without
    --init-random, and the flags that would give it weights."""
    if holds_run_checkpoint(cfg.load):
        return  # the trainable roles resume from --load
    sources = initial_sources(cfg)
    random = [r for r in cfg.roles if ROLES[r].trainable and sources[r].kind == "random"]
    if random and not cfg.init_random:
        needs = "; ".join(f"the {r}'s with {ROLES[r].hf_path_flag} DIR (HF) or {ROLES[r].pretrained_flag} DIR "
                          f"(Megatron-LM)" + (" or --load DIR --finetune" if r == "actor" else "") for r in random)
        raise ArgumentError(f"--init-random: the {' and '.join(random)} would start from random weights: "
                            f"give {needs}; or pass --init-random to train from random initialisation")


def _trainable_line(cfg, initial: WeightSource) -> str:
    text = initial.describe()
    if not cfg.load or initial.flag.startswith("--load"):
        return text
    if holds_run_checkpoint(cfg.load):
        how = "--load --finetune: its weights, iteration 0" if cfg.finetune else "--load: the run resumes"
        return f"puzzle checkpoint {cfg.load} ({how}); started from {text}"
    return f"{text}; resumed from --load {cfg.load} once it holds a checkpoint"


def source_lines(cfg) -> List[str]:
    """One line per role: where its weights come from (the first lines of a run and a dry run)."""
    sources = initial_sources(cfg)
    lines = ["weights:"]
    for role in cfg.roles:
        text = _trainable_line(cfg, sources[role]) if ROLES[role].trainable else sources[role].describe()
        if role == "ref":
            text += ", the actor's initial weights"
        if role == "critic" and sources[role].kind in ("hf", "megatron"):
            text += ", with its value/score head if it has one (else a fresh head)"
        lines.append(f"  {role:7s} {text}")
    return lines


def print_sources(cfg) -> None:
    for line in source_lines(cfg):
        print(line, flush=True)


# ---- the checkpoint flags, before the models' shapes are read ---------------------------------------
def resolve_checkpoint_flags(args) -> None:
    """On ``args`` (a copy, in validate_args): a Megatron-LM checkpoint at --load becomes the
    actor's --pretrained-checkpoint with --finetune (refused without: it holds no run to resume);
    one given as --reward-model the reward model's; one role with two sources is refused."""
    megatron_load = find_megatron_checkpoint(args.load) if args.load else None
    if megatron_load is not None:
        if not args.finetune:
            raise ArgumentError(
                f"--load: {megatron_load.describe()} is a Megatron-LM checkpoint, not a puzzle run: it has no RL "
                f"state (critic, KL controller, prompt position) to resume; start the actor and reference from its "
                f"weights with --finetune (Megatron-LM's meaning: weights only, iteration 0), or pass it as "
                f"--pretrained-checkpoint and give the run its own --load/--save directory")
        if args.pretrained_checkpoint and os.path.abspath(args.pretrained_checkpoint) != os.path.abspath(args.load):
            raise ArgumentError(f"--pretrained-checkpoint: --load {args.load} already gives the actor's weights "
                                f"(--finetune); give one of them")
        args.pretrained_checkpoint = args.load
    model = args.reward_model
    if model and model != "random" and not args.hf_reward_path and not args.reward_pretrained_checkpoint \
            and find_megatron_checkpoint(model) is not None:
        args.reward_pretrained_checkpoint = model
    if args.reward_pretrained_checkpoint and not args.reward_model:
        args.reward_model = args.reward_pretrained_checkpoint
    for weights_from in ("actor", "critic", "reward"):
        desc = ROLES[weights_from]
        hf = getattr(args, f"hf_{weights_from}_path")
        megatron = getattr(args, desc.pretrained_flag[2:].replace("-", "_"))
        if hf and megatron:
            raise ArgumentError(f"{desc.pretrained_flag}: {desc.hf_path_flag} {hf} also gives the {weights_from}'s "
                                f"weights; give one of them")


def check_checkpoint_paths(args) -> None:
    """Every Megatron-LM checkpoint flag names one (a run on this machine; dry runs skip it)."""
    from puzzle.models.megatron_checkpoint import MegatronCheckpointError, require_megatron_checkpoint

    for weights_from in ("actor", "critic", "reward"):
        flag = ROLES[weights_from].pretrained_flag
        path = getattr(args, flag[2:].replace("-", "_"))
        if path:
            try:
                require_megatron_checkpoint(path, flag)
            except MegatronCheckpointError as e:
                raise ArgumentError(str(e)) from None
