"""The scripts' settings, TRL's way: ``--config FILE`` (else the demo YAML when no model is named) plus
flags; unknown names are refused with the nearest known one."""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import MISSING, asdict, fields
from pathlib import Path
from typing import Any

from posttrain import checks
from posttrain.errors import ConfigError
from posttrain.placement.launch import check_launch
from posttrain.placement.roles import check_placement

DEMO_DIR = Path(__file__).resolve().parent / "demo"


def demo_config(name: str) -> Path:
    return DEMO_DIR / f"{name}.yaml"


def parse_config(dataclass_types: Any, demo: str | os.PathLike | None = None,
                 argv: Sequence[str] | None = None, model_fields: Sequence[str] = ("model_name_or_path",),
                 prog: str | None = None) -> tuple:
    """Instances of ``dataclass_types`` from ``--config`` (or ``demo`` if no model is named) and flags."""
    types = list(dataclass_types) if isinstance(dataclass_types, (list, tuple)) else [dataclass_types]
    argv = _split_config_flag(list(sys.argv[1:] if argv is None else argv))
    config = argv.pop(argv.index("--config") + 1) if "--config" in argv else None
    if "--config" in argv:
        argv.remove("--config")
    source = f"--config {config}" if config else "defaults (TRL's where the concept is the same) and flags"
    outputs = _parse(types, config, argv, prog)
    if config is None and demo is not None and not any(getattr(o, f, None) for o in outputs for f in model_fields):
        outputs = _parse(types, str(demo), argv, prog)
        source = f"the built-in tiny default's demo settings ({_shown_path(demo)}) and flags"
    check_inputs(outputs)
    if _is_main_process():
        print(describe(outputs, source, prog), flush=True)
    return outputs


def _split_config_flag(argv: list[str]) -> list[str]:
    out = []
    for a in argv:
        out.extend(a.split("=", 1) if a.startswith("--config=") else [a])
    return out


def _parse(types: list, config: str | None, argv: list[str], prog: str | None) -> tuple:
    import yaml
    from trl import TrlParser

    # No prefix matching: a mistyped flag (--total_episode) must not silently set another one.
    parser = TrlParser(types, prog=prog, allow_abbrev=False, description=(
        "--config FILE: a YAML of settings, which the flags below override. Without it, a run with no model "
        "takes the built-in tiny default's demo settings, a run with your model the defaults shown."))
    known = {s[2:] for action in parser._actions for s in action.option_strings if s.startswith("--")}
    for action in parser._actions:  # TrainingArguments' enums, TRL's Literals: the config's check says it in a sentence
        if action.choices is not None and action.dest != "help" and not isinstance(action.choices, dict):
            action.choices = None
    # argparse takes "-1e-3" for a flag before Python 3.14 (gh-124693); this is 3.14's pattern.
    parser._negative_number_matcher = re.compile(r"^-\.?\d")
    if config is not None:
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"--config {config}: no such file; give the path of a YAML file of settings")
        try:
            values = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:  # a tab in the indentation, an unclosed quote, ...
            mark = getattr(err, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            raise ConfigError(f"{config} is not valid YAML{where}: {getattr(err, 'problem', None) or err}; indent "
                              "with spaces, not tabs") from None
        if not isinstance(values, dict):
            raise ConfigError(f"{config} must be a YAML mapping of setting: value, got a {type(values).__name__}")
        for key, value in (values.pop("env", None) or {}).items():  # TrlParser's `env:` block
            os.environ[key] = str(value)
        for key in values:
            if key not in known:
                raise ConfigError(f"{config}: unknown setting {key!r}{_nearest(key, known)}")
        parser.set_defaults_with_config(**_coerce(parser, values))
    *outputs, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    flags = [a for a in rest if a.startswith("-")]
    if rest:
        bad = (flags or rest)[0]
        name = bad.lstrip("-").split("=", 1)[0]
        if flags:
            raise ConfigError(f"unknown flag {bad.split('=', 1)[0]}{_nearest(name, known, prefix='--')}")
        raise ConfigError(f"unexpected argument {bad!r}: settings are given as --name value")
    return tuple(outputs)


# Renamed settings, with their names now (difflib would pick another one).
RENAMED = {"dataset_split": "dataset_train_split"}


def _nearest(name: str, known: set[str], prefix: str = "") -> str:
    """The sentence's end: the closest known name (difflib) or where the list is."""
    if RENAMED.get(name) in known:
        return f": did you mean {prefix}{RENAMED[name]}?"
    match = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    if match:
        return f": did you mean {prefix}{match[0]}?"
    return "; --help lists every setting"


def _coerce(parser: Any, values: dict) -> dict:
    """Convert YAML strings such as ``1e-3`` with the flag's own type, so a YAML and a flag agree."""
    types = {a.dest: a.type for a in parser._actions if callable(a.type)}
    out = {}
    for key, value in values.items():
        convert = types.get(key)
        if isinstance(value, str) and convert in (int, float):
            try:
                value = convert(value)
            except ValueError as err:
                raise ConfigError(f"{key}: {value!r} is not a {convert.__name__}") from err
        out[key] = value
    return out


# Shown whatever their value: what a reader checks first.
KEY_SETTINGS = ("model_name_or_path", "dataset_name", "learning_rate", "per_device_train_batch_size",
                "gradient_accumulation_steps", "max_steps", "num_train_epochs", "mixed_precision", "mix")


def describe(outputs: Sequence[Any], source: str, prog: str | None = None) -> str:
    """The settings' source, the key ones, and every other value that differs from its default."""
    values, changed, output_dir = {}, [], None
    for obj in outputs:
        for f in fields(obj):
            value = getattr(obj, f.name)
            output_dir = value if f.name == "output_dir" else output_dir
            default = f.default if f.default is not MISSING else (
                f.default_factory() if f.default_factory is not MISSING else MISSING)
            values[f.name] = value
            if value != default and f.name not in KEY_SETTINGS:
                changed.append(f"{f.name}={value}")
    key = [f"{k}={values[k]}" for k in KEY_SETTINGS if k in values and values[k] is not None]
    head = f"{prog or 'posttrain'}: settings from {source}"
    if output_dir:
        head += f"; all of them go to {output_dir}/posttrain_config.json"
    body = textwrap.fill(" ".join(key + changed), width=108, initial_indent="  ", subsequent_indent="  ",
                         break_on_hyphens=False)
    return f"{head}\n{body}"


def record_script_arguments(output_dir: str | os.PathLike, *arguments: Any) -> None:
    """Add the script's dataclasses to ``posttrain_config.json`` (after training, main process)."""
    from posttrain.run.output_dir import SETTINGS_FILE

    path = Path(output_dir) / SETTINGS_FILE
    settings = json.loads(path.read_text()) if path.exists() else {}
    settings["script_arguments"] = {k: v if isinstance(v, (int, float, str, bool, type(None), list, dict)) else str(v)
                                    for a in arguments for k, v in asdict(a).items()}
    path.write_text(json.dumps(settings, indent=1))


def _shown_path(path: str | os.PathLike) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def check_model_paths(outputs: Sequence[Any]) -> None:
    """Check that every ``*model_name_or_path``/``*model_path`` names a model folder or a hub id."""
    for obj in outputs:
        for f in fields(obj):
            value = getattr(obj, f.name)
            if f.name.endswith(("model_name_or_path", "model_path")) and isinstance(value, str) and value != "none":
                checks.check_model_path(value, f"--{f.name}")
                if f.name == "reward_model_path":
                    checks.check_reward_model(value, f"--{f.name}")


def check_inputs(outputs: Sequence[Any]) -> None:
    """Check paths, placement, checkpoint and output dir before anything is written or loaded."""
    check_model_paths(outputs)
    values = {f.name: getattr(o, f.name) for o in outputs for f in fields(o)}
    if values.get("dataset_streaming"):  # TRL's ScriptArguments flag: the trainers take whole datasets
        raise ConfigError("--dataset_streaming: posttrain's trainers take a whole datasets.Dataset (or rows), not a "
                          "stream; drop the flag")
    if isinstance(values.get("dataset_name"), str):
        checks.check_data_path(values["dataset_name"])
    if "mix" in values:
        check_placement(values["mix"], values.get("role_configs"))
    if "output_dir" in values:
        checks.check_output_dir(values["output_dir"])
        checks.check_resume_path(values.get("resume_from_checkpoint"), values["output_dir"])


def require_dataset(outputs: Sequence[Any], model_fields: Sequence[str] = ("model_name_or_path",)) -> None:
    """Refuse a named model without ``--dataset_name`` (the bundled data is made for the tiny default)."""
    values = {f.name: getattr(o, f.name) for o in outputs for f in fields(o)}
    named = [f for f in model_fields if values.get(f)]
    if named and not values.get("dataset_name"):
        raise ConfigError(f"--{named[0]} is set but --dataset_name is not: give your data with --dataset_name (a hub "
                          "name or a json/jsonl/parquet/csv file), or drop --model_name_or_path to run the built-in "
                          "tiny default on its bundled data")


# ModelConfig's LoRA flags: set without --use_peft they would be ignored.
_LORA_FLAGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters",
               "lora_modules_to_save", "use_rslora", "use_dora")


def model_arguments(model_args: Any, cfg: Any, demo_model: Callable[[], Any]) -> tuple[str, Any]:
    """The model to train and its peft config from TRL's ``ModelConfig``, as TRL's scripts build them
    (``model_init_kwargs`` from ``--dtype``, ``--model_revision``, ``--attn_implementation``)."""
    from trl import ModelConfig, get_peft_config

    from posttrain.models.lora import check_lora_fields

    check_lora_fields(model_args)
    defaults = ModelConfig()
    if model_args.load_in_4bit or model_args.load_in_8bit:
        raise ConfigError("--load_in_4bit / --load_in_8bit: quantized (bitsandbytes) training is not supported; "
                          "drop the flag and load the model in bf16 (--dtype bfloat16)")
    changed = [f for f in _LORA_FLAGS if hasattr(model_args, f) and getattr(model_args, f) != getattr(defaults, f)]
    if changed and not model_args.use_peft:
        raise ConfigError(f"--{changed[0]} is set but --use_peft is not: add --use_peft to train LoRA adapters, or "
                          "drop the LoRA flags")
    if getattr(cfg, "merge_adapters", False) and not model_args.use_peft:
        raise ConfigError("--merge_adapters merges LoRA adapters into the saved model, but --use_peft is not set: "
                          "add --use_peft, or drop --merge_adapters")
    kwargs = {"revision": model_args.model_revision, "trust_remote_code": getattr(cfg, "trust_remote_code", None),
              "attn_implementation": model_args.attn_implementation, "dtype": model_args.dtype}
    cfg.model_init_kwargs = {**{k: v for k, v in kwargs.items() if v is not None}, **(cfg.model_init_kwargs or {})}
    model = model_args.model_name_or_path or str(demo_model())
    return model, get_peft_config(model_args)


def finish(trainer: Any, dataset_name: str | None) -> None:
    """A script's last steps after the save, as TRL's: the card naming the data (after the save: a peft save
    rewrites the card's tags), the upload when asked, then ``end()``."""
    trainer.create_model_card(dataset_name=dataset_name)
    if trainer.args.push_to_hub:
        url = trainer.push_to_hub(dataset_name=dataset_name)
        if url:
            note(f"pushed to {url}")
    trainer.end()


def run_script(main: Callable[[list[str] | None], Any], argv: Sequence[str] | None = None) -> int:
    """Run a script's ``main``: a ConfigError ends it with one sentence (status 2), Ctrl-C with 130."""
    from posttrain.run import interrupt

    interrupt.install()
    try:
        check_launch()  # a multi-process launch that started one process
        main(None if argv is None else list(argv))
    except ConfigError as err:
        return report_error(err)
    except BaseException as err:
        try:
            status = interrupt.exit_status(err)
        except KeyboardInterrupt as late:  # a rank stuck in a collective runs the signal's handler only now
            status = interrupt.exit_status(late)
        if status is None:
            raise
        return status
    return 0


# How long a rank other than 0 waits before reporting a bad input itself: rank 0 normally fails too
# and its launcher stops the others; a rank still alive after this failed alone.
OTHER_RANKS_WAIT_S = 10.0


def report_error(err: Exception) -> int:
    """Say the sentence once (rank 0, or another rank that failed alone), in the launcher's error
    file when there is one so that its failure report ends with it, else on stderr. Returns 2."""
    message = f"error: {err}"
    rank = int(os.environ.get("RANK", "0"))
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        # After an error the ranks are not in step: no exit barrier.
        torch.distributed.destroy_process_group()
    if rank != 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # The launcher's signal once rank 0 has failed: a silent end, not an interrupt report.
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        time.sleep(OTHER_RANKS_WAIT_S)
        message = f"error (rank {rank}): {err}"
    if not _write_launcher_error_file(message):
        print(message, file=sys.stderr, flush=True)
    return 2


def _write_launcher_error_file(message: str) -> bool:
    """Write ``message`` to ``TORCHELASTIC_ERROR_FILE`` as torch elastic does; False if not possible."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    data = {"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                          "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        return False
    return True


def note(text: str) -> None:
    """A line for the user, from rank 0 only."""
    if _is_main_process():
        print(text, flush=True)
