"""Where query texts and label files come from: OAI's public files cached locally, else Hugging Face stand-ins.

OAI's datasets/{books,tldr,cnndm}.py and its label sources (launch.py labels.source) download files once from OpenAI's
public blob storage into a local cache. We do the same (`download_cached`); when a file cannot be fetched (some were
lost in OpenAI's storage migration, or there is no network) the task falls back, announced once, to a Hugging Face
stand-in reshaped into OAI-like text. Environment: LHPD_OAI_URL (base URL, e.g. a mirror), LHPD_CACHE (cache folder).
https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/datasets/books.py#L7-L11
"""

import http.client
import json
import logging
import os
import re
import shutil
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ftfy

from lm_human_preference_details.hub import HubUnavailableError, check_available

logger = logging.getLogger(__name__)

OAI_URL = "https://openaipublic.blob.core.windows.net/lm-human-preferences/"
"""OpenAI's public storage of the lm-human-preferences data (datasets/*.py, launch.py labels.source)."""
OAI_URL_ENV = "LHPD_OAI_URL"
"""Environment variable overriding OAI_URL (a mirror holding the same paths)."""
CACHE_ENV = "LHPD_CACHE"
"""Environment variable naming the download cache folder (default ~/.cache/lm_human_preference_details)."""
DOWNLOAD_TIMEOUT = 10.0
"""Seconds to wait for a connection or for the next bytes of a download."""

BOOKS_ROWS_PER_PASSAGE = 8
"""HF bookcorpus sentences (consecutive rows) joined into one passage of the books stand-in."""
HUB_TEXT_SOURCES = {
    "books": ("bookcorpus/bookcorpus", None, "text"),
    "tldr": ("CarperAI/openai_summarize_tldr", None, "prompt"),
    "cnndm": ("abisee/cnn_dailymail", "3.0.0", "article"),
}
"""query_dataset name -> (HF hub dataset id, config name, text column) of its stand-in."""

_announced: set[str] = set()


class SourceUnavailableError(RuntimeError):
    """A file could not be downloaded (no network, gone, timed out) and is not in the local cache."""


def announce_once(key: str, message: str) -> None:
    """logger.warning(message) the first time `key` is seen in this process."""
    if key not in _announced:
        _announced.add(key)
        logger.warning(message)


# ---------------------------------------------------------------- download cache


def oai_url(path: str) -> str:
    """The URL of `path` (e.g. 'labels/sentiment/offline_5k.json') under OAI's storage, or LHPD_OAI_URL."""
    base = os.environ.get(OAI_URL_ENV) or OAI_URL
    return base.rstrip("/") + "/" + path.lstrip("/")


def cache_dir() -> str:
    """The download cache folder: LHPD_CACHE, else ~/.cache/lm_human_preference_details."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "lm_human_preference_details")


def cached_path(url: str, folder: str | None = None) -> str:
    """Where `url` is (or will be) cached: FOLDER/HOST/PATH."""
    parts = urllib.parse.urlsplit(url)
    host = parts.netloc.replace(":", "_")
    return os.path.join(folder or cache_dir(), host, *[p for p in parts.path.split("/") if p not in ("", ".", "..")])


def download_cached(url: str, folder: str | None = None, timeout: float = DOWNLOAD_TIMEOUT) -> str:
    """Local path of `url`, downloaded into the cache on first use (atomically: a failed download leaves nothing)."""
    # OAI: download once into a local cache, later runs read the cached file (books.py#L10, tldr.py#L17)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/datasets/tldr.py#L13-L18
    path = cached_path(url, folder)
    if os.path.isfile(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # one per process: ranks downloading at once never share a partial file
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as f:
            shutil.copyfileobj(response, f, 1 << 20)
            expected = response.headers.get("Content-Length")
            if expected is not None and f.tell() != int(expected):  # the connection closed early
                raise OSError(f"incomplete download: {f.tell()} of {expected} bytes")
        os.replace(tmp, path)
    except (OSError, http.client.HTTPException, ValueError) as e:  # URLError and timeouts are OSErrors
        reason = f"HTTP {e.code} {e.reason}" if isinstance(e, urllib.error.HTTPError) else getattr(e, "reason", e)
        raise SourceUnavailableError(
            f"could not download {url} ({reason or type(e).__name__}); download it where there is network and put it "
            f"at {path} (or set {CACHE_ENV} to a folder laid out the same way)."
        ) from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


# ---------------------------------------------------------------- text cleaning


def clean_tldr_text(text: str) -> str:
    """OAI's tldr post cleaning: ftfy, three or more newlines collapsed to two, stripped."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/datasets/tldr.py#L24-L29
    return re.sub(r"\n{3,}", "\n\n", ftfy.fix_text(text)).strip()


def clean_tldr_post(text: str) -> str:
    """A post of HF's TL;DR prompts: its trailing 'TL;DR:' dropped (the task suffix adds it), then OAI's cleaning."""
    return clean_tldr_text(re.sub(r"\s*TL;DR:\s*$", "", text))


# OAI's UPDATED header pattern ends in "[2011|2012|2013|2014|2015]", a character class: one of 0-5 or "|"
_UPDATED_RE = re.compile(r".*UPDATED:\s+[0-9]{2}:[0-9]{2}.*[012345|]")


def clean_cnndm_story(text: str) -> str:
    """OAI's CNN/DM story cleaning: clean_up_start, ftfy, newlines collapsed, cut at the first @highlight."""
    # clean_up_start: a text starting with "By" loses its first two lines; everything before "(CNN) --" (anywhere) or
    # "(CNN)" (in the first 100 characters) goes; a leading "and WORD" line goes; everything up to the last
    # "UPDATED: hh:mm ...<date>" header goes; curly single quotes are straightened
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/datasets/cnndm.py#L70-L79
    if text[:2] == "By":
        text = "\n".join(text.split("\n")[2:])
    text = re.split(r"\(CNN\) +--", text)[-1]
    text = re.split(r"\(CNN\)", text[:100])[-1] + text[100:]
    text = re.sub(r"^and \w+\n", "", text)
    text = _UPDATED_RE.split(text)[-1]
    text = text.replace("\u2019", "'").replace("\u2018", "'").strip()
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/datasets/cnndm.py#L97-L102
    text = re.sub(r"\n{3,}", "\n\n", ftfy.fix_text(text))
    return text.split("@highlight")[0].strip()


# a period added by HF's fix_missing_period to a story line without end punctuation: " ." after a word
_ADDED_PERIOD_RE = re.compile(r"(?<=\S) \.(?: +|$)")
# a sentence end followed by a capitalized (possibly quoted) next sentence
_SENTENCE_END_RE = re.compile(r"([.!?][\"'\u2019\u201d)]*) +(?=[\"'\u2018\u201c(]?[A-Z0-9])")
_ABBREVIATIONS = {"Mr", "Mrs", "Ms", "Dr", "St", "Jr", "Sr", "Gen", "Sen", "Rep", "Gov", "Lt", "Col", "Sgt", "Capt"}
_ABBREVIATIONS |= {"Prof", "Rev", "Inc", "Co", "Corp", "Ltd", "No", "vs", "Mt", "Ft", "U.S", "U.K", "U.N", "a.m", "p.m"}


def _paragraph_break(match: re.Match) -> str:
    """A paragraph break after a sentence end, unless the period ends an abbreviation or an initial."""
    word = re.search(r"[\w.]*$", match.string[max(0, match.start() - 12) : match.start()]).group(0)
    if match.group(1) == "." and (word in _ABBREVIATIONS or re.fullmatch(r"[A-Z]", word)):
        return match.group(0)
    return match.group(1) + "\n\n"


def restore_cnndm_paragraphs(article: str) -> str:
    """An HF CNN/DM article (one line) in the story files' shape: paragraphs separated by a blank line."""
    # DEVIATION (cnndm-stand-in): HF's articles join the story's paragraphs with spaces; a paragraph is restored at
    # every period HF added to a line without end punctuation (" ." after a word: bylines, datelines, captions) and
    # after every sentence (most paragraphs of these news stories are one sentence long), so the cnndm preset's end_text
    # '\n' ends queries at a paragraph end as on OAI's story files
    text = _ADDED_PERIOD_RE.sub("\n\n", article.strip())
    return _SENTENCE_END_RE.sub(_paragraph_break, text).strip()


def clean_cnndm_article(article: str) -> str:
    """An HF CNN/DM article turned into OAI's cleaned story text: paragraphs restored, then OAI's cleaning."""
    return clean_cnndm_story(restore_cnndm_paragraphs(article))


# PTB-style tokens of HF bookcorpus -> plain text
_BOOKCORPUS_DETOKENIZE = (
    (re.compile(r"``\s*"), '"'),  # opening quote
    (re.compile(r"\s*''"), '"'),  # closing quote
    (re.compile(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", re.IGNORECASE), r"\1"),  # contractions: "did n't" -> "didn't"
    (re.compile(r"\s+([.,!?;:%)\]}]+)"), r"\1"),  # no space before closing punctuation
    (re.compile(r"([(\[{$])\s+"), r"\1"),  # no space after opening brackets
    (re.compile(r"(?<![\w'])i(?=[\s'.,!?;:]|$)"), "I"),  # the pronoun "i"
    # a row is a sentence: capitalize its first letter (after an opening quote) and any after an unquoted "." "!" "?"
    (re.compile(r"(^\"?|(?<!\.)[.!?] +)([a-z])"), lambda m: m.group(1) + m.group(2).upper()),
)


def detokenize_bookcorpus(text: str) -> str:
    """An HF bookcorpus row (lower-cased, space-tokenized, `` '' quotes) as plain prose with sentence capitals."""
    # DEVIATION (books-stand-in): OAI's book passages are plain prose; HF bookcorpus is tokenized ("he said ." ends in
    # token 764, not '.' = 13), so it is detokenized and sentence starts and "I" capitalized (other capitals are lost)
    text = text.strip()
    for pattern, replacement in _BOOKCORPUS_DETOKENIZE:
        text = pattern.sub(replacement, text)
    return text


# ---------------------------------------------------------------- lazy text sequences


class HubTexts(Sequence):
    """Lazy texts of an HF dataset column: each row cleaned, `rows_per_text` consecutive rows joined by a space."""

    def __init__(
        self, dataset: Any, column: str, clean: Callable[[str], str] | None = None, rows_per_text: int = 1
    ) -> None:
        self.dataset = dataset.select_columns([column])
        self.column = column
        self.clean = clean
        self.rows_per_text = rows_per_text

    def __len__(self) -> int:
        return len(self.dataset) // self.rows_per_text

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.take(range(*index.indices(len(self))))
        if not -len(self) <= index < len(self):
            raise IndexError(f"text {index} out of range for {len(self)} texts")
        return self.take([index % len(self)])[0]

    def take(self, indices: Sequence[int]) -> list[str]:
        """The (cleaned) texts at `indices`, their rows read in one batched lookup."""
        k = self.rows_per_text
        rows = self.dataset[[int(i) * k + j for i in indices for j in range(k)]][self.column]
        rows = [self.clean(row) for row in rows] if self.clean is not None else rows
        return [" ".join(rows[n : n + k]) for n in range(0, len(rows), k)] if k > 1 else rows


class CleanedTexts(Sequence):
    """Raw texts cleaned one at a time when read (cleaning a whole dataset up front takes minutes)."""

    def __init__(self, texts: Sequence[str], clean: Callable[[str], str]) -> None:
        self.texts = texts
        self.clean = clean

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.clean(t) for t in self.texts[index]]
        return self.clean(self.texts[index])


# ---------------------------------------------------------------- OAI's files and the stand-ins


def not_utf8_error(path: str, what: str, flag: str, error: UnicodeDecodeError) -> ValueError:
    """The ValueError for a file that is not UTF-8 text: its first bad byte, line and offset, and the fix."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        data.decode("utf-8")
        start, reason = error.start, error.reason  # decoded whole: the error came from a chunk boundary
    except UnicodeDecodeError as e:
        start, reason = e.start, e.reason
    line = data.count(b"\n", 0, start) + 1
    byte = f"byte 0x{data[start]:02x}" if start < len(data) else "the last bytes"
    return ValueError(
        f"{what} '{path}' is not UTF-8 text ({byte} at line {line}, offset {start}: {reason}); save it as UTF-8 "
        f"(e.g. iconv -f latin1 -t utf-8 '{path}' > new{os.path.splitext(path)[1]}) and pass that file as {flag}."
    )


def read_utf8(path: str, what: str, flag: str) -> str:
    """The content of a UTF-8 text file; ValueError naming the file, the bad byte's line and `flag` when it is not
    UTF-8 (Latin-1, UTF-16, a binary file)."""
    with open(path, encoding="utf-8") as f:
        try:
            return f.read()
        except UnicodeDecodeError as e:
            raise not_utf8_error(path, what, flag, e) from e


def read_utf8_lines(path: str, what: str, flag: str) -> Iterator[str]:
    """The lines of a UTF-8 text file, one at a time, as `read_utf8` reads it."""
    with open(path, encoding="utf-8") as f:
        try:
            yield from f
        except UnicodeDecodeError as e:
            raise not_utf8_error(path, what, flag, e) from e


def read_jsonl_texts(path: str) -> list[str]:
    """The bare JSON string, or the `text` field, of every non-blank row of a .jsonl file."""
    texts = []
    for lineno, line in enumerate(read_utf8_lines(path, "query dataset file", "--task.query_dataset"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path} line {lineno}: invalid JSON ({e}); write one {{'text': ...}} object per line."
            ) from e
        # OAI's book_passages/*.jsonl rows are bare JSON strings (books.py#L8-L11); other rows need a "text" field
        text = row.get("text") if isinstance(row, dict) else row
        if not isinstance(text, str):
            raise ValueError(
                f"{path} line {lineno}: expected a JSON string or an object with a 'text' string, "
                f"got {line.strip()[:80]!r}."
            )
        texts.append(text)
    return texts


def _oai_books(split: str) -> Sequence[str]:
    """OAI's book passages, one JSON string per line of book_passages/{split}.jsonl."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/datasets/books.py#L7-L11
    return read_jsonl_texts(download_cached(oai_url(f"datasets/book_passages/{split}.jsonl")))


def _oai_tldr(split: str) -> Sequence[str]:
    """OAI's reddit posts: the `content` of each object of tldr/{split}-subset.json ('test' reads 'valid'), cleaned."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/datasets/tldr.py#L13-L29
    split = "valid" if split == "test" else split
    path = download_cached(oai_url(f"tldr/{split}-subset.json"))
    with open(path, encoding="utf-8") as f:
        try:
            rows = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON ({e}); delete it so that it is downloaded again.") from e
    if not isinstance(rows, list) or not all(isinstance(row, dict) and "content" in row for row in rows[:1]):
        raise ValueError(f"{path}: expected a JSON list of objects with a 'content' field; delete it to re-download.")
    return CleanedTexts([row["content"] for row in rows], clean_tldr_text)


def _oai_cnndm(split: str) -> Sequence[str]:
    """OAI's CNN/DM stories are not a public file: they come from a Google Cloud bucket through gsutil."""
    # DEVIATION (cnndm-stand-in): OAI reads its URL list from the public storage but the story files from
    # gs://lm-human-preferences (gsutil, credentials), so the cnndm task always uses the HF stand-in
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/datasets/cnndm.py#L81-L103
    raise SourceUnavailableError("OAI's CNN/DM stories are in gs://lm-human-preferences (gsutil), not a public file")


OAI_TEXT_SOURCES: dict[str, Callable[[str], Sequence[str]]] = dict(books=_oai_books, tldr=_oai_tldr, cnndm=_oai_cnndm)
"""query_dataset name -> reader of OAI's own file for a split."""


def load_hub_dataset(repo_id: str, config: str | None, split: str) -> Any:
    """One split of an HF hub dataset; HubUnavailableError at once when offline and not cached."""
    check_available(repo_id, "--task.query_dataset", kind="dataset", filename="README.md")
    import datasets

    return datasets.load_dataset(repo_id, config, split=split)


def _hub_texts(name: str, split: str) -> Sequence[str]:
    """The HF stand-in of a query dataset, reshaped into OAI-like texts."""
    repo_id, config, column = HUB_TEXT_SOURCES[name]
    if name == "books":
        # DEVIATION (books-stand-in): HF bookcorpus has one sentence per row; consecutive rows are joined into passages
        # (OAI's are multi-sentence passages, spec G3, and start_text/end_text '.' need two sentence ends)
        dataset = load_hub_dataset(repo_id, config, split)
        return HubTexts(dataset, column, detokenize_bookcorpus, rows_per_text=BOOKS_ROWS_PER_PASSAGE)
    if name == "tldr":
        # DEVIATION (tldr-stand-in): CarperAI's prompts are reddit posts (subreddit, title, post) ending in "TL;DR:",
        # which is stripped because the task suffix adds it; then OAI's cleaning (ftfy, newlines)
        return HubTexts(load_hub_dataset(repo_id, config, split), column, clean_tldr_post)
    split = "validation" if split in ("valid", "val") else split
    return HubTexts(load_hub_dataset(repo_id, config, split), column, clean_cnndm_article)


_STAND_IN_NOTES = {
    "books": f"HF bookcorpus, {BOOKS_ROWS_PER_PASSAGE} consecutive sentences per passage, detokenized",
    "tldr": "HF CarperAI/openai_summarize_tldr prompts, ftfy-cleaned",
    "cnndm": "HF abisee/cnn_dailymail articles with paragraph breaks restored, cleaned as OAI's stories",
}


def load_task_texts(name: str, split: str = "train") -> Sequence[str]:
    """The texts of OAI's query dataset `name`: OAI's file (downloaded once), else its HF stand-in, announced once."""
    try:
        return OAI_TEXT_SOURCES[name](split)
    except SourceUnavailableError as oai_error:
        try:
            texts = _hub_texts(name, split)
        except HubUnavailableError as hub_error:
            repo_id = HUB_TEXT_SOURCES[name][0]
            raise SourceUnavailableError(
                f"query dataset '{name}': {str(oai_error).rstrip('.')}; and its stand-in, hub dataset '{repo_id}', is "
                "unreachable (offline) and not in the HF cache. Run once with network, or pass --task.query_dataset a "
                "local .jsonl/.txt of texts."
            ) from hub_error
        reason = str(oai_error).rstrip(".")
        announce_once(f"texts:{name}", f"query dataset '{name}': {reason}. Using {_STAND_IN_NOTES[name]} instead.")
        return texts
