import pytest

from puzzle.arguments import ArgumentError, parse_args, validate_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--disable-bias-linear", "--micro-batch-size", "2", "--rollout-batch-size", "8",
        "--max-new-tokens", "16", "--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction"]


def cfg(*extra, world=4, vocab=259):
    return validate_args(parse_args(BASE + list(extra)), world, vocab)


def test_layouts_and_role_overrides():
    c = cfg("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--critic-tensor-model-parallel-size", "1", "--critic-num-layers", "4",
            "--actor-gen-tensor-model-parallel-size", "4", "--actor-gen-pipeline-model-parallel-size", "1")
    assert (c.roles["actor"].plan.P, c.roles["actor"].plan.D, c.roles["actor"].plan.T) == (2, 1, 2)
    assert (c.roles["actor"].gen_plan.P, c.roles["actor"].gen_plan.T) == (1, 4)
    critic = c.roles["critic"].plan  # P follows the actor unless overridden
    assert (critic.P, critic.D, critic.T) == (2, 2, 1)
    assert c.roles["critic"].arch.num_layers == 4 and c.roles["ref"].arch.num_layers == 2
    assert "reward" not in c.roles and c.roles["actor"].trainable and not c.roles["ref"].trainable
    assert c.ppo.max_prompt_length == 48


def test_later_flags_override_and_no_abbreviations():
    c = cfg("--lr", "1e-3", "--lr", "2e-3")
    assert c.optim.lr == 2e-3
    with pytest.raises(ArgumentError, match="unrecognized arguments: --rollout-batch"):
        parse_args(BASE + ["--rollout-batch", "8"])


@pytest.mark.parametrize("extra, flag", [
    (["--critic-num-layers", "3", "--critic-pipeline-model-parallel-size", "2"], "--critic-tensor-model-parallel-size"),
    (["--global-batch-size", "3"], "--global-batch-size"),
    (["--micro-batch-size", "4", "--rollout-batch-size", "8", "--global-batch-size", "8"], "--global-batch-size"),
    (["--max-new-tokens", "70"], "--max-new-tokens"),
    (["--max-prompt-length", "60"], "--max-new-tokens"),
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size"),
    (["--top-p", "1.5"], "--top-p"),
    (["--reward-fn", "no_colon"], "--reward-fn"),
    (["--bf16", "--fp16"], "--bf16/--fp16"),
    (["--ranks-per-node", "3"], "--ranks-per-node"),
    (["--actor-gen-tensor-model-parallel-size", "8"], "--actor-gen-tensor-model-parallel-size"),
    (["--actor-data-parallel-size", "1", "--critic-data-parallel-size", "2"], "--actor-data-parallel-size"),
])
def test_bad_flags_name_the_flag(extra, flag):
    with pytest.raises(ArgumentError) as e:
        cfg(*extra)
    assert str(e.value).startswith(flag), str(e.value)


def test_two_reward_sources_are_refused():
    with pytest.raises(ArgumentError, match="--reward-fn: give one reward source"):
        cfg("--reward-model", "random")


def test_missing_reward_source():
    args = [a for a in BASE if a not in ("--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction")]
    with pytest.raises(ArgumentError, match="--reward-fn: no reward source"):
        validate_args(parse_args(args), 4, 259)


def test_unknown_role_flag_is_rejected():
    with pytest.raises(ArgumentError, match="unrecognized arguments: --policy-num-layers"):
        parse_args(BASE + ["--policy-num-layers", "2"])


def test_model_shape_error_names_role():
    with pytest.raises(ArgumentError, match="critic"):
        cfg("--critic-hidden-size", "66")


def test_time_sharing_needs_equal_layouts():
    with pytest.raises(ArgumentError, match="--train-placement: time-sharing requires equal P"):
        cfg("--pipeline-model-parallel-size", "2", "--critic-pipeline-model-parallel-size", "1",
            "--train-placement", "time-sharing")
    c = cfg("--train-placement", "time-sharing", "--score-placement", "time-sharing")
    assert c.train_placement == "time-sharing"
    # equal P at another (D, T) on the same ranks: one stream (puzzle.parallel.streams)
    c = cfg("--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
            "--critic-tensor-model-parallel-size", "1", "--ref-tensor-model-parallel-size", "1",
            "--train-placement", "time-sharing", "--score-placement", "time-sharing")
    assert [(c.roles[r].plan.D, c.roles[r].plan.T) for r in ("actor", "critic", "ref")] == [(1, 2), (2, 1), (2, 1)]
    # experts split at another plan: refused, naming the models and the plans
    moe = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--critic-expert-model-parallel-size", "4"]
    with pytest.raises(ArgumentError, match=r"--train-placement: time-sharing of actor and critic: experts split"
                                            r".*actor \(P=1, D=4, T=1, E=2\).*critic \(P=1, D=4, T=1, E=4\)"):
        cfg(*moe, "--train-placement", "time-sharing")


def test_disjoint_placement_layouts():
    c = cfg("--critic-rank-offset", "2", "--critic-data-parallel-size", "2", "--critic-tensor-model-parallel-size", "1",
            "--actor-data-parallel-size", "2", "--ref-data-parallel-size", "2",
            "--train-placement", "disjoint", "--score-placement", "disjoint")
    assert c.roles["critic"].plan.ranks == [2, 3] and c.roles["actor"].plan.ranks == [0, 1]
    assert c.roles["actor"].gen_plan.ranks == [0, 1]
    with pytest.raises(ArgumentError, match="--train-placement: disjoint placement needs models on disjoint"):
        cfg("--train-placement", "disjoint")
    with pytest.raises(ArgumentError, match="partly overlap"):
        cfg("--critic-rank-offset", "2", "--critic-data-parallel-size", "2", "--train-placement", "disjoint")
    with pytest.raises(ArgumentError, match="--critic-tensor-model-parallel-size.*outside the world"):
        cfg("--critic-rank-offset", "4")


def test_transformer_impl_and_sequence_parallel_on_cpu():
    c = cfg()  # Megatron-LM's default impl, resolved to local where TE cannot run, and said so
    assert c.transformer_impl == "local" and "using the local implementation" in c.transformer_impl_note
    assert cfg("--transformer-impl", "local").transformer_impl_note is None
    assert cfg("--sequence-parallel").sequence_parallel  # T=1 everywhere: accepted, a no-op
    with pytest.raises(ArgumentError, match=r"^--sequence-parallel: needs --transformer-impl transformer_engine"):
        cfg("--sequence-parallel", "--tensor-model-parallel-size", "2")
    with pytest.raises(ArgumentError, match="argument --transformer-impl: invalid choice: 'te'"):
        parse_args(BASE + ["--transformer-impl", "te"])
