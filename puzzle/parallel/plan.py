"""ParallelPlan: a (P, D, T) layout over a contiguous block of ranks (pure, no torch.distributed).

Rank order follows the PUZZLE paper (Algorithm 1): T fastest, then D, then P::

    rank = offset + p * D * T + d * T + t
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple


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

    def __post_init__(self):
        for name in ("P", "D", "T"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(f"ParallelPlan.{name} must be a positive integer, got {v!r}")
        if not isinstance(self.offset, int) or self.offset < 0:
            raise PlanError(f"ParallelPlan.offset must be a non-negative integer, got {self.offset!r}")

    # ---- sizes -------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Number of ranks the plan occupies (P*D*T)."""
        return self.P * self.D * self.T

    @property
    def ranks(self) -> List[int]:
        return list(range(self.offset, self.offset + self.size))

    def __str__(self) -> str:
        s = f"(P={self.P}, D={self.D}, T={self.T})"
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
        """Parse 'P,D,T' or 'P,D,T@offset' (also accepts 'x' separators)."""
        body, _, off = text.strip().partition("@")
        parts = body.replace("x", ",").replace("(", "").replace(")", "").split(",")
        try:
            vals = [int(x) for x in parts if x.strip()]
        except ValueError:
            raise PlanError(f"cannot parse plan {text!r}: expected 'P,D,T' or 'P,D,T@offset'") from None
        if len(vals) != 3:
            raise PlanError(f"cannot parse plan {text!r}: expected three degrees P,D,T")
        return cls(P=vals[0], D=vals[1], T=vals[2], offset=int(off) if off else 0)
