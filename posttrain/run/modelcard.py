"""A run's model card (``README.md``) and learning curves (``learning_curves.png``): TRL's card parts, plus
each role's DeepSpeed placement, the config and the final metrics."""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import asdict, fields, is_dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from posttrain.run.jsonrows import read_rows

CARD_FILE = "README.md"
CURVES_FILE = "learning_curves.png"

# Each method's name, tags and paper from TRL's trainer classes, copied: importing them costs seconds.
METHODS: dict[str, dict[str, Any]] = yaml.safe_load(
    (Path(__file__).resolve().parent / "modelcard_methods.yaml").read_text(encoding="utf-8"))

# The main curves by metric name without "eval/" or "train/" (any "<model>/loss" too).
CURVES = ("loss", "rewards/accuracies", "rewards/margins", "objective/scores", "objective/rlhf_reward",
          "objective/kl", "loss/policy_avg", "loss/value_avg", "reward", "kl", "forward_kl")
MAX_PANELS = 9
_kept_readmes: set[Path] = set()  # output dirs whose README.md was kept (said once per dir)

_TEMPLATE = """\
---
{{ card_data }}
---

# Model Card for {{ model_name }}

This model is a fine-tuned version of {{ base_model_text }}{% if dataset_text %} on {{ dataset_text }}{% endif %}.
It has been trained with posttrain's {{ trainer_name }} trainer (TRL's data formats and {{ trainer_name }} \
math, each model role under its own DeepSpeed plugin).
{% if quick_start %}
## Quick start

```python
from transformers import pipeline

question = "If you had a time machine, but could only go to the past or the future once and never return, which would you choose and why?"
generator = pipeline("text-generation", model="{{ quick_start_model }}", device_map="auto")
output = generator([{"role": "user", "content": question}], max_new_tokens=128, return_full_text=False)[0]
print(output["generated_text"])
```
{% endif %}{% if model_folders %}
## The models

In Hugging Face format in this folder: {% if quick_start %}the trained {{ top_model }} at its top \
(`from_pretrained` of the folder loads it) and {% endif %}\
{% for name in model_folders %}the trained {{ name }} in `{{ name }}/`{% if not loop.last %}, {% endif %}{% endfor %}.
{% endif %}
## Training procedure

This model was trained with {{ trainer_name }}{% if paper_id %}, a method introduced in \
[{{ paper_title }}](https://huggingface.co/papers/{{ paper_id }}){% endif %}.
{% if roles %}
| role | trains | DeepSpeed config | ZeRO stage | master weights and Adam states |
|---|---|---|---|---|
{% for r in roles %}| {{ r.name }} | {{ r.trains }} | {{ r.config }} | {{ r.stage }} | {{ r.master }} |
{% endfor %}{% endif %}{% if lora_text %}
{{ lora_text }}
{% endif %}
### Final metrics
{% if metrics %}
| metric | value | step |
|---|---|---|
{% for m in metrics %}| {{ m.name }} | {{ m.value }} | {{ m.step }} |
{% endfor %}{% else %}
No metrics were logged.
{% endif %}{% if curves %}
### Learning curves

![learning curves]({{ curves }})
{% endif %}
### Configuration

```yaml
{{ config_yaml }}```

### Framework versions

{% for name, version in versions %}- {{ name }}: {{ version }}
{% endfor %}
## Citations
{% if trainer_citation %}
Cite {{ trainer_name }} as:

```bibtex
{{ trainer_citation }}
```
{% endif %}
Cite TRL as:

```bibtex
{% raw %}@software{vonwerra2020trl,
  title   = {{TRL: Transformers Reinforcement Learning}},
  author  = {von Werra, Leandro and Belkada, Younes and Tunstall, Lewis and Beeching, Edward and Thrush, Tristan and Lambert, Nathan and Huang, Shengyi and Rasul, Kashif and Gallouédec, Quentin},
  license = {Apache-2.0},
  url     = {https://github.com/huggingface/trl},
  year    = {2020}
}{% endraw %}
```
"""


def is_posttrain_card(path: str | Path) -> bool:
    """Whether ``path`` is a model card posttrain wrote (its front matter tags "posttrain")."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(65536)  # the front matter is at the top
    except OSError:
        return False
    match = re.match(r"---\n(.*?)\n---\n", text, re.DOTALL)
    if match is None:
        return False
    try:
        front = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        return False
    return isinstance(front, dict) and isinstance(front.get("tags"), list) and "posttrain" in front["tags"]


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a ``metrics.jsonl`` (an empty list when there is none)."""
    return read_rows(path)


def final_metrics(rows: list[dict]) -> dict[str, tuple[float, int]]:
    """Each metric's last logged finite value and its step (time/* and counters left out)."""
    out: dict[str, tuple[float, int]] = {}
    for row in rows:
        step = int(row.get("step", row.get("update", 0)))
        for key, value in row.items():
            if key in ("step", "update") or key.startswith("time/") or not _is_number(value):
                continue
            out[key] = (float(value), step)
    return out


def curve_panels(keys: list[str] | set[str]) -> list[tuple[str, list[str]]]:
    """(title, metric names) per panel: the main curves present, each with its eval counterpart."""
    panels: dict[str, list[str]] = {}
    for key in sorted(keys):
        base = re.sub(r"^(eval|train)/", "", key)
        if base in CURVES or base.endswith("/loss"):
            panels.setdefault(base, []).append(key)
    order = {name: i for i, name in enumerate(CURVES)}
    ranked = sorted(panels.items(), key=lambda item: (order.get(item[0], len(CURVES)), item[0]))
    return [(title, sorted(names, key=lambda k: k.startswith("eval/"))) for title, names in ranked[:MAX_PANELS]]


def plot_learning_curves(rows: list[dict], path: str | Path) -> Path | None:
    """A PNG of the main curves in ``rows``; None without matplotlib or any curve to draw."""
    try:
        from matplotlib.figure import Figure  # no pyplot: leaves the process-wide backend alone
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print("[posttrain] matplotlib is not installed: no learning-curve plot "
              "(pip install 'posttrain[bench]' or matplotlib)", file=sys.stderr)
        return None
    panels = curve_panels({k for row in rows for k, v in row.items() if _is_number(v)})
    if not panels:
        return None
    cols = min(3, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.0 * nrows), layout="constrained")
    axes = list(fig.subplots(nrows, cols, squeeze=False).flat)
    for ax, (title, names) in zip(axes, panels):
        for name in names:
            points = [(int(r.get("step", r.get("update", 0))), float(r[name])) for r in rows if _is_number(r.get(name))]
            steps, values = zip(*points)
            ax.plot(steps, values, label="eval" if name.startswith("eval/") else "train",
                    marker="o" if name.startswith("eval/") or len(points) < 20 else None, markersize=3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(names) > 1:
            ax.legend(fontsize=8)
    for ax in axes[len(panels):]:
        ax.set_axis_off()
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path


def write_model_card(output_dir: str | Path, cfg: Any, method: str, session: Any = None,
                     base_model: str | None = None, dataset_name: str | None = None,
                     peft_config: Any = None, model_name: str | None = None, tags: Any = None) -> Path | None:
    """Write ``README.md`` and curves to ``output_dir`` from ``cfg``; returns its path. Main only.
    A README.md posttrain did not write is kept (said once) and None returned."""
    from huggingface_hub import ModelCard, ModelCardData

    from posttrain.placement import dsconfig

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (out / CARD_FILE).exists() and not is_posttrain_card(out / CARD_FILE):
        # Someone else's README (a project's, in --output_dir .): never replaced, and no curves for a card not written.
        if out.resolve() not in _kept_readmes:
            _kept_readmes.add(out.resolve())
            print(f"[posttrain] {out / CARD_FILE} is not posttrain's model card: it is kept as it is, and the run's "
                  "model card is not written", file=sys.stderr)
        return None
    info = METHODS.get(method, {"name": method, "tags": [method], "paper": {}})
    base_model = base_model or getattr(cfg, "model_name_or_path", None)

    rows = read_metrics(out / "metrics.jsonl")
    try:
        curves = plot_learning_curves(rows, out / CURVES_FILE)
    except Exception as err:  # the final model is saved after this: never fail the run here
        print(f"[posttrain] learning-curve plot skipped ({type(err).__name__}: {err}); the card is written without it",
              file=sys.stderr)
        curves = None
    if curves is None:
        (out / CURVES_FILE).unlink(missing_ok=True)  # an older run's plot would not match this card
    metrics = [{"name": k, "value": f"{v:.4g}", "step": step} for k, (v, step) in final_metrics(rows).items()]

    roles = []
    if session is not None:
        for name, role in session.roles.items():
            resolved = session.configs[name]
            stage = str(dsconfig.zero_stage(resolved))
            if dsconfig.params_offloaded(resolved):
                stage += " (parameters offloaded)"
            label = f"`{role.config}`" if isinstance(role.config, (str, Path)) else "a dict given in code"
            if name in getattr(session, "plain_roles", ()):
                label += " (one process: no DeepSpeed engine, torch AdamW)"
                stage = "none"
            elif name in getattr(session, "one_rank_changes", {}) and dsconfig.zero_stage(resolved) == 0:
                label += " (one process: replicated)"
            master = dsconfig.master_weights(resolved) if role.trains else "–"
            roles.append({"name": name, "trains": "yes" if role.trains else "no", "config": label, "stage": stage,
                          "master": master})

    if model_name is None:  # TRL's: the hub repo's name, else the output dir's
        model_name = Path(cfg.hub_model_id).name if getattr(cfg, "hub_model_id", None) else out.resolve().name
    extra = [tags] if isinstance(tags, str) else list(tags or [])
    hub_base = base_model if _is_hub_id(base_model) else None
    hub_dataset = dataset_name if _is_hub_id(dataset_name) else None
    card_data = ModelCardData(base_model=hub_base, datasets=hub_dataset, library_name="transformers",
                              model_name=model_name, tags=["generated_from_trainer", *info["tags"], *extra, "posttrain"])
    trained = [r.name for r in session.roles.values() if r.trains] if session is not None else []
    card = ModelCard.from_template(
        card_data, template_str=_TEMPLATE, model_name=model_name,
        base_model_text=_source_text(base_model, "https://huggingface.co", "a model given as an object"),
        dataset_text=_source_text(dataset_name, "https://huggingface.co/datasets", None),
        trainer_name=info["name"], paper_title=info["paper"].get("title"), paper_id=info["paper"].get("id"),
        trainer_citation=info["paper"].get("citation"), quick_start_model=_quick_start_model(cfg, out),
        quick_start=method != "multi" and (not trained or trained[0] in ("policy", "student")),
        # Folders of their own: every model of a multi-model run, else those beside the top one.
        model_folders=trained if method == "multi" else trained[1:],
        top_model=trained[0] if trained else "model", roles=roles, metrics=metrics,
        curves=CURVES_FILE if curves is not None else None, lora_text=_lora_text(cfg, peft_config),
        config_yaml=_config_yaml(cfg), versions=[(name, _version(dist)) for name, dist in _FRAMEWORKS])
    path = out / CARD_FILE
    card.save(path)
    return path


def _lora_text(cfg: Any, peft_config: Any) -> str | None:
    """What a LoRA run trained and saved, and what its reference was (``reference_model``)."""
    if peft_config is None:
        return None
    targets = peft_config.target_modules
    targets = (sorted(targets) if isinstance(targets, (set, list, tuple)) else targets) or \
        "peft's default for the architecture"
    saved = ("the base with the adapters merged in, a plain transformers model" if cfg.merge_adapters else
             "the adapter in PEFT format (`PeftModel.from_pretrained(base, folder)` loads it)")
    text = (f"LoRA (r {peft_config.r}, alpha {peft_config.lora_alpha}, dropout {peft_config.lora_dropout}, target "
            f"modules {targets}): "
            f"only the adapters were trained, and the model is saved as {saved}.")
    reference = getattr(cfg, "reference_model", "")
    if reference and not reference.startswith("none"):
        text += f" The reference model was {reference} (no reference role, no reference memory)."
    return text


def _quick_start_model(cfg: Any, out: Path) -> str:
    """What the quick start loads: the hub repo when the run pushes there, else the output dir."""
    if getattr(cfg, "hub_model_id", None):
        return cfg.hub_model_id
    if getattr(cfg, "push_to_hub", False):
        return out.resolve().name
    return str(out)


_FRAMEWORKS = (("posttrain", "posttrain"), ("TRL", "trl"), ("Transformers", "transformers"), ("Pytorch", "torch"),
               ("Datasets", "datasets"), ("Tokenizers", "tokenizers"), ("Accelerate", "accelerate"),
               ("DeepSpeed", "deepspeed"))


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_hub_id(name: str | None) -> bool:
    """A hub repo id (``org/name`` or ``name``), not a local path or data file."""
    if not name or Path(name).expanduser().exists():
        return False
    return bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name)) and not re.search(r"\.(jsonl?|csv|parquet|txt)$", name)


def _source_text(name: str | None, hub_url: str, default: str | None) -> str | None:
    if not name:
        return default
    return f"[{name}]({hub_url}/{name})" if _is_hub_id(name) else f"`{name}`"


def config_values(cfg: Any) -> dict[str, Any]:
    """The config's fields, tokens masked and enums as values (TrainingArguments.to_dict) where the config can,
    and the values the run resolved itself (fields without a flag, such as GRPO's ``reference_model``)."""
    if not hasattr(cfg, "to_dict"):
        return asdict(cfg) if is_dataclass(cfg) else dict(cfg)
    resolved = {f.name: getattr(cfg, f.name) for f in fields(cfg) if not f.init and not f.name.startswith("_")}
    return {**cfg.to_dict(), **resolved}


def _config_yaml(cfg: Any) -> str:
    return yaml.safe_dump(json.loads(json.dumps(config_values(cfg), default=str)), sort_keys=False)
