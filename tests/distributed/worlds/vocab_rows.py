"""4-rank world: a tokenizer with fewer ids (300) than the model has vocabulary rows (400, padded
to 512), as Qwen2.5's 151936 rows over ~151665 tokenizer ids.

The rows the tokenizer has no id for are biased after initialisation to hold most of the
probability, so generation would sample them if it did not mask them like scoring does. Four PPO /
GRPO runs of several sampled iterations, in-process trainers:

- ppo_flags_111:  PPO, --vocab-size 400 with the 300-id tokenizer, every model at (1,1,1)
- grpo_hf_111:    GRPO, a Qwen2 HF checkpoint whose config.json has 400 rows, at (1,1,1)
- ppo_hf_212:     PPO, the same checkpoint, actor/ref at (2,1,2) (pipelined generation, T=2)
- grpo_flags_212: GRPO, --vocab-size 400, actor/ref at (2,1,2) generating at (1,2,2) through the
  switch; then the whole-step decode path of --cuda-graph-generation (without the capture, on CPU)
  against the eager loop on the same shadow model

And the other way round (check_added_pad): a Qwen2 checkpoint of 301 rows whose tokenizer gains a
302nd id (<|endoftext|>, its pad) through AutoTokenizer, run by puzzle.tools.generate at (1,1,1) and
(2,1,2) against transformers' greedy tokens; with that id as its EOS it is refused.

Every sampled token's logits are recorded inside sample_tokens (all TP slices gathered): each run
reports the probability the unmasked logits put on the unused rows (so the check could fail), the
sampled ids, and the largest gap between the log-prob of each sampled token under the sampling
distribution (softmax over the tokenizer's ids, computed here from the tokenizer's length) and the
old log-prob that scoring computed for it; the log-prob generation recorded for each token (against
the one computed here from its logits) and the run's gen_score_logprob_diff metrics. grpo_flags_212
runs with the truncated importance-sampling correction (--rl-inference-logprobs-is-correction).
"""

import math
import os
import tempfile

import torch
import torch.distributed as dist

import puzzle.rollout.pipelined_generation as pipelined_generation
from puzzle.arguments import parse_args, validate_args
from puzzle.data.prompts import bundled_prompts_path, load_prompt_dataset
from puzzle.data.tokenizers import build_tokenizer
from tests.harness import world_main

TOKENS, ROWS = 300, 400  # tokenizer ids, model vocabulary rows (padded to 512)
TEMPERATURE = 0.8
ITERS = 2
COMMON = ["--seq-length", "48", "--max-new-tokens", "8", "--micro-batch-size", "4", "--lr", "5e-3",
          "--temperature", str(TEMPERATURE), "--train-iters", str(ITERS), "--seed", "7",
          "--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction",
          "--tokenizer-type", "HuggingFaceTokenizer"]
FLAGS_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
               "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
               "--disable-bias-linear", "--vocab-size", str(ROWS)]
PPO = ["--rollout-batch-size", "4", "--ppo-epochs", "1", "--kl-coef", "0.05"]
GRPO = ["--advantage-estimator", "grpo", "--n-samples-per-prompt", "2", "--rollout-batch-size", "4",
        "--kl-coef", "0", "--use-kl-loss", "--kl-loss-coef", "0.1"]
L212 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
_DIRS = {}
RECORDS = []  # (sample ids [n], steps [n], tokens [n], full logits [n, V]) of every sampling call


def _byte_tokenizer(n):
    """A byte-level BPE tokenizer (no merges) of ``n`` ids: 4 specials, the 256 byte symbols, then
    filler tokens; any text round-trips."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "<pad>"] + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({f"<extra_{i}>": len(vocab) + i for i in range(n - len(vocab))})
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def _make_dirs():
    """Rank 0 writes the tokenizer alone and a Qwen2 checkpoint (tied embeddings, q/k/v biases)
    of ROWS rows with the same tokenizer beside it."""
    obj = [tempfile.mkdtemp(prefix="puzzle-vocab-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    _DIRS.update(tok=os.path.join(obj[0], "tok"), qwen=os.path.join(obj[0], "qwen"))
    if dist.get_rank() == 0:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        tok = _byte_tokenizer(TOKENS)
        assert len(tok) == TOKENS
        tok.save_pretrained(_DIRS["tok"])
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=ROWS, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                          pad_token_id=3)
        Qwen2ForCausalLM(cfg).save_pretrained(_DIRS["qwen"])
        tok.save_pretrained(_DIRS["qwen"])
    dist.barrier()


def _record(original):
    def sample(logits, params, *, tp_group=None, sample_ids=None, step=0, **kw):
        tok = original(logits, params, tp_group=tp_group, sample_ids=sample_ids, step=step, **kw)
        parts = [logits.float()]
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            parts = [torch.empty_like(parts[0]) for _ in range(dist.get_world_size(tp_group))]
            dist.all_gather(parts, logits.float().contiguous(), group=tp_group)
        n = logits.shape[0]
        steps = torch.as_tensor(step, device=logits.device).expand(n)
        RECORDS.append((sample_ids.clone(), steps.clone(), tok.clone(), torch.cat(parts, dim=-1)))
        return tok
    return sample


def _bias_unused_rows(engine, scale=0.3):
    """Random output rows of norm ~ scale * sqrt(hidden) for every id >= TOKENS: the unmasked
    softmax then puts most of its mass on ids the tokenizer does not have."""
    m = engine.module
    if m is None or not engine.layout.is_last_stage:
        return
    w = m.output_layer.weight if m.output_layer.weight is not None else m.embedding.word_embeddings.weight
    start = engine.layout.t * w.shape[0]
    ids = torch.arange(start, start + w.shape[0])
    unused = ids >= TOKENS
    g = torch.Generator().manual_seed(11 + start)
    with torch.no_grad():
        w[unused] = (scale * torch.randn(int(unused.sum()), w.shape[1], generator=g)).to(w.dtype)


def _run(argv, tokenizer_dir, after=None):
    from puzzle.dataflow.trainer import PPOTrainer

    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_dir)
    cfg = validate_args(parse_args(COMMON + ["--tokenizer-model", tokenizer_dir] + argv), dist.get_world_size(),
                        tok.vocab_size)
    ds = load_prompt_dataset(bundled_prompts_path(), tok, max_prompt_len=cfg.ppo.max_prompt_length)
    trainer = PPOTrainer(cfg, tok, ds)
    for role in ("actor", "ref"):
        _bias_unused_rows(trainer.engines[role])
    batches, metrics = [], []
    score = trainer.scoring.run
    def scored(batch, iteration):  # the batch with the scored fields, as the trainer builds it
        fields, stats = score(batch, iteration)
        batches.append(batch.with_outputs("scoring", **{k: v for k, v in fields.items() if k != "scores"}))
        return fields, stats

    trainer.scoring.run = scored
    original = pipelined_generation.sample_tokens
    pipelined_generation.sample_tokens = _record(original)
    n = cfg.ppo.rollout_batch_size
    out = {"arch": [cfg.roles["actor"].arch.vocab_size, cfg.roles["actor"].arch.valid_vocab_size,
                    cfg.roles["actor"].arch.padded_vocab_size]}
    try:
        for i in range(ITERS):
            RECORDS.clear()
            m = trainer.step(ds.prompts[i * n:(i + 1) * n])
            metrics.append(m)
            out[f"iter{i}"] = _compare(RECORDS, batches[-1], TEMPERATURE)
        if after is not None:
            out.update(after(trainer, ds.prompts[:n]))
    finally:
        pipelined_generation.sample_tokens = original
        trainer.close()
    keys = ("reward_mean", "kl", "entropy", "policy_loss", "approx_kl", "actor_grad_norm", "kl_loss", "value_loss",
            "gen_score_logprob_diff_max", "gen_score_logprob_diff_mean", "is_weight_mean", "is_truncated_frac")
    out["metrics"] = [{k: m[k] for k in keys if k in m} for m in metrics]
    masks = [b.response_mask.bool() for b in batches]
    out["finite"] = {k: all(bool(torch.isfinite(b.fields[k][m]).all()) for b, m in zip(batches, masks))
                     for k in ("old_logprobs", "ref_logprobs", "entropy") if k in batches[0].fields}
    out["max_response_id"] = max(int(_responses(b)[m].max()) for b, m in zip(batches, masks))
    return out


def _responses(batch):
    """[B, R] response tokens (pad after each response)."""
    R = batch.max_new_tokens
    k = torch.arange(R).unsqueeze(0)
    idx = (batch.prompt_lengths.unsqueeze(1) + k).clamp(max=batch.tokens.shape[1] - 1)
    return batch.tokens.gather(1, idx)


def _compare(records, batch, temperature):
    """Max |log p_sampling(token) - old log-prob| over every recorded sampled token of ``batch``;
    the mean probability the unmasked logits put on the unused rows; how many were compared."""
    resp, lengths = _responses(batch), batch.response_lengths
    old, recorded = batch.fields["old_logprobs"], batch.fields["gen_logprobs"]
    gap, recorded_gap, mass, compared, mismatched = 0.0, 0.0, [], 0, 0
    for sids, steps, toks, logits in records:
        live = steps < lengths[sids]  # the whole-step path also samples for finished rows
        sids, steps, toks, logits = sids[live], steps[live], toks[live], logits[live]
        if not len(sids):
            continue
        mismatched += int((resp[sids, steps] != toks).sum())
        x = logits / temperature
        mass += torch.softmax(x[:, :ROWS], dim=-1)[:, TOKENS:].sum(dim=-1).tolist()
        lp = torch.log_softmax(x[:, :TOKENS], dim=-1)
        picked = lp.gather(1, toks.clamp(max=TOKENS - 1).unsqueeze(1)).squeeze(1)
        picked = torch.where(toks < TOKENS, picked, torch.full_like(picked, -math.inf))
        gap = max(gap, float((picked - old[sids, steps]).abs().max()))
        recorded_gap = max(recorded_gap, float((picked - recorded[sids, steps].double()).abs().max()))
        compared += len(sids)
    return {"gap": gap, "recorded_gap": recorded_gap, "compared": compared, "mismatched": mismatched,
            "unused_mass": sum(mass) / max(len(mass), 1)}


def _graph_path(trainer, prompts):
    """The --cuda-graph-generation whole-step decode (static shapes, no capture on CPU) samples the
    same tokens as the eager loop on the switch's (1,2,2) shadow model, all of them tokenizer ids."""
    from puzzle.rollout.cuda_graphs import DecodeGraphs
    from puzzle.rollout.generation import generate
    from puzzle.rollout.sampling import SamplingParams

    engine = trainer.switch.generation_engine()
    if not engine.member:
        return {"graph": None}
    tok = trainer.tokenizer
    params = SamplingParams(max_new_tokens=8, temperature=TEMPERATURE, eos_id=tok.eos_id, pad_id=tok.pad_id)
    D, d = engine.layout.plan.D, engine.layout.d
    share = len(prompts) // D
    mine = prompts[d * share:(d + 1) * share]
    RECORDS.clear()
    eager = generate(engine, mine, params, seed=5, sample_offset=d * share)
    mass = [float(torch.softmax(r[3][:, :ROWS] / TEMPERATURE, -1)[:, TOKENS:].sum(-1).mean()) for r in RECORDS]
    engine.module._puzzle_decode_graphs = DecodeGraphs(engine.module.puzzle_device, capture=False)
    try:
        fused = generate(engine, mine, params, seed=5, sample_offset=d * share, cuda_graphs=True)
        whole_step = len(engine.module._puzzle_decode_graphs.fused)
    finally:
        del engine.module._puzzle_decode_graphs
    past = torch.arange(8).unsqueeze(0) >= fused.response_lengths.unsqueeze(1)
    return {"graph": {"same_tokens": bool(torch.equal(eager.response_tokens, fused.response_tokens)),
                      "logprob_gap": float((eager.logprobs - fused.logprobs).abs().max()),
                      "logprobs_past_response": float(fused.logprobs[past].abs().sum()),
                      "max_id": int(fused.response_tokens[~past].max()),
                      "whole_step_settings": whole_step, "unused_mass": sum(mass) / len(mass),
                      "T": engine.layout.plan.T, "P": engine.layout.plan.P}}


def check_runs():
    """(1,1,1) on a 1-rank world (a model must span the world: megatron's optimizer gathers its
    parameter groups over all ranks), (2,1,2) on a 4-rank one."""
    _make_dirs()
    qwen = ["--hf-actor-path", _DIRS["qwen"]]
    if dist.get_world_size() == 1:
        return {"ppo_flags_111": _run(FLAGS_MODEL + PPO, _DIRS["tok"]),
                "grpo_hf_111": _run(qwen + GRPO, _DIRS["qwen"])}
    return {"ppo_hf_212": _run(qwen + PPO + L212, _DIRS["qwen"]),
            "grpo_flags_212": _run(FLAGS_MODEL + GRPO + L212 + [
                "--actor-gen-tensor-model-parallel-size", "2", "--actor-gen-pipeline-model-parallel-size", "1",
                "--rl-inference-logprobs-is-correction", "--rl-importance-sampling-truncation-coef", "2"],
                _DIRS["tok"], after=_graph_path)}


ADDED_PAD_PROMPTS = ["hello world", "The quick brown fox"]
ADDED_PAD_NEW = 5


def _qwen2_with_added_pad(root):
    """Rank 0: a transformers-made Qwen2 of 301 rows (generation_config.json: eos 299) with a 301-id
    tokenizer declaring no special tokens beside it (AutoTokenizer adds <|endoftext|> as id 301:
    pad, eos, unk), the same with eos_token_id 301 in generation_config.json, the prompts JSONL and
    transformers' greedy tokens of each prompt."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from puzzle.data.tokenizers import HFTokenizer
    from tests.distributed.worlds.hf_import import _randomise
    from tests.unit.test_tokenizer_rows import ROWS as PAD_ROWS, STOP, byte_tokenizer_without_specials

    cfg = Qwen2Config(vocab_size=PAD_ROWS, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=STOP)
    torch.manual_seed(0)
    lm = _randomise(Qwen2ForCausalLM(cfg)).eval()
    for name, eos in (("qwen2", STOP), ("qwen2-eos-beyond", PAD_ROWS)):
        lm.generation_config.eos_token_id = eos
        lm.save_pretrained(os.path.join(root, name))
        byte_tokenizer_without_specials().save_pretrained(os.path.join(root, name))
    tok = HFTokenizer(os.path.join(root, "qwen2"))
    with open(os.path.join(root, "prompts.jsonl"), "w") as f:
        f.writelines(f'{{"prompt": "{p}"}}\n' for p in ADDED_PAD_PROMPTS)
    greedy = []
    for p in ADDED_PAD_PROMPTS:
        ids = torch.tensor([tok.encode(p)])
        out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=ADDED_PAD_NEW,
                          do_sample=False, eos_token_id=STOP, pad_token_id=STOP)
        greedy.append(out[0, ids.shape[1]:].tolist())
    return {"ids": tok.vocab_size, "pad": [tok.tok.pad_token, tok.tok.pad_token_id], "greedy": greedy}


def check_added_pad():
    """puzzle.tools.generate from the Qwen2 checkpoint whose tokenizer has an id (its pad) beyond the
    301 rows, at (1,1,1) on 1 rank, (2,1,2) on 4 ranks: its tokens against transformers' greedy ones
    and the largest id fed to the word embeddings; then the same checkpoint with eos 301 is refused.
    On 1 rank also a PPO iteration with right-padded rows and exactly 301 embedding rows (the pad
    301 fed there raised IndexError): padding feeds the eos id."""
    import contextlib
    import io
    import json

    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    from puzzle.tools.generate import main as generate_main

    box = [tempfile.mkdtemp(prefix="puzzle-added-pad-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    root = box[0]
    made = [_qwen2_with_added_pad(root) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, src=0)
    layout = [] if dist.get_world_size() == 1 else L212
    fed = [0]
    original = VocabParallelEmbedding.forward

    def recording(self, input_, *args, **kwargs):
        fed[0] = max(fed[0], int(input_.max()))
        return original(self, input_, *args, **kwargs)

    common = ["--prompts", os.path.join(root, "prompts.jsonl"), "--greedy", "--max-new-tokens", str(ADDED_PAD_NEW)] + layout
    VocabParallelEmbedding.forward = recording
    try:
        rc = generate_main(["--load", os.path.join(root, "qwen2"), "--output", os.path.join(root, "out.jsonl")]
                           + common)
    finally:
        VocabParallelEmbedding.forward = original
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        refused = generate_main(["--load", os.path.join(root, "qwen2-eos-beyond"), "--output",
                                 os.path.join(root, "never.jsonl")] + common)
    out = {"made": made[0], "rc": rc, "max_fed_id": fed[0], "refused_rc": refused, "refusal": err.getvalue()}
    if dist.get_world_size() == 1:  # a PPO step with padded rows and exactly 301 embedding rows
        from tests.harness import train_in_world

        qwen2 = os.path.join(root, "qwen2")
        fed[0] = 0
        VocabParallelEmbedding.forward = recording
        try:
            run = train_in_world(["--seq-length", "48", "--micro-batch-size", "2", "--rollout-batch-size", "4",
                                  "--global-batch-size", "4", "--max-new-tokens", "8", "--train-iters", "1",
                                  "--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction",
                                  "--reward-timeout", "0", "--hf-actor-path", qwen2, "--tokenizer-type", "HuggingFaceTokenizer",
                                  "--tokenizer-model", qwen2, "--make-vocab-size-divisible-by", "1",
                                  "--no-use-remove-padding", "--init-random"])
        finally:
            VocabParallelEmbedding.forward = original
        out["ppo"] = {"iterations": len(run["rows"]), "max_fed_id": fed[0]}
    if dist.get_rank() == 0:
        out["tokens"] = [json.loads(line)["tokens"] for line in open(os.path.join(root, "out.jsonl"))]
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return out


if __name__ == "__main__":
    world_main([("runs", check_runs), ("added_pad", check_added_pad)])
