"""posttrain.rewards.models on one process: reward functions (loading, errors, weights, TRL's calling
convention) and how a reward model reads the policy's output (same vocabulary, its own tokenizer,
or a mismatch refused with the fix)."""

import shutil
import sys
from pathlib import Path

import pytest
import torch

from posttrain.demo import tiny
from posttrain.errors import ConfigError
from posttrain.rewards import functions as reward_funcs
from posttrain.rewards import models as rewards


def other_tokenizer_path(cache: Path, vocab_size: int = 400) -> Path:
    """A second tiny BPE tokenizer, another vocabulary over the same corpus (its own ids): 400
    learned tokens (the policy's has 547, all the corpus allows), then filler tokens up to
    ``vocab_size`` for one larger than the policy's."""
    path = cache / f"tokenizer-v{vocab_size}"
    if not (path / "tokenizer.json").exists():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        # Specials in another order than the policy's, so even their ids differ.
        specials = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<pad>"]
        tok.train_from_iterator(tiny.corpus(), trainer=trainers.BpeTrainer(
            vocab_size=min(vocab_size, 400), special_tokens=specials, show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|endoftext|>")
        fast.add_tokens([f"<extra_{i}>" for i in range(vocab_size - len(fast))])
        assert len(fast) == vocab_size
        # Another chat template than the policy's, to see that the reward model's own is applied.
        fast.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|endoftext|>{% endfor %}")
        fast.save_pretrained(str(path))
    return path


def other_reward_model_path(cache: Path, vocab_size: int = 400, with_tokenizer: bool = True) -> Path:
    """A tiny randomly initialised reward model over :func:`other_tokenizer_path`'s vocabulary."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = cache / f"reward-v{vocab_size}{'' if with_tokenizer else '-notok'}"
    if not (path / "config.json").exists():
        tok = AutoTokenizer.from_pretrained(other_tokenizer_path(cache, vocab_size))
        cfg = tiny.model_config("reward")
        cfg.vocab_size, cfg.pad_token_id, cfg.eos_token_id = len(tok), tok.pad_token_id, tok.eos_token_id
        torch.manual_seed(1)
        AutoModelForSequenceClassification.from_config(cfg).save_pretrained(str(path))
        if with_tokenizer:
            tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("reward-assets")


@pytest.fixture(scope="module")
def policy_tok():
    return tiny.load_tokenizer()


# -- reward functions --------------------------------------------------------------------------
def test_load_reward_funcs_and_errors(tmp_path, monkeypatch):
    from posttrain.demo import synthetic

    assert reward_funcs.load_reward_funcs(["posttrain.demo.synthetic:sentiment_reward"]) == [synthetic.sentiment_reward]
    (tmp_path / "broken_rewards.py").write_text("import not_installed_dep\n\ndef fn(completions, **kw):\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"reward function 'broken_rewards:fn': importing 'broken_rewards' failed "
                                          r"with ModuleNotFoundError: No module named 'not_installed_dep'"):
        reward_funcs.load_reward_funcs(["broken_rewards:fn"])
    sys.modules.pop("broken_rewards", None)
    with pytest.raises(ConfigError, match="posttrain.demo.synthetic has no 'nope'.*sentiment_reward"):
        reward_funcs.load_reward_funcs(["posttrain.demo.synthetic:nope"])
    with pytest.raises(ConfigError, match="'posttrain.demo.synthetic' is not a function \\(of type module\\)"):
        reward_funcs.load_reward_funcs(["posttrain.demo.synthetic"])  # module.function spelling: posttrain's 'synthetic'
    with pytest.raises(ConfigError, match="is not a function \\(of type list\\)"):
        reward_funcs.load_reward_funcs(["posttrain.demo.tiny:SPECIAL"])
    assert rewards.is_function_name("pkg.mod:fn") and not rewards.is_function_name("org/reward-model")


def test_weights_and_calling_convention():
    assert rewards.check_reward_weights(None, 2) == [1.0, 1.0]
    with pytest.raises(ConfigError, match="reward_weights has 1 values for 2 reward functions"):
        rewards.check_reward_weights([0.5], 2)
    seen = {}

    def length(prompts, completions, completion_ids, **columns):
        seen.update(columns, n_ids=len(completion_ids))
        return [float(len(c)) for c in completions]

    def partial(completions, **_):
        return [None, 1.0]

    per_func = reward_funcs.call_reward_funcs([length, partial], ["a", "b"], ["xy", "xyz"], [[1], [2]], answer=["1", "2"])
    assert per_func.tolist()[0][0] == 2.0 and torch.isnan(per_func[0, 1]) and seen == {"answer": ["1", "2"], "n_ids": 2}
    # None counts as absent (TRL's nansum): row 0 = 0.5 * 2, row 1 = 0.5 * 3 + 2 * 1.
    assert reward_funcs.weighted_sum(per_func, [0.5, 2.0]).tolist() == [1.0, 3.5]
    with pytest.raises(ConfigError, match="'partial' returned 2 rewards for 3 completions"):
        reward_funcs.call_reward_funcs([partial], ["a", "b", "c"], ["x", "y", "z"])
    conv = [[{"role": "user", "content": "hi"}]]
    assert rewards.as_completions(conv, ["yo"]) == [[{"role": "assistant", "content": "yo"}]]
    assert rewards.as_completions(["hi"], ["yo"]) == ["yo"]


# -- reward models -----------------------------------------------------------------------------
def test_same_vocabulary_reads_policy_ids(policy_tok):
    rin = rewards.reward_model_input(str(tiny.reward_model_path()), policy_tok)
    assert rin.shares_policy_ids and rin.vocab_size == len(policy_tok)


@pytest.mark.parametrize("vocab_size", [400, 700])  # smaller and larger than the policy's 547
def test_own_tokenizer_is_reencoded_with_its_chat_template(cache, policy_tok, vocab_size):
    from transformers import AutoModelForSequenceClassification

    path = other_reward_model_path(cache, vocab_size)
    rin = rewards.reward_model_input(str(path), policy_tok)
    assert not rin.shares_policy_ids and rin.tokenizer.get_vocab() != policy_tok.get_vocab()
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    rin.prepare(model)
    prompts, completions = ["the cat is", "a very long prompt here is"], [" happy and kind .", " sad ."]
    scores = rewards.score_texts(model, rin, prompts, completions, "cpu", batch_size=1)
    # Each row alone, unpadded, through the model's own pooling: the same score.
    for p, c, s in zip(prompts, completions, scores):
        ids = rin.tokenizer(p + c, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            assert float(model(**ids).logits[0, 0]) == pytest.approx(float(s), abs=1e-5)
    batched = rewards.score_texts(model, rin, prompts, completions, "cpu")  # padded together
    assert torch.allclose(batched, scores, atol=1e-5)
    conv = [[{"role": "user", "content": "how is the cat"}]]
    text = rewards.reward_texts(conv, [" happy ."], rin.tokenizer)[0]
    assert text == "[user] how is the cat<|endoftext|>[assistant]  happy .<|endoftext|>"


def test_mismatches_are_refused_with_the_fix(cache, policy_tok):
    # No tokenizer saved and another vocabulary size (smaller or larger): the policy's ids cannot be
    # read by it; the fix is to save its tokenizer.
    for size in (400, 700):
        notok = other_reward_model_path(cache, size, with_tokenizer=False)
        with pytest.raises(ConfigError, match=rf"has no tokenizer saved and a vocabulary of {size} tokens, the "
                                              rf"policy's has 547.*tokenizer.save_pretrained"):
            rewards.reward_model_input(str(notok), policy_tok)
    # No tokenizer, the policy's vocabulary size: read as the policy's ids (nothing to check against).
    same_size = cache / "reward-same-size-notok"
    shutil.copytree(tiny.reward_model_path(), same_size, ignore=shutil.ignore_patterns("tokenizer*", "special*",
                                                                                         "chat_template*"))
    assert rewards.load_reward_tokenizer(str(same_size)) is None
    assert rewards.reward_model_input(str(same_size), policy_tok).shares_policy_ids
    # A tokenizer with more tokens than the embedding has rows.
    small = cache / "reward-embedding-too-small"
    if not small.exists():
        shutil.copytree(other_reward_model_path(cache), small)
        tiny.load_tokenizer().save_pretrained(str(small))  # 547 tokens over a 400-row embedding
    with pytest.raises(ConfigError, match="tokenizer has 547 tokens but its embedding only 400 rows.*resize"):
        rewards.reward_model_input(str(small), policy_tok)
