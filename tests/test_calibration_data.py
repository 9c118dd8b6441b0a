"""Calibration data: sequences from files, strings, token tensors and the data-free mode, and their record."""

import hashlib
import math
import os

import pytest
import torch
from conftest import make_tokenizer, tiny_llama_config

from turboquant_hf.calibration.data import (
    calibration_batches,
    describe,
    generate_calibration_ids,
)
from turboquant_hf.quantization.config import CalibrationConfig

WORDS = ["the", "a", "of", "to", "and", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are", "with",
         "as", "his", "they", "be", "at", "one", "have", "this"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config()).eval()


def words(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (n,), generator=g).tolist())


def text_file(tmp_path, text, name="plays.txt"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_text_file_sequences_are_bos_plus_consecutive_text(tmp_path, model, tok):
    text = words(1000)
    ids = tok(text, add_special_tokens=False).input_ids
    cal = CalibrationConfig(data=text_file(tmp_path, text), samples=5, sequence_length=32, seed=3)
    batches = calibration_batches(cal, model, tok)
    assert len(batches) == 5 and all(b.shape == (1, 32) and b.dtype == torch.long for b in batches)
    starts = set()
    for b in batches:
        assert b[0, 0].item() == tok.bos_token_id
        body = b[0, 1:].tolist()
        start = next(s for s in range(0, len(ids), 31) if ids[s: s + 31] == body)  # a non-overlapping window
        starts.add(start)
    assert len(starts) == 5
    again = calibration_batches(cal, model, tok)
    assert all(torch.equal(a, b) for a, b in zip(batches, again))
    other = calibration_batches(CalibrationConfig(data=cal.data, samples=5, sequence_length=32, seed=4), model, tok)
    assert any(not torch.equal(a, b) for a, b in zip(batches, other))

    record = describe(cal, batches)
    assert record["kind"] == "text-file" and record["source"] == "plays.txt"
    assert record["source_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert record["samples"] == 5 and record["tokens"] == 160 and record["sequence_length"] == 32
    assert record["seed"] == 3
    assert str(tmp_path) not in repr(record)


def test_fewer_sequences_than_samples_uses_all_with_a_warning(tmp_path, model, tok):
    cal = CalibrationConfig(data=text_file(tmp_path, words(100)), samples=50, sequence_length=32)
    with pytest.warns(UserWarning, match="holds 3 sequences of 32 tokens; 50 were asked for"):
        batches = calibration_batches(cal, model, tok)
    assert len(batches) == 3 and describe(cal, batches)["samples"] == 3


def test_strings_are_joined_with_eos(model, tok):
    texts = [words(20, seed=i) for i in range(6)]
    cal = CalibrationConfig(data=texts, samples=100, sequence_length=16)
    with pytest.warns(UserWarning):
        batches = calibration_batches(cal, model, tok)
    stream = []
    for t in texts:
        stream += ([tok.eos_token_id] if stream else []) + tok(t, add_special_tokens=False).input_ids
    assert len(stream) == 125 and len(batches) == 125 // 15
    got = sorted(tuple(b[0, 1:].tolist()) for b in batches)
    assert got == sorted(tuple(stream[s: s + 15]) for s in range(0, 125 - 14, 15))
    record = describe(cal, batches)
    assert record["kind"] == "strings" and record["source"] == "list of 6 strings"


def test_token_tensors_are_split_as_given(model):
    flat = torch.arange(0, 100) % 256
    rows = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(1))
    cal = CalibrationConfig(data=[flat, rows], samples=7, sequence_length=32)
    batches = calibration_batches(cal, model, None)
    expected = [flat[s: s + 32] for s in (0, 32, 64)] + [r[s: s + 32] for r in rows for s in (0, 32)]
    assert len(batches) == 7
    assert sorted(b[0].tolist() for b in batches) == sorted(e.tolist() for e in expected)
    subset = calibration_batches(CalibrationConfig(data=[flat, rows], samples=4, sequence_length=32), model, None)
    assert len(subset) == 4 and all(any(torch.equal(s[0], e) for e in expected) for s in subset)
    assert describe(cal, batches)["source"] == "list of 2 token-id tensors"


@pytest.mark.parametrize("data, error, message", [
    ([], ValueError, "empty list"),
    (["text", torch.zeros(40, dtype=torch.long)], TypeError, "element 1 is a Tensor"),
    ([torch.zeros(40)], TypeError, "dtype torch.float32"),
    ([torch.full((40,), 999)], ValueError, r"outside \[0, 256\)"),
    ([torch.zeros(2, 2, 40, dtype=torch.long)], ValueError, "1-D or 2-D"),
    ([torch.zeros(20, dtype=torch.long)], ValueError, "longest row has 20 tokens; one sequence needs 32"),
    ({"text": ["a"]}, TypeError, "dict is not calibration data"),
    (3, TypeError, "int is not calibration data"),
])
def test_bad_data_is_named(model, tok, data, error, message):
    with pytest.raises(error, match=message):
        calibration_batches(CalibrationConfig(data=data, sequence_length=32), model, tok)


def test_file_and_tokenizer_errors(tmp_path, model, tok):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match="calibration data file not found: .*nope.txt"):
        calibration_batches(CalibrationConfig(data=missing), model, tok)
    with pytest.raises(FileNotFoundError, match=r"pass it in a list: data=\[text\]"):
        calibration_batches(CalibrationConfig(data="some text\nthat is not a path"), model, tok)
    short = text_file(tmp_path, words(10))
    with pytest.raises(ValueError, match=r"gives 10 tokens; one calibration sequence needs 31 \(sequence_length 32, "
                       r"plus 1 special token"):
        calibration_batches(CalibrationConfig(data=short, sequence_length=32), model, tok)
    with pytest.raises(ValueError, match="no tokenizer"):
        calibration_batches(CalibrationConfig(data=["some text"], sequence_length=32), model, None)
    explicit = CalibrationConfig(data=[words(200)], sequence_length=32, samples=2, tokenizer=tok)
    assert len(calibration_batches(explicit, model, None)) == 2


def test_dataset_type_needs_a_text_column():
    datasets = pytest.importorskip("datasets")
    from turboquant_hf.calibration.data import _kind

    assert _kind(datasets.Dataset.from_dict({"text": ["a b"]})) == "dataset"
    with pytest.raises(ValueError, match="no `text` column"):
        calibration_batches(CalibrationConfig(data=datasets.Dataset.from_dict({"t": ["a"]})), None, None)


def test_data_free_is_seeded_exact_length_and_restores_the_random_state(model, tok):
    cal = CalibrationConfig(data="data-free", samples=5, sequence_length=24, seed=7)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    batches = calibration_batches(cal, model, tok)
    assert torch.equal(torch.get_rng_state(), before)
    assert len(batches) == 5 and all(b.shape == (1, 24) for b in batches)
    prompts = ["", "The", "In the", "It is", "One of the", "A"]
    for i, b in enumerate(batches):
        prompt = [tok.bos_token_id] + tok(prompts[i], add_special_tokens=False).input_ids
        assert b[0, : len(prompt)].tolist() == prompt
        assert tok.eos_token_id not in b[0, len(prompt):].tolist()  # EOS suppressed: every token is text
    again = calibration_batches(cal, model, tok)
    assert all(torch.equal(a, b) for a, b in zip(batches, again))
    other = calibration_batches(CalibrationConfig(samples=5, sequence_length=24, seed=8), model, tok)
    assert any(not torch.equal(a, b) for a, b in zip(batches, other))
    record = describe(cal, batches)
    assert record["kind"] == "data-free" and "self-generated" in record["source"]
    assert record["prompts"] == prompts and record["sampling"] == {"temperature": 1.0, "top_p": 0.95, "top_k": 0}
    assert record["tokens"] == 120


def test_data_free_batches_do_not_change_the_text(model, tok):
    """Left-padding prompts of different lengths into one batch gives the same sequences as one prompt at a time
    would (the same model, the same samples), up to sampling: checked on greedy-like sampling (tiny top_k)."""
    one = generate_calibration_ids(model, tok, 6, 20, seed=1, top_k=1, batch_size=1)
    six = generate_calibration_ids(model, tok, 6, 20, seed=1, top_k=1, batch_size=6)
    assert all(torch.equal(a, b) for a, b in zip(one, six))


def test_data_free_options_and_unknown_settings(model, tok):
    cal = CalibrationConfig(samples=2, sequence_length=12, options={"data_free": {"prompts": ["It is"]}})
    for b in calibration_batches(cal, model, tok):
        assert b[0, :3].tolist() == [tok.bos_token_id] + tok("It is", add_special_tokens=False).input_ids
    with pytest.raises(ValueError, match="unknown setting.*temprature"):
        calibration_batches(CalibrationConfig(options={"data_free": {"temprature": 1}}), model, tok)


def test_data_free_refuses_an_encoder():
    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=64))
    with pytest.raises(ValueError, match="needs a model that generates text.*BertModel.*give real text"):
        calibration_batches(CalibrationConfig(samples=2, sequence_length=16), bert, None)


def test_encoder_tokenizer_frames_each_sequence_with_cls_and_sep(tmp_path, model):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[CLS]", "[SEP]", *WORDS])}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    bert_like = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]")
    text = words(200)
    ids = bert_like(text, add_special_tokens=False).input_ids
    cal = CalibrationConfig(data=text_file(tmp_path, text), samples=6, sequence_length=16)
    batches = calibration_batches(cal, model, bert_like)
    windows = [[1] + ids[s: s + 14] + [2] for s in range(0, len(ids) - 13, 14)]
    assert len(batches) == 6 and all(b[0].tolist() in windows for b in batches)


def test_no_absolute_path_in_record(tmp_path, model, tok):
    path = text_file(tmp_path, words(300), name="other_plays.txt")
    cal = CalibrationConfig(data=os.path.abspath(path), samples=2, sequence_length=32)
    record = describe(cal, calibration_batches(cal, model, tok))
    assert record["source"] == "other_plays.txt" and os.sep not in record["source"]


def test_evaluation_counts_top1_agreement_and_kl(model):
    from transformers import LlamaForCausalLM

    from turboquant_hf.reporting.evaluation import compare_log_probs, compare_on_text

    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(0))
    same = compare_on_text(model, model, ids, window=32)
    assert same.tokens == 69 and same.top1_agreement == 1.0 and abs(same.mean_kl) < 1e-6
    assert same.base_perplexity == same.quantized_perplexity
    torch.manual_seed(1)
    other = LlamaForCausalLM(tiny_llama_config()).eval()
    diff = compare_on_text(model, other, ids, window=32)
    with torch.no_grad():
        a = model(ids[None, :-1]).logits[0].argmax(-1)
        b = other(ids[None, :-1]).logits[0].argmax(-1)
    assert diff.top1_agreement == pytest.approx((a == b).float().mean().item())
    assert diff.top1_agreement < 1 and diff.mean_kl > 0
    # two hand-made positions over a vocabulary of 2: argmaxes agree at the first one only
    base = [torch.log(torch.tensor([[0.9, 0.1], [0.6, 0.4]]))]
    quant = [torch.log(torch.tensor([[0.8, 0.2], [0.3, 0.7]]))]
    r = compare_log_probs(base, quant, torch.tensor([0, 0, 1]), window=2)
    kl = 0.9 * math.log(0.9 / 0.8) + 0.1 * math.log(0.1 / 0.2) + 0.6 * math.log(0.6 / 0.3) + 0.4 * math.log(0.4 / 0.7)
    assert r.top1_agreement == 0.5 and r.mean_kl == pytest.approx(kl / 2)
    assert r.quantized_perplexity == pytest.approx(math.exp(-(math.log(0.8) + math.log(0.7)) / 2))


def test_data_free_text_of_smollm2_is_text_the_model_finds_likely(smollm2_dir):
    """On the real SmolLM2-135M: self-generated calibration text is varied (not one token repeated) and typical of
    the model (its perplexity on its own samples is far below its perplexity on shuffled copies of them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    batches = calibration_batches(CalibrationConfig(samples=3, sequence_length=48, seed=0), model, tok)
    ids = torch.cat(batches)
    assert ids.shape == (3, 48) and len(set(ids[:, 1:].flatten().tolist())) > 60

    def perplexity(x):
        with torch.no_grad():
            logits = model(x).logits[:, :-1].float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).exp().item()

    g = torch.Generator().manual_seed(0)
    shuffled = torch.cat([ids[:, :1], ids[:, 1:][:, torch.randperm(47, generator=g)]], 1)
    own, scrambled = perplexity(ids), perplexity(shuffled)
    assert own < 40 and scrambled > 5 * own, (own, scrambled)
