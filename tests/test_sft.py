"""SFT: data preparation, loss, token accuracy and gradients equal trl.SFTTrainer's (fp32, TRL in the
test) for every dataset format and mask option, packed and padding-free; bad data in one sentence."""

import pytest
import torch

from posttrain.data import sft as sft_data
from posttrain.demo import synthetic, tiny
from posttrain.errors import ConfigError
from posttrain.trainers.sft import SFTConfig, add_fused_head, token_terms

ROWS = 12


def text_rows() -> list[dict]:
    return [{"text": line} for line in tiny.corpus()[:ROWS]]


def prompt_completion_rows() -> list[dict]:
    return [{"prompt": r["prompt"], "completion": r["chosen"]} for r in synthetic.preference_pairs(ROWS, seed=5)]


def messages_rows() -> list[dict]:
    return [{"messages": [{"role": "system", "content": "be kind"}, {"role": "user", "content": r["prompt"]},
                          {"role": "assistant", "content": r["completion"]},
                          {"role": "user", "content": "more"}, {"role": "assistant", "content": r["completion"]}]}
            for r in prompt_completion_rows()]


def conversational_prompt_completion_rows() -> list[dict]:
    return [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "completion": [{"role": "assistant", "content": r["completion"]}]} for r in prompt_completion_rows()]


def tokenized_rows(eos: bool = False) -> list[dict]:
    """The text rows as token ids (TRL adds no EOS to tokenized rows: with ``eos`` it is written in)."""
    tok = tokenizer()
    return [{"input_ids": tok(r["text"] + tok.eos_token * eos)["input_ids"]} for r in text_rows()]


def tokenized_prompt_completion_rows() -> list[dict]:
    """The prompt-completion rows tokenized as TRL tokenizes them (EOS after the completion, which
    starts where the prompt's ids and the whole row's diverge), the completion as a completion_mask."""
    from trl.data_utils import common_prefix_length

    tok = tokenizer()
    rows = []
    for r in prompt_completion_rows():
        ids = tok(r["prompt"] + r["completion"] + tok.eos_token)["input_ids"]
        n = common_prefix_length(tok(r["prompt"])["input_ids"], ids)
        rows.append({"input_ids": ids, "completion_mask": [0] * n + [1] * (len(ids) - n)})
    return rows


def tokenized_labels_rows() -> list[dict]:
    """Tokenized prompt-completion rows with their own labels (-100 on the prompt), and a mask
    column beside them that labels override (TRL's rule)."""
    return [{"input_ids": r["input_ids"],
             "labels": [t if m else -100 for t, m in zip(r["input_ids"], r["completion_mask"])],
             "completion_mask": [1] * len(r["input_ids"])} for r in tokenized_prompt_completion_rows()]


def tokenized_messages_rows() -> list[dict]:
    """Conversations tokenized with their assistant_masks (applied without assistant_only_loss)."""
    tok = tokenizer()
    out = []
    for r in messages_rows():
        enc = tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        out.append({"input_ids": list(enc["input_ids"]), "assistant_masks": list(enc["assistant_masks"])})
    return out


def tokenized_packed_rows() -> list[dict]:
    """Tokenized rows packed two by two already, with TRL's seq_lengths."""
    rows = tokenized_prompt_completion_rows()
    return [{"input_ids": a["input_ids"] + b["input_ids"], "seq_lengths": [len(a["input_ids"]), len(b["input_ids"])]}
            for a, b in zip(rows[::2], rows[1::2])]


DATA = {"text": text_rows, "prompt_completion": prompt_completion_rows, "messages": messages_rows,
        "conv_prompt_completion": conversational_prompt_completion_rows, "tokenized": tokenized_rows,
        "tokenized_prompt_completion": tokenized_prompt_completion_rows, "tokenized_labels": tokenized_labels_rows,
        "tokenized_messages": tokenized_messages_rows, "tokenized_packed": tokenized_packed_rows}
# (name, data, SFTConfig fields shared by TRL and posttrain)
CASES = [
    ("text", "text", {}),
    ("text_packed_bfd", "text", {"packing": True, "max_length": 24}),
    ("text_packed_wrapped", "text", {"packing": True, "packing_strategy": "wrapped", "max_length": 16}),
    ("text_padding_free", "text", {"padding_free": True, "max_length": None}),
    ("prompt_completion", "prompt_completion", {}),
    ("prompt_completion_full_loss", "prompt_completion", {"completion_only_loss": False}),
    ("prompt_completion_padding_free", "prompt_completion", {"padding_free": True, "max_length": None}),
    ("messages", "messages", {}),
    ("messages_assistant_only", "messages", {"assistant_only_loss": True}),
    ("messages_assistant_only_packed", "messages", {"assistant_only_loss": True, "packing": True, "max_length": 40}),
    ("conv_prompt_completion", "conv_prompt_completion", {}),
    ("conv_prompt_completion_assistant_only", "conv_prompt_completion", {"assistant_only_loss": True}),
    ("text_dft_truncated", "text", {"loss_type": "dft", "max_length": 8}),
    # Pre-tokenized (an input_ids column): used as given, no EOS added.
    ("tokenized", "tokenized", {}),
    ("tokenized_keep_end", "tokenized", {"max_length": 8, "truncation_mode": "keep_end"}),
    ("tokenized_completion_mask", "tokenized_prompt_completion", {"completion_only_loss": True}),
    ("tokenized_completion_mask_by_default_unused", "tokenized_prompt_completion", {}),  # TRL's default
    ("tokenized_completion_mask_packed", "tokenized_prompt_completion",
     {"completion_only_loss": True, "packing": True, "max_length": 32}),
    ("tokenized_completion_mask_padding_free", "tokenized_prompt_completion",
     {"completion_only_loss": True, "padding_free": True, "max_length": None}),
    ("tokenized_labels_truncated", "tokenized_labels", {"completion_only_loss": True, "max_length": 12}),
    ("tokenized_assistant_masks_packed_wrapped", "tokenized_messages",
     {"packing": True, "packing_strategy": "wrapped", "max_length": 24}),
    ("tokenized_packed_already_padding_free", "tokenized_packed", {"padding_free": True, "max_length": None}),
]


def tokenizer():
    tok = tiny.load_tokenizer()
    # The tiny template with {% generation %} markers: TRL then uses it as given (it renders the same).
    tok.chat_template = sft_data.TINY_TRAINING_CHAT_TEMPLATE
    return tok


def ours(name: str, data: str, fields: dict) -> dict:
    from transformers import AutoModelForCausalLM

    cfg = SFTConfig(output_dir="unused", **fields)
    tok = tokenizer()
    rows = sft_data.prepare_sft_dataset(
        DATA[data](), tok, max_length=cfg.max_length, packing=cfg.packing, packing_strategy=cfg.packing_strategy,
        completion_only_loss=cfg.completion_only_loss, assistant_only_loss=cfg.assistant_only_loss,
        truncation_mode=cfg.truncation_mode).to_list()
    padding_free = cfg.padding_free or (cfg.packing and cfg.packing_strategy != "wrapped")
    batch = sft_data.collator(tok, padding_free)(rows[:4])  # packed data may have fewer rows
    model = add_fused_head(AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=0), dtype=torch.float32))
    terms = token_terms(model, batch, cfg.loss_type)
    loss = terms["loss_sum"] / terms["tokens"].clamp(min=1)
    loss.backward()
    return {"rows": rows, "batch": batch, "loss": loss.item(),
            "mean_token_accuracy": (terms["correct"] / terms["tokens"]).item(),
            "entropy": (terms["entropy_sum"] / terms["tokens"]).item(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def theirs(name: str, data: str, fields: dict, tmp_path) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig as TRLConfig
    from trl import SFTTrainer as TRLTrainer

    args = TRLConfig(output_dir=str(tmp_path / name), use_cpu=True, bf16=False, gradient_checkpointing=False,
                     report_to=[], per_device_train_batch_size=4, **fields)
    model = AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=0), dtype=torch.float32)
    trainer = TRLTrainer(model=model, args=args, train_dataset=Dataset.from_list(DATA[data]()),
                         processing_class=tokenizer())
    rows = trainer.train_dataset.to_list()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(min(4, len(rows)))])
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    metrics = trainer._metrics["train"] or trainer._metrics["eval"]  # from_pretrained leaves eval mode
    return {"rows": rows, "batch": batch, "loss": loss.item(), "mean_token_accuracy": metrics["mean_token_accuracy"][-1],
            "entropy": metrics["entropy"][-1], "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("name,data,fields", CASES, ids=[c[0] for c in CASES])
def test_loss_accuracy_and_gradients_equal_trl(name, data, fields, tmp_path):
    a, b = ours(name, data, fields), theirs(name, data, fields, tmp_path)
    assert [r["input_ids"] for r in a["rows"]] == [r["input_ids"] for r in b["rows"]]
    assert [r["labels"] for r in a["rows"]] == [r["labels"] for r in b["rows"]]
    assert a["batch"].keys() == b["batch"].keys()
    for key in a["batch"]:
        assert torch.equal(torch.as_tensor(a["batch"][key]), torch.as_tensor(b["batch"][key])), key
    for key in ("loss", "mean_token_accuracy", "entropy"):
        assert a[key] == pytest.approx(b[key], abs=1e-5, rel=1e-5), key
    assert a["grads"].keys() == b["grads"].keys()
    for n, g in a["grads"].items():
        torch.testing.assert_close(g, b["grads"][n], atol=1e-5, rtol=1e-5, msg=n)
    labels = a["batch"]["labels"]
    assert (labels != -100).any() and a["loss"] > 0
    masked = (fields.get("assistant_only_loss")
              or data == "prompt_completion" and fields.get("completion_only_loss") is not False
              or data.startswith("tokenized_") and (fields.get("completion_only_loss")
                                                     or data != "tokenized_prompt_completion"))
    if masked:
        assert (labels == -100).sum() > labels.size(0)  # prompt tokens masked beyond the first
    if data.startswith("tokenized") and not fields.get("packing"):  # the ids as given: no EOS added, none cut
        given = [r["input_ids"] for r in DATA[data]()]
        assert all(ids == given[i][: len(ids)] or ids == given[i][-len(ids):] for i, ids in
                   enumerate(r["input_ids"] for r in a["rows"])) and len(a["rows"]) == len(given)


def test_padding_free_equals_padded_loss():
    """The same rows, padded or flattened into one row with restarting position ids: the same loss
    (sdpa/eager get a block-diagonal mask from the restarts, so attention does not cross rows)."""
    from transformers import AutoModelForCausalLM

    tok = tokenizer()
    rows = sft_data.prepare_sft_dataset(prompt_completion_rows(), tok, max_length=None, packing=False).to_list()[:4]
    model = add_fused_head(AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=0), dtype=torch.float32))
    padded = sft_data.collator(tok, False)(rows)
    flat = sft_data.collator(tok, True)(rows)
    assert "attention_mask" not in flat and flat["input_ids"].size(0) == 1
    assert flat["input_ids"].numel() == padded["attention_mask"].sum()  # no pad token in the batch
    a, b = token_terms(model, padded), token_terms(model, flat)
    assert a["tokens"] == b["tokens"]
    assert (a["loss_sum"] / a["tokens"]).item() == pytest.approx((b["loss_sum"] / b["tokens"]).item(), abs=1e-6)
    assert a["correct"] == b["correct"]
    # Without the restarts the rows would attend across each other: the loss changes.
    crossed = {**flat, "position_ids": torch.arange(flat["input_ids"].size(1))[None]}
    c = token_terms(model, crossed)
    assert abs((c["loss_sum"] - b["loss_sum"]).item()) > 1e-3


@pytest.mark.parametrize("text,tokens,fields", [
    (text_rows, lambda: tokenized_rows(eos=True), {}),
    (text_rows, lambda: tokenized_rows(eos=True), {"packing": True, "max_length": 24}),
    (prompt_completion_rows, tokenized_prompt_completion_rows, {"completion_only_loss": True}),
    (prompt_completion_rows, tokenized_prompt_completion_rows, {"completion_only_loss": True, "max_length": 10}),
], ids=["text", "text_packed", "prompt_completion", "prompt_completion_truncated"])
def test_text_and_its_tokenized_form_give_the_same_loss(text, tokens, fields):
    """A text dataset and the same rows already tokenized (with the EOS and completion mask that
    tokenizing the text adds) prepare to the same rows and give the same loss; tokenized rows
    without their EOS are left without it."""
    from transformers import AutoModelForCausalLM

    tok = tokenizer()
    model = add_fused_head(AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=0), dtype=torch.float32))
    kwargs = {"max_length": None, "packing": False, **fields}
    a = sft_data.prepare_sft_dataset(text(), tok, **kwargs).to_list()
    b = sft_data.prepare_sft_dataset(tokens(), tok, **kwargs).to_list()
    assert a == b
    padding_free = bool(fields.get("packing"))
    ta = token_terms(model, sft_data.collator(tok, padding_free)(a[:4]))
    tb = token_terms(model, sft_data.collator(tok, padding_free)(b[:4]))
    assert ta["tokens"] == tb["tokens"] > 0
    assert (ta["loss_sum"] / ta["tokens"]).item() == pytest.approx((tb["loss_sum"] / tb["tokens"]).item(), abs=1e-6)
    bare = sft_data.prepare_sft_dataset(tokenized_rows(), tok, max_length=None, packing=False).to_list()
    assert [r["input_ids"] for r in bare] == [r["input_ids"] for r in tokenized_rows()]
    assert all(r["input_ids"][-1] != tok.eos_token_id for r in bare)


# -- bad data: one sentence naming the fix --------------------------------------------------------
def test_missing_column():
    with pytest.raises(ConfigError, match="no column 'text', 'messages' or 'prompt'/'completion'.*dataset_text_field"):
        sft_data.prepare_sft_dataset([{"body": "x"}], tokenizer(), max_length=8, packing=False)
    with pytest.raises(ConfigError, match="add its 'completion' column"):
        sft_data.prepare_sft_dataset([{"prompt": "x"}], tokenizer(), max_length=8, packing=False)


def test_conversation_without_assistant_turn():
    rows = messages_rows()[:2] + [{"messages": [{"role": "user", "content": "hello"}]}]
    with pytest.raises(ConfigError, match="row 2 has no assistant turn.*add an assistant message"):
        sft_data.prepare_sft_dataset(rows, tokenizer(), max_length=64, packing=False, assistant_only_loss=True)


def test_row_longer_than_max_length_without_truncation():
    with pytest.raises(ConfigError, match=r"row 0 has \d+ tokens, more than max_length=4.*raise --max_length"):
        sft_data.prepare_sft_dataset(text_rows(), tokenizer(), max_length=4, packing=False, truncation_mode="none")


def test_tokenizer_without_chat_template():
    tok = tiny.load_tokenizer()
    tok.chat_template = None
    with pytest.raises(ConfigError, match="no chat template: give one with --chat_template_path"):
        sft_data.prepare_sft_dataset(messages_rows(), tok, max_length=64, packing=False)


def test_empty_value_and_assistant_only_on_text():
    with pytest.raises(ConfigError, match="row 1 has a missing or empty 'completion'"):
        sft_data.prepare_sft_dataset([{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": ""}],
                                     tokenizer(), max_length=8, packing=False)
    with pytest.raises(ConfigError, match="assistant_only_loss needs conversational data"):
        sft_data.prepare_sft_dataset(text_rows(), tokenizer(), max_length=8, packing=False, assistant_only_loss=True)


IDS = [[5, 6, 7, 8], [9, 10]]
# (id, rows, prepare_sft_dataset fields, the sentence's start after "dataset: " or "dataset ")
TOKENIZED_BAD = [
    ("strings", [{"input_ids": ["a", "b"]}], {},
     r"'input_ids' holds List\(Value\('string'\)\), not a list of integers per "
     r"row: give each row its token ids as a list of ints"),
    ("floats", [{"input_ids": [1.5, 2.0]}], {},
     r"'input_ids' holds List\(Value\('float64'\)\), not a list of integers"),
    ("one_string", [{"input_ids": "5 6 7"}], {}, r"'input_ids' holds Value\('string'\), not a list of integers"),
    ("nested", [{"input_ids": [[5, 6]]}], {}, r"'input_ids' holds List\(List\(Value\('int\d+'\)\)\), not a list"),
    ("null_row", [{"input_ids": IDS[0]}, {"input_ids": None}], {},
     r"row 1 has no 'input_ids' \(null\): fill it in or drop the row"),
    ("empty_row", [{"input_ids": IDS[0]}, {"input_ids": []}], {}, r"row 1 has an empty 'input_ids': drop the row"),
    ("id_past_vocab", [{"input_ids": IDS[0]}, {"input_ids": [5, 547]}], {},
     r"row 1 has the token id 547 in 'input_ids', outside the tokenizer's vocabulary \(0 to 546\): tokenize the data "
     r"with this model's tokenizer, or give it as text"),
    ("negative_id", [{"input_ids": [5, -1]}], {},
     r"row 0 has the token id -1 in 'input_ids', outside the tokenizer's vocabulary"),
    ("mask_short", [{"input_ids": ids, "completion_mask": [0, 1]} for ids in IDS], {"completion_only_loss": True},
     r"row 0 has 2 'completion_mask' values for its 4 'input_ids': give one completion_mask value per token"),
    ("mask_long", [{"input_ids": ids, "completion_mask": [0, 1, 1, 1]} for ids in IDS], {"completion_only_loss": True},
     r"row 1 has 4 'completion_mask' values for its 2 'input_ids'"),
    ("mask_value", [{"input_ids": IDS[0], "completion_mask": [0, 2, 1, 1]}], {"completion_only_loss": True},
     r"row 0's 'completion_mask' holds 2: use 1 for tokens trained on and 0 for the others"),
    ("assistant_masks_short", [{"input_ids": IDS[0], "assistant_masks": [0, 1]}], {},
     r"row 0 has 2 'assistant_masks' values for its 4"),
    ("labels_short", [{"input_ids": IDS[0], "labels": [-100, 6, 7]}], {},
     r"row 0 has 3 'labels' values for its 4 'input_ids'"),
    ("labels_value", [{"input_ids": IDS[0], "labels": [-1, 6, 7, 8]}], {},
     r"row 0's 'labels' holds -1: use -100 for tokens left out of the loss and the token id elsewhere"),
    ("padding", [{"input_ids": [5, 6, 0, 0], "attention_mask": [1, 1, 0, 0]}], {},
     r"row 0's 'attention_mask' holds 0: SFT pads each batch itself and would train on this padding: strip the padding"),
    ("completion_only_without_mask", [{"input_ids": ids} for ids in IDS], {"completion_only_loss": True},
     r"completion_only_loss is on \(asked for, or the default with prompt/completion columns\) but the tokenized rows "
     r"have no 'completion_mask' \(nor 'labels'\): add a completion_mask column"),
    ("completion_only_by_default_without_mask", [{"input_ids": IDS[0], "prompt": "a", "completion": "b"}], {},
     r"completion_only_loss is on"),
    ("assistant_only_loss", [{"input_ids": IDS[0], "assistant_masks": [0, 0, 1, 1]}], {"assistant_only_loss": True},
     r"is already tokenized \(it has 'input_ids'\) and assistant_only_loss needs conversations to find the assistant "
     r"turns: drop --assistant_only_loss \(an 'assistant_masks' column is applied without it\)"),
    ("prompt_ids", [{"prompt_ids": [5, 6], "completion_ids": [7, 8]}], {},
     r"has 'prompt_ids'/'completion_ids' but no 'input_ids', which SFT \(as TRL\) reads tokenized rows from: give each "
     r"row input_ids = prompt_ids \+ completion_ids and a completion_mask"),
    ("packed_again", [{"input_ids": IDS[0], "seq_lengths": [2, 2]}], {"packing": True, "max_length": 8},
     r"is already packed \(it has 'seq_lengths'\): set --packing false"),
    ("seq_lengths_sum", [{"input_ids": IDS[0], "seq_lengths": [2, 1]}], {},
     r"row 0's 'seq_lengths' \[2, 1\] do not split its 4 tokens: give the length of each sequence packed into the row"),
    ("packed_cut", [{"input_ids": IDS[0], "seq_lengths": [2, 2]}], {"max_length": 3},
     r"row 0 is packed \(it has 'seq_lengths'\) and has 4 tokens, more than max_length=3, which would cut it"),
]


@pytest.mark.parametrize("case,rows,fields,message", TOKENIZED_BAD, ids=[c[0] for c in TOKENIZED_BAD])
def test_bad_tokenized_rows(case, rows, fields, message):
    kwargs = {"max_length": None, "packing": False, **fields}
    with pytest.raises(ConfigError, match=r"^dataset:? " + message):
        sft_data.prepare_sft_dataset(rows, tokenizer(), **kwargs)


def test_good_tokenized_rows_pass_the_checks(caplog):
    """What TRL takes and trains on correctly passes: bool masks, a labels column beside an unused
    mask of another length (TRL reads labels only), an unused completion_mask, a full
    attention_mask, rows packed already (TRL's seq_lengths)."""
    tok = tokenizer()
    ok = [
        ([{"input_ids": IDS[0], "assistant_masks": [False, False, True, True]}], {}),
        ([{"input_ids": IDS[0], "labels": [-100, 6, 7, 8], "completion_mask": [1]}], {"completion_only_loss": True}),
        ([{"input_ids": IDS[0], "completion_mask": [1]}], {"completion_only_loss": False}),
        ([{"input_ids": IDS[0], "attention_mask": [1, 1, 1, 1]}], {}),
        ([{"input_ids": IDS[0], "seq_lengths": [3, 1]}], {"max_length": 4}),
    ]
    for rows, fields in ok:
        out = sft_data.prepare_sft_dataset(rows, tok, **{"max_length": None, "packing": False, **fields}).to_list()
        assert out[0]["input_ids"] == IDS[0]
    assert out[0]["seq_lengths"] == [3, 1]
    assert not caplog.records
    # A completion_mask that TRL's default leaves unused (no prompt/completion columns) is named.
    out = sft_data.prepare_sft_dataset([{"input_ids": IDS[0], "completion_mask": [0, 0, 1, 1]}], tok, max_length=None,
                                       packing=False).to_list()
    assert out[0]["labels"] == IDS[0]
    assert [r.getMessage() for r in caplog.records] == [
        "dataset: its 'completion_mask' column is not applied, completion_only_loss being off by default for data "
        "without prompt/completion columns (TRL's rule): set --completion_only_loss true to train on the completion "
        "tokens only"]


def test_tiny_training_template_renders_as_the_default():
    tok = tiny.load_tokenizer()
    conv = messages_rows()[0]["messages"]
    for prompt in (False, True):
        assert (tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=prompt)
                == tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=prompt,
                                           chat_template=sft_data.TINY_TRAINING_CHAT_TEMPLATE))
    assert sft_data.training_chat_template(tok) == sft_data.TINY_TRAINING_CHAT_TEMPLATE


@pytest.mark.parametrize("fields,message", [
    ({"packing_strategy": "greedy"}, "unknown packing_strategy 'greedy'"),
    ({"loss_type": "mse"}, "unknown loss_type 'mse'"),
    ({"padding_free": True}, "padding_free without packing does not enforce max_length"),
    ({"packing": True, "max_length": None}, "packing needs max_length"),
    ({"truncation_mode": "middle"}, "truncation_mode must be one of"),
    ({"neftune_noise_alpha": -1.0}, "neftune_noise_alpha must be > 0"),
])
def test_config_errors(fields, message):
    with pytest.raises(ConfigError, match=message):
        SFTConfig(output_dir="unused", **fields)


@pytest.mark.parametrize("config", ["sft", "reward"])
def test_tokenizer_fields(config, tmp_path):
    """SFT's and reward's chat_template_path and eos_token (posttrain/models/tokenizer.py): a template that is
    not a Jinja file is refused with the config, an EOS token outside the vocabulary when it is set."""
    from posttrain.models.tokenizer import set_tokens
    from posttrain.trainers.reward import RewardConfig

    config_cls = {"sft": SFTConfig, "reward": RewardConfig}[config]
    with pytest.raises(ConfigError, match="chat_template_path 'template.txt' is not a .jinja/.j2 file"):
        config_cls(output_dir="unused", chat_template_path="template.txt")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tok = tiny.load_tokenizer()
    assert tok.eos_token == "<|endoftext|>"
    tok.pad_token = None
    set_tokens(tok, config_cls(output_dir="unused", chat_template_path=str(template), eos_token="<|pad|>"))
    assert tok.chat_template == template.read_text()
    assert tok.eos_token == tok.pad_token == "<|pad|>"  # no pad token: the EOS token pads (TRL's default)
    with pytest.raises(ConfigError, match="eos_token '<nope>' is not in the tokenizer's vocabulary"):
        set_tokens(tok, config_cls(output_dir="unused", eos_token="<nope>"))


# -- two processes, one launch: SFT and reward trainers on the role layer -------------------------
@pytest.fixture(scope="module")
def dist(launched_together):
    from conftest import together_json

    return together_json(launched_together, "test_sft")  # tests/dist/sft_reward_checks.py


def _close(a: list[dict], b: list[dict], keys: tuple[str, ...]) -> None:
    assert len(a) == len(b) and a
    for ra, rb in zip(a, b):
        assert ra["step"] == rb["step"]
        for k in keys:
            assert ra[k] == pytest.approx(rb[k], abs=1e-5, rel=1e-5), (ra["step"], k)


SFT_KEYS = ("loss", "mean_token_accuracy", "entropy", "num_tokens", "grad_norm", "learning_rate")
REWARD_KEYS = ("loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens", "grad_norm")


@pytest.mark.parametrize("trainer,keys,eval_key", [("sft", SFT_KEYS, "eval/loss"), ("reward", REWARD_KEYS, "eval/accuracy")])
def test_placement_invariance_and_resume(dist, trainer, keys, eval_key):
    runs = dist[trainer]
    assert dist["world"] == 2
    assert set(runs["zero2"]["stages"].values()) == {2} and set(runs["zero3"]["stages"].values()) == {3}
    for other in ("zero3", "offload"):
        _close(runs["zero2"]["rows"], runs[other]["rows"], keys)
        _close(runs["zero2"]["evals"], runs[other]["evals"], (eval_key,))
    # Resumed at step 2 of 4: steps 3-4 equal the uninterrupted run's.
    assert [r["step"] for r in runs["resumed"]["rows"]] == [3, 4]
    _close(runs["zero2"]["rows"][2:], runs["resumed"]["rows"], keys)
    losses = [r["loss"] for r in runs["zero2"]["rows"]]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("trainer", ["sft", "reward"])
def test_first_step_loss_and_gradient_are_the_global_batch_ones(dist, trainer):
    """Two processes x two accumulation micro-batches: SFT's loss is the token mean over all of them
    (TRL's num_items_in_batch), the reward loss the mean of the micro-batch means (TRL's DDP and
    accumulation averaging); the engine's gradient norm is that of this loss on one process."""
    first, direct = dist[trainer]["zero2"]["rows"][0], dist[trainer]["direct_first_step"]
    assert first["loss"] == pytest.approx(direct["loss"], abs=1e-5, rel=1e-5)
    assert first["grad_norm"] == pytest.approx(direct["grad_norm"], abs=1e-5, rel=1e-5)


def test_sft_run_outputs(dist):
    sft = dist["sft"]
    # bfd packing trains padding-free: no attention mask, position ids restart per sentence.
    assert "attention_mask" not in sft["padding_free_batch_keys"] and "position_ids" in sft["padding_free_batch_keys"]
    for name in ("metrics.jsonl", "posttrain_config.json", "README.md", "checkpoint-2", "checkpoint-4", "final"):
        assert name in sft["files"]
    assert "adapter_model.safetensors" in sft["lora_files"]
    lora = [r["loss"] for r in sft["lora"]["rows"]]
    assert lora[-1] < lora[0]
    assert [r["step"] for r in sft["zero2"]["evals"]] == [2, 4]


def test_reward_lora_trains_and_saves_its_adapter(dist):
    rw = dist["reward"]
    assert "adapter_model.safetensors" in rw["lora_files"]
    losses = [r["loss"] for r in rw["lora"]["rows"]]
    assert losses[-1] < losses[0]


def test_saved_reward_model_is_what_grpo_loads(dist):
    assert dist["reward"]["saved"] == {"num_labels": 1, "pad_token_id": tiny.load_tokenizer().pad_token_id,
                                       "class": "LlamaForSequenceClassification"}
    grpo = dist["grpo"]
    assert any(role.startswith("reward") for role in grpo["roles"])
    assert grpo["rewards"] and all(isinstance(r, float) for r in grpo["rewards"])
    assert all(s > 0 for s in grpo["reward_std"])  # the model scores completions differently


# -- the scripts: bad data ends in one sentence and exit status 2, before any process group --------
@pytest.mark.parametrize("command,row,message", [
    ("sft", {"body": "no text column"}, "error: train_dataset: no column 'text', 'messages' or 'prompt'/'completion'"),
    ("sft", {"messages": [{"role": "user", "content": "hi"}]}, "row 0 has no assistant turn to train on"),
    ("reward", {"prompt": "a", "chosen": " b"}, "(split 'train'): no column 'rejected'"),
])
def test_scripts_refuse_bad_data_in_one_sentence(tmp_path, capsys, command, row, message):
    import json

    from posttrain import cli

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(row) + "\n")
    extra = ["--assistant_only_loss", "true"] if "messages" in row else []
    model = tiny.model_path("reward" if command == "reward" else "causal")
    status = cli.main([command, "--output_dir", str(tmp_path / "run"), "--model_name_or_path", str(model),
                       "--dataset_name", str(data), *extra])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert status == 2 and len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("name,data,fields", [CASES[0], CASES[6]], ids=["padded", "padding_free"])
def test_neftune_noise_equals_trl(name, data, fields, tmp_path):
    """``neftune_noise_alpha``: the noise transformers' hook adds scales with the collated batch's shape, so the
    same batch and generator state give TRL's noisy loss, padded and padding-free; the noise changes the loss."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from transformers.integrations.neftune import activate_neftune
    from trl import SFTConfig as TRLConfig
    from trl import SFTTrainer as TRLTrainer

    cfg = SFTConfig(output_dir="unused", **fields)
    tok = tokenizer()
    rows = sft_data.prepare_sft_dataset(DATA[data](), tok, max_length=cfg.max_length, packing=cfg.packing,
                                        completion_only_loss=cfg.completion_only_loss).to_list()
    batch = sft_data.collator(tok, cfg.padding_free)(rows[:4])
    model = add_fused_head(AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=0), dtype=torch.float32)).train()
    clean = token_terms(model, batch)
    activate_neftune(model, 5.0)
    torch.manual_seed(7)
    terms = token_terms(model, batch)
    ours = (terms["loss_sum"] / terms["tokens"]).item()

    args = TRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, gradient_checkpointing=False, report_to=[],
                     per_device_train_batch_size=4, neftune_noise_alpha=5.0, **fields)
    trainer = TRLTrainer(model=AutoModelForCausalLM.from_pretrained(tiny.model_path(seed=0), dtype=torch.float32),
                         args=args, train_dataset=Dataset.from_list(DATA[data]()), processing_class=tokenizer())
    activate_neftune(trainer.model, args.neftune_noise_alpha)  # what its train() does first
    trainer.model.train()
    theirs_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    torch.manual_seed(7)
    theirs = trainer.compute_loss(trainer.model, dict(theirs_batch)).item()
    assert ours == pytest.approx(theirs, abs=1e-6)
    assert abs(ours - (clean["loss_sum"] / clean["tokens"]).item()) > 1e-4


def test_neftune_hooks_the_embeddings_only_while_training(tmp_path):
    """SFTTrainer puts transformers' NEFTune hook on the trained model's input embeddings for train() and takes
    it off after (as transformers' Trainer); with the noise the run's first loss differs; evaluation, run in eval
    mode, has none (the evaluation inside the run equals one after it, with the same weights)."""
    from transformers import TrainerCallback

    from posttrain.trainers.sft import SFTTrainer

    rows = [{"text": t} for t in ("the cat sat", "a much longer row of text with many more words", "short one",
                                  "and a fourth row, of middling length")]
    seen = []

    class Look(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            seen.append(bool(trainer.session.unwrap("policy").get_input_embeddings()._forward_hooks))

    def run(alpha):
        nonlocal trainer
        trainer = SFTTrainer(str(tiny.model_path()), train_dataset=rows, eval_dataset=rows, callbacks=[Look()],
                             args=SFTConfig(output_dir=str(tmp_path / str(alpha)), per_device_train_batch_size=4,
                                            max_steps=2, logging_steps=1, save_strategy="no", report_to="none",
                                            gradient_checkpointing=False, neftune_noise_alpha=alpha, seed=0,
                                            eval_strategy="steps", eval_steps=2))
        trainer.train()
        losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        during = [r["eval/loss"] for r in trainer.state.log_history if "eval/loss" in r]
        evaluated = (during, trainer.evaluate()["eval/loss"])
        hooked = bool(trainer.session.unwrap("policy").get_input_embeddings()._forward_hooks)
        trainer.end()
        return losses, evaluated, hooked

    trainer = None
    noisy, noisy_eval, after = run(5.0)
    assert seen == [True, True] and not after
    seen.clear()
    plain, _, _ = run(None)
    assert seen == [False, False] and abs(noisy[0] - plain[0]) > 1e-4
    assert noisy_eval[0] == [noisy_eval[1]]
