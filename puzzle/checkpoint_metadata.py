"""What a checkpoint's metadata.json says of the run (``run_metadata``: layout-free, per role its
shape, layouts, trainable or the source of its frozen weights, a LoRA actor's adapters and base)
and what a resume must agree with (``run_problems``): the same roles and shapes, the same frozen
sources, LoRA adapters of the same rank on the same linears and on the same base (its
fingerprint), an experts' optimizer saved apart. Pure: puzzle.checkpointing reads and writes the
files and calls these."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import List, Optional

import puzzle

FORMAT = 1
_FINGERPRINT_RTOL = 1e-6


def _plan_dict(plan) -> Optional[dict]:
    return None if plan is None else {"P": plan.P, "D": plan.D, "T": plan.T,
                                      "offset": getattr(plan, "offset", 0),
                                      "E": getattr(plan, "E", 1), "ETP": getattr(plan, "ETP", plan.T)}


def role_source(cfg, role: str) -> dict:
    """Where a model's initial weights come from (its Role: seed offset, HF or Megatron-LM checkpoint)."""
    spec = cfg.roles[role]
    source = {"hf_path": os.path.abspath(spec.hf_path) if spec.hf_path else None, "seed": spec.init_seed(cfg.seed)}
    if spec.pretrained_checkpoint:
        source["pretrained_checkpoint"] = os.path.abspath(spec.pretrained_checkpoint)
    return source


def _lora_dict(lora) -> dict:
    return {"dim": lora.dim, "alpha": lora.alpha, "dropout": lora.dropout, "target_modules": list(lora.target_modules)}


def run_metadata(cfg) -> dict:
    roles = {}
    for role, spec in cfg.roles.items():
        roles[role] = {"arch": asdict(spec.arch), "plan": _plan_dict(spec.plan),
                       "gen_plan": _plan_dict(spec.gen_plan), "trainable": bool(spec.trainable)}
        if not spec.trainable:
            roles[role]["source"] = role_source(cfg, role)
        elif cfg.role_lora(role).enabled:  # the adapters; the base by reference (its fingerprint: save)
            roles[role]["lora"] = _lora_dict(cfg.role_lora(role))
            roles[role]["base"] = {"source": role_source(cfg, role)}
        elif spec.arch.is_moe:  # puzzle.engine.model_engine: the experts' optimizer apart at every E
            roles[role]["experts_optimizer"] = EXPERTS_OWN_OPTIMIZER
    return {"format": FORMAT, "puzzle_version": puzzle.__version__, "world_size": cfg.world_size,
            "seed": cfg.seed, "roles": roles,
            "optimizer": {"use_distributed_optimizer": bool(cfg.optim.use_distributed_optimizer),
                          "bf16": bool(cfg.bf16), "fp16": bool(cfg.fp16)}}


def run_problems(cfg, meta: dict) -> List[str]:
    """Every way the checkpoint described by ``meta`` differs from this run (``cfg``) that a resume
    cannot take, one message each."""
    problems = []
    saved_roles = meta.get("roles", {})
    for role, spec in cfg.roles.items():
        if role not in saved_roles:
            problems.append(f"role {role}: not in the checkpoint (it has {', '.join(saved_roles)})")
            continue
        saved = saved_roles[role]
        mine = asdict(spec.arch)
        diff = [f"{k}: checkpoint {saved['arch'].get(k)!r} vs this run {v!r}"
                for k, v in mine.items() if saved["arch"].get(k) != v]
        if diff:
            problems.append(f"role {role} model shape differs: " + "; ".join(diff))
        if bool(saved["trainable"]) != bool(spec.trainable):
            problems.append(f"role {role}: trainable={saved['trainable']} in the checkpoint")
        problems += _expert_optimizer_problems(cfg, role, saved)
        problems += _lora_problems(cfg, role, saved)
        if not spec.trainable and not cfg.finetune:  # --finetune: the frozen roles are this run's own
            problems += _frozen_source_problems(cfg, role, saved.get("source", {}))
    for role in saved_roles:
        if role not in cfg.roles and not cfg.finetune:
            problems.append(f"role {role}: in the checkpoint but not in this run")
    return problems


def _lora_problems(cfg, role: str, saved: dict) -> List[str]:
    """A LoRA actor (or critic) resumes adapters of the same rank on the same linears (alpha and dropout
    may change)."""
    if not cfg.roles[role].trainable:
        return []
    lora = cfg.role_lora(role)
    mine = _lora_dict(lora) if lora.enabled else None
    theirs = saved.get("lora")
    if mine is None and theirs is None:
        return []
    if mine is None or theirs is None:
        what = lambda d: f"LoRA rank {d['dim']} adapters" if d else "full-parameter training"
        return [f"role {role}: the checkpoint holds {what(theirs)}, this run asks for {what(mine)}"]
    diff = [f"{k}: checkpoint {theirs.get(k)!r} vs this run {mine[k]!r}" for k in ("dim", "target_modules")
            if theirs.get(k) != mine[k]]
    return [f"role {role} LoRA adapters differ: " + "; ".join(diff)] if diff else []


def base_fingerprint_problem(meta: dict, role: str, now: list, source: dict) -> Optional[str]:
    """The adapters of ``role`` were trained on a base whose fingerprint (sum and sum of squares of
    its weights) differs from this run's base: a message naming both, else None."""
    saved = (meta["roles"].get(role, {}).get("base") or {})
    before = saved.get("fingerprint")
    if before is None or fingerprints_match(before, now):
        return None
    return (f"role {role}: its LoRA adapters were trained on the base {saved.get('source')} (fingerprint {before}), "
            f"this run's base is {source} (fingerprint {now}): refusing to put them on another base")


def _frozen_source_problems(cfg, role: str, src: dict) -> List[str]:
    """A frozen role (saved by reference) whose source differs in this run."""
    want = role_source(cfg, role)
    for key, what in (("hf_path", "hf_path"), ("pretrained_checkpoint", "Megatron-LM checkpoint")):
        if src.get(key) != want.get(key):
            return [f"role {role} (frozen, saved by reference): weights came from {what}={src.get(key)!r}, "
                    f"this run uses {want.get(key)!r}"]
    if want["hf_path"] is None and "pretrained_checkpoint" not in want and src.get("seed") != want["seed"]:
        return [f"role {role} (frozen, saved by reference): weights were initialised from seed "
                f"{src.get('seed')}, this run's --seed gives {want['seed']}"]
    return []


#: run_metadata's mark of a MoE role whose experts' optimizer state is apart from the dense one at
#: every E (checkpoints from before it kept the experts in the dense optimizer at E = 1)
EXPERTS_OWN_OPTIMIZER = "own"


def _expert_optimizer_problems(cfg, role: str, saved: dict) -> List[str]:
    """Trained MoE models keep their experts' optimizer state in an optimizer of their own at
    every E (puzzle.engine.model_engine), so it resumes at any E. Checkpoints saved at E = 1 before
    that (no experts_optimizer mark) hold the experts in the dense optimizer: their optimizer state
    does not resume, their weights do (--no-load-optim). At E > 1 megatron always kept experts apart."""
    spec = cfg.roles[role]
    if not (spec.trainable and spec.arch.is_moe and getattr(cfg, "load_optim", True)
            and not getattr(cfg, "finetune", False)):
        return []
    was = (saved.get("plan") or {}).get("E", 1)
    if was > 1 or saved.get("experts_optimizer") == EXPERTS_OWN_OPTIMIZER:
        return []
    return [f"role {role}: saved at E=1 with its experts' optimizer state inside the dense optimizer "
            f"(an earlier puzzle); this run keeps the experts in an optimizer of their own at every E: "
            f"resume the weights alone with --no-load-optim"]


def fingerprints_match(a, b) -> bool:
    return all(abs(x - y) <= _FINGERPRINT_RTOL * max(abs(x), abs(y), 1e-12) for x, y in zip(a, b))
