"""The model card and learning curves a run leaves in its output dir (posttrain/modelcard.py)."""

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import ROOT, torchrun
from huggingface_hub import ModelCard
from PIL import Image

from posttrain.demo import tiny
from posttrain.run import modelcard
from posttrain.trainers.dpo import DPOConfig
from posttrain.trainers.ppo import PPOConfig


def _metrics(path: Path) -> list[dict]:
    rows = []
    for step in range(1, 31):
        rows.append({"step": step, "loss": 0.69 * 0.95**step, "rewards/accuracies": min(1.0, step / 20),
                     "rewards/margins": 0.1 * step, "grad_norm": 1.0 + step / 7, "learning_rate": 1e-3,
                     "time/backward": 0.25})
        if step % 10 == 0:
            rows.append({"step": step, "eval/loss": 0.7 * 0.96**step, "eval/rewards/accuracies": step / 31})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _final_rows(text: str) -> dict[str, tuple[str, int]]:
    """The card's final-metrics table: metric -> (value as written, step)."""
    table = text.split("### Final metrics")[1].split("###")[0]
    return {m[0]: (m[1], int(m[2])) for m in re.findall(r"^\| (\S+) \| (\S+) \| (\d+) \|$", table, re.M)}


def _assert_png(path: Path) -> None:
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.width >= 300 and image.height >= 200
        image.verify()


def test_methods_are_trls():
    """The copied name, tags and paper of each method equal TRL's trainer class attributes."""
    from trl import DPOTrainer, GRPOTrainer, KTOTrainer, RewardTrainer, SFTTrainer
    from trl.experimental.gkd import GKDTrainer

    for method, trainer in {"dpo": DPOTrainer, "grpo": GRPOTrainer, "distill": GKDTrainer, "sft": SFTTrainer,
                            "reward": RewardTrainer, "kto": KTOTrainer}.items():
        assert modelcard.METHODS[method] == {"name": trainer._name, "tags": trainer._tag_names, "paper": trainer._paper}


def test_card_and_curves_from_metrics(tmp_path):
    rows = _metrics(tmp_path / "metrics.jsonl")
    cfg = DPOConfig(output_dir=str(tmp_path), learning_rate=3e-7, beta=0.2)
    path = modelcard.write_model_card(tmp_path, cfg, "dpo", base_model="Qwen/Qwen2.5-0.5B",
                                      dataset_name="trl-lib/ultrafeedback_binarized")

    card = ModelCard.load(path)
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B"
    assert card.data.datasets == "trl-lib/ultrafeedback_binarized"
    assert {"generated_from_trainer", "trl", "dpo", "posttrain"} <= set(card.data.tags)
    text = card.text
    assert "fine-tuned version of [Qwen/Qwen2.5-0.5B](https://huggingface.co/Qwen/Qwen2.5-0.5B) on " \
           "[trl-lib/ultrafeedback_binarized](https://huggingface.co/datasets/trl-lib/ultrafeedback_binarized)" in text
    assert "trained with DPO, a method introduced in [Direct Preference Optimization" in text
    assert "@inproceedings{rafailov2023direct" in text
    # The final value of every metric, time/* left out.
    last = {k: (f"{v:.4g}", 30) for k, v in {**rows[-2], **rows[-1]}.items() if k != "step" and not k.startswith("time/")}
    assert _final_rows(text) == last
    # The config, as YAML.
    config = text.split("```yaml\n")[1].split("```")[0]
    assert "learning_rate: 3.0e-07" in config and "beta: 0.2" in config

    assert "![learning curves](learning_curves.png)" in text
    _assert_png(tmp_path / "learning_curves.png")
    assert modelcard.curve_panels({k for r in rows for k in r}) == [
        ("loss", ["loss", "eval/loss"]), ("rewards/accuracies", ["rewards/accuracies", "eval/rewards/accuracies"]),
        ("rewards/margins", ["rewards/margins"])]


def test_local_model_and_bundled_data(tmp_path):
    from posttrain.scripts.data import BUNDLED_PROMPTS

    _metrics(tmp_path / "metrics.jsonl")
    # The trainers take data objects, so a card names the data only when its caller (a script) does; a model
    # built from a config has no name or path to give.
    card = ModelCard.load(modelcard.write_model_card(tmp_path, PPOConfig(output_dir=str(tmp_path)), "ppo"))
    assert "fine-tuned version of a model given as an object.\n" in card.text
    card = ModelCard.load(modelcard.write_model_card(tmp_path, PPOConfig(output_dir=str(tmp_path)), "ppo",
                                                     dataset_name=BUNDLED_PROMPTS))
    assert card.data.base_model is None and card.data.datasets is None  # the hub validates both: hub names only
    assert "fine-tuned version of a model given as an object on `posttrain's bundled synthetic prompts`" in card.text
    assert "huggingface.co/None" not in card.text
    assert "trained with PPO, a method introduced in [Fine-Tuning Language Models from Human Preferences]" in card.text


def test_quick_start_loads_the_output_dir_or_the_hub_repo(tmp_path):
    """The trained model is saved at the top of the output dir, so the quick start loads that dir;
    a run that pushes (or names its hub repo) loads the repo, as TRL's card does."""
    out = tmp_path / "my-run"

    def quick_start(**fields) -> str:
        text = modelcard.write_model_card(out, DPOConfig(output_dir=str(out), **fields), "dpo").read_text()
        return re.search(r'pipeline\("text-generation", model="([^"]+)"', text).group(1)

    assert quick_start() == str(out)
    assert quick_start(push_to_hub=True) == "my-run"
    assert quick_start(hub_model_id="me/dpo-tiny") == "me/dpo-tiny"


def test_without_matplotlib(tmp_path, monkeypatch, capsys):
    _metrics(tmp_path / "metrics.jsonl")
    (tmp_path / "learning_curves.png").write_bytes(b"an older run's plot")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    card = ModelCard.load(modelcard.write_model_card(tmp_path, DPOConfig(output_dir=str(tmp_path)), "dpo"))
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "learning_curves.png").exists()
    assert "learning_curves.png" not in card.text and "| loss |" in card.text


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("modelcard") / "ppo"
    torchrun(ROOT / "tests" / "dist" / "modelcard_run.py", out, nproc=1)
    return out


def test_trainer_writes_card_and_curves(ppo_run):
    """A real run of the script: RunLog.close writes the card from the run's own config, roles and
    metrics.jsonl, and the script names the data in it."""
    text = (ppo_run / "README.md").read_text()
    assert f"fine-tuned version of `{tiny.sft_model_path()}` on `{ppo_run.parent / 'prompts.jsonl'}`" in text
    assert "trained with PPO" in text
    # One process: the reference's ZeRO-3 mix placement ran replicated (dsconfig.one_rank), and the
    # card says so, with the precision the policy's optimizer kept.
    assert "| policy | yes | `zero2_train` | 2 | fp32 |" in text
    # PPO decodes its policy: single_process_engine auto keeps DeepSpeed for both trained roles at fp32.
    assert "| value | yes | `zero2_train` | 2 | fp32 |" in text
    assert "| reference | no | `zero3_inference` (one process: replicated) | 0 | – |" in text
    assert f'model="{ppo_run}"' in text
    assert "the trained policy at its top (`from_pretrained` of the folder loads it) and the trained value in `value/`." in text
    rows = modelcard.read_metrics(ppo_run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    final = _final_rows(text)
    assert final["objective/scores"] == (f"{rows[-1]['objective/scores']:.4g}", 3)
    assert final == {k: (f"{v:.4g}", s) for k, (v, s) in modelcard.final_metrics(rows).items()}
    _assert_png(ppo_run / "learning_curves.png")
