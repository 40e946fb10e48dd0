"""SFT data in TRL's formats: checking, tokenizing, label masks, truncation and packing as
``trl.SFTTrainer._prepare_dataset`` (TRL 1.16), each bad row refused naming the row and the fix."""

from __future__ import annotations

import json
import logging
from typing import Any

from posttrain.data.preference import ROLES, as_dataset, check_forms, check_values, feature_form
from posttrain.errors import ConfigError

logger = logging.getLogger(__name__)

# The chat template of posttrain's tiny tokenizer (posttrain.demo.tiny).
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|endoftext|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# The same with {% generation %} markers for assistant_only_loss (TRL patches only hub templates).
TINY_TRAINING_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}<|assistant|>{% generation %}"
    "{{ message['content'] }}<|endoftext|>{% endgeneration %}{% else %}<|{{ message['role'] }}|>"
    "{{ message['content'] }}<|endoftext|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TRUNCATION_MODES = ("keep_start", "keep_end", "none")
# ShareGPT's speakers as chat roles (TRL's maybe_convert_to_chatml renames the keys only, so templates print "gpt").
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}
CONVERSATIONAL_COLUMNS = ("messages", "prompt", "completion")
MASK_COLUMNS = ("completion_mask", "assistant_masks")


def dataset_kind(dataset: Any, text_field: str = "text", name: str = "dataset") -> str:
    """"prompt_completion", "messages" (also ShareGPT ``conversations``) or "text"; else raises."""
    columns = dataset.column_names
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    if "messages" in columns or "conversations" in columns:
        return "messages"
    if text_field in columns:
        return "text"
    wanted = "prompt" if "completion" in columns else "completion" if "prompt" in columns else None
    hint = f"add its {wanted!r} column" if wanted else "rename a column"
    raise ConfigError(
        f"{name}: no column {text_field!r}, 'messages' or 'prompt'/'completion' (columns: {columns}): "
        f"{hint}, or set --dataset_text_field to the column that holds the text"
    )


def training_chat_template(tokenizer: Any) -> str | None:
    """assistant_only_loss's template: None if the tokenizer's has generation markers, else TRL's patched."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    template = tokenizer.chat_template
    if template is None:
        return None  # refused later, with the data's first conversational row in hand
    if has_generation_markers(template):
        return None
    if template == TINY_CHAT_TEMPLATE:
        return TINY_TRAINING_CHAT_TEMPLATE
    try:
        return get_training_chat_template(tokenizer)
    except ValueError as err:
        raise ConfigError(
            "assistant_only_loss needs a chat template with {% generation %} ... {% endgeneration %} around each "
            "assistant turn and TRL cannot patch this tokenizer's: give one with --chat_template_path FILE.jinja, "
            "or drop --assistant_only_loss"
        ) from err


_INT_TYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def _holds_int_lists(feature: Any, bools: bool) -> bool:
    from datasets import LargeList, List, Value

    inner = getattr(feature, "feature", None)
    allowed = _INT_TYPES + ("bool",) * bools + ("null",)  # "null": every list empty, refused by its length
    return isinstance(feature, (List, LargeList)) and isinstance(inner, Value) and inner.dtype in allowed


def _first_bad(column: Any, bad: Any) -> tuple[int, Any] | None:
    """(row, value) of the first flattened value of a list column where ``bad`` is true, or None."""
    import pyarrow.compute as pc

    if not pc.any(bad).as_py():
        return None
    at = pc.index(bad, True).as_py()
    return pc.list_parent_indices(column)[at].as_py(), pc.list_flatten(column)[at].as_py()


def _flat_values(column: Any, what: str, name: str) -> Any:
    """A list column's values flattened (an arrow array), after refusing a null row or value."""
    import pyarrow.compute as pc

    if column.null_count:
        raise ConfigError(f"{name}: row {pc.index(column.is_null(), True).as_py()} has no {what} (null): fill it "
                          "in or drop the row")
    flat = pc.list_flatten(column)
    if flat.null_count:
        row, _ = _first_bad(column, flat.is_null())
        raise ConfigError(f"{name}: row {row}'s {what} holds a null: give every token a value, or drop the row")
    return flat.cast("int64")


def check_tokenized(dataset: Any, tokenizer: Any, *, completion_only_loss: bool, assistant_only_loss: bool,
                    packing: bool, max_length: int | None, name: str = "dataset") -> None:
    """Refuse tokenized rows SFTTrainer fails on or mistrains (``attention_mask`` too: it gets dropped)."""
    import pyarrow.compute as pc

    columns = dataset.column_names
    if assistant_only_loss:  # TRL refuses it too: a tokenized row is not conversational
        raise ConfigError(f"{name} is already tokenized (it has 'input_ids') and assistant_only_loss needs "
                          "conversations to find the assistant turns: drop --assistant_only_loss (an 'assistant_masks' "
                          "column is applied without it)")
    if completion_only_loss and "completion_mask" not in columns and "labels" not in columns:
        raise ConfigError(f"{name}: completion_only_loss is on (asked for, or the default with prompt/completion "
                          "columns) but the tokenized rows have no 'completion_mask' (nor 'labels'): add a completion_mask "
                          "column (1 per completion token, 0 per prompt token), or set --completion_only_loss false to "
                          "train on every token")
    # Labels as given, else the masks that apply (TRL's rule); unused ones are dropped unread.
    used = ["labels"] if "labels" in columns else [c for c in MASK_COLUMNS if c in columns and (
        c == "assistant_masks" or completion_only_loss)]
    used += ["attention_mask"] * ("attention_mask" in columns)
    present = ["input_ids", *used, *["seq_lengths"] * ("seq_lengths" in columns)]
    for column in present:
        if not _holds_int_lists(dataset.features[column], bools=column in (*MASK_COLUMNS, "attention_mask")):
            what = "its token ids" if column == "input_ids" else f"its {column}, one per token"
            raise ConfigError(f"{name}: {column!r} holds {dataset.features[column]}, not a list of integers per row: "
                              f"give each row {what} as a list of ints")
    table = dataset.select_columns(present).with_format("arrow")[:]
    ids = table.column("input_ids").combine_chunks()
    values = _flat_values(ids, "'input_ids'", name)
    lengths = pc.list_value_length(ids)
    if pc.any(pc.equal(lengths, 0)).as_py():
        raise ConfigError(f"{name}: row {pc.index(lengths, 0).as_py()} has an empty 'input_ids': drop the row")
    vocab = len(tokenizer)
    bad = _first_bad(ids, pc.or_(pc.less(values, 0), pc.greater_equal(values, vocab)))
    if bad:
        raise ConfigError(f"{name}: row {bad[0]} has the token id {bad[1]} in 'input_ids', outside the tokenizer's "
                          f"vocabulary (0 to {vocab - 1}): tokenize the data with this model's tokenizer, or give it as "
                          "text")
    for column in used:
        col = table.column(column).combine_chunks()
        got = _flat_values(col, repr(column), name)
        n = pc.list_value_length(col)
        if not pc.all(pc.equal(n, lengths)).as_py():
            index = pc.index(pc.not_equal(n, lengths), True).as_py()
            raise ConfigError(f"{name}: row {index} has {n[index]} {column!r} values for its {lengths[index]} "
                              f"'input_ids': give one {column} value per token")
        if column == "labels":
            wrong = pc.and_(pc.not_equal(got, -100), pc.or_(pc.less(got, 0), pc.greater_equal(got, vocab)))
            fix = "use -100 for tokens left out of the loss and the token id elsewhere"
        elif column == "attention_mask":
            wrong = pc.not_equal(got, 1)
            fix = ("SFT pads each batch itself and would train on this padding: strip the padding from its "
                   "input_ids (and drop the attention_mask column)")
        else:
            wrong = pc.and_(pc.not_equal(got, 0), pc.not_equal(got, 1))
            fix = "use 1 for tokens trained on and 0 for the others"
        bad = _first_bad(col, wrong)
        if bad:
            raise ConfigError(f"{name}: row {bad[0]}'s {column!r} holds {bad[1]:d}: {fix}")
    if "seq_lengths" in columns:  # rows packed already (TRL's packed format)
        if packing:
            raise ConfigError(f"{name} is already packed (it has 'seq_lengths'): set --packing false")
        for index, (parts, n) in enumerate(zip(table.column("seq_lengths").to_pylist(), lengths.to_pylist())):
            if not parts or None in parts or min(parts) <= 0 or sum(parts) != n:
                raise ConfigError(f"{name}: row {index}'s 'seq_lengths' {parts} do not split its {n} tokens: give "
                                  "the length of each sequence packed into the row")
            if max_length is not None and n > max_length:
                raise ConfigError(f"{name}: row {index} is packed (it has 'seq_lengths') and has {n} tokens, more "
                                  f"than max_length={max_length}, which would cut it: raise --max_length or set it "
                                  "to none")


def prepare_sft_dataset(dataset: Any, tokenizer: Any, *, max_length: int | None, packing: bool,
                        packing_strategy: str = "bfd", completion_only_loss: bool | None = None,
                        assistant_only_loss: bool = False, text_field: str = "text",
                        truncation_mode: str = "keep_start", chat_template: str | None = None,
                        num_proc: int | None = None, name: str = "dataset", shuffle_seed: int | None = None) -> Any:
    """``input_ids``/``labels`` (+``seq_lengths`` packed) as SFTTrainer; ``shuffle_seed``: its pre-packing shuffle."""
    from trl.data_utils import is_conversational

    dataset = as_dataset(dataset, name)
    if len(dataset) == 0:
        raise ConfigError(f"{name} has no rows: give it at least one")
    map_kwargs = {"num_proc": num_proc, "keep_in_memory": True}  # every rank maps alone, no shared cache files
    if completion_only_loss is None:  # TRL's default: on exactly for data with prompt and completion columns
        completion_only_loss = "prompt" in dataset.column_names and "completion" in dataset.column_names
        given = dataset.column_names
        if not completion_only_loss and "completion_mask" in given and "labels" not in given:
            logger.warning("%s: its 'completion_mask' column is not applied, completion_only_loss being off by "
                           "default for data without prompt/completion columns (TRL's rule): set "
                           "--completion_only_loss true to train on the completion tokens only", name)
    if "input_ids" in dataset.column_names:  # already tokenized (TRL's rule): the tokens as given, no EOS added
        check_tokenized(dataset, tokenizer, completion_only_loss=completion_only_loss,
                        assistant_only_loss=assistant_only_loss, packing=packing, max_length=max_length, name=name)
        if "labels" not in dataset.column_names:  # a labels column is used as is (TRL)
            dataset = _labels_from_masks(dataset, completion_only_loss, map_kwargs)
        kept = [c for c in ("input_ids", "labels", "seq_lengths") if c in dataset.column_names]  # TRL's signature
        dataset = dataset.select_columns(kept)
        return _finish(dataset, max_length, packing, packing_strategy, truncation_mode, map_kwargs, name,
                       shuffle_seed)
    if "prompt_ids" in dataset.column_names or "completion_ids" in dataset.column_names:
        raise ConfigError(f"{name} has 'prompt_ids'/'completion_ids' but no 'input_ids', which SFT (as TRL) reads "
                          "tokenized rows from: give each row input_ids = prompt_ids + completion_ids and a "
                          "completion_mask (0 per prompt token, 1 per completion token), with "
                          "--completion_only_loss true")
    kind = dataset_kind(dataset, text_field, name)
    columns = {"prompt_completion": ["prompt", "completion"], "messages": None, "text": [text_field]}[kind]
    if columns is None:
        columns = ["messages" if "messages" in dataset.column_names else "conversations"]
    _check_column_forms(dataset, kind, columns, name)
    if completion_only_loss and (kind == "text" or kind == "messages" and not assistant_only_loss):
        raise ConfigError(_completion_only_loss_error(kind, columns[0], name))
    check_values(dataset, columns, name)
    shown = columns[0]  # the column named in errors: the user's 'conversations', not the renamed one
    if kind != "text" and _needs_chatml(dataset, columns):
        dataset = dataset.map(_to_chatml, remove_columns=["conversations"] * ("conversations" in columns),
                              **map_kwargs)
        columns = ["messages"] if kind == "messages" else columns
    conversational_columns = [c for c in columns if feature_form(dataset.features[c]) == "messages"]
    if conversational_columns:
        _check_roles(dataset, conversational_columns, shown, name)
    first = dataset[0]
    conversational = is_conversational(first)
    if assistant_only_loss and not conversational:
        raise ConfigError(f"{name}: assistant_only_loss needs conversational data ('messages' or conversational "
                          "prompt/completion); drop --assistant_only_loss for this dataset")
    if conversational and tokenizer.chat_template is None and chat_template is None:
        raise ConfigError(f"{name} is conversational but the tokenizer has no chat template: give one with "
                          "--chat_template_path FILE.jinja (or use a tokenizer that has one)")
    if not conversational:  # TRL adds EOS to standard text and completions
        eos = tokenizer.eos_token

        def add_eos(row: dict) -> dict:
            key = text_field if kind == "text" else "completion"
            return {key: row[key] if row[key].endswith(eos) else row[key] + eos}

        dataset = dataset.map(add_eos, **map_kwargs)
    dataset = dataset.map(_tokenize_row, with_indices=True, remove_columns=dataset.column_names, **map_kwargs,
                          fn_kwargs={"tokenizer": tokenizer, "kind": kind, "text_field": text_field,
                                     "name": name, "assistant_only_loss": assistant_only_loss,
                                     "chat_template": chat_template})
    dataset = _labels_from_masks(dataset, completion_only_loss, map_kwargs)
    return _finish(dataset, max_length, packing, packing_strategy, truncation_mode, map_kwargs, name, shuffle_seed)


def _check_column_forms(dataset: Any, kind: str, columns: list[str], name: str) -> None:
    """Refuse a text column of non-strings or a messages column of non-lists (TRL: KeyError, AttributeError)."""
    if kind == "prompt_completion":
        check_forms(dataset, columns, name)
        return
    column = columns[0]
    form = feature_form(dataset.features[column])
    if kind == "text" and form not in ("text", "null"):  # null: every value missing, named by check_values
        raise ConfigError(f"{name}: its {column!r} column holds {form}, not strings: give each row's text as a "
                          "string, or set --dataset_text_field to the column that holds the text")
    if kind == "messages" and form not in ("messages", "null"):
        fix = {"text": f"give each row's {column!r} as a list of {{\"role\": ..., \"content\": ...}} dicts, not "
                       "as a JSON string (json.loads it)",
               "single dicts": "wrap each row's message in a list, one dict per message"}.get(
            form, f"give each row's {column!r} as a list of {{\"role\": ..., \"content\": ...}} dicts")
        holds = "strings" if form == "text" else form
        raise ConfigError(f"{name}: its {column!r} column holds {holds}, not lists of messages: {fix}")


def _completion_only_loss_error(kind: str, column: str, name: str) -> str:
    """The sentence for completion_only_loss on data with no completion, which TRL ignores (every token trains)."""
    if kind == "text":
        return (f"{name}: completion_only_loss is on but the rows are plain text ({column!r}) with no completion to "
                "train on alone (TRL would train on every token): give the data as 'prompt'/'completion' columns, or "
                "set --completion_only_loss false")
    return (f"{name}: completion_only_loss is on but the rows are conversations ({column!r}) with no "
            "prompt/completion split (TRL would train on every token): set --assistant_only_loss true to train on "
            "the assistant turns, or --completion_only_loss false")


def _needs_chatml(dataset: Any, columns: list[str]) -> bool:
    """A ShareGPT ``conversations`` column, or messages with ShareGPT's "from"/"value" keys."""
    if "conversations" in columns:
        return True
    for column in columns:
        inner = getattr(dataset.features[column], "feature", None)
        if isinstance(inner, dict) and "from" in inner and "value" in inner:
            return True
    return False


def _to_chatml(row: dict) -> dict:
    """TRL's ``maybe_convert_to_chatml`` (keys "from"/"value" to "role"/"content"), then human/gpt to user/assistant."""
    from trl.data_utils import maybe_convert_to_chatml

    row = maybe_convert_to_chatml(row)
    for column in CONVERSATIONAL_COLUMNS:
        if isinstance(row.get(column), list):
            for message in row[column]:
                if isinstance(message, dict) and message.get("role") in SHAREGPT_ROLES:
                    message["role"] = SHAREGPT_ROLES[message["role"]]
    return row


def _check_roles(dataset: Any, columns: list[str], shown: str, name: str) -> None:
    """Refuse a message without a role, or with one chat templates do not know (they drop or misprint it)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = dataset.select_columns(columns).with_format("arrow")[:]
    seen: dict[str, None] = {}
    first_bad = None  # (row, column, role)
    for column in columns:
        col = table.column(column).combine_chunks()
        flat = pc.list_flatten(col)
        label = shown if column == "messages" else column
        if not pa.types.is_struct(flat.type) or flat.type.get_field_index("role") < 0:
            keys = [flat.type.field(i).name for i in range(flat.type.num_fields)] if pa.types.is_struct(flat.type) else []
            raise ConfigError(f"{name}: the messages of its {label!r} column have no 'role' (their keys: "
                              f"{', '.join(keys)}): give each message as {{\"role\": ..., \"content\": ...}}")
        roles = pc.struct_field(flat, "role")
        if roles.null_count:
            row, _ = _first_bad(col, roles.is_null())
            raise ConfigError(f"{name}: row {row}'s {label!r} has a message with no 'role': give each message as "
                              "{\"role\": ..., \"content\": ...}")
        seen.update(dict.fromkeys(pc.unique(roles).to_pylist()))
        unknown = pc.invert(pc.is_in(roles, value_set=pa.array(ROLES)))
        if first_bad is None and pc.any(unknown).as_py():
            at = pc.index(unknown, True).as_py()
            first_bad = (pc.list_parent_indices(col)[at].as_py(), label, roles[at].as_py())
    if first_bad:
        row, label, role = first_bad
        raise ConfigError(f"{name}: row {row}'s {label!r} has the unknown role {role!r} (roles in the data: "
                          f"{', '.join(seen)}): use only {', '.join(ROLES)}")


def _tokenize_row(row: dict, index: int, tokenizer: Any, kind: str, text_field: str, name: str,
                  assistant_only_loss: bool, chat_template: str | None) -> dict:
    """TRL 1.16's ``tokenize_fn`` of SFTTrainer._prepare_dataset, with its error as one sentence."""
    from trl.data_utils import _tokenize, common_prefix_length, is_conversational

    tools = row.get("tools")
    kwargs = {"chat_template": chat_template, "tools": json.loads(tools) if isinstance(tools, str) else tools,
              **(row.get("chat_template_kwargs") or {})}
    out: dict = {}
    if kind == "prompt_completion":
        if is_conversational(row):
            prompt_ids = _tokenize(tokenizer, row["prompt"], add_generation_prompt=True, **kwargs)["input_ids"]
            full = _tokenize(tokenizer, row["prompt"] + row["completion"],
                             return_assistant_tokens_mask=assistant_only_loss, **kwargs)
            ids = full["input_ids"]
            if "assistant_masks" in full:
                out["assistant_masks"] = list(full["assistant_masks"])
        else:
            prompt_ids = _tokenize(tokenizer, row["prompt"], chat_template=chat_template)["input_ids"]
            ids = _tokenize(tokenizer, row["prompt"] + row["completion"], chat_template=chat_template)["input_ids"]
        n = common_prefix_length(prompt_ids, ids)  # where the completion starts (TRL's rule)
        out["input_ids"] = list(ids)
        out["completion_mask"] = [0] * n + [1] * (len(ids) - n)
    elif kind == "messages":
        full = _tokenize(tokenizer, row["messages"], return_assistant_tokens_mask=assistant_only_loss, **kwargs)
        out = {k: list(full[k]) for k in ("input_ids", "assistant_masks") if k in full}
    else:
        out["input_ids"] = list(_tokenize(tokenizer, row[text_field], chat_template=chat_template)["input_ids"])
    if "assistant_masks" in out and 1 not in out["assistant_masks"]:
        raise ConfigError(f"{name}: row {index} has no assistant turn to train on (assistant_only_loss is on): "
                          "add an assistant message to it, drop the row, or drop --assistant_only_loss")
    return out


def _build_labels(row: dict, mask_columns: list[str]) -> dict:
    """TRL's labels: the token where every applicable mask is 1, else -100."""
    masks = [row[c] for c in mask_columns]
    return {"labels": [t if all(bits) else -100 for t, *bits in zip(row["input_ids"], *masks)]}


def _labels_from_masks(dataset: Any, completion_only_loss: bool, map_kwargs: dict) -> Any:
    """TRL's ``labels`` from the masks that apply (``completion_mask`` only under completion_only_loss)."""
    masks = [c for c in MASK_COLUMNS if c in dataset.column_names]
    applied = [c for c in masks if c == "assistant_masks" or completion_only_loss]
    return dataset.map(_build_labels, fn_kwargs={"mask_columns": applied}, remove_columns=masks, **map_kwargs)


def _finish(dataset: Any, max_length: int | None, packing: bool, strategy: str, truncation_mode: str,
            map_kwargs: dict, name: str, shuffle_seed: int | None = None) -> Any:
    """Truncation (or, with truncation_mode "none", refusal) of unpacked rows, then TRL's packing."""
    from trl.data_utils import pack_dataset

    if "labels" not in dataset.column_names:
        dataset = dataset.map(lambda row: {"labels": row["input_ids"]}, **map_kwargs)
    if max_length is not None and not packing:
        if truncation_mode == "none":
            for index, ids in enumerate(dataset["input_ids"]):
                if len(ids) > max_length:
                    raise ConfigError(f"{name}: row {index} has {len(ids)} tokens, more than max_length={max_length}, "
                                      "and truncation_mode is 'none': raise --max_length, shorten or drop the row, "
                                      "or set --truncation_mode keep_start")
        else:
            sl = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
            dataset = dataset.map(lambda row: {"input_ids": row["input_ids"][sl], "labels": row["labels"][sl]},
                                  **map_kwargs)
        # Rows left with no trained token (a prompt alone filling max_length) add no loss: TRL drops them.
        dataset = dataset.filter(lambda row: any(t != -100 for t in row["labels"]), **map_kwargs)
        if len(dataset) == 0:
            raise ConfigError(f"{name}: no row keeps a trained token within max_length={max_length}: raise --max_length")
    if packing:
        if max_length is None:
            raise ConfigError("packing needs max_length (the packed row length): set --max_length")
        dataset = dataset.select_columns(["input_ids", "labels"])
        if shuffle_seed is not None:  # TRL's shuffle_dataset also shuffles rows before packing (the caller after)
            dataset = dataset.shuffle(seed=shuffle_seed, keep_in_memory=True)
        dataset = pack_dataset(dataset, max_length, strategy, map_kwargs)
    return dataset


def collator(tokenizer: Any, padding_free: bool, pad_to_multiple_of: int | None = None) -> Any:
    """TRL's ``DataCollatorForLanguageModeling`` (right padding, or padding-free)."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id, padding_free=padding_free,
                                           pad_to_multiple_of=pad_to_multiple_of)
