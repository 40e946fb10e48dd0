"""Unpaired preference data (TRL's ``prompt``/``completion``/``label``), checked, unpaired from pairs and
tokenized as ``trl.KTOTrainer`` 1.16 prepares it, with each row's mismatched KL completion."""

from __future__ import annotations

from typing import Any

from posttrain.data import preference
from posttrain.errors import ConfigError

COLUMNS = ("prompt", "completion", "label")


def check_rows(dataset: Any, name: str = "dataset", both_labels: bool = True) -> None:
    """Refuse data KTO cannot train on, in one sentence naming the fix: missing columns or values, a label
    that is not a boolean, one label only (``both_labels``), a conversation whose completion has no assistant
    turn. Paired data (``chosen``/``rejected``) is checked as DPO's."""
    dataset = preference.as_dataset(dataset, name)
    if len(dataset) == 0:
        raise ConfigError(f"{name} has no rows: give it at least one")
    columns = dataset.column_names
    if "chosen" in columns and "rejected" in columns:
        preference.check_rows(dataset, name)
        _check_assistant_turns(dataset, ("chosen", "rejected"), name)
        return
    missing = [c for c in COLUMNS if c not in columns]
    if missing:
        raise ConfigError(f"{name}: no column {missing[0]!r}; KTO's unpaired data needs {', '.join(COLUMNS)} (label "
                          "true for a desirable completion, false for an undesirable one), or paired data with "
                          f"chosen and rejected, got columns {columns}: add or rename the columns")
    feature = dataset.features["label"]
    if getattr(feature, "dtype", None) != "bool":
        form = preference.feature_form(feature)
        raise ConfigError(f"{name}: its 'label' column holds {form}, not booleans: give each row's label as true "
                          "(desirable completion) or false (undesirable completion)")
    preference.check_values(dataset, ["prompt", "completion", "label"], name)
    preference.check_forms(dataset, ("prompt", "completion"), name)
    _check_assistant_turns(dataset, ("completion",), name)
    if both_labels:
        labels = dataset["label"]
        if all(labels) or not any(labels):
            kind, other = ("true (desirable)", "false") if labels[0] else ("false (undesirable)", "true")
            raise ConfigError(f"{name}: every row's label is {kind}; KTO learns from both kinds of completion: add "
                              f"rows labelled {other}")


def _check_assistant_turns(dataset: Any, columns: tuple[str, ...], name: str) -> None:
    """A conversational completion is the model's turn: it needs an assistant message to train on."""
    index = 0
    for batch in dataset.select_columns(list(columns)).iter(batch_size=1000):
        for column in columns:
            for i, value in enumerate(batch[column]):
                if (isinstance(value, list) and value and isinstance(value[0], dict)
                        and not any(isinstance(m, dict) and m.get("role") == "assistant" for m in value)):
                    raise ConfigError(f"{name}: row {index + i}'s {column!r} has no assistant message, so there is "
                                      "no completion to train on: end it with a {\"role\": \"assistant\", "
                                      "\"content\": ...} message")
        index += len(batch[columns[0]])


def add_kl_completions(rows: list[dict], group: int) -> list[dict]:
    """TRL's mismatched pairs for the KL estimate: in each run of ``group`` rows (its batched map of
    ``per_device_train_batch_size``), row i takes row i-1's completion, the first the last's."""
    for start in range(0, len(rows), group):
        chunk = rows[start : start + group]
        shifted = [chunk[-1]["completion_ids"]] + [r["completion_ids"] for r in chunk[:-1]]
        for row, kl in zip(chunk, shifted):
            row["KL_completion_ids"] = kl
    return rows


def prepare_unpaired_dataset(dataset: Any, tokenizer: Any, max_length: int | None, kl_group: int | None,
                             name: str = "dataset", num_proc: int | None = None,
                             both_labels: bool = True) -> list[dict[str, Any]]:
    """Check, extract implicit prompts, unpair pairs, tokenize (EOS added), leave out rows whose prompt fills
    ``max_length`` and add KL completions (``kl_group`` rows a group; None: no KL), as TRL in that order."""
    from trl.data_utils import extract_prompt, maybe_unpair_preference_dataset

    dataset = preference.as_dataset(dataset, name)
    check_rows(dataset, name, both_labels=both_labels)
    columns = dataset.column_names
    preference.check_conversation(dataset, (*COLUMNS[:2], "chosen", "rejected"), tokenizer, name)
    # keep_in_memory: ranks map alone, never racing on shared cache files.
    if "prompt" not in columns:
        dataset = dataset.map(extract_prompt, keep_in_memory=True, num_proc=num_proc)
    dataset = maybe_unpair_preference_dataset(dataset, num_proc=num_proc)
    keep = [c for c in dataset.column_names if c in (*COLUMNS, "tools", "chat_template_kwargs")]
    # TRL's KTO tokenization is its DPO one with one completion (standard completions end with EOS).
    tokenized = dataset.select_columns(keep).map(preference.tokenize_completions,
                                                 fn_kwargs={"tokenizer": tokenizer, "columns": ("completion",)},
                                                 remove_columns=[c for c in keep if c != "label"],
                                                 keep_in_memory=True, num_proc=num_proc)
    rows = preference.prompts_within(tokenized.to_list(), max_length, name)
    return add_kl_completions(rows, kl_group) if kl_group else rows
