"""``--impl ar.fake=parity_adapters.ar:hunyuan_image3_rollout``: flowstage's AR stage drives HunyuanImage-3 only
(the CPU tier's ``fake`` model is the HunyuanImage-3 upstream fake)."""

from __future__ import annotations

from flowstage.hunyuan_ar import ARPromptBatch, HunyuanImage3ARStage

from harness.ar.loop import Rollout
from harness.plugins.declarations import ARDeclaration


def rollout_with(stage_class: type):
    def fast_rollout(backend, batch, max_new_tokens, eos=()):
        if batch.real_pos is None:
            raise ValueError("flowstage's AR stage needs tokenizer_output.real_pos (each row's unpadded length)")
        stage = stage_class(backend.model)
        run = stage.rollout(ARPromptBatch(batch.input_ids, batch.position_ids, batch.attention_mask,
                                          batch.real_pos.reshape(-1)), max_new_tokens=max_new_tokens, eos_ids=eos)
        return Rollout(run.tokens, run.logp, run.logits, run.lengths, run.real_pos, run.kv_rows())
    return fast_rollout


hunyuan_image3_rollout = rollout_with(HunyuanImage3ARStage)
hunyuan_image3_rollout.declares = ARDeclaration(models=("fake",), padding_side="right")
