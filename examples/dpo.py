"""DPO with the policy and the reference on their own DeepSpeed plugins.

With no model and no dataset it trains the built-in tiny default on bundled synthetic preference
pairs (written to jsonl and read back through `datasets`) and reports held-out reward accuracy:

    torchrun --standalone --nproc_per_node 2 examples/dpo.py --config configs/dpo.yaml
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml examples/dpo.py

The same script takes hub names or local paths (`--model_name_or_path`, `--dataset_name`) and
placements (`--mix`, or `role_configs` in the YAML). Without `--config` it reads configs/dpo.yaml.
"""

from dataclasses import dataclass
from pathlib import Path

from trl import ScriptArguments

from posttrain import synthetic
from posttrain.preference import load_dataset_source, write_jsonl
from posttrain.trainers.common import parse_config
from posttrain.trainers.dpo import DPOConfig, DPOTrainer


@dataclass
class SyntheticArguments:
    synthetic_train_size: int = 512
    synthetic_eval_size: int = 128


def datasets(script: ScriptArguments, synth: SyntheticArguments, cfg: DPOConfig):
    if script.dataset_name is None:
        # Bundled pairs; the held-out split is another seed.
        data = Path(cfg.output_dir) / "data"
        train = write_jsonl(synthetic.preference_pairs(synth.synthetic_train_size, seed=0), data / "train.jsonl")
        test = write_jsonl(synthetic.preference_pairs(synth.synthetic_eval_size, seed=1), data / "test.jsonl")
        return load_dataset_source(str(train)), load_dataset_source(str(test))
    train = load_dataset_source(script.dataset_name, script.dataset_train_split, script.dataset_config)
    try:
        test = load_dataset_source(script.dataset_name, script.dataset_test_split, script.dataset_config)
    except (ValueError, KeyError):
        test = None  # a single file, or no test split
    return train, test


DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "dpo.yaml"


def main() -> None:
    script, synth, cfg = parse_config((ScriptArguments, SyntheticArguments, DPOConfig), DEFAULT_CONFIG)
    train, test = datasets(script, synth, cfg)
    trainer = DPOTrainer(cfg, train_dataset=train, eval_dataset=test)
    before = trainer.evaluate() if test is not None else {}
    trainer.train()
    if trainer.session.is_main_process and before:
        after = next(r for r in reversed(trainer.history) if "eval/rewards/accuracies" in r)
        print(f"held-out eval/rewards/accuracies: {before['eval/rewards/accuracies']:.3f} -> "
              f"{after['eval/rewards/accuracies']:.3f} (eval/loss {before['eval/loss']:.4f} -> {after['eval/loss']:.4f})")
    trainer.save_model(Path(cfg.output_dir) / "final")


if __name__ == "__main__":
    main()
