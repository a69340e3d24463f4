"""The actor's inter-stage switch as PPOTrainer uses it (PUZZLE §5).

The actor trains in its training layout and generates in its generation layout. The last
optimizer step of an iteration runs segment by segment with each segment's weights sent to the
shadow generation model as soon as they are updated (puzzle.switch.overlap); the shadow serves
the next iteration's generation and is released right after it. Before the first iteration
(nothing to step yet) the current weights are moved without a step.
"""

from __future__ import annotations

from types import SimpleNamespace

from puzzle.parallel.groups import layout_for


class ActorSwitch:
    def __init__(self, actor, gen_plan, segments: int = 1, ranks_per_node=None):
        self.actor, self.gen_plan, self.segments = actor, gen_plan, segments
        self.ranks_per_node = ranks_per_node  # same-node sources preferred among replicas
        self.shadow = None
        self.last_stats = None
        layout_for(gen_plan)  # collective: build the generation layout's groups up front

    def generation_engine(self):
        """An engine-like view of the shadow model (module, layout, arch, role, config)."""
        from puzzle.switch.shadow import switch_to_generation

        if self.shadow is None:
            self.shadow = switch_to_generation(self.actor, self.gen_plan, self.segments,
                                               ranks_per_node=self.ranks_per_node)
            self.last_stats = self.shadow.switch_stats
        m = self.shadow.module
        return SimpleNamespace(module=m, layout=self.shadow.layout, arch=self.actor.arch,
                               role=self.actor.role, config=m.config if m is not None else None,
                               member=m is not None)

    def optimizer_step_and_switch(self) -> dict:
        """The actor's optimizer step overlapped with the switch into a fresh shadow model."""
        from puzzle.switch.shadow import switch_to_generation

        self.shadow = switch_to_generation(self.actor, self.gen_plan, self.segments, optimizer_step=True,
                                           ranks_per_node=self.ranks_per_node)
        self.last_stats = self.shadow.switch_stats
        return self.shadow.step_result

    def release(self) -> None:
        if self.shadow is not None:
            self.shadow.release()
            self.shadow = None
