"""A user's own data files for the BERT jobs: label ids that stay those the model learned, empty cells, float
labels, empty files, text field lists, and model configs the parent checks; in process (but for one real launch),
with files in tmp_path."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as hf

from conftest import run_cli
from jobs.bert import MaskedLM, TextClassification, classification_model, masked_lm_model
from launcher.derived import ConfigError
from launcher.launch.checks import check_job_inputs

GOOD, BAD = ["a great film", "lovely and warm", "truly superb"], ["a dull mess", "awful acting", "so boring"]


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def reviews_csv(tmp_path: Path, name: str = "train.csv", labels: tuple[str, str] = ("neg", "pos")) -> str:
    rows = [f"{t},{labels[1]}\n" for t in GOOD] + [f"{t},{labels[0]}\n" for t in BAD]
    return write(tmp_path / name, "text,label\n" + "".join(rows))


def jsonl(tmp_path: Path, name: str, rows: list[dict]) -> str:
    return write(tmp_path / name, "".join(json.dumps(row) + "\n" for row in rows))


def files(tiny_bert: Path | str, path: str, **kwargs) -> TextClassification:
    return TextClassification(str(tiny_bert), source="files", path=path, **kwargs)


def test_string_labels_are_the_train_files_and_the_checkpoint_keeps_them(tmp_path: Path, tiny_bert: Path) -> None:
    """Ids come from the sorted train labels, not from whatever the eval file holds; write_model_files saves
    them as id2label (a pipeline shows the names), and a model built from that checkpoint maps by them, even
    for a file of one label (it once took 'pos' for id 0 there)."""
    only_pos = jsonl(tmp_path, "only_pos.jsonl", [{"text": t, "label": "pos"} for t in GOOD])
    task = files(tiny_bert, reviews_csv(tmp_path), eval_path=only_pos)
    assert [s["labels"] for s in task.eval_set] == [1, 1, 1]
    checkpoint = tmp_path / "checkpoint"
    model = classification_model(str(tiny_bert), num_labels=2)
    model.save_pretrained(checkpoint)
    task.write_model_files(model, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    assert (config["id2label"], config["label2id"]) == ({"0": "neg", "1": "pos"}, {"neg": 0, "pos": 1})
    predicted = hf.pipeline("text-classification", model=str(checkpoint))(GOOD)
    assert {p["label"] for p in predicted} <= {"neg", "pos"}
    again = files(checkpoint, only_pos, eval_path=only_pos)  # model.pretrained=<run dir>: its checkpoint
    assert [s["labels"] for s in again.train_set + again.eval_set] == [1] * 6
    no_names = files(tiny_bert, only_pos)  # a pre-trained model has LABEL_0, LABEL_1: a new mapping
    assert no_names.labels.names == ["pos"] and no_names.train_set[0]["labels"] == 0


def test_a_label_the_mapping_does_not_know_is_named_with_its_file_and_row(tmp_path: Path, tiny_bert: Path) -> None:
    """An eval-only label was reported as another one ('positive' outside data.num_labels=2)."""
    dev = jsonl(tmp_path, "dev.jsonl", [{"text": "fine", "label": label} for label in ("neg", "pos", "neutral")])
    with pytest.raises(ValueError, match=rf"^data\.eval_path={dev} row 3: label 'neutral' is not one of the labels the "
                                         rf"model is trained on \['neg', 'pos'\] \(the labels of data\.path="):
        files(tiny_bert, reviews_csv(tmp_path), eval_path=dev)
    checkpoint = tmp_path / "checkpoint"
    model = classification_model(str(tiny_bert), num_labels=2)
    model.save_pretrained(checkpoint)
    files(tiny_bert, reviews_csv(tmp_path)).write_model_files(model, checkpoint)
    other = reviews_csv(tmp_path, "other.csv", labels=("ham", "spam"))
    with pytest.raises(ValueError, match=rf"^data\.path={other} row 1: label 'spam' is not one of the labels the model "
                                         rf"is trained on \['neg', 'pos'\] \(id2label in the config\.json of "):
        files(checkpoint, other)
    with pytest.raises(ValueError, match=r"^data\.num_labels=3 but data\.tokenizer=.* is a classifier of 2 labels"):
        files(checkpoint, reviews_csv(tmp_path), num_labels=3)
    with pytest.raises(ValueError, match=r"train\.csv has 2 labels \['neg', 'pos'\] in column 'label' \(data\.label_"
                                         r"field\), more than data\.num_labels=1; set data\.num_labels=2"):
        files(tiny_bert, reviews_csv(tmp_path), num_labels=1)


CELLS = {"missing text": ("text,label\ngood,pos\n,neg\n", "row 2: no text in column 'text' (data.text_fields)"),
         "blank text": ('text,label\ngood,pos\n"  ",neg\n', "row 2: no text in column 'text' (data.text_fields)"),
         # pandas skips the blank lines, not the quoted empty one: a row (the parent skipped it as blank)
         "quoted empty text": ('text,label\ngood,pos\n\n \t\n""\nbad,neg\n',
                               "row 2: no text in column 'text' (data.text_fields)"),
         "missing name": ("text,label\ngood,pos\nbad,\n", "row 2: no label in column 'label' (data.label_field)"),
         "missing id": ("text,label\ngood,1\nbad,\nok,0\n", "row 2: no label in column 'label' (data.label_field)"),
         "float label": ("text,label\ngood,0.4\nbad,1.9\n", "row 1: label 0.4 in column 'label' (data.label_field) is "
                                                             "not a class: give integer class ids or names"),
         "id outside": ("text,label\ngood,1\nbad,2\n", "row 2: label 2 is outside data.num_labels=2 (class ids 0..1)")}


@pytest.mark.parametrize("case", list(CELLS))
def test_empty_cells_and_labels_that_are_no_class_name_the_file_key_and_row(
        tmp_path: Path, tiny_bert: Path, case: str) -> None:
    """Trained on silently before: an empty text as the word None, an empty name as a class of its own, 0.4 and
    1.9 as 0 and 1; an empty id failed in int() with a hint at the config."""
    content, expected = CELLS[case]
    path = write(tmp_path / "train.csv", content)
    with pytest.raises(ValueError) as error:
        files(tiny_bert, path)
    assert str(error.value).startswith(f"data.path={path} {expected}"), str(error.value)


@pytest.mark.parametrize("case", ["missing text", "blank text", "quoted empty text"])
def test_an_empty_text_cell_is_found_by_the_parent_before_any_worker_starts(tmp_path: Path, case: str) -> None:
    """The workers said it only after their start-up (13 s on the CPU machine for +exp=bert), each of them."""
    path = write(tmp_path / "train.csv", CELLS[case][0])
    config = {"model": {}, "data": {"path": str(path), "text_fields": ["text"], "label_field": "label"}}
    with pytest.raises(ConfigError, match=rf"^data\.path={path} row 2: no text in column 'text'; fill it in or drop"):
        check_job_inputs(config, {})
    lines = jsonl(tmp_path, "train.jsonl", [{"text": "good", "label": "pos"}, {"text": "ok", "label": "pos"},
                                            {"label": "neg"}])
    with pytest.raises(ConfigError, match=rf"^data\.path={lines} row 3: no text in column 'text'"):
        check_job_inputs({"model": {}, "data": {**config["data"], "path": str(lines)}}, {})
    check_job_inputs({"model": {}, "data": {**config["data"], "path": str(write(tmp_path / "ok.csv", "text,label\n"
                                                                              "good,pos\nbad,neg\n"))}}, {})


def test_a_line_that_is_no_json_or_a_row_of_more_cells_is_named_by_its_number(tmp_path: Path, tiny_bert: Path) -> None:
    """datasets said "JSON parse error ... in row 1" (counted from 0) under a 112-line traceback, on every rank."""
    good = json.dumps({"text": "good", "label": "pos"})
    path = write(tmp_path / "train.jsonl", f'{good}\n\n{{"text": "broken, "label": "neg"}}\n{good}\n')
    config = {"model": {}, "data": {"path": path, "text_fields": ["text"], "label_field": "label"}}
    with pytest.raises(ConfigError, match=rf"^data\.path={path} line 3 is no JSON object \(Expecting ',' delimiter, "
                                          r"column 20\); each line of a .jsonl file holds one sample$"):
        check_job_inputs(config, {})
    with pytest.raises(ConfigError, match=r"line 2 is no JSON object \(a JSON list\)"):
        check_job_inputs({"model": {}, "data": {**config["data"], "path": write(tmp_path / "list.jsonl",
                                                                                 f'{good}\n["good", "pos"]\n')}}, {})
    ragged = write(tmp_path / "train.csv", "text,label\ngood film,pos\nbad, really bad,neg\n")
    with pytest.raises(ConfigError, match=r"train\.csv row 2 has 3 cells where the header names 2 columns; quote a "
                                          r"text that holds a comma"):
        check_job_inputs({"model": {}, "data": {**config["data"], "path": ragged}}, {})
    # what datasets reads, the parent lets by: one JSON document over a .jsonl's lines, a cell over csv's 128 KiB
    for name, text in {"array.jsonl": f"[{good},\n{good}]\n", "long.csv": f"text,label\n{'word ' * 30000},pos\n"}.items():
        check_job_inputs({"model": {}, "data": {**config["data"], "path": write(tmp_path / name, text)}}, {})
    # a file too big for the parent to scan: the job's reader says it in one line
    with pytest.raises(ValueError, match=rf"^data\.path={path} does not read as json: JSON parse error") as error:
        files(tiny_bert, path)
    assert getattr(error.value, "one_line", False)


LABELS = {  # case: (train file, eval file or None) in tmp_path, for labels the job refuses
    **{case: lambda tmp, case=case: (write(tmp / "train.csv", CELLS[case][0]), None) for case in CELLS
       if "text" not in case},
    "ids and names in one file": lambda tmp: (jsonl(tmp, "train.jsonl", [{"text": "good", "label": 1},
                                                                          {"text": "bad", "label": "neg"}]), None),
    "names where the train labels are ids": lambda tmp: (write(tmp / "ids.csv", "text,label\ngood,1\nbad,0\n"),
                                                         jsonl(tmp, "dev.jsonl", [{"text": "ok", "label": "pos"}])),
    "a name the train file lacks": lambda tmp: (reviews_csv(tmp), jsonl(tmp, "dev.jsonl", [
        {"text": "ok", "label": "pos"}, {"text": "meh", "label": "so-so"}])),
    "more names than num_labels": lambda tmp: (write(tmp / "three.csv", "text,label\na,x\nb,y\nc,z\n"), None)}


@pytest.mark.parametrize("case", list(LABELS))
def test_labels_the_job_refuses_are_found_by_the_parent_in_the_jobs_words(
        tmp_path: Path, tiny_bert: Path, case: str) -> None:
    """The workers said it only after their start-up, each of them. The parent reads the label column as the job's
    reader types it (pandas for a CSV: 1 an id, 0.4 a float, an empty cell missing) and stops with the job's own
    line. A JSON Lines file of ids and names (1 and 'neg') was trained on: 1 as id 1, 'neg' as id 0."""
    path, eval_path = LABELS[case](tmp_path)
    with pytest.raises(ValueError) as job:
        files(tiny_bert, path, eval_path=eval_path)
    data = {"tokenizer": str(tiny_bert), "path": path, "eval_path": eval_path, "text_fields": ["text"],
            "label_field": "label", "num_labels": 2}
    with pytest.raises(ConfigError) as parent:
        check_job_inputs({"model": {}, "data": data}, {})
    assert str(parent.value) == str(job.value)
    if case == "ids and names in one file":
        assert str(job.value) == (f"data.path={path} row 2: label 'neg' is a name, but row 1's label 1 is not (data."
                                  f"label_field); give every row an integer id, or every row a name")
    check_job_inputs({"model": {}, "data": {**data, "path": reviews_csv(tmp_path), "eval_path": None}}, {})


def test_a_label_cell_the_job_refuses_stops_the_launch_before_any_worker(tmp_path: Path) -> None:
    """One line and exit 2, as every check of the parent; no run dir is left behind."""
    path = write(tmp_path / "train.csv", CELLS["missing id"][0])
    out = run_cli("+exp=bert", "data=files", f"data.path={path}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"error: data.path={path} row 2: no label in column 'label' (data.label_field); fill it in or drop the row"]
    assert not (tmp_path / "run").exists()


def test_integer_labels_are_ids(tmp_path: Path, tiny_bert: Path) -> None:
    """pandas writes an int column with an empty cell as floats: 1.0 is id 1. A name where the train labels are
    ids has no id."""
    path = jsonl(tmp_path, "train.jsonl", [{"text": "good", "label": 1.0}, {"text": "bad", "label": 0.0}])
    assert [s["labels"] for s in files(tiny_bert, path).train_set] == [1, 0]
    dev = jsonl(tmp_path, "dev.jsonl", [{"text": "good", "label": "pos"}])
    with pytest.raises(ValueError, match=rf"^data\.eval_path={dev} row 1: label 'pos' is a name, but the labels of "
                                         rf"data\.path={path} are class ids \(integers\)"):
        files(tiny_bert, path, eval_path=dev)


def test_text_fields_are_one_column_or_a_pair(tmp_path: Path, tiny_bert: Path) -> None:
    """A plain string is one column (the job split it into characters); a third column is refused, in the parent
    and in the job (the tokenizer took it as text_target, silently)."""
    path = write(tmp_path / "nli.csv", "premise,hypothesis,extra,label\nit rains,it is wet,x,1\nit is dry,it is,y,0\n")
    as_string, as_list = files(tiny_bert, path, text_fields="premise"), files(tiny_bert, path, text_fields=["premise"])
    assert [s["input_ids"] for s in as_string.train_set] == [s["input_ids"] for s in as_list.train_set]
    config = {"model": {}, "data": {"path": path, "text_fields": "premise", "label_field": "label"}}
    check_job_inputs(config, {})
    three = ["premise", "hypothesis", "extra"]
    expected = r"^data\.text_fields=\['premise', 'hypothesis', 'extra'\] names 3 columns; the tokenizer takes a text or"
    with pytest.raises(ConfigError, match=expected):
        check_job_inputs({"model": {}, "data": {**config["data"], "text_fields": three}}, {})
    with pytest.raises(ValueError, match=expected):
        files(tiny_bert, path, text_fields=three)


def test_empty_files_name_their_key(tmp_path: Path, tiny_bert: Path) -> None:
    """A header-only CSV gave datasets' 'Instruction "train" corresponds to no data!' (for data.eval_path too), an
    empty JSONL a StopIteration, a blank .txt an IndexError; the parent refused a 0-byte CSV for its columns."""
    train = reviews_csv(tmp_path)
    empty = {"header.csv": "text,label\n\n", "empty.csv": "", "empty.jsonl": "", "blank.jsonl": "\n \n",
             "blank.txt": "\n  \n"}
    for name, content in empty.items():
        path = write(tmp_path / name, content)
        with pytest.raises(ConfigError, match=rf"^data\.eval_path={path} has no rows; .*, or set data\.eval_path=null"):
            check_job_inputs({"model": {}, "data": {"path": train, "eval_path": path}}, {})
        if name.endswith(".txt"):
            with pytest.raises(ValueError, match=rf"^data\.path={path} has no rows; give a file with at least one"):
                MaskedLM(str(tiny_bert), source="files", path=path)
            continue
        with pytest.raises(ValueError, match=rf"^data\.eval_path={path} has no rows; give a file with at least one"):
            files(tiny_bert, train, eval_path=path)
        with pytest.raises(ValueError, match=rf"^data\.path={path} has no rows; give a file with at least one"):
            files(tiny_bert, path)


def test_a_csv_with_a_byte_order_mark_has_its_columns(tmp_path: Path, tiny_bert: Path) -> None:
    """Excel's UTF-8 CSV starts with a BOM: the parent read the first column as '\\ufefftext' and refused it."""
    path = tmp_path / "excel.csv"
    path.write_bytes("text,label\r\ngood,pos\r\nbad,neg\r\n".encode("utf-8-sig"))
    check_job_inputs({"model": {}, "data": {"path": str(path), "text_fields": ["text"], "label_field": "label"}}, {})
    assert [s["labels"] for s in files(tiny_bert, str(path)).train_set] == [1, 0]


def test_masked_lm_refuses_a_model_that_is_no_bert(tmp_path: Path) -> None:
    """It loaded a RoBERTa into BertForMaskedLM: no weight matched, and it pre-trained a random BERT."""
    hf.RobertaForMaskedLM(hf.RobertaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                           intermediate_size=64)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"^model\.pretrained={tmp_path} is a roberta model; model=bert_mlm "
                                         rf"pre-trains BERT only"):
        masked_lm_model(str(tmp_path))


@pytest.mark.parametrize("pad", [0, 1])
def test_max_length_leaves_roberta_its_padding_positions(tmp_path: Path, pad: int) -> None:
    """RoBERTa's position ids start at pad_token_id + 1: of 66 positions, 66 - pad - 1 hold tokens (a run with
    data.max_length=66 passed the parent and failed in the workers: index 66 is out of bounds)."""
    config = hf.RobertaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=64, max_position_embeddings=66, pad_token_id=pad)
    model = hf.RobertaModel(config).eval()
    model.save_pretrained(tmp_path)
    longest = 66 - pad - 1
    model(input_ids=torch.full((1, longest), 5))  # the longest that fits
    with pytest.raises((IndexError, RuntimeError)):
        model(input_ids=torch.full((1, longest + 1), 5))
    check_job_inputs({"model": {"pretrained": str(tmp_path)}, "data": {"max_length": longest}}, {})
    with pytest.raises(ConfigError, match=rf"^data\.max_length={longest + 1} is more than the {longest} positions of "
                                          rf"model\.pretrained={tmp_path} \(roberta: its position ids start at"):
        check_job_inputs({"model": {"pretrained": str(tmp_path)}, "data": {"max_length": longest + 1}}, {})
    hf.BertConfig(max_position_embeddings=66, pad_token_id=pad).save_pretrained(tmp_path)  # BERT's start at 0
    check_job_inputs({"model": {"pretrained": str(tmp_path)}, "data": {"max_length": 66}}, {})


def test_a_tokenizer_without_files_or_with_more_words_than_the_model_is_refused(tmp_path: Path, tiny_bert: Path) -> None:
    """A dir of save_pretrained's model alone trained on every word as [UNK] (transformers 5 makes a tokenizer of the 5
    special tokens from its config), exit 0; a tokenizer of more words than the model's embeddings failed on every
    rank with `IndexError: index out of range in self`. Both refused in the parent, naming the key."""
    model_dir = tmp_path / "model"
    hf.BertForSequenceClassification(hf.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=64)).save_pretrained(model_dir)
    config = {"model": {"pretrained": str(model_dir)}, "data": {"tokenizer": str(model_dir)}}
    with pytest.raises(ConfigError, match=rf"^model\.pretrained={model_dir} has no tokenizer files \(tokenizer\.json, "
                                          rf"tokenizer_config\.json, vocab\.txt, \.\.\.\), and a tokenizer made without "
                                          rf"them knows no word; save the tokenizer there too"):
        check_job_inputs(config, {})
    with pytest.raises(ConfigError, match=rf"^data\.tokenizer={tiny_bert} has 30522 words, more than the 100 of "
                                          rf"model\.pretrained={model_dir}'s embeddings \(vocab_size\)"):
        check_job_inputs({**config, "data": {"tokenizer": str(tiny_bert)}}, {})
    check_job_inputs({"model": {"pretrained": str(tiny_bert)}, "data": {"tokenizer": str(tiny_bert)}}, {})
