"""Scheduling of generation micro-batches over the pipeline stages of one model replica.

Work items are the model calls of a SlotBatch (puzzle/rollout/generation.py): a prefill of new
prompts or a decode step; every stage plans the same next call from the same state.

P = 1: SlotBatches run one after another, each to completion (one, refilled as rows finish). With
CUDA graphs, once no prompt waits for a slot the remaining decode steps run as whole-step graphs
(puzzle/rollout/cuda_graphs.py ``FusedDecode``).

P > 1 (hybrid pipelined inference): every stage walks the same sequence of work items, pass by
pass — pass j runs step j of every live micro-batch, in micro-batch order. A work item on stage p
receives its activations from p-1 (first stage: its token ids), runs the model with the
micro-batch's own KV cache and sends the result to p+1; the last stage samples and sends the
tokens and their log-probs to every other stage (each TP rank to its counterparts, so no extra TP broadcast). A
stage receives the tokens of (micro-batch m, step j-1) right before it runs (m, j): the first
stage needs them as input, the others to drop finished rows and to build the output. With
M >= P micro-batches the stages are all busy after warm-up: while the last stage samples m, the
first stage already embeds m+1.

Deadlock freedom: sends are non-blocking (``isend``), receives blocking. Every item
(stage p, micro-batch m, step j) depends only on items earlier in the (j, m, p) order, so the
dependency graph is acyclic. Sends of pass j-2 are waited for at the start of pass j (their
receives happen by pass j-1), which bounds the tensors held by in-flight sends.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from puzzle.rollout.sampling import SamplingParams, sample_tokens, sampled_logprobs, vocab_ids_of


def run_schedule(engine, mbatches: List, stepper, params: SamplingParams, seed: int,
                 quota=None) -> None:
    """Runs the model calls of ``mbatches`` until their rows finish or, at P=1, until ``quota``
    (a partial.QuotaTracker) reports its quota of finished groups met."""
    layout = engine.layout
    tp = layout.tp_group
    vocab = engine.arch.valid_vocab_size  # the tokenizer's ids: scoring masks the same rows

    def sample(mb, logits):
        """(tokens [m], their log-probs [m]) of the call's sampled rows."""
        logits = mb.select(logits)
        tok = sample_tokens(logits, params, true_vocab=vocab, seed=seed,
                            sample_ids=mb.sample_ids(), step=mb.steps(), tp_group=tp)
        return tok, sampled_logprobs(logits, tok, params, true_vocab=vocab, tp_group=tp)

    def sample_in_graph(logits, sample_ids, steps, seed_buffer, vocab_ids):
        tok = sample_tokens(logits, params, true_vocab=vocab, seed=seed_buffer, sample_ids=sample_ids,
                            step=steps, tp_group=tp, graph_safe=True, vocab_ids=vocab_ids)
        return tok, sampled_logprobs(logits, tok, params, true_vocab=vocab, tp_group=tp)

    if layout.plan.P == 1:
        for mb in mbatches:
            while not mb.done:
                if stepper.graphs is not None and not mb.queue and quota is None:  # every prompt has its slot
                    stepper.hooks.bind(mb.cache)
                    left = mb.max_new - min(mb.host_count[s] for s in mb.host_active)
                    ids = vocab_ids_of(engine.arch.padded_vocab_size // layout.plan.T, tp, mb.device)
                    stepper.forward_passes += stepper.graphs.fused_decode(
                        mb, stepper.run, sample_in_graph, (params, vocab), seed, left, ids)
                    continue
                mb.next_call()
                mb.advance(*sample(mb, stepper(mb, None)))
                if quota is not None and quota.add(mb.finished_rows):
                    return
        return
    _run_pipelined(engine, mbatches, stepper, sample)


def _run_pipelined(engine, mbatches: List, stepper, sample) -> None:
    layout, config = engine.layout, engine.config
    P, p, pp = layout.plan.P, layout.p, layout.pp_group
    first, last = layout.is_first_stage, layout.is_last_stage
    peer = [dist.get_global_rank(pp, q) for q in range(P)]
    dtype = config.pipeline_dtype or config.params_dtype
    awaiting = [False] * len(mbatches)  # non-last stages: tokens of the previous step not yet in
    sends: Dict[int, list] = {}         # pass -> [(work, tensor)]
    j = 0
    while any(not mb.done for mb in mbatches):
        for work, _ in sends.pop(j - 2, []):
            work.wait()
        mine = sends.setdefault(j, [])
        for i, mb in enumerate(mbatches):
            if mb.done:
                continue
            if awaiting[i]:
                tok = torch.empty(len(mb.call.slots), dtype=torch.long, device=mb.device)
                lp = torch.empty(len(mb.call.slots), dtype=torch.float32, device=mb.device)
                dist.recv(tok, src=peer[P - 1], group=pp)
                dist.recv(lp, src=peer[P - 1], group=pp)
                awaiting[i] = False
                mb.advance(tok, lp)
                if mb.done:
                    continue
            call = mb.next_call()
            hidden = None
            if not first:
                hidden = torch.empty(call.seq_len, call.n, config.hidden_size, dtype=dtype,
                                     device=mb.device)
                dist.recv(hidden, src=peer[p - 1], group=pp)
            out = stepper(mb, hidden)
            if not last:
                mine.append((dist.isend(out, dst=peer[p + 1], group=pp), out))
                awaiting[i] = True
                continue
            tok, lp = (x.contiguous() for x in sample(mb, out))
            for q in range(P - 1):
                mine.append((dist.isend(tok, dst=peer[q], group=pp), tok))
                mine.append((dist.isend(lp, dst=peer[q], group=pp), lp))
            mb.advance(tok, lp)
        j += 1
    # on normal completion only (after an error the peers may be gone)
    for pending in sends.values():
        for work, _ in pending:
            work.wait()
