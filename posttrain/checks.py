"""What a run is given (model folders, data files, the resume checkpoint, the output dir), checked
before anything is written or loaded; each failure is a ConfigError whose one sentence names the fix."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from posttrain.errors import ConfigError

# Suffixes that make a name a file, never a hub id (a hub lookup of "prefs.jsonl" retries for 30 s).
FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".txt", ".safetensors", ".bin", ".pt", ".yaml", ".yml")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")


def looks_local(text: str) -> bool:
    """A path, not a hub id: absolute, ``./``, ``../``, ``~``, more than one ``/``, or a file suffix."""
    return (text.startswith(("/", ".", "~")) or text.count("/") > 1 or "\\" in text
            or text.lower().endswith(FILE_SUFFIXES))


def check_model_path(name_or_path: str | os.PathLike, what: str = "model", weights: bool = True) -> None:
    """A local model folder must hold a config and (``weights``) readable weights; any other name
    must be a well-formed hub id that does not look like a path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        check_model_folder(path, what, weights)
        return
    if path.exists():
        raise ConfigError(f"{what} {text!r} is a file: give the directory that holds its config.json and weights")
    if path.parent != Path(".") and path.parent.is_dir():
        # "runs/my-sft" is also a well-formed hub id, but its parent folder exists here.
        raise ConfigError(f"{what} {text!r} does not exist: {path.parent} has no folder {path.name!r}; check the path")
    try:
        validate_repo_id(text)
        hub_id = not looks_local(text)
    except HFValidationError:
        hub_id = False
    if not hub_id:
        raise ConfigError(f"{what} {text!r} does not exist: it is neither a local directory nor a hub id "
                          "(owner/name); check the path")


def check_model_folder(path: Path, what: str = "model", weights: bool = True) -> None:
    """``save_pretrained``'s output: config.json and whole weight files (a LoRA adapter alone is refused)."""
    if not (path / "config.json").is_file():
        if (path / "adapter_config.json").is_file():
            raise ConfigError(adapter_folder_problem(path, what))
        raise ConfigError(f"{what} {str(path)!r} has no config.json: give the folder that save_pretrained wrote "
                          "(config.json beside the weights)")
    if not weights:
        return
    weights = sorted({p for pattern in WEIGHT_PATTERNS for p in path.glob(pattern)})
    if not weights:
        raise ConfigError(f"{what} {str(path)!r} has no weights (model.safetensors or pytorch_model.bin): give the "
                          "folder that save_pretrained wrote, or copy the weights into it")
    for index in (p for p in weights if p.name.endswith(".index.json")):
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{index} is not a weight index (no weight_map): re-save the model") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ConfigError(f"{what} {str(path)!r} lacks {len(missing)} of its {len(shards)} weight shards "
                              f"({missing[0]}, ...): copy the missing files, or re-save the model")
    for file in weights:
        if file.suffix == ".safetensors":
            check_safetensors(file)


def adapter_folder_problem(path: Path, what: str = "model") -> str:
    """The sentence for a LoRA adapter folder (adapter_config.json, no config.json) given as a model."""
    try:
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    of = f"a LoRA adapter of {base!r}" if base else "a LoRA adapter (its adapter_config.json names no base model)"
    model = repr(base) if base else "its base model"
    return (f"{what} {str(path)!r} is {of}, not a whole model (adapter_config.json, no config.json): give {model} as "
            "the model (with --use_peft, or peft_config=, to train new adapters on it), or merge the adapter into it "
            f"first with PeftModel.from_pretrained(base, {str(path)!r}).merge_and_unload().save_pretrained(folder) "
            "and give that folder")


def check_reward_model(name_or_path: str | os.PathLike, what: str = "reward model") -> None:
    """A local reward model scores with one logit (``num_labels`` 1, as TRL's RewardTrainer saves it)."""
    path = Path(str(name_or_path)).expanduser()
    if not (path / "config.json").is_file():
        return
    config = json.loads((path / "config.json").read_text())
    labels = len(config["id2label"]) if config.get("id2label") else int(config.get("num_labels", 2))
    if labels != 1:
        raise ConfigError(f"{what} {str(name_or_path)!r} has {labels} labels in its config.json; a reward model "
                          "scores with one logit: give a sequence-classification model trained with num_labels=1 (as TRL's "
                          "RewardTrainer saves it)")


def check_safetensors(file: str | os.PathLike) -> None:
    """A safetensors file is whole: its header parses and the last tensor ends at the end of the file."""
    problem = safetensors_problem(file)
    if problem:
        raise ConfigError(f"{file} {problem}: copy it again or re-save the model")


def safetensors_problem(file: str | os.PathLike) -> str | None:
    """What is wrong with a safetensors file ("is truncated (...)"), or None when it is whole."""
    file = Path(file)
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is truncated ({size} bytes, no safetensors header)"
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            return f"is truncated (its header says {length} bytes, the file has {size})"
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError):
            return "is not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return "is not a safetensors file (its header is not a mapping)"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
               and "data_offsets" in t), default=0)
    if 8 + length + end != size:
        return f"is truncated or corrupt ({size} bytes; its header says {8 + length + end})"
    return None


def check_data_path(name: str, what: str = "--dataset_name") -> None:
    """A dataset name that is plainly a local path must exist (``datasets`` would ask the hub)."""
    path = Path(name).expanduser()
    if path.exists():
        return
    if looks_local(name) or (path.parent != Path(".") and path.parent.is_dir()):
        where = ("no such file in the current directory" if path.parent == Path(".") else
                 f"{path.parent} has no {path.name!r}" if path.parent.is_dir() else f"{path.parent} does not exist")
        raise ConfigError(f"{what} {name!r} does not exist ({where}): give a json/jsonl/parquet/csv file, a dataset "
                          "folder or a hub dataset name")


def check_resume_path(value: str | None, output_dir: str) -> None:
    """``resume_from_checkpoint`` names a checkpoint (``checkpoint-N/``, or latest), not a model folder."""
    if not value or str(value).lower() in ("latest", "true"):
        return
    path = Path(value).expanduser()
    if not path.exists():
        raise ConfigError(f"resume_from_checkpoint {value!r} does not exist: give a checkpoint-N folder of an output "
                          f"dir, or latest (the newest in {output_dir})")
    if not (path / "state").exists() and (path / "config.json").is_file():
        raise ConfigError(f"resume_from_checkpoint {value!r} is a model folder, not a checkpoint: to start from these "
                          "weights pass --model_name_or_path instead; to continue a run give its checkpoint-N folder")


def check_output_dir(output_dir: str | os.PathLike) -> str:
    """The output dir (or its nearest existing parent) is a writable folder; returns it with ``~`` expanded,
    the path the run must use (a YAML value reaches here unexpanded: no folder named ``~`` is ever made)."""
    text = os.fspath(output_dir)
    if not text.strip():
        raise ConfigError("output_dir is empty: give the folder for the run with --output_dir (it is created if "
                          "missing)")
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):
        user = expanded[1:].split("/", 1)[0]
        raise ConfigError(f"output_dir {text!r} starts with ~{user}, and this machine has no user {user!r}: give the "
                          "folder's full path with --output_dir")
    path = Path(expanded).absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output_dir {text!r} is a file: choose a folder with --output_dir")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"output_dir {text!r} cannot be created: {existing} is a file; choose another "
                          "--output_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created: {existing} is not writable"
        raise ConfigError(f"output_dir {text!r} {what}; choose a writable --output_dir")
    return expanded
