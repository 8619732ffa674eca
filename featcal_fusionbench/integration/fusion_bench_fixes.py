"""FusionBench 0.2.33 method classes that fail as shipped, each fixed by the smallest subclass, named by the config
that replaces FusionBench's (``config_fixes/method/...``, docs/compatibility.md: "FusionBench configs we override").
Nothing else of the class changes; delete a fix once a FusionBench release ships the class working
(tests/test_fusion_bench_fixes.py says when)."""

from __future__ import annotations

from bidict import bidict
from fusion_bench.method import RegMeanAlgorithmForCLIPPlusPlus as _ShippedRegMeanForCLIPPlusPlus
from fusion_bench.method.regmean_plusplus.regmean_plusplus import RegMeanAlgorithmPlusPlus


class RegMeanAlgorithmForCLIPPlusPlus(_ShippedRegMeanForCLIPPlusPlus):
    """FusionBench's RegMean++ for CLIP, constructible. Its parent is decorated with ``auto_register_config``, whose
    wrapped ``__init__`` looks each argument up in ``type(self)._config_mapping.inverse``; the shipped class sets a
    plain dict holding only ``_dataloader_kwargs``, so construction fails (``'dict' object has no attribute
    'inverse'``). Here the mapping is the parent's with that entry added, as a bidict."""

    _config_mapping = bidict({**RegMeanAlgorithmPlusPlus._config_mapping,
                              **vars(_ShippedRegMeanForCLIPPlusPlus)["_config_mapping"]})
