"""A task read with Hugging Face `datasets`: local ``.jsonl``/``.json``/``.parquet``/``.csv`` files, a
directory of them, a dataset on the Hub, or rows in memory (a `datasets.Dataset`, an `IterableDataset`, a list
of dicts: `grpo.train(train_dataset=...)`).

Each row becomes an `Example` (`to_examples`, TRL's conventions): the prompt column (``prompt`` by default) is
the prompt, text or a conversation (a list of ``{"role", "content"}`` messages, rendered through the chat
template); the answer column (``answer`` by default), if the data has it, the reference answer (converted to
text; a float with an integer value, as CSV files give, is written as an integer; without the column it is
None, and a reward that needs ``answer`` says so); every column but the prompt's reaches the reward functions
as a keyword argument under its own name, and the answer column also as ``answer``.

Held-out examples come from, in order of precedence (give at most one):

- ``eval_path``: a local file or directory (all its data files);
- ``eval_split``: another split of the same Hub dataset, or, for a local directory, the files named after
  that split (``test.jsonl``, ``test-00000-of-00001.parquet``, ``test/…``);
- ``eval_fraction``: that fraction of the training rows, chosen by a stable hash of the prompt text
  (`grpo.tasks.base.in_held_out`): the same prompt always lands on the same side, whatever the seed or the
  row order, and duplicated prompts never straddle the split.

Otherwise the held-out list is empty. `seed` shuffles the training list (as the built-in tasks do); the
held-out list keeps the file order.

Local directories: with ``split="train"`` (the default) and no file named after any split, every data file
in the directory (recursively) is read; otherwise only the files named after the requested split are.

Every problem with the data is a one-line `DataError` naming the file (or Hub dataset) and, for rows, the
1-based row number.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.errors import ConfigError, DataError
from grpo.tasks.base import Example, in_held_out

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""File extension → `datasets` builder."""

# Extensions that mark a path as meant to be a local file even when it does not exist (not a Hub name).
_FILE_LIKE = set(BUILDERS) | {".txt", ".tsv", ".arrow", ".gz", ".zip", ".xz", ".bz2", ".zst", ".xlsx",
                              ".yaml", ".yml", ".jsonl.gz"}
_SPLIT_NAMES = ("train", "test", "validation", "valid", "val", "dev", "eval", "heldout", "held_out")
# Keyword names the reward call itself uses: a column of that name would clash with them.
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids")


@dataclass
class DatasetTask:
    """A task loaded from data files or the Hub: training and held-out examples."""

    name: str
    train: list[Example]
    eval: list[Example]


def load_dataset_task(path, *, prompt_column: str = "prompt", answer_column: str = "answer",
                      image_column: str = "images", split: str = "train", config_name: str | None = None, eval_path=None,
                      eval_split: str | None = None, eval_fraction: float = 0.0, seed: int = 0,
                      name: str | None = None) -> DatasetTask:
    """Load a prompt/answer task from local files or a Hub dataset (see the module docstring). `path` and
    `eval_path` may also be data in memory (`in_memory`): a `datasets.Dataset`, an `IterableDataset` (read to its
    end once, here) or a list of dicts, one per row.

    Example: ``load_dataset_task("data/gsm8k/train.jsonl", prompt_column="question", eval_fraction=0.05)`` reads
    GSM8K rows ``{"question": ..., "answer": "...\\n#### 72"}`` into prompts ``question`` and answers ``answer``.
    """
    _check_arguments(path, prompt_column, answer_column, eval_path, eval_split, eval_fraction)
    columns = (prompt_column, answer_column, image_column)
    local = in_memory(path) or _is_local(path)
    train = _load(path, split, config_name, columns, local=local)
    if eval_path is not None:
        if not in_memory(eval_path) and not _is_local(eval_path):
            raise DataError(f"eval data file {eval_path} does not exist")
        held = _load(eval_path, None, None, columns, local=True)
    elif eval_split is not None:
        if in_memory(path):
            raise ConfigError("eval_split picks a split of a Hub dataset or of a directory; the training data was "
                              "given as an object: give the held-out rows as eval_dataset (or use eval_fraction)")
        held = _load(path, eval_split, config_name, columns, local=local)
    elif eval_fraction > 0:
        held = [e for e in train if in_held_out(_split_key(e), eval_fraction)]
        train = [e for e in train if not in_held_out(_split_key(e), eval_fraction)]
        if not train:
            raise DataError(f"{_source(path)}: every example fell in the held-out fraction {eval_fraction}; "
                            "lower eval_fraction")
        if not held:
            raise DataError(f"{_source(path)}: no example fell in the held-out fraction {eval_fraction} "
                            f"({len(train)} rows); raise eval_fraction or give eval_path")
    else:
        held = []
    random.Random(seed).shuffle(train)
    return DatasetTask(name or ("dataset" if in_memory(path) else _default_name(path, local)), train, held)


def in_memory(data) -> bool:
    """Whether `data` is rows in memory (a `datasets.Dataset`, an `IterableDataset`, a list of dicts), not a path."""
    return not isinstance(data, (str, Path))


def _source(data) -> str:
    """How errors name a data source: its path, or the kind of object it was given as."""
    if not in_memory(data):
        return str(data)
    return f"the data given as a {type(data).__name__}"


def _check_arguments(path, prompt_column, answer_column, eval_path, eval_split, eval_fraction) -> None:
    if not in_memory(path) and (not isinstance(path, str) or not path.strip()):
        raise ConfigError(f"data path must be a file, directory or Hub dataset name, got {path!r}")
    for what, col in (("prompt", prompt_column), ("answer", answer_column)):
        if not isinstance(col, str) or not col:
            raise ConfigError(f"{what} column must be a column name, got {col!r}")
    if prompt_column == answer_column:
        raise ConfigError(f"prompt and answer columns must differ, both are {prompt_column!r}")
    if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) \
            or not 0 <= eval_fraction < 1:
        raise ConfigError(f"eval_fraction must be a number in [0, 1), got {eval_fraction!r}")
    given = [k for k, v in (("eval_path", eval_path), ("eval_split", eval_split),
                            ("eval_fraction", eval_fraction or None)) if v is not None]
    if len(given) > 1:
        raise ConfigError(f"give at most one of eval_path, eval_split and eval_fraction, got {', '.join(given)}")


def _suffix(path: Path) -> str:
    return path.suffix.lower()


def _is_local(path: str) -> bool:
    """Whether `path` names a local file or directory (existing or clearly meant as one) rather than a Hub
    dataset such as ``openai/gsm8k``."""
    p = Path(path).expanduser()
    if p.exists():
        return True
    lowered = path.lower()
    return (path.startswith(("/", ".", "~", "\\")) or any(lowered.endswith(ext) for ext in _FILE_LIKE))


def _default_name(path: str, local: bool) -> str:
    if not local:
        return path
    p = Path(path).expanduser()
    stem = p.stem if p.is_file() or _suffix(p) in BUILDERS else p.name
    if _split_of_name(stem) is not None and p.resolve().parent.name:  # "gsm8k/train.jsonl" → "gsm8k"
        return p.resolve().parent.name
    return stem or path


def _split_key(e: Example) -> str:
    """What decides an example's split: its prompt text, and its images' pixels where it has any (prompts of an
    image data set often share their text)."""
    if not e.images:
        return e.prompt
    h = hashlib.sha256()
    for image in e.images:
        h.update(image.tobytes())
    return e.prompt + h.hexdigest()


# --------------------------------------------------------------------------------------------------------
# reading

def _load(path, split: str | None, config_name: str | None, columns: tuple[str, str, str], *,
          local: bool) -> list[Example]:
    if in_memory(path):
        return to_examples(path, _source(path), columns)
    if not local:
        return to_examples(_read_hub(path, config_name, split or "train"),
                            f"Hub dataset {path!r} split {split!r}", columns)
    out: list[Example] = []
    for file in _local_files(Path(path).expanduser(), split, config_name):
        out.extend(to_examples(_read_file(file), str(file), columns))
    return out


def _names_split(name: str, split: str) -> bool:
    """Whether a file or folder name stands for `split`: ``test``, ``test.jsonl``, ``test-00000-of-00002``,
    ``test_gsm8k.csv``."""
    stem, split = name.lower().split(".", 1)[0], split.lower()
    return stem == split or stem.startswith((split + "-", split + "_"))


def _split_of_name(name: str) -> str | None:
    """The common split (train, test, validation, …) a file or folder name stands for, if any."""
    for s in sorted(_SPLIT_NAMES, key=len, reverse=True):
        if _names_split(name, s):
            return s
    return None


def _local_files(path: Path, split: str | None, config_name: str | None) -> list[Path]:
    """The data files to read at `path`, for `split` (None: every file)."""
    if not path.exists():
        kind = "file" if _suffix(path) in _FILE_LIKE else "file or directory"
        raise DataError(f"data {kind} {path} does not exist")
    if config_name is not None:
        raise ConfigError(f"config_name {config_name!r} applies to Hub datasets only, not to the local "
                          f"path {path}")
    if path.is_file():
        if _suffix(path) not in BUILDERS:
            raise DataError(f"{path}: unsupported file type {path.suffix or '(no extension)'!r}; "
                            f"use {', '.join(BUILDERS)}")
        if split not in (None, "train"):
            raise DataError(f"{path}: split {split!r} needs a Hub dataset or a directory with files named "
                            f"after the split (e.g. {split}.jsonl)")
        return [path]
    files = sorted(f for f in path.rglob("*") if f.is_file() and _suffix(f) in BUILDERS
                   and not any(part.startswith(".") for part in f.relative_to(path).parts))
    if not files:
        raise DataError(f"{path}: no {', '.join(BUILDERS)} files in this directory")
    if split is None:
        return files

    def names(f: Path, test) -> list:
        return [test(part) for part in (f.name, *f.relative_to(path).parts[:-1])]

    chosen = [f for f in files if any(names(f, lambda part: _names_split(part, split)))]
    if chosen:
        return chosen
    known = {s for f in files for s in names(f, _split_of_name) if s}
    if split == "train" and not known:
        return files
    found = sorted(known)
    raise DataError(f"{path}: no data files for split {split!r} (name them {split}.jsonl, {split}-*.parquet or "
                    f"put them in {split}/); splits found: {', '.join(found) if found else 'none'}")


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No progress bars or error logs from `datasets` while reading local files: we raise our own."""
    import datasets
    from datasets.utils import logging as ds_logging

    bars, level = datasets.is_progress_bar_enabled(), ds_logging.get_verbosity()
    datasets.disable_progress_bars()
    ds_logging.set_verbosity(ds_logging.CRITICAL)
    try:
        yield
    finally:
        ds_logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def _reason(e: BaseException) -> str:
    """The innermost cause of an exception, on one line."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _read_file(file: Path):
    import datasets

    try:
        if file.stat().st_size == 0:
            raise DataError(f"{file} is empty")
    except OSError as e:
        raise DataError(f"cannot read {file}: {_reason(e)}") from None
    try:
        with _quiet_datasets():
            return datasets.load_dataset(BUILDERS[_suffix(file)], data_files=[str(file)], split="train")
    except Exception as e:  # noqa: BLE001 - any reader failure is the file's fault here
        reason = _reason(e)
        if any(m in reason for m in ("corresponds to no data", "No columns to parse")) \
                or reason == "StopIteration":  # only a header, [], {} or blank lines
            raise DataError(f"{file} has no rows") from None
        if _suffix(file) == ".jsonl":  # Arrow's message has no line number: find the line
            _check_jsonl(file)
        raise DataError(f"cannot read {file}: {reason}") from None


def _check_jsonl(file: Path) -> None:
    """The first line of a JSONL file that is not a JSON object, as a DataError with its file and line number."""
    with open(file, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))
            except ValueError as e:
                raise DataError(f"{file}:{n}: not valid JSON ({getattr(e, 'msg', e)}, column "
                                f"{getattr(e, 'colno', '?')})") from None
            if not isinstance(row, dict):
                raise DataError(f"{file}:{n}: a line must be a JSON object with the columns, not "
                                f"{type(row).__name__}") from None


def _read_hub(name: str, config_name: str | None, split: str):
    import datasets

    try:
        return datasets.load_dataset(name, config_name, split=split)
    except Exception as e:  # noqa: BLE001
        what = f"{name!r}" + (f" config {config_name!r}" if config_name else "") + f" split {split!r}"
        raise DataError(f"cannot load {what}: it is not a local file or directory, and loading it from the "
                        f"Hub failed with {_reason(e)}") from None


# --------------------------------------------------------------------------------------------------------
# rows → examples

def _answer_text(value: Any) -> str | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    text = str(value)
    return text if text.strip() else None


def _rows(data) -> tuple[list[str], list[dict]]:
    """The column names and the rows (dicts) of a `datasets.Dataset`, an `IterableDataset` (read to its end), a
    pandas DataFrame or a list of dicts (the columns: every key of any row, in order of appearance; a row's
    missing key is None)."""
    if hasattr(data, "to_list") and getattr(data, "column_names", None) is not None:  # a Dataset
        return list(data.column_names), data.to_list()
    if hasattr(data, "to_dict") and hasattr(data, "columns"):  # a pandas DataFrame
        return [str(c) for c in data.columns], data.to_dict("records")
    if isinstance(data, dict) or isinstance(data, (str, bytes)) or not hasattr(data, "__iter__"):
        raise DataError(f"data must be a datasets.Dataset, an IterableDataset, a list of dicts or a path, got a "
                        f"{type(data).__name__}")
    rows = list(data)  # a list, or an IterableDataset read to its end
    columns: dict[str, None] = dict.fromkeys(getattr(data, "column_names", None) or [])
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DataError(f"row {i} of the data is a {type(row).__name__}, not a dict of columns")
        columns.update(dict.fromkeys(row))
    return list(columns), [{c: row.get(c) for c in columns} for row in rows]


def conversation(value: Any) -> list[dict] | None:
    """`value` as a conversational prompt (TRL's format: a list of {"role", "content"} messages with at least one
    user message, each content text or, as vision-language data has it, a list of parts: {"type": "text", "text":
    ...} and {"type": "image"}), or None when it is not one. Keys Arrow filled with None are dropped."""
    if not isinstance(value, (list, tuple)) or not value:
        return None
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value):
        return None
    contents = [_content(m.get("content")) for m in value]
    if None in contents or not any(m["role"] == "user" for m in value):
        return None
    return [{**{k: v for k, v in m.items() if v is not None}, "content": c} for m, c in zip(value, contents)]


def _content(value: Any) -> str | list[dict] | None:
    """A message's content: text, or its list of text and image parts (each without the None-filled keys);
    None if it is neither."""
    if isinstance(value, str):
        return value
    if not isinstance(value, (list, tuple)) or not value:
        return None
    parts = []
    for part in value:
        if not isinstance(part, dict):
            return None
        part = {k: v for k, v in part.items() if v is not None}
        if part.get("type") == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif part.get("type") == "image":
            parts.append({"type": "image"})  # the picture itself comes from the image column
        else:
            return None
    return parts


def _text(content: str | list[dict]) -> str:
    return content if isinstance(content, str) else " ".join(p["text"] for p in content if p["type"] == "text")


def _with_images(chat: list[dict], count: int, where: str) -> list[dict]:
    """A conversation's messages for a row with `count` images: as given when its image parts are as many; with
    none, the images placed first in its first user message (as TRL does); a list content without images becomes
    its text, for a text model's template. A DataError naming the row when the counts differ."""
    parts = sum(1 for m in chat if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image")
    if parts == count:
        if count:
            return chat
        return [{**m, "content": _text(m["content"])} for m in chat]
    if parts:
        raise DataError(f"{where}: the conversation has {parts} image part{'s' * (parts != 1)} for {count} "
                        f"image{'s' * (count != 1)} in the image column")
    first = next(i for i, m in enumerate(chat) if m["role"] == "user")
    content = chat[first]["content"]
    text = [{"type": "text", "text": content}] if isinstance(content, str) else content
    return [*chat[:first], {**chat[first], "content": [{"type": "image"}] * count + text}, *chat[first + 1:]]


def to_examples(ds, source: str, columns: tuple[str, ...]) -> list[Example]:
    """The rows of `ds` (a `datasets.Dataset`, an `IterableDataset` or a list of dicts) as Examples: the prompt
    column is the prompt (text, or a conversation), the answer column (optional) the reference answer as text
    (`Example.answer`, None without the column), and every column but the prompt's reaches the reward functions
    under its own name (the answer column also as `answer`); the image column (optional, the third of `columns`)
    gives the prompt's images (`grpo.images.load_images`). `source` names the data in errors."""
    prompt_column, answer_column, image_column = (*columns, "images")[:3]
    present, rows = _rows(ds)
    if prompt_column not in present:
        hint = (f"; set data.prompt_column={next(c for c in ('question', 'problem') if c in present)}"
                if prompt_column == "prompt" and {"question", "problem"} & set(present)
                else "; data.prompt_column names the prompt's column")
        raise DataError(f"{source}: no prompt column {prompt_column!r}; its columns are "
                        f"{', '.join(repr(c) for c in present) or '(none)'}{hint}")
    clash = [c for c in present if c in RESERVED_COLUMNS]
    if clash:
        raise DataError(f"{source}: column {clash[0]!r} clashes with the reward function argument of that name; "
                        "rename or drop it")
    has_answer = answer_column in present
    if has_answer and answer_column != "answer" and "answer" in present:
        raise DataError(f"{source}: the answer column {answer_column!r} reaches the rewards also as 'answer', and the "
                        "data has another column named 'answer'; rename or drop one of them")
    if not rows:
        raise DataError(f"{source} has no rows")
    out = []
    kinds = set()
    has_images = image_column in present
    for i, row in enumerate(rows, start=1):
        prompt = row.pop(prompt_column)
        images = ()
        if has_images:
            from grpo.images import load_images
            images = load_images(row.pop(image_column), f"{source} row {i}, column {image_column!r}")
        chat = conversation(prompt)
        kinds.add(chat is not None)
        if len(kinds) > 1:
            raise DataError(f"{source} row {i}: prompt column {prompt_column!r} mixes text prompts and "
                            "conversations (lists of messages); give one kind")
        if chat is not None:
            chat = _with_images(chat, len(images), f"{source} row {i}")
            prompt = _text(next(m["content"] for m in reversed(chat) if m["role"] == "user"))
        elif isinstance(prompt, (list, tuple)):
            raise DataError(f"{source} row {i}: prompt column {prompt_column!r} is a list but not a conversation: "
                            "a conversational prompt is a list of {'role': ..., 'content': <text, or a list of "
                            "text and image parts>} messages with at least one user message")
        elif not isinstance(prompt, str):
            what = "empty" if prompt is None else f"of type {type(prompt).__name__}, not text"
            raise DataError(f"{source} row {i}: prompt column {prompt_column!r} is {what}")
        if chat is None and not prompt.strip():
            raise DataError(f"{source} row {i}: prompt column {prompt_column!r} is empty")
        answer = None
        if has_answer:
            answer = _answer_text(row[answer_column])
            if answer is None:
                raise DataError(f"{source} row {i}: answer column {answer_column!r} is empty")
            if answer_column == "answer":
                del row["answer"]  # it is Example.answer, as text
        out.append(Example(prompt, answer, row, chat, images))
    return out
