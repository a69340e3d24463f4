"""The RL dataflow of one run: ``PPOTrainer`` (trainer.py) owns the loop and calls the five stages
in order, each an object that owns its part and its data movement:

    generate    generation_stage.py   the actor in its generation layout -> the world's RolloutBatch
    reward      reward_stage.py       Rewards: the one owner of the sequence scores
    score       scoring_stage.py      old log-probs, reference log-probs, values, reward-model scores
    advantages  advantage_stage.py    KL-penalised rewards and the --advantage-estimator (pure math
                                      from puzzle.algorithms) with the KL controller's state
    train       training_stage.py     actor and critic updates, then the switch (actor_switch.py)

The rollout batch (batch.py: typed fields, each written by one stage), micro-batching
(micro_batching.py: balancing, token budgets, packing once per iteration, gathering; token_budget.py), the stages' forward steps and loss functions (steps.py) and evaluation on
held-out prompts (evaluation.py) live here too. The model engines they drive are puzzle.engine.
"""
