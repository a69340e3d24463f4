"""Patch: the tied output-layer copy of a pipeline's last stage takes its data-parallel rank from
the model's own DP group when saving a dist checkpoint.

Target: megatron.core.models.common.language_module.language_module.LanguageModule
``tie_embeddings_and_output_weights_state_dict``, checked on megatron-core 0.16.0 and 0.16.1.

Reason: with tied embeddings (Qwen2.5 0.5B-3B, Llama-3.2 1B/3B) and P > 1 the last stage holds a
copy of the word embeddings; megatron marks it as a replica of the first stage's tensor with
``replica_id = (1, 0, parallel_state.get_data_parallel_rank(with_context_parallel=True))``, i.e.
from the GLOBAL parallel_state, which puzzle never initialises (each model has its own process
groups, passed as ``metadata['dp_cp_group']``): ``sharded_state_dict`` raised
"data parallel group with context parallel combined is not initialized". The fix reads the rank
from ``metadata['dp_cp_group']`` (the group megatron already uses for every other tensor of the
same call) and is otherwise megatron's code unchanged. Without a ``dp_cp_group`` in the metadata
the original runs.

Remove when: megatron-core takes that rank from ``metadata['dp_cp_group']``.
"""

from __future__ import annotations

_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.tie_embeddings_and_output_weights_state_dict

    def tie_embeddings_and_output_weights_state_dict(self, sharded_state_dict, output_layer_weight_key,
                                                     first_stage_word_emb_key, metadata={}):
        group = (metadata or {}).get("dp_cp_group")
        if group is None or not self.post_process or self.pre_process or getattr(self, "mtp_process", False):
            return original(self, sharded_state_dict, output_layer_weight_key, first_stage_word_emb_key,
                            metadata)
        from megatron.core.models.common.language_module import language_module as lm

        del sharded_state_dict[output_layer_weight_key]
        sharded_state_dict[output_layer_weight_key] = lm.make_tp_sharded_tensor_for_checkpoint(
            tensor=self.shared_embedding_or_output_weight(), key=first_stage_word_emb_key,
            replica_id=(1, 0, group.rank()), allow_shape_mismatch=True, tp_group=self.tp_group,
            dp_cp_group=group)

    LanguageModule.tie_embeddings_and_output_weights_state_dict = tie_embeddings_and_output_weights_state_dict
    _applied = True
