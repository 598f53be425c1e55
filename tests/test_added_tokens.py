"""Tokens added to a BERT job's tokenizer (tokenizer.add_tokens, then save_pretrained): the model's embeddings grow to
them (model.tokenizer, jobs/vocab.py), in process, in the parent's check, and in one real launch whose checkpoint plain
transformers loads. Before, a text with such a token failed on every rank: `IndexError: index out of range in self`."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as hf

from conftest import run_cli
from jobs.bert import classification_model, masked_lm_model
from jobs.text import DataError
from launcher.derived import ConfigError, config_hash
from launcher.launch.checks import check_job_inputs

ADDED = ["[ent]", "[/ent]"]
ROWS = 30522  # tiny_bert's embedding rows: the bert-base-uncased vocabulary


@pytest.fixture
def added(tmp_path: Path, tiny_bert: Path) -> Path:
    """tiny_bert's tokenizer with two tokens added: ids 30522 and 30523."""
    tokenizer = hf.AutoTokenizer.from_pretrained(tiny_bert)
    assert tokenizer.add_tokens(ADDED) == 2 and len(tokenizer) == ROWS + 2
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    return tmp_path / "tokenizer"


def test_the_embeddings_grow_to_the_added_tokens_and_keep_their_rows(tmp_path: Path, tiny_bert: Path, added: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """The new rows are the tokenizer's added ids, the old ones the checkpoint's; the MLM decoder stays tied to the
    word embeddings and its bias grows with them; on the meta device (strategy=fsdp's ranks but 0) the same shapes;
    a tokenizer of no more words than the rows changes nothing and says nothing; one of more words is another
    vocabulary, refused."""
    grown, plain = (classification_model(str(tiny_bert), num_labels=2, tokenizer=t) for t in (str(added), None))
    said = capsys.readouterr().out
    assert f"the tokenizer {added} has {ROWS + 2} tokens, 2 more than the {ROWS} rows of the model's embeddings: " \
           f"grown to {ROWS + 2}" in said
    embedded = grown.get_input_embeddings().weight
    assert embedded.shape == (ROWS + 2, 32) and grown.config.vocab_size == ROWS + 2
    assert torch.equal(embedded[:ROWS], plain.get_input_embeddings().weight)
    tokenizer = hf.AutoTokenizer.from_pretrained(added)
    batch = tokenizer(["[ent] a great film [/ent]"], return_tensors="pt")
    assert batch["input_ids"].max() == ROWS + 1
    grown(**batch, labels=torch.tensor([1])).loss.backward()
    assert embedded.grad[ROWS:].abs().sum() > 0  # the added tokens' rows learn

    mlm = masked_lm_model(str(tiny_bert), tokenizer=str(added))
    decoder = mlm.cls.predictions.decoder
    assert decoder.weight is mlm.bert.embeddings.word_embeddings.weight and decoder.bias.shape == (ROWS + 2,)
    labels = torch.full_like(batch["input_ids"], -100)
    labels[0, 1], labels[0, -2] = ROWS, ROWS + 1  # the targets of the MLM's loss are the added tokens
    loss, _ = mlm(input_ids=batch["input_ids"], labels=labels)
    assert torch.isfinite(loss)

    with torch.device("meta"):
        meta = classification_model(str(tiny_bert), num_labels=2, tokenizer=str(added))
    assert [(n, p.shape) for n, p in meta.named_parameters()] == [(n, p.shape) for n, p in grown.named_parameters()]
    capsys.readouterr()
    same = classification_model(str(tiny_bert), num_labels=2, tokenizer=str(tiny_bert))
    assert same.get_input_embeddings().num_embeddings == ROWS and "the tokenizer" not in capsys.readouterr().out
    small = tmp_path / "small"  # a model of another vocabulary: no growing makes the tokenizer's words its own
    hf.BertForSequenceClassification(hf.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=64)).save_pretrained(small)
    with pytest.raises(DataError, match=rf"^the tokenizer {added} has {ROWS} words, more than the 100 rows of the "
                                        r"model's embeddings: it is another vocabulary"):
        classification_model(str(small), num_labels=2, tokenizer=str(added))


def test_the_parent_lets_added_tokens_through_to_a_model_that_grows_and_names_the_data_s_key(
        tmp_path: Path, tiny_bert: Path, added: Path) -> None:
    """Tokens added past model.pretrained's rows pass where the model takes data.tokenizer (model.tokenizer, as the
    BERT models' ${data.tokenizer}), and are refused, named, where it does not (null, or another tokenizer); a
    tokenizer of more words than the rows is another vocabulary, refused either way; a tokenizer dir that is not
    there is told as data.tokenizer, the key the user gave, which model.tokenizer repeats."""
    data = {"tokenizer": str(added)}
    check_job_inputs({"model": {"pretrained": str(tiny_bert), "tokenizer": str(added)}, "data": data}, {})
    for other in (None, str(tiny_bert)):
        with pytest.raises(ConfigError, match=rf"^data\.tokenizer={added} has {ROWS + 2} token ids, 2 added past the "
                                              rf"{ROWS} rows of model\.pretrained={tiny_bert}'s embeddings "
                                              r"\(\[ent\], \[/ent\]\): such a token fails in the model; "
                                              r"model=bert_cls and bert_mlm grow"):
            check_job_inputs({"model": {"pretrained": str(tiny_bert), "tokenizer": other}, "data": data}, {})
    small = tmp_path / "small"
    hf.BertForSequenceClassification(hf.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=64)).save_pretrained(small)
    with pytest.raises(ConfigError, match=rf"^data\.tokenizer={added} has {ROWS} words, more than the 100 of "):
        check_job_inputs({"model": {"pretrained": str(small), "tokenizer": str(added)}, "data": data}, {})
    # a slow tokenizer's vocab.txt, its added tokens where transformers 4.34 on writes them, and before; a fast one's
    # tokenizer.json with more in tokenizer_config.json (transformers adds those too)
    vocab, decoder = "".join(f"w{i}\n" for i in range(100)), '{"added_tokens_decoder": {"100": {"content": "[x]"}}}'
    fast = '{"model": {"vocab": {%s}}, "added_tokens": []}' % ", ".join(f'"w{i}": {i}' for i in range(100))
    for case, saved in {"v4.34": {"vocab.txt": vocab, "tokenizer_config.json": decoder},
                        "v4.33": {"vocab.txt": vocab, "added_tokens.json": '{"[x]": 100}'},
                        "fast": {"tokenizer.json": fast, "tokenizer_config.json": decoder}}.items():
        words = tmp_path / case
        words.mkdir()
        for name, text in saved.items():
            (words / name).write_text(text)
        with pytest.raises(ConfigError, match=r"has 101 token ids, 1 added past the 100 rows .*\(\[x\]\)"):
            check_job_inputs({"model": {"pretrained": str(small)}, "data": {"tokenizer": str(words)}}, {})
    # a run dir from before model.tokenizer resumes: the key repeats data.tokenizer, which the hash holds
    before = {"model": {"pretrained": str(tiny_bert)}, "data": data, "train": {}}
    assert config_hash({**before, "model": {**before["model"], "tokenizer": str(added)}}) == config_hash(before)
    missing = str(tmp_path / "no_such_tokenizer")
    with pytest.raises(ConfigError, match=rf"^data\.tokenizer={missing} is not a directory"):
        check_job_inputs({"model": {"pretrained": str(small), "tokenizer": missing},
                          "data": {"tokenizer": missing}}, {})


def test_a_run_on_texts_with_added_tokens_trains_and_its_checkpoint_loads_in_transformers(
        tmp_path: Path, tiny_bert: Path, added: Path) -> None:
    rows = [f"[ent] thing {i} [/ent] is {'good' if i % 2 else 'bad'},{i % 2}\n" for i in range(16)]
    (tmp_path / "train.csv").write_text("text,label\n" + "".join(rows))
    run_dir = tmp_path / "run"
    out = run_cli("+exp=bert", f"model.pretrained={tiny_bert}", f"data.tokenizer={added}", "data=files",
                  f"data.path={tmp_path / 'train.csv'}", "train.max_steps=2", "train.global_batch_size=8",
                  "train.micro_batch_size=2", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.count(f"grown to {ROWS + 2}") == 1  # rank 0's line
    checkpoint = run_dir / "checkpoints" / "2"
    model = hf.AutoModelForSequenceClassification.from_pretrained(checkpoint)
    assert model.config.vocab_size == ROWS + 2 and len(hf.AutoTokenizer.from_pretrained(checkpoint)) == ROWS + 2
