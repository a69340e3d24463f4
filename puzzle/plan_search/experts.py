"""Mixture-of-experts terms of the memory and cost models (pure Python, no torch).

A MoE layer (megatron-core's MoELayer: a TopKRouter and ``num_experts`` SwiGLU experts of
``moe_ffn_hidden_size``) splits its experts over E ranks (``--expert-model-parallel-size``) and
each expert's MLP over ETP ranks (``--expert-tensor-parallel-size``); attention and the dense
layers keep the (P, D, T) split. Per pipeline stage the D*T ranks hold E*ETP expert shards,
replicated over EDP = D*T / (E*ETP) expert-data-parallel ranks (megatron-core's expert grid).

* Parameters: the experts' weights, gradients and (distributed) optimizer states are split over
  E*ETP and sharded over EDP; the router (num_experts x hidden) is replicated.
* Work: with balanced routing every rank of a stage computes an equal share of the routed
  (token, expert) pairs. In training at T > 1 each MoE layer splits its tokens over the T ranks
  as sequence parallelism would (megatron_patches.moe_tensor_parallel_without_sp): the per-rank
  FLOPs equal a dense layer's whose MLP is ``topk`` experts wide (active parameters) at T, the
  layer's output is all-gathered over T (forward and backward) instead of all-reduced, and the
  routers' gradients are summed over T. Forward-only passes (scoring, generation) run megatron's
  MoE layer unchanged: every tensor-parallel rank routes and computes all of its tokens (the
  experts' work is not split by T; ETP > 1 gathers the T copies) and needs no all-reduce.
* Dispatcher: the all-to-all dispatcher sends each token's ``topk`` copies to the experts' ranks
  and brings them back -- 2 all-to-alls per MoE layer forward, 2 more backward, each moving
  ``tokens x hidden x topk x bf16 x (E-1)/E`` bytes per rank; with ETP > 1 the received pairs
  are all-gathered over the ETP ranks (reduce-scattered back), ``(ETP-1) x`` as many bytes. The
  all-gather dispatcher gathers the hidden states of the expert group's E*ETP ranks and
  reduce-scatters the result. ``tokens`` are the rank's own: a micro-batch's over T when the
  layer splits them.
* Decode: a step reads only the experts its tokens touch: of N experts, a batch of n tokens
  routed top-k touches N * (1 - (1 - k/N)^n) in expectation (uniform routing).
Routing is assumed balanced (dropless, no capacity factor); an unbalanced step is slower and
holds more activations on its busiest expert rank.
"""

from __future__ import annotations

from typing import Optional

from puzzle.model_shape import expert_params, expert_params_per_layer, moe_fraction

BF16 = 2
#: bytes per token of the router's fp32 logits and probabilities kept for the backward pass, per expert
ROUTER_BYTES_PER_EXPERT = 8


def expert_params_on_rank(shape, P: int, E: int, ETP: int) -> float:
    """Expert parameters one rank of a pipeline stage holds under degrees (P, E, ETP)."""
    return shape.num_layers / P * expert_params_per_layer(shape) / (E * ETP) if shape.num_experts else 0.0


def expected_experts_touched(num_experts: int, topk: int, tokens: float) -> float:
    """Expected distinct experts ``tokens`` tokens reach when each picks ``topk`` of
    ``num_experts`` uniformly: N * (1 - (1 - k/N)^tokens)."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - topk / num_experts) ** tokens)


def token_sets(E: int, ETP: int, T: int) -> int:
    """Distinct token sets an expert group of E*ETP ranks serves when the tensor-parallel ranks
    share their tokens (forward-only passes)."""
    return max(1, E * ETP // T)


def rank_tokens(tokens: float, T: int, split: bool) -> float:
    """Tokens a MoE layer routes on one rank: the micro-batch's, over T when the layer splits them
    (training at T > 1)."""
    return tokens / T if split else tokens


def dispatch_bytes(shape, tokens: float, E: int, ETP: int, T: int, split: bool = False) -> float:
    """Bytes one rank sends (and receives) in ONE dispatch or combine of a micro-batch of
    ``tokens`` tokens (``split``: the layer splits them over T)."""
    if not shape.num_experts:
        return 0.0
    n = rank_tokens(tokens, T, split)
    if shape.moe_dispatcher == "alltoall":  # all-to-all over E, then the ETP all-gather of the pairs
        return n * shape.hidden_size * shape.moe_router_topk * BF16 * ((E - 1) / E + (ETP - 1))
    return n * shape.hidden_size * BF16 * (E * ETP - 1)  # all-gather / reduce-scatter over E*ETP


def dispatch_seconds(profile, shape, tokens: float, E: int, ETP: int, T: int, inter_node: bool,
                     split: bool = False) -> float:
    """Time of one dispatch (or combine) over the expert group's link."""
    nbytes = dispatch_bytes(shape, tokens, E, ETP, T, split)
    if nbytes <= 0:
        return 0.0
    return nbytes / profile.bandwidth(inter_node) + profile.latency(inter_node)


def split_gather_seconds(profile, shape, tokens: float, T: int, inter_node: bool) -> float:
    """The all-gather over T of a token-splitting MoE layer's output (forward), or of its input's
    gradient (backward): (T-1)/T of the micro-batch's bf16 hidden states per rank."""
    if T <= 1 or tokens <= 0:
        return 0.0
    return (T - 1) / T * tokens * shape.hidden_size * BF16 / profile.bandwidth(inter_node) + profile.latency(
        inter_node)


def unsplit_expert_flops(shape, tokens: float, T: int) -> float:
    """Forward FLOPs of an average layer's experts that a forward-only pass at T > 1 adds to the
    active width's T-split share: every tensor-parallel rank computes its tokens' routed pairs."""
    if not shape.num_experts or T <= 1:
        return 0.0
    per_token = 2.0 * shape.moe_router_topk * expert_params(shape)
    return moe_fraction(shape) * tokens * per_token * (1.0 - 1.0 / T)


def moe_activation_bytes_per_token(shape, T: int, E: int, ETP: int, split: bool = True) -> float:
    """Activations of one MoE layer's MLP part per micro-batch token on one rank: the routed
    pairs' gate/up/product (6 * topk * moe_ffn bf16 bytes), the permuted tokens in and out of the
    experts (2 * topk * hidden bf16, ETP copies gathered), the router's fp32 logits and
    probabilities, and with the all-gather dispatcher the gathered hidden states of the E*ETP
    group. ``split`` (training at T > 1): a rank holds those of its 1/T of the tokens; else
    (forward-only passes) those of all of them."""
    k, h = shape.moe_router_topk, shape.hidden_size
    share = 1.0 / T if split else 1.0
    act = 6.0 * k * shape.moe_ffn_hidden_size * share + 2.0 * BF16 * k * h * ETP * share
    act += ROUTER_BYTES_PER_EXPERT * shape.num_experts * share
    if shape.moe_dispatcher != "alltoall":
        act += BF16 * h * E * ETP * share
    return act


def decode_extra_expert_bytes(shape, rows: float, E: int, ETP: int, T: int) -> float:
    """Expert bytes one rank reads per decode step of an average layer beyond a dense layer of
    the active width (topk experts over T, which the layer table already prices): the local
    experts the expert group's tokens touch. Never negative (the active width is the floor)."""
    if not shape.num_experts:
        return 0.0
    n, k = shape.num_experts, shape.moe_router_topk
    touched = expected_experts_touched(n, k, rows * token_sets(E, ETP, T)) / E
    per_expert = expert_params(shape) / ETP * BF16
    active = k * expert_params(shape) / T * BF16
    return moe_fraction(shape) * max(0.0, touched * per_expert - active)


def static_step_extra_params(shape, T: int) -> float:
    """Expert parameters one rank reads and multiplies per graphed decode step of an average
    layer beyond a dense layer of the active width (topk experts over T): the static step
    (puzzle/models/moe_decode.py) runs every expert, whole on the rank, on every row."""
    if not shape.num_experts:
        return 0.0
    return moe_fraction(shape) * expert_params(shape) * (shape.num_experts - shape.moe_router_topk / T)


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def switch_bytes(shape, src, dst, ranks_per_node=None, dtype_bytes: int = BF16,
                 per_expert_params: Optional[float] = None, per_expert_replicated: float = 0.0) -> dict:
    """Expert bytes every rank of ``dst`` lacks when the experts move from ``src``'s split to
    ``dst``'s: {rank: (intra-node, inter-node)}. A rank's expert box is (its stage's layers) x
    (its E-slice of the experts) x (its ETP-slice of each expert's MLP); what its own ``src`` box
    covers stays, the rest comes from a ``src`` holder of each piece, counted intra-node when one
    holder (over the expert-data-parallel replicas) shares the receiver's node.
    ``per_expert_params`` / ``per_expert_replicated``: what one expert holds split over ETP and
    whole on each ETP rank, when not its MLP (a LoRA actor's expert adapters)."""
    if not shape.num_experts:
        return {}
    L, N = shape.num_layers, shape.num_experts
    per_expert = expert_params(shape) if per_expert_params is None else per_expert_params
    per = moe_fraction(shape) * per_expert * dtype_bytes  # one expert of an average layer
    rep = moe_fraction(shape) * per_expert_replicated * dtype_bytes
    rpn = ranks_per_node or (1 << 62)
    out = {}
    for r in dst.ranks:
        pd, _, ed, td = dst.expert_coords(r)
        box = ((pd * L / dst.P, (pd + 1) * L / dst.P), (ed * N / dst.E, (ed + 1) * N / dst.E),
               (td / dst.ETP, (td + 1) / dst.ETP))
        own = src.expert_coords(r) if src.contains(r) else None
        intra = inter = 0.0
        for ps in range(src.P):
            lay = _overlap(*box[0], ps * L / src.P, (ps + 1) * L / src.P)
            for es in range(src.E) if lay else ():
                exp = _overlap(*box[1], es * N / src.E, (es + 1) * N / src.E)
                for ts in range(src.ETP) if exp else ():
                    if own is not None and (own[0], own[2], own[3]) == (ps, es, ts):
                        continue
                    piece = lay * exp * _overlap(*box[2], ts / src.ETP, (ts + 1) / src.ETP) * per
                    holders = (src.expert_rank(ps, d, es, ts) // rpn for d in range(src.EDP))
                    if any(node == r // rpn for node in holders):
                        intra += piece
                    else:
                        inter += piece
                if exp and rep and not (own is not None and (own[0], own[2]) == (ps, es)):  # whole, once
                    holders = [src.expert_rank(ps, d, es, ts) // rpn for d in range(src.EDP) for ts in range(src.ETP)]
                    if r // rpn in holders:
                        intra += lay * exp * rep
                    else:
                        inter += lay * exp * rep
        out[r] = (intra, inter)
    return out
