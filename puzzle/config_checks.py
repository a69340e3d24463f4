"""Checks of a RunConfig's fields that need no layout search (layer 0, beside the config): the
multi-turn flags and the checkpoint flags, called from ``RunConfig.__post_init__``'s checks."""

from __future__ import annotations

from puzzle.config_flags import check, check_at_least


def check_turn_flags(cls, cfg) -> None:
    """The multi-turn flags of ``cfg`` (a RunConfig, ``cls``): --max-turns, --max-observation-tokens
    and --env-step-overlap-calls in range, --max-turns > 1 with --env and an actor generation layout
    the decode loop's turns run in (P=1, no expert-parallel split)."""
    check_at_least(cls, cfg, 1, "max_turns", "max_observation_tokens")
    check_at_least(cls, cfg, 0, "env_step_overlap_calls")
    check(cls, cfg, "max_turns", cfg.max_turns == 1 or bool(cfg.env), "needs --env (what answers the turns)")
    actor = cfg.roles.get("actor")
    gen = actor and (actor.gen_plan or actor.plan)
    check(cls, cfg, "max_turns", cfg.max_turns == 1 or gen is None or (gen.P == 1 and not gen.has_experts_split),
          f"multi-turn generation runs at P=1 without an expert-parallel split for now; the actor generates at {gen}")


def check_checkpoint_flags(cls, cfg) -> None:
    """The checkpoint flags of ``cfg`` (a RunConfig, ``cls``): --save-interval with --save; the
    flags that shape a resume (--no-load-optim, --no-load-rng, --ckpt-step, --finetune) with --load."""
    check(cls, cfg, "save_interval", cfg.save_interval is None or cfg.save_interval >= 1 and bool(cfg.save),
          f"needs --save DIR and must be >= 1 (got {cfg.save_interval})")
    for name, given in (("load_optim", not cfg.load_optim), ("load_rng", not cfg.load_rng),
                        ("ckpt_step", cfg.ckpt_step is not None), ("finetune", cfg.finetune)):
        check(cls, cfg, name, not given or bool(cfg.load), "needs --load DIR")
    check_at_least(cls, cfg, 1, "ckpt_step", optional=True)
