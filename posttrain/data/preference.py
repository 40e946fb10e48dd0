"""Preference data in TRL's formats: loading, checking and tokenizing as ``trl.DPOTrainer`` does."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from posttrain.checks import check_data_path
from posttrain.errors import ConfigError

logger = logging.getLogger(__name__)

COLUMNS = ("prompt", "chosen", "rejected")
# Roles chat templates render ("ipython": Llama 3's tool output); another is a typo a template would drop.
ROLES = ("system", "user", "assistant", "tool", "developer", "ipython", "function")
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_dataset_source(name_or_path: str, split: str = "train", config: str | None = None) -> Any:
    """A ``datasets.Dataset`` from a hub name, a local json/jsonl/parquet/csv file or a dataset folder."""
    from datasets import load_dataset, load_from_disk

    path = Path(name_or_path)
    if path.is_file():
        fmt = LOCAL_FORMATS.get(path.suffix)
        if fmt is None:
            raise ConfigError(f"{path}: unknown data file type {path.suffix!r}; use one of {', '.join(LOCAL_FORMATS)}")
        if split != "train":
            raise ValueError(f"{path} is a single file: it has only the split 'train', not {split!r}")
        if _blank(path):
            raise ConfigError(f"{path} is empty: give a data file with at least one row")
        try:
            dataset = load_dataset(fmt, data_files=str(path), split="train")
        except Exception as err:
            if fmt == "json":  # `datasets` names neither the line nor the file's own error
                _raise_json_error(path, err)
            raise
    elif path.is_dir() and (path / "dataset_info.json").exists():
        dataset = load_from_disk(str(path))
    else:
        check_data_path(name_or_path, "dataset")  # a missing local file must not reach the hub
        try:
            dataset = load_dataset(name_or_path, config, split=split)
        except (FileNotFoundError, ConnectionError) as err:  # no such hub dataset, or no network
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"dataset {name_or_path!r} could not be loaded ({first}): check the name, or give a "
                              "local json/jsonl/parquet/csv file") from None
    if len(dataset) == 0:
        raise ConfigError(f"{name_or_path} (split {split!r}) has no rows: give a dataset with at least one row")
    return dataset


def _blank(path: Path) -> bool:
    """Whether a text file holds only whitespace (read up to its first other byte)."""
    if path.suffix == ".parquet":
        return path.stat().st_size == 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _raise_json_error(path: Path, err: Exception) -> None:
    """Re-raise a failed JSON load naming the file, line and column (``err`` itself if the JSON is valid)."""
    text = path.read_text()
    try:
        json.loads(text)  # one JSON document (a .json list of rows)
        raise err
    except json.JSONDecodeError as doc_err:
        first = next((line for line in text.splitlines() if line.strip()), "")
        if not _is_json(first) or first.strip() == text.strip():
            raise ConfigError(f"{path}, line {doc_err.lineno}, column {doc_err.colno}: not valid JSON "
                              f"({doc_err.msg}); fix the file there") from err
    for number, line in enumerate(text.splitlines(), 1):  # JSON lines: one row per line
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError as line_err:
            raise ConfigError(f"{path}, line {number}: not valid JSON ({line_err.msg} at column {line_err.colno}); "
                              "fix or remove that line") from err
    raise err


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def write_jsonl(rows: Sequence[dict], path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)  # atomic: another process never reads a half-written file
    return path


def as_dataset(data: Any, name: str = "dataset") -> Any:
    """A ``datasets.Dataset`` from a list of row dicts (or the dataset itself); mixed value types refused."""
    if isinstance(data, (list, tuple)):
        import pyarrow as pa
        from datasets import Dataset

        try:
            return Dataset.from_list(list(data))
        except (pa.ArrowInvalid, pa.ArrowTypeError) as err:  # a column of mixed types: arrow names no row
            _raise_mixed_types(list(data), name, err)
    return data


def _python_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a bool"
    if isinstance(value, (int, float)):  # arrow stores ints and floats together
        return "a number"
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return "a list of messages"
    return {str: "a string", dict: "a dict", list: "a list"}.get(type(value), f"a {type(value).__name__}")


def _raise_mixed_types(rows: list, name: str, err: Exception) -> NoReturn:
    """Name the first column whose rows hold values of different kinds; ``err`` itself if none does."""
    for column in dict.fromkeys(key for row in rows if isinstance(row, dict) for key in row):
        first: dict[str, int] = {}
        for index, row in enumerate(rows):
            value = row.get(column) if isinstance(row, dict) else None
            if value is not None:
                first.setdefault(_python_kind(value), index)
        if len(first) > 1:
            (kind_a, row_a), (kind_b, row_b) = list(first.items())[:2]
            raise ConfigError(f"{name}: row {row_a}'s {column!r} is {kind_a} but row {row_b}'s is {kind_b}: give "
                              f"every row's {column!r} the same form") from err
    raise err


def feature_form(feature: Any) -> str:
    """"text" (strings), "messages" (lists of dicts), "null" (every value missing), else what it holds."""
    from datasets import LargeList, List, Value

    if isinstance(feature, Value):
        if feature.dtype in ("string", "large_string"):
            return "text"
        return "null" if feature.dtype == "null" else f"{feature.dtype} values"
    if isinstance(feature, (List, LargeList)):
        inner = feature.feature
        if isinstance(inner, dict):
            return "messages"
        if isinstance(inner, Value) and inner.dtype in ("string", "large_string"):
            return "lists of strings"
        return f"lists of {feature_form(inner)}"
    if isinstance(feature, dict):
        return "single dicts"
    return str(feature)


def check_forms(dataset: Any, columns: Sequence[str], name: str) -> None:
    """Refuse a column that is neither text nor messages, or text and messages mixed in one row (TRL: TypeError)."""
    present = [c for c in columns if c in dataset.column_names]
    forms = {c: feature_form(dataset.features[c]) for c in present}
    for column, form in forms.items():
        if form not in ("text", "messages", "null"):
            others = {f for c, f in forms.items() if c != column and f in ("text", "messages")}
            want = ("one string" if others == {"text"} else "a list of {\"role\": ..., \"content\": ...} messages"
                    if others == {"messages"} else "one string or a list of {\"role\": ..., \"content\": ...} messages")
            raise ConfigError(f"{name}: its {column!r} column holds {form}, neither strings (standard) nor lists of "
                              f"messages (conversational): give each row's {column!r} as {want}")
    text = [c for c, f in forms.items() if f == "text"]
    messages = [c for c, f in forms.items() if f == "messages"]
    if text and messages:
        listed = " and ".join([", ".join(map(repr, present[:-1])), repr(present[-1])])
        every = "both" if len(present) == 2 else "all"
        raise ConfigError(f"{name}: its {messages[0]!r} column holds lists of messages (conversational) but its "
                          f"{text[0]!r} column holds strings (standard): give {listed} {every} as lists of messages "
                          f"or {every} as strings")


def _empty(value: Any) -> bool:
    """None, a blank string, an empty list, or a message/content part with blank text."""
    if value is None:
        return True
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, (list, tuple)):
        return len(value) == 0 or any(_empty(m) for m in value)
    if isinstance(value, dict):
        if value.get("tool_calls"):  # an assistant tool call may carry no text
            return False
        if "content" in value:
            return _empty(value["content"])
        return value.get("type") == "text" and _empty(value.get("text"))
    return False


def check_rows(dataset: Any, name: str = "dataset") -> None:
    """Raise on a missing column or a missing/empty value, naming the row index and column."""
    if len(dataset) == 0:  # an empty list has no columns either: say so, not "rename its columns"
        raise ConfigError(f"{name} has no rows: give it at least one")
    need = ("chosen", "rejected") if "prompt" not in dataset.column_names else COLUMNS
    missing = [c for c in need if c not in dataset.column_names]
    if missing:
        raise ConfigError(
            f"{name}: no column {missing[0]!r}; a preference dataset needs {', '.join(COLUMNS)} "
            f"(or an implicit prompt in chosen/rejected), got columns {dataset.column_names}: rename its columns"
        )
    check_values(dataset, list(need), name)


def check_values(dataset: Any, columns: Sequence[str], name: str) -> None:
    """Raise on the first missing or empty value of ``columns``, naming its row and column."""
    index = 0
    for batch in dataset.select_columns(list(columns)).iter(batch_size=1000):
        for i in range(len(batch[columns[0]])):
            for column in columns:
                if _empty(batch[column][i]):
                    raise ConfigError(f"{name}: row {index + i} has a missing or empty {column!r}; "
                                      "fill it in or drop the row")
        index += len(batch[columns[0]])


def check_conversation(dataset: Any, columns: Sequence[str], tokenizer: Any, name: str = "dataset") -> None:
    """Refuse conversational columns without a chat template, or with a malformed message."""
    if isinstance(dataset, (list, tuple)):
        batches = [{c: [r.get(c) for r in dataset] for c in columns}]
    else:
        present = [c for c in columns if c in dataset.column_names]
        batches = dataset.select_columns(present).iter(batch_size=1000) if present else []
    index, conversational = 0, False
    for batch in batches:
        size = len(next(iter(batch.values()), []))
        for column, values in batch.items():
            for i, value in enumerate(values):
                if isinstance(value, (list, tuple)) and value and isinstance(value[0], dict):
                    conversational = True
                    _check_messages(value, f"{name}: row {index + i}, {column!r}")
        if conversational and not getattr(tokenizer, "chat_template", None):
            source = getattr(tokenizer, "name_or_path", "") or "the model"
            raise ConfigError(f"{name} is conversational (lists of messages) but the tokenizer of {source} has no chat "
                              "template: use a chat model's tokenizer, set tokenizer.chat_template and save it with the "
                              "model, or give the data as plain text")
        index += size


def _check_messages(messages: Sequence[Any], where: str) -> None:
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") is None:  # a dataset fills a missing key with None
            raise ConfigError(f"{where}, message {j} has no 'role': each message is {{\"role\": ..., \"content\": ...}}")
        if message["role"] not in ROLES:
            raise ConfigError(f"{where}, message {j} has the unknown role {message['role']!r}: use one of "
                              f"{', '.join(ROLES)}")
        if message.get("content") is None and not message.get("tool_calls"):
            raise ConfigError(f"{where}, message {j} has no 'content': each message is {{\"role\": ..., "
                              "\"content\": ...}")


def tokenize_completions(row: dict, tokenizer: Any, columns: Sequence[str]) -> dict[str, list[int]]:
    """``prompt_ids`` and ``<column>_ids`` for each completion column, as TRL's DPO and KTO trainers tokenize them:
    the prompt with the generation prompt, each prompt + completion whole, standard completions ending with EOS,
    the completions starting where the tokenizations of the prompt and of every prompt + completion diverge."""
    from trl.data_utils import _tokenize, common_prefix_length, is_conversational

    if is_conversational(row):
        tools = row.get("tools")
        kwargs = {"tools": json.loads(tools) if isinstance(tools, str) else tools, **(row.get("chat_template_kwargs") or {})}
        prompt = _tokenize(tokenizer, row["prompt"], add_generation_prompt=True, **kwargs)["input_ids"]
        full = [_tokenize(tokenizer, row["prompt"] + row[c], **kwargs)["input_ids"] for c in columns]
    else:
        eos = tokenizer.eos_token
        prompt = _tokenize(tokenizer, row["prompt"])["input_ids"]
        full = [_tokenize(tokenizer, row["prompt"] + (row[c] if row[c].endswith(eos) else row[c] + eos))["input_ids"]
                for c in columns]
    n = min(common_prefix_length(prompt, ids) for ids in full)
    return {"prompt_ids": prompt[:n], **{f"{c}_ids": ids[n:] for c, ids in zip(columns, full)}}


def tokenize_row(row: dict, tokenizer: Any) -> dict[str, list[int]]:
    """``prompt_ids``/``chosen_ids``/``rejected_ids`` exactly as ``trl.DPOTrainer`` builds them."""
    return tokenize_completions(row, tokenizer, ("chosen", "rejected"))


def prompts_within(rows: list[dict], max_length: int | None, name: str) -> list[dict]:
    """The rows whose prompt is shorter than ``max_length`` (TRL drops the others; the count is logged)."""
    if max_length is None:
        return rows
    kept = [r for r in rows if len(r["prompt_ids"]) < max_length]
    if not kept:
        raise ConfigError(f"{name}: no usable rows, every prompt fills max_length={max_length}: raise --max_length")
    if len(kept) < len(rows):
        logger.warning("%s: %d of %d rows left out, their prompt fills max_length=%d (as TRL); raise --max_length "
                       "to keep them", name, len(rows) - len(kept), len(rows), max_length)
    return kept


def prepare_preference_dataset(dataset: Any, tokenizer: Any, max_length: int | None = None,
                               truncation_mode: str = "keep_start", name: str = "dataset",
                               num_proc: int | None = None) -> list[dict[str, list[int]]]:
    """Check, split implicit prompts, tokenize; leave out rows whose prompt fills ``max_length`` (keep_start, as
    TRL; logged)."""
    from trl.data_utils import extract_prompt

    dataset = as_dataset(dataset, name)
    check_rows(dataset, name)
    check_conversation(dataset, COLUMNS, tokenizer, name)
    check_forms(dataset, COLUMNS, name)
    # keep_in_memory: ranks map alone, never racing on shared cache files.
    if "prompt" not in dataset.column_names:
        dataset = dataset.map(extract_prompt, keep_in_memory=True, num_proc=num_proc)
    keep = [c for c in dataset.column_names if c in (*COLUMNS, "tools", "chat_template_kwargs")]
    tokenized = dataset.select_columns(keep).map(tokenize_row, fn_kwargs={"tokenizer": tokenizer},
                                                 remove_columns=keep, keep_in_memory=True, num_proc=num_proc)
    rows = tokenized.to_list()
    return prompts_within(rows, max_length, name) if truncation_mode == "keep_start" else rows


def collator(tokenizer: Any, max_length: int | None, truncation_mode: str = "keep_start"):
    """TRL's ``DataCollatorForPreference``: [chosen; rejected] rows, right-padded, with a completion mask."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return DataCollatorForPreference(pad_token_id=pad, max_length=max_length, truncation_mode=truncation_mode)
