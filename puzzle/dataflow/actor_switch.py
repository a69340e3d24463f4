"""The actor's inter-stage switch as PPOTrainer uses it (PUZZLE §5).

The actor trains in its training layout and generates in its generation layout. The last
optimizer step of an iteration runs segment by segment with each segment's weights sent to the
shadow generation model as soon as they are updated (puzzle.switch.overlap); the shadow serves
the next iteration's generation and is released right after it. Before the first iteration
(nothing to step yet) the current weights are moved without a step.

A LoRA actor (puzzle/switch/lora_merge.py): its base is frozen, so the shadow and the base it
holds are kept between iterations; the first switch lays the base (and the adapters) out, every
later one moves only the adapters. The adapters are merged into the shadow's weights for each
generation and taken out again after it.
"""

from __future__ import annotations

from types import SimpleNamespace

from puzzle.parallel.groups import layout_for


class ActorSwitch:
    def __init__(self, actor, gen_plan, segments: int = 1, ranks_per_node=None):
        self.actor, self.gen_plan, self.segments = actor, gen_plan, segments
        self.ranks_per_node = ranks_per_node  # same-node sources preferred among replicas
        self.shadow = None
        self.ready = False  # the shadow holds the current weights (merged adapters, LoRA)
        self.last_stats = None
        layout_for(gen_plan)  # collective: build the generation layout's groups up front

    def _switch(self, optimizer_step: bool):
        """Switch into the shadow (a new one; LoRA: the kept one, adapters only once its base is
        in place); with ``optimizer_step`` overlapped with the actor's optimizer step."""
        from puzzle.switch.shadow import switch_to_generation

        lora = getattr(self.actor, "lora", None) is not None
        kept = self.shadow if lora else None
        if self.shadow is not None and not lora:
            self.release()
        self.shadow = switch_to_generation(self.actor, self.gen_plan, self.segments, shadow=kept,
                                           optimizer_step=optimizer_step, ranks_per_node=self.ranks_per_node,
                                           adapters_only=kept is not None)
        self.shadow.merge_adapters()
        self.last_stats, self.ready = self.shadow.switch_stats, True
        return self.shadow.step_result

    def generation_engine(self):
        """An engine-like view of the shadow model (module, layout, arch, role, config)."""
        if not self.ready:
            self._switch(optimizer_step=False)
        m = self.shadow.module
        return SimpleNamespace(module=m, layout=self.shadow.layout, arch=self.actor.arch,
                               role=self.actor.role, config=m.config if m is not None else None,
                               member=m is not None)

    def optimizer_step_and_switch(self) -> dict:
        """The actor's optimizer step overlapped with the switch into the shadow model."""
        if self.ready:  # LoRA: the adapters are merged (a generation that did not release)
            self.shadow.unmerge_adapters()
        return self._switch(optimizer_step=True)

    def release(self) -> None:
        """After generation: the shadow is freed (LoRA: the adapters are taken out of the kept base)."""
        self.ready = False
        if self.shadow is None:
            return
        if getattr(self.actor, "lora", None) is not None:
            self.shadow.unmerge_adapters()
        else:
            self.shadow.release()
            self.shadow = None

    def reset(self) -> None:
        """Free the shadow, a LoRA actor's base too (the weights were loaded: the next switch moves all)."""
        self.ready = False
        if self.shadow is not None:
            self.shadow.release()
            self.shadow = None
