"""Model pools for saving an upstream merged model in a form `method.merged_model_path` can load.

FusionBench's ``Seq2SeqLMPool`` inherits ``BaseModelPool.save_model``, which writes ``torch.save(state_dict)`` to
a file; FeatCal, Surgery and ProbSurgery load ``merged_model_path`` with the model class's ``from_pretrained``.
``Seq2SeqLMPoolSavingPretrained`` is the same pool that saves with ``save_pretrained`` (a folder). The runner of
the paper's tables selects it for the upstream run only (``modelpool._target_=...``); loading and merging are
FusionBench's own. CLIP's pool already saves with ``save_pretrained``.
"""

from __future__ import annotations

from fusion_bench.modelpool import Seq2SeqLMPool


class Seq2SeqLMPoolSavingPretrained(Seq2SeqLMPool):
    def save_model(self, model, path: str, *args, **kwargs):
        model.save_pretrained(path)
