"""ParallelPlan: a (P, D, T) layout over a contiguous block of ranks (pure, no torch.distributed).

Rank order follows the PUZZLE paper (Algorithm 1): T fastest, then D, then P::

    rank = offset + p * D * T + d * T + t

Expert layers (mixture of experts) re-split each pipeline stage's D*T ranks as megatron-core
does: expert-tensor rank fastest, then expert-parallel rank, then expert-data-parallel rank::

    i = d * T + t  (the rank's index inside its stage)
    etp = i % ETP,  ep = (i // ETP) % E,  edp = i // (ETP * E)

E (``--expert-model-parallel-size``) splits the experts, ETP (``--expert-tensor-parallel-size``,
default T) splits each expert's MLP; E * ETP must divide D * T.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple


class PlanError(ValueError):
    """A parallel plan that cannot be used (degrees, world size, model shape)."""


@dataclass(frozen=True)
class ParallelPlan:
    """Pipeline (P), data (D) and tensor (T) degrees of one model, placed on ranks
    ``offset .. offset + P*D*T - 1`` of the job's world."""

    P: int = 1
    D: int = 1
    T: int = 1
    offset: int = 0
    E: int = 1                    # expert-parallel size
    ETP: Optional[int] = None     # expert-tensor-parallel size (None: T)

    def __post_init__(self):
        if self.ETP is None:
            object.__setattr__(self, "ETP", self.T)
        for name in ("P", "D", "T", "E", "ETP"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(f"ParallelPlan.{name} must be a positive integer, got {v!r}")
        if not isinstance(self.offset, int) or self.offset < 0:
            raise PlanError(f"ParallelPlan.offset must be a non-negative integer, got {self.offset!r}")
        if (self.D * self.T) % (self.E * self.ETP):
            raise PlanError(f"expert parallelism E={self.E} x expert tensor parallelism ETP={self.ETP} must "
                            f"divide the D*T={self.D * self.T} ranks of a pipeline stage")

    # ---- sizes -------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Number of ranks the plan occupies (P*D*T)."""
        return self.P * self.D * self.T

    @property
    def ranks(self) -> List[int]:
        return list(range(self.offset, self.offset + self.size))

    @property
    def has_experts_split(self) -> bool:
        """Whether expert layers are laid out differently from dense ones (E > 1 or ETP != T)."""
        return self.E > 1 or self.ETP != self.T

    def __str__(self) -> str:
        s = f"(P={self.P}, D={self.D}, T={self.T})"
        if self.has_experts_split:
            s = s[:-1] + f", E={self.E}" + (f", ETP={self.ETP})" if self.ETP != self.T else ")")
        return s if self.offset == 0 else f"{s}@{self.offset}"

    # ---- coordinates -------------------------------------------------------------------
    def contains(self, rank: int) -> bool:
        return self.offset <= rank < self.offset + self.size

    def coords(self, rank: int) -> Tuple[int, int, int]:
        """(p, d, t) of a global rank inside this plan."""
        if not self.contains(rank):
            raise PlanError(f"rank {rank} is not in plan {self} (ranks {self.offset}..{self.offset + self.size - 1})")
        r = rank - self.offset
        return r // (self.D * self.T), (r // self.T) % self.D, r % self.T

    def expert_coords(self, rank: int) -> Tuple[int, int, int, int]:
        """(p, edp, ep, etp) of a global rank: its stage, expert-data-parallel, expert-parallel and
        expert-tensor-parallel ranks (see the module docstring)."""
        p, d, t = self.coords(rank)
        i = d * self.T + t
        return p, i // (self.ETP * self.E), (i // self.ETP) % self.E, i % self.ETP

    def expert_rank(self, p: int, edp: int, ep: int, etp: int) -> int:
        return self.offset + p * self.D * self.T + (edp * self.E + ep) * self.ETP + etp

    @property
    def EDP(self) -> int:
        """Expert-data-parallel size: replicas of each expert's shard per stage."""
        return self.D * self.T // (self.E * self.ETP)

    def _expert_groups(self, vary: str) -> List[List[int]]:
        """Groups over which the coordinates in ``vary`` (letters of 'dei': edp, ep, etp) change."""
        sizes = {"d": self.EDP, "e": self.E, "i": self.ETP}
        fixed = [c for c in "dei" if c not in vary]
        out = []
        import itertools

        for p in range(self.P):
            for f in itertools.product(*(range(sizes[c]) for c in fixed)):
                base = dict(zip(fixed, f))
                group = []
                for v in itertools.product(*(range(sizes[c]) for c in vary)):
                    c = dict(base, **dict(zip(vary, v)))
                    group.append(self.expert_rank(p, c["d"], c["e"], c["i"]))
                out.append(sorted(group))
        return out

    def ep_groups(self) -> List[List[int]]:
        return self._expert_groups("e")

    def expt_tp_groups(self) -> List[List[int]]:
        return self._expert_groups("i")

    def expt_dp_groups(self) -> List[List[int]]:
        return self._expert_groups("d")

    def tp_ep_groups(self) -> List[List[int]]:
        """Expert-tensor x expert-parallel ranks of one stage (the MoE dispatcher's group)."""
        return self._expert_groups("ei")

    def tp_ep_pp_groups(self) -> List[List[int]]:
        return [sorted(r for p in range(self.P) for r in self._expert_groups("ei")[p * self.EDP + k])
                for k in range(self.EDP)]

    def generation_share(self, rank: int) -> Tuple[int, int]:
        """(share, shares): which part of a batch the rank generates when every rank of one
        expert-parallel group must run the same steps (they generate the same prompts)."""
        p, d, t = self.coords(rank)
        width = max(1, self.E * self.ETP // self.T)
        if self.D % width:
            raise PlanError(f"plan {self}: E*ETP/T={width} must divide D={self.D} for generation")
        return d // width, self.D // width

    def generation_owners(self) -> List[int]:
        """The rank that hands on each part of a generated batch (``generation_share``'s parts, in
        order): the first pipeline stage's TP rank 0 of the part's first DP rank."""
        width = max(1, self.E * self.ETP // self.T)
        return [self.rank(0, k * width, 0) for k in range(self.D // width)]

    def output_owners(self) -> List[int]:
        """The rank that hands on each DP rank's outputs (in DP order): the last pipeline stage's
        TP rank 0."""
        return [self.rank(self.P - 1, d, 0) for d in range(self.D)]

    def rank(self, p: int, d: int, t: int) -> int:
        if not (0 <= p < self.P and 0 <= d < self.D and 0 <= t < self.T):
            raise PlanError(f"coordinates (p={p}, d={d}, t={t}) are outside plan {self}")
        return self.offset + p * self.D * self.T + d * self.T + t

    # ---- groups (lists of global ranks; every rank computes the same lists) -------------
    def tp_groups(self) -> List[List[int]]:
        return [[self.rank(p, d, t) for t in range(self.T)] for p in range(self.P) for d in range(self.D)]

    def dp_groups(self) -> List[List[int]]:
        return [[self.rank(p, d, t) for d in range(self.D)] for p in range(self.P) for t in range(self.T)]

    def pp_groups(self) -> List[List[int]]:
        return [[self.rank(p, d, t) for p in range(self.P)] for d in range(self.D) for t in range(self.T)]

    def mp_groups(self) -> List[List[int]]:
        """Model-parallel groups: all P*T ranks holding one replica."""
        return [[self.rank(p, d, t) for p in range(self.P) for t in range(self.T)] for d in range(self.D)]

    def embedding_groups(self) -> List[List[int]]:
        """First and last pipeline stage of each pipeline (tied-embedding / embedding sync group)."""
        out = []
        for g in self.pp_groups():
            out.append(sorted({g[0], g[-1]}))
        return out

    def position_embedding_groups(self) -> List[List[int]]:
        return [[g[0]] for g in self.pp_groups()]

    # ---- validation against a world and a model ----------------------------------------
    def check_world(self, world_size: int, what: str = "plan") -> None:
        if self.offset + self.size > world_size:
            raise PlanError(
                f"{what} {self} needs ranks {self.offset}..{self.offset + self.size - 1} "
                f"(P*D*T={self.size}) but the world has {world_size} ranks"
            )

    def check_model(self, *, num_layers: int, num_attention_heads: int, num_query_groups: int,
                    ffn_hidden_size: int, hidden_size: int, padded_vocab_size: int = 0,
                    what: str = "model") -> None:
        """Raise PlanError when the model shape cannot be split by this plan."""
        problems = []
        if num_layers % self.P:
            problems.append(f"num_layers={num_layers} is not divisible by P={self.P}")
        if num_attention_heads % self.T:
            problems.append(f"num_attention_heads={num_attention_heads} is not divisible by T={self.T}")
        if num_query_groups % self.T:
            problems.append(f"num_query_groups={num_query_groups} is not divisible by T={self.T}")
        if ffn_hidden_size % self.T:
            problems.append(f"ffn_hidden_size={ffn_hidden_size} is not divisible by T={self.T}")
        if padded_vocab_size % self.T:
            problems.append(f"padded vocab size {padded_vocab_size} is not divisible by T={self.T} "
                            "(raise --make-vocab-size-divisible-by)")
        if hidden_size % num_attention_heads:
            problems.append(f"hidden_size={hidden_size} is not divisible by num_attention_heads={num_attention_heads}")
        if problems:
            raise PlanError(f"{what} cannot use plan {self}: " + "; ".join(problems))

    @classmethod
    def parse(cls, text: str) -> "ParallelPlan":
        """Parse 'P,D,T' or 'P,D,T@offset' (also accepts 'x' separators), optionally followed by
        the expert degrees 'E=e' and 'ETP=x' ('(1,8,1,E=8)@0')."""
        body, _, off = text.strip().partition("@")
        parts = [x.strip() for x in body.replace("x", ",").replace("(", "").replace(")", "").split(",")]
        named = dict(x.split("=", 1) for x in parts if "=" in x)
        try:
            vals = [int(x) for x in parts if x and "=" not in x]
            expert = {k.strip(): int(v) for k, v in named.items()}
        except ValueError:
            raise PlanError(f"cannot parse plan {text!r}: expected 'P,D,T' or 'P,D,T@offset'") from None
        if len(vals) != 3 or set(expert) - {"E", "ETP"}:
            raise PlanError(f"cannot parse plan {text!r}: expected three degrees P,D,T (then E=, ETP=)")
        return cls(P=vals[0], D=vals[1], T=vals[2], offset=int(off) if off else 0, **expert)
