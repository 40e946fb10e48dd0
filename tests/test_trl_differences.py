"""Where posttrain and TRL 1.16 meet a user's model differently (issue 42), on CPU: the dtype a model is saved in,
a LoRA adapter folder given as the model, and GPT-2's first-step loss (posttrain is exact, TRL is not)."""

import json
import textwrap

import pytest
import torch
from conftest import torchrun

from posttrain import SFTConfig, SFTTrainer
from posttrain.demo import tiny
from posttrain.errors import ConfigError

ROWS = [{"text": "the cat sat"}, {"text": "a much longer row of text with many more words in it"},
        {"text": "short one here"}, {"text": "and a fourth row, of middling length"}]


def saved_dtypes(directory) -> set[str]:
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    assert files, f"no safetensors in {directory}"
    found = set()
    for file in files:
        with safe_open(str(file), "pt") as f:
            found |= {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    return found


def sft_args(out, **fields) -> SFTConfig:
    defaults = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=1, logging_steps=1,
                    save_strategy="no", gradient_checkpointing=False, report_to="none", learning_rate=1e-2)
    return SFTConfig(**{**defaults, **fields})


# -- 1. the saved dtype is the load dtype --------------------------------------------------------------------
@pytest.mark.parametrize("load, bf16, saved", [("bfloat16", True, "BF16"), ("bfloat16", False, "BF16"),
                                               ("float32", True, "F32")])
def test_saved_in_the_dtype_the_model_was_loaded_in(load, bf16, saved, tmp_path):
    """One process trains without a DeepSpeed engine on fp32 master weights, even for a bf16-loaded model: the
    saved model (checkpoint export and final save) is in the load dtype, as TRL saves it, and config.json says so."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    trainer = SFTTrainer(str(tiny.model_path()), train_dataset=ROWS,
                         args=sft_args(out, model_init_kwargs={"dtype": load}, bf16=bf16, save_strategy="steps",
                                       save_steps=1))
    assert trainer.session.engine_kind("policy") == "torch"
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}  # fp32 masters, whatever the load
    trainer.train()
    trainer.save_model()
    trained = {k: v.detach().clone() for k, v in trainer.session.unwrap("policy").state_dict().items()}
    trainer.end()
    exported = [p.parent for p in (out / "checkpoint-1").rglob("config.json")]
    assert exported
    for folder in (out, *exported):
        assert saved_dtypes(folder) == {saved}, folder
        assert json.loads((folder / "config.json").read_text())["dtype"] == load, folder
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert loaded.dtype == getattr(torch, load)
    for key, value in loaded.state_dict().items():  # the trained weights, rounded to the load dtype
        assert torch.equal(value, trained[key].to(value.dtype)), key


def test_lora_saves_adapters_in_fp32_and_merges_in_the_load_dtype(tmp_path):
    """A bf16-loaded model with LoRA: the adapter as peft makes it (fp32, as TRL saves it), the merged model bf16."""
    from peft import LoraConfig

    from posttrain.run.save import save_trained_model

    trainer = SFTTrainer(str(tiny.model_path()), train_dataset=ROWS,
                         args=sft_args(tmp_path / "run", model_init_kwargs={"dtype": "bfloat16"}),
                         peft_config=LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules="all-linear"))
    trainer.train()
    trainer.save_model()
    save_trained_model(trainer.session, "policy", tmp_path / "merged", trainer.processing_class, merge_adapters=True)
    trainer.end()
    assert saved_dtypes(tmp_path / "run") == {"F32"} and not (tmp_path / "run" / "config.json").exists()
    assert saved_dtypes(tmp_path / "merged") == {"BF16"}
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["dtype"] == "bfloat16"


TWO_PROCESSES = textwrap.dedent('''
    import json, sys
    from posttrain import SFTConfig, SFTTrainer
    from posttrain.demo import tiny

    rows = [{"text": "the cat sat on the mat"}, {"text": "another row of text here"}] * 2
    for load in ("bfloat16", "float32"):
        out = f"{sys.argv[1]}/{load}"
        trainer = SFTTrainer(str(tiny.model_path()), train_dataset=rows, args=SFTConfig(
            output_dir=out, per_device_train_batch_size=1, max_steps=1, save_strategy="no", report_to="none",
            gradient_checkpointing=False, bf16=True, learning_rate=1e-2, model_init_kwargs={"dtype": load}))
        trainer.train()
        trainer.save_model()
        held = {k: v.detach().clone() for k, v in trainer.session.unwrap("policy").state_dict().items()}
        if trainer.session.is_main_process:
            import torch
            from safetensors.torch import load_file
            saved = load_file(f"{out}/model.safetensors")
            json.dump({"kind": trainer.session.engine_kind("policy"),
                       "held": sorted({str(v.dtype) for v in held.values()}),
                       "saved": sorted({str(v.dtype) for v in saved.values()}),
                       "config": json.load(open(f"{out}/config.json"))["dtype"],
                       "rounded": all(torch.equal(saved[k].to(held[k].dtype), held[k]) for k in saved),
                       "wider": any(not torch.equal(v.to(torch.bfloat16).to(v.dtype), v) for v in saved.values())},
                      open(f"{out}.json", "w"))
        trainer.end()
''')


def test_saved_in_the_load_dtype_on_two_processes(tmp_path):
    """Two processes train under DeepSpeed's bf16 engine (16-bit weights, fp32 masters): a bf16-loaded model saves
    bf16, an fp32-loaded one saves its fp32 master weights (not the engine's bf16 copies), as one process does."""
    script = tmp_path / "two.py"
    script.write_text(TWO_PROCESSES)
    torchrun(script, tmp_path, timeout=300)
    bf16 = json.loads((tmp_path / "bfloat16.json").read_text())
    fp32 = json.loads((tmp_path / "float32.json").read_text())
    assert bf16["kind"] == fp32["kind"] == "deepspeed"
    assert bf16["held"] == fp32["held"] == ["torch.bfloat16"]
    assert bf16["saved"] == ["torch.bfloat16"] and bf16["config"] == "bfloat16" and not bf16["wider"]
    assert fp32["saved"] == ["torch.float32"] and fp32["config"] == "float32" and fp32["wider"]
    assert bf16["rounded"] and fp32["rounded"]  # the engine's bf16 weights are the saved ones rounded


# -- 2. a LoRA adapter folder given as the model -------------------------------------------------------------
def test_an_adapter_folder_as_the_model_is_one_sentence(tmp_path):
    """A folder with adapter_config.json and adapter weights but no config.json names its base and the two ways on."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from posttrain import checks

    base_path = str(tiny.model_path())
    adapter = tmp_path / "adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(base_path),
                   LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["q_proj"])).save_pretrained(adapter)
    tiny.load_tokenizer().save_pretrained(adapter)  # as TRL's save_model leaves it: the tokenizer loads
    sentence = (f"--model_name_or_path {str(adapter)!r} is a LoRA adapter of {base_path!r}, not a whole model "
                f"(adapter_config.json, no config.json): give {base_path!r} as the model (with --use_peft, or "
                "peft_config=, to train new adapters on it), or merge the adapter into it first with "
                f"PeftModel.from_pretrained(base, {str(adapter)!r}).merge_and_unload().save_pretrained(folder) and "
                "give that folder")
    with pytest.raises(ConfigError) as err:
        checks.check_model_path(adapter, "--model_name_or_path")
    assert str(err.value) == sentence
    with pytest.raises(ConfigError) as err:
        checks.check_model_path(adapter, weights=False)  # as posttrain plan checks a --shape folder
    assert "is a LoRA adapter of" in str(err.value)
    with pytest.raises(ConfigError) as err:
        SFTTrainer(str(adapter), train_dataset=ROWS, args=sft_args(tmp_path / "run"))
    assert str(err.value) == sentence.replace("--model_name_or_path", "model=")  # before its tokenizer loads
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    with pytest.raises(ConfigError, match=r"is a LoRA adapter \(its adapter_config.json names no base model\), not "
                                          r"a whole model .*: give its base model as the model"):
        checks.check_model_path(adapter)


# -- 3. GPT-2's first-step loss -------------------------------------------------------------------------------
def true_mean_and_count(path, tokenizer, rows) -> tuple[float, float, int]:
    """(sum of the next-token cross-entropies, their number N) over ``rows`` (text + EOS, as both tokenize them),
    from the model's own logits, row by row without padding; and the token ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = [tokenizer(r["text"])["input_ids"] + [tokenizer.eos_token_id] for r in rows]
    total, count = 0.0, 0
    with torch.no_grad():
        for row in ids:
            logits = model(torch.tensor([row])).logits[0, :-1].double()
            total += torch.nn.functional.cross_entropy(logits, torch.tensor(row[1:]), reduction="sum").item()
            count += len(row) - 1
    return total, count, ids


def trl_first_loss(path, tokenizer, rows, out) -> tuple[float, object]:
    import trl
    from datasets import Dataset

    args = trl.SFTConfig(output_dir=str(out), per_device_train_batch_size=len(rows), max_steps=1, learning_rate=1e-9,
                         gradient_checkpointing=False, use_cpu=True, bf16=False, logging_steps=1, report_to="none",
                         save_strategy="no")
    trainer = trl.SFTTrainer(model=str(path), args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=tokenizer)
    trainer.train()
    return trainer.state.log_history[0]["loss"], trainer


def ours_first_loss(path, tokenizer, rows, out) -> tuple[float, list]:
    from datasets import Dataset

    trainer = SFTTrainer(str(path), args=sft_args(out, learning_rate=1e-9), train_dataset=Dataset.from_list(rows),
                         processing_class=tokenizer)
    trainer.train()
    trainer.end()
    return trainer.state.log_history[0]["loss"], [r["input_ids"] for r in trainer.train_rows]


def test_gpt2_text_rows_first_loss_exact_here_and_not_in_trl(tmp_path):
    """GPT-2's ``loss_type`` is None, so transformers 5.24's Trainer counts ``num_items_in_batch`` over all of
    ``labels`` (it takes ``labels[..., 1:]`` only for a ForCausalLM loss type), one label too many per row (the
    first, which nothing predicts); TRL 1.16's SFTTrainer divides the summed token loss by that count. posttrain
    divides by the trained tokens: its first loss is the true mean S / N, TRL's is S / (N + rows). A Llama
    (loss_type ForCausalLM) gives TRL the true mean too."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = tiny.load_tokenizer()
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=len(tokenizer), resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    assert gpt2.loss_type is None
    path = tmp_path / "gpt2"
    gpt2.save_pretrained(path)
    tokenizer.save_pretrained(path)
    total, count, ids = true_mean_and_count(path, tokenizer, ROWS)
    assert len({len(r) for r in ids}) == len(ROWS)  # rows of different lengths: padding in the batch

    ours, our_ids = ours_first_loss(path, tokenizer, ROWS, tmp_path / "ours")
    assert our_ids == ids
    assert ours == pytest.approx(total / count, abs=1e-5)

    theirs, trainer = trl_first_loss(path, tokenizer, ROWS, tmp_path / "trl")
    assert [r["input_ids"] for r in trainer.train_dataset] == ids
    assert trainer._loss_shifts_labels is False  # transformers: count all of labels, not labels[..., 1:]
    assert theirs == pytest.approx(total / (count + len(ROWS)), abs=1e-5)
    assert theirs / ours == pytest.approx(count / (count + len(ROWS)), abs=1e-5)
    assert ours - theirs > 0.1

    llama = tiny.model_path()  # loss_type ForCausalLM: TRL's count is right
    total, count, _ = true_mean_and_count(llama, tokenizer, ROWS)
    theirs, trainer = trl_first_loss(llama, tokenizer, ROWS, tmp_path / "trl_llama")
    assert trainer._loss_shifts_labels is True
    assert theirs == pytest.approx(total / count, abs=1e-5)
