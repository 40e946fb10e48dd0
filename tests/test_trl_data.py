"""Issue 42: SFT and preference data that TRL 1.16 trains wrongly or fails on with a traceback; each is
refused in one sentence, or prepared as TRL prepares it (ShareGPT rows, the shuffle before packing)."""

from types import SimpleNamespace

import pytest

from posttrain.data import preference
from posttrain.data import sft as sft_data
from posttrain.demo import tiny
from posttrain.errors import ConfigError

ROLES = "system, user, assistant, tool, developer, ipython, function"
MESSAGE = '{"role": ..., "content": ...}'


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny.model_path()))


def sft(rows, tok, **fields):
    return sft_data.prepare_sft_dataset(rows, tok, **{"max_length": 64, "packing": False, **fields}).to_list()


def refused(call, sentence: str) -> None:
    with pytest.raises(ConfigError) as err:
        call()
    assert str(err.value) == sentence


def conversation(user: str, reply: str, role: str = "user") -> list[dict]:
    return [{"role": "system", "content": "be brief"}, {"role": role, "content": user},
            {"role": "assistant", "content": reply}]


# -- 1. silent wrongs ---------------------------------------------------------------------------
def test_unknown_role_in_sft_messages_is_refused(tok):
    rows = [{"messages": conversation("hi", "yo")}, {"messages": conversation("hey", "ho", role="usr")}]
    refused(lambda: sft(rows, tok), "dataset: row 1's 'messages' has the unknown role 'usr' (roles in the data: "
                                    f"system, user, assistant, usr): use only {ROLES}")
    pc = [{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "bot", "content": "yo"}]}]
    refused(lambda: sft(pc, tok, name="train_dataset"), "train_dataset: row 0's 'completion' has the unknown role "
                                                        f"'bot' (roles in the data: user, bot): use only {ROLES}")


def test_completion_only_loss_without_a_completion_is_refused(tok):
    # TRL 1.16 ignores it there (no completion_mask to apply) and trains on every token.
    refused(lambda: sft([{"text": "the cat sat"}], tok, completion_only_loss=True),
            "dataset: completion_only_loss is on but the rows are plain text ('text') with no completion to train on "
            "alone (TRL would train on every token): give the data as 'prompt'/'completion' columns, or set "
            "--completion_only_loss false")
    refused(lambda: sft([{"messages": conversation("hi", "yo")}], tok, completion_only_loss=True),
            "dataset: completion_only_loss is on but the rows are conversations ('messages') with no prompt/completion "
            "split (TRL would train on every token): set --assistant_only_loss true to train on the assistant turns, "
            "or --completion_only_loss false")
    assert sft([{"text": "the cat sat"}], tok, completion_only_loss=False)[0]["labels"][0] != -100


@pytest.mark.parametrize("assistant_only_loss", [False, True])
def test_sharegpt_rows_train_as_their_messages(tok, assistant_only_loss):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    chats = [conversation("hi", "yo"), conversation("what is up", "the sky")]
    sharegpt = [{"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in c]} for c in chats]
    fields = {"assistant_only_loss": assistant_only_loss,
              "chat_template": sft_data.TINY_TRAINING_CHAT_TEMPLATE if assistant_only_loss else None}
    got = sft(sharegpt, tok, **fields)
    assert got == sft([{"messages": c} for c in chats], tok, **fields)
    assert tok.decode(got[0]["input_ids"]) == "<|system|>be brief<|endoftext|><|user|>hi<|endoftext|><|assistant|>yo<|endoftext|>"
    if assistant_only_loss:  # the reply alone is trained on
        assert tok.decode([t for t in got[0]["labels"] if t != -100]) == "yo<|endoftext|>"


# -- 2. tracebacks turned into one sentence -----------------------------------------------------
SFT_BAD = [
    ("messages_json_string", [{"messages": '[{"role": "user", "content": "hi"}]'}],
     "dataset: its 'messages' column holds strings, not lists of messages: give each row's 'messages' as a list of "
     f"{MESSAGE} dicts, not as a JSON string (json.loads it)"),
    ("messages_one_dict", [{"messages": {"role": "user", "content": "hi"}}],
     "dataset: its 'messages' column holds single dicts, not lists of messages: wrap each row's message in a list, one "
     "dict per message"),
    ("text_ints", [{"text": 3}, {"text": 4}],
     "dataset: its 'text' column holds int64 values, not strings: give each row's text as a string, or set "
     "--dataset_text_field to the column that holds the text"),
    ("text_mixed_types", [{"text": "a"}, {"text": 3}],
     "dataset: row 0's 'text' is a string but row 1's is a number: give every row's 'text' the same form"),
    ("completion_list", [{"prompt": "a", "completion": ["b", "c"]}],
     "dataset: its 'completion' column holds lists of strings, neither strings (standard) nor lists of messages "
     "(conversational): give each row's 'completion' as one string"),
    ("conversational_prompt_string_completion", [{"prompt": [{"role": "user", "content": "hi"}], "completion": "yo"}],
     "dataset: its 'prompt' column holds lists of messages (conversational) but its 'completion' column holds "
     "strings (standard): give 'prompt' and 'completion' both as lists of messages or both as strings"),
]


@pytest.mark.parametrize("case,rows,sentence", SFT_BAD, ids=[c[0] for c in SFT_BAD])
def test_sft_bad_forms_in_one_sentence(tok, case, rows, sentence):
    refused(lambda: sft(rows, tok), sentence)


MIXED_PAIR = [{"prompt": [{"role": "user", "content": "hi"}], "chosen": "yo", "rejected": "no"}]
MIXED_SENTENCE = ("dataset: its 'prompt' column holds lists of messages (conversational) but its 'chosen' column holds "
                  "strings (standard): give 'prompt', 'chosen' and 'rejected' all as lists of messages or all as strings")


def test_reward_and_dpo_mixed_forms_in_one_sentence(tok):
    from posttrain.trainers.reward import prepare_reward_dataset

    refused(lambda: prepare_reward_dataset(MIXED_PAIR, tok, max_length=64), MIXED_SENTENCE)
    refused(lambda: preference.prepare_preference_dataset(MIXED_PAIR, tok), MIXED_SENTENCE)
    implicit = [{"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                 "rejected": "no"}]
    refused(lambda: preference.prepare_preference_dataset(implicit, tok),
            "dataset: its 'chosen' column holds lists of messages (conversational) but its 'rejected' column holds "
            "strings (standard): give 'chosen' and 'rejected' both as lists of messages or both as strings")


# -- 3. an empty reward dataset ----------------------------------------------------------------
def test_empty_reward_dataset_says_it_is_empty(tok):
    from datasets import Dataset

    from posttrain.trainers.reward import prepare_reward_dataset

    refused(lambda: prepare_reward_dataset([], tok, max_length=64, name="train_dataset"),
            "train_dataset has no rows: give it at least one")
    empty = Dataset.from_dict({"prompt": [], "chosen": [], "rejected": []})
    refused(lambda: preference.prepare_preference_dataset(empty, tok), "dataset has no rows: give it at least one")


# -- 4. TRL's shuffle before packing ------------------------------------------------------------
def trl_prepared(rows, tok, tmp_path, **fields):
    """The rows ``trl.SFTTrainer._prepare_dataset`` returns (on a stand-in for the trainer: no model)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], **fields)
    pc = "prompt" in rows[0]
    stub = SimpleNamespace(_tokenizer=tok, chat_template=None,
                           completion_only_loss=pc if args.completion_only_loss is None else args.completion_only_loss)
    return SFTTrainer._prepare_dataset(stub, Dataset.from_list(rows), tok, args, args.packing, None, "train").to_list()


@pytest.mark.parametrize("strategy,max_length", [("wrapped", 16), ("bfd", 24)])
def test_shuffle_before_packing_gives_trls_rows(tok, tmp_path, strategy, max_length):
    from posttrain.demo import synthetic

    rows = [{"prompt": r["prompt"], "completion": r["chosen"]} for r in synthetic.preference_pairs(24, seed=3)]
    seed = 7
    theirs = trl_prepared(rows, tok, tmp_path, packing=True, packing_strategy=strategy, max_length=max_length,
                          shuffle_dataset=True, seed=seed)

    def ours(shuffle_seed):
        packed = sft_data.prepare_sft_dataset(rows, tok, max_length=max_length, packing=True, packing_strategy=strategy,
                                              shuffle_seed=shuffle_seed)
        return packed.shuffle(seed=seed).to_list()  # the trainer's shuffle after packing, as TRL's

    assert ours(seed) == theirs
    assert ours(None) != theirs  # which rows share a packed row depends on their order, for both strategies
