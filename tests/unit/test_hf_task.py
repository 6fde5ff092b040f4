"""Tasks read with `datasets`: local JSONL/JSON/Parquet/CSV files and directories, held-out splits, errors.

No network: the Hub branch is checked with `datasets.load_dataset` replaced by a stub.
"""
import json
import re

import pytest

datasets = pytest.importorskip("datasets")

from grpo.errors import ConfigError, DataError  # noqa: E402
from grpo.tasks.base import in_held_out  # noqa: E402
from grpo.tasks.hf import load_dataset_task  # noqa: E402

ROWS = [{"prompt": f"Tom has {i} apples and buys {i + 2} more. How many apples does he have?",
         "answer": f"He has {i} + {i + 2} = <<{i}+{i + 2}={2 * i + 2}>>{2 * i + 2} apples.\n#### {2 * i + 2}",
         "id": i, "level": "easy" if i % 2 else "hard"} for i in range(40)]


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """Keep the arrow cache that `datasets` writes for local files out of the user's home."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def test_gsm8k_jsonl_rows_become_examples(tmp_path):
    f = write_jsonl(tmp_path / "gsm8k.jsonl", ROWS[:5])
    task = load_dataset_task(str(f))
    assert task.name == "gsm8k" and task.eval == []
    by_id = {e.fields["id"]: e for e in task.train}
    assert sorted(by_id) == [0, 1, 2, 3, 4]
    e = by_id[3]
    assert e.prompt == ROWS[3]["prompt"] and e.answer == ROWS[3]["answer"]
    assert e.fields == {"id": 3, "level": "easy"}           # every other column, nothing else


def test_train_order_follows_the_seed(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", ROWS)
    a, b, c = (load_dataset_task(str(f), seed=s) for s in (0, 0, 1))
    assert [e.prompt for e in a.train] == [e.prompt for e in b.train]
    assert [e.prompt for e in a.train] != [e.prompt for e in c.train]
    assert sorted(e.prompt for e in a.train) == sorted(e.prompt for e in c.train)


def test_parquet_with_custom_columns_and_non_text_answers(tmp_path):
    rows = [{"problem": "What is 6 * 7?", "solution": 42, "tags": ["arith", "mul"]},
            {"problem": "What is 1/2 + 1/4?", "solution": 0.75, "tags": []}]
    f = write_parquet(tmp_path / "p.parquet", rows)
    task = load_dataset_task(str(f), prompt_column="problem", answer_column="solution", name="mine")
    assert task.name == "mine"
    got = {e.prompt: e for e in task.train}
    assert got["What is 6 * 7?"].answer == "42"          # floats with an integer value are written as integers
    assert got["What is 1/2 + 1/4?"].answer == "0.75"
    # every column but the prompt's under its own name: the answer column too, its value as read
    assert got["What is 6 * 7?"].fields == {"solution": 42.0, "tags": ["arith", "mul"]}


def test_csv_with_quoted_newlines_and_missing_extra_values(tmp_path):
    f = tmp_path / "d.csv"
    f.write_text('prompt,answer,source\n"Line one,\nline two?","x\n#### 5",book\n"Q2",7,\n')
    task = load_dataset_task(str(f))
    got = {e.prompt: e for e in task.train}
    assert got["Line one,\nline two?"].answer == "x\n#### 5"
    assert got["Line one,\nline two?"].fields == {"source": "book"}
    assert got["Q2"].answer == "7" and got["Q2"].fields == {"source": None}


def test_json_array_file(tmp_path):
    f = tmp_path / "d.json"
    f.write_text(json.dumps(ROWS[:3]))
    assert len(load_dataset_task(str(f)).train) == 3


def test_directory_of_files_without_split_names(tmp_path):
    write_jsonl(tmp_path / "data" / "part1.jsonl", ROWS[:3])
    write_parquet(tmp_path / "data" / "part2.parquet", ROWS[3:5])
    (tmp_path / "data" / "notes.md").write_text("ignored")
    task = load_dataset_task(str(tmp_path / "data"))
    assert task.name == "data" and sorted(e.fields["id"] for e in task.train) == [0, 1, 2, 3, 4]


def test_directory_with_split_files(tmp_path):
    d = tmp_path / "gsm8k"
    write_jsonl(d / "train.jsonl", ROWS[:6])
    write_parquet(d / "test-00000-of-00001.parquet", ROWS[6:8])
    task = load_dataset_task(str(d), eval_split="test")
    assert sorted(e.fields["id"] for e in task.train) == list(range(6))
    assert [e.fields["id"] for e in task.eval] == [6, 7]
    only_test = load_dataset_task(str(d), split="test")
    assert sorted(e.fields["id"] for e in only_test.train) == [6, 7]
    with pytest.raises(DataError, match=r"no data files for split 'validation'.*splits found: test, train"):
        load_dataset_task(str(d), eval_split="validation")


def test_eval_path_gives_the_held_out_set(tmp_path):
    train = write_jsonl(tmp_path / "gsm8k" / "train.jsonl", ROWS[:30])
    test = write_jsonl(tmp_path / "gsm8k" / "test.jsonl", ROWS[30:])
    task = load_dataset_task(str(train), eval_path=str(test))
    assert task.name == "gsm8k"
    assert [e.fields["id"] for e in task.eval] == list(range(30, 40))     # file order
    assert {e.prompt for e in task.train}.isdisjoint(e.prompt for e in task.eval)
    assert len(task.train) == 30


def test_eval_fraction_split_is_disjoint_deterministic_and_seed_independent(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", ROWS)
    a = load_dataset_task(str(f), eval_fraction=0.25, seed=0)
    b = load_dataset_task(str(f), eval_fraction=0.25, seed=7)
    assert a.eval and a.train
    held = {e.prompt for e in a.eval}
    assert held == {e.prompt for e in b.eval}                                # same held-out set for any seed
    assert [e.prompt for e in a.eval] == [e.prompt for e in b.eval]
    assert held.isdisjoint(e.prompt for e in a.train)
    assert len(a.train) + len(a.eval) == len(ROWS)
    assert held == {r["prompt"] for r in ROWS if in_held_out(r["prompt"], 0.25)}
    # Shuffling the file does not move a prompt across the split.
    g = write_jsonl(tmp_path / "shuffled.jsonl", ROWS[::-1])
    assert {e.prompt for e in load_dataset_task(str(g), eval_fraction=0.25).eval} == held


def test_hub_dataset_branch_without_network(monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, *, split):
        calls.append((path, name, split))
        rows = ROWS[:4] if split == "train" else ROWS[4:6]
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    task = load_dataset_task("openai/gsm8k", config_name="main", eval_split="test")
    assert calls == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]
    assert task.name == "openai/gsm8k" and len(task.train) == 4 and len(task.eval) == 2

    def failing(path, name=None, *, split):
        raise ValueError("Unknown split \"dev\". Should be one of ['train', 'test'].")

    monkeypatch.setattr(datasets, "load_dataset", failing)
    with pytest.raises(DataError, match=r"cannot load 'openai/gsm8k' config 'main' split 'dev'.*Unknown split"):
        load_dataset_task("openai/gsm8k", config_name="main", split="dev")


# ------------------------------------------------------------------------------------------------ errors

def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_missing_column_names_it_and_lists_the_columns(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"problem": "q", "solution": "1", "id": 0}])
    with pytest.raises(DataError) as e:
        load_dataset_task(str(f))
    assert one_line(e) == (f"{f}: no prompt column 'prompt'; its columns are 'problem', 'solution', 'id'; set "
                           "data.prompt_column=problem")
    g = write_jsonl(tmp_path / "g.jsonl", [{"text": "q"}])
    with pytest.raises(DataError, match=r"no prompt column 'prompt'; its columns are 'text'; data.prompt_column names"):
        load_dataset_task(str(g))
    # the answer column is optional: without it, no answer, and the other columns still reach the rewards
    (e,) = load_dataset_task(str(f), prompt_column="problem").train
    assert e.answer is None and e.fields == {"solution": "1", "id": 0}


def test_missing_file_and_unknown_extension(tmp_path):
    with pytest.raises(DataError) as e:
        load_dataset_task(str(tmp_path / "nope.jsonl"))
    assert one_line(e) == f"data file {tmp_path / 'nope.jsonl'} does not exist"
    with pytest.raises(DataError, match="does not exist"):
        load_dataset_task("./no/such/dir")
    f = tmp_path / "d.txt"
    f.write_text("prompt,answer\nq,1\n")
    with pytest.raises(DataError) as e:
        load_dataset_task(str(f))
    assert one_line(e) == f"{f}: unsupported file type '.txt'; use .jsonl, .json, .parquet, .csv"
    with pytest.raises(DataError, match="does not exist"):
        load_dataset_task(str(tmp_path / "d.jsonl"), eval_path=str(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize("filename, content, pattern", [
    ("d.jsonl", "", r"d\.jsonl is empty$"),
    ("d.jsonl", '{"prompt": "q", "answer": 1}\n{"prompt": "q2", "answer"\n',
     r"d\.jsonl:2: not valid JSON \(Expecting ':' delimiter, column 26\)$"),
    ("d.jsonl", '{"prompt": "q", "answer": 1}\n\n[1, 2]\n', r"d\.jsonl:3: a line must be a JSON object"),
    ("d.json", "[1, 2,", r"cannot read .*d\.json: "),
    ("d.csv", "prompt,answer\n", r"d\.csv has no rows$"),
    ("d.csv", "\n", r"d\.csv has no rows$"),
    ("d.json", "[]", r"d\.json has no rows$"),
    ("d.parquet", "not parquet at all", r"cannot read .*d\.parquet: "),
])
def test_empty_and_unparsable_files(tmp_path, filename, content, pattern):
    f = tmp_path / filename
    f.write_text(content)
    with pytest.raises(DataError) as e:
        load_dataset_task(str(f))
    assert re.search(pattern, one_line(e)) and str(f) in str(e.value)


def test_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: no \.jsonl, \.json, \.parquet, \.csv files in this directory"):
        load_dataset_task(str(tmp_path / "empty"))


@pytest.mark.parametrize("row, pattern", [
    ({"prompt": "q", "answer": None}, r"row 2: answer column 'answer' is empty"),
    ({"prompt": "q", "answer": "  "}, r"row 2: answer column 'answer' is empty"),
    ({"prompt": "", "answer": "1"}, r"row 2: prompt column 'prompt' is empty"),
    ({"prompt": None, "answer": "1"}, r"row 2: prompt column 'prompt' is empty"),
])
def test_bad_rows_name_the_row(tmp_path, row, pattern):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok", "answer": "1"}, row])
    with pytest.raises(DataError, match=pattern):
        load_dataset_task(str(f))


def test_non_text_prompt_and_reserved_column(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": ["chat", "turns"], "answer": "1"}])
    with pytest.raises(DataError, match=r"row 1: prompt column 'prompt' is a list but not a conversation"):
        load_dataset_task(str(f))
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": 7, "answer": "1"}])
    with pytest.raises(DataError, match=r"row 1: prompt column 'prompt' is of type int, not text"):
        load_dataset_task(str(f))
    g = write_jsonl(tmp_path / "g.jsonl", [{"prompt": "q", "answer": "1", "completions": "x"}])
    with pytest.raises(DataError, match=r"column 'completions' clashes with the reward function argument"):
        load_dataset_task(str(g))


def test_eval_fraction_that_holds_out_nothing(tmp_path):
    prompt = next(f"q{i}" for i in range(1000) if not in_held_out(f"q{i}", 0.01))
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt, "answer": "1"}])
    with pytest.raises(DataError, match=r"no example fell in the held-out fraction 0\.01"):
        load_dataset_task(str(f), eval_fraction=0.01)


@pytest.mark.parametrize("kwargs, pattern", [
    ({"eval_fraction": 0.1, "eval_path": "x.jsonl"}, "at most one of eval_path, eval_split and eval_fraction"),
    ({"eval_split": "test", "eval_path": "x.jsonl"}, "at most one of"),
    ({"eval_fraction": 1.0}, r"eval_fraction must be a number in \[0, 1\)"),
    ({"eval_fraction": -0.1}, "eval_fraction must be"),
    ({"prompt_column": "answer"}, "prompt and answer columns must differ"),
    ({"config_name": "main"}, "config_name 'main' applies to Hub datasets only"),
])
def test_argument_errors(tmp_path, kwargs, pattern):
    f = write_jsonl(tmp_path / "d.jsonl", ROWS[:3])
    with pytest.raises(ConfigError, match=pattern):
        load_dataset_task(str(f), **kwargs)


def test_split_other_than_train_needs_a_hub_dataset_or_split_files(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", ROWS[:3])
    with pytest.raises(DataError, match=r"split 'test' needs a Hub dataset or a directory"):
        load_dataset_task(str(f), eval_split="test")


# ------------------------------------------------------------------------------------------------ TRL's conventions

CHAT = [{"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"},   # a few-shot turn
        {"role": "user", "content": "3 + 4?"}]


def test_conversational_prompts_are_kept_whole(tmp_path):
    f = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": CHAT, "solution": "7"}])
    (e,) = load_dataset_task(str(f)).train
    assert e.conversation == CHAT and e.prompt == "3 + 4?"     # the text: its last user message
    assert e.answer is None and e.fields == {"solution": "7"}  # no answer column: `solution` under its own name
    g = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": CHAT}, {"prompt": "text"}])
    with pytest.raises(DataError, match=r"row 2: prompt column 'prompt' mixes text prompts and conversations"):
        load_dataset_task(str(g))
    h = write_jsonl(tmp_path / "nouser.jsonl", [{"prompt": [{"role": "system", "content": "s"}]}])
    with pytest.raises(DataError, match=r"row 1: .* is a list but not a conversation"):
        load_dataset_task(str(h))


def test_answer_column_reaches_rewards_as_answer_and_under_its_own_name(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "solution": 3.0, "id": 1}])
    (e,) = load_dataset_task(str(f), answer_column="solution").train
    assert e.answer == "3" and e.fields == {"solution": 3.0, "id": 1}   # the raw value under its own name
    from grpo.rewards import example_fields
    assert example_fields([e], 2) == {"answer": ["3", "3"], "id": [1, 1], "solution": [3.0, 3.0]}
    g = write_jsonl(tmp_path / "g.jsonl", [{"prompt": "p", "solution": "3", "answer": "4"}])
    with pytest.raises(DataError, match=r"answer column 'solution' reaches the rewards also as 'answer'"):
        load_dataset_task(str(g), answer_column="solution")


@pytest.mark.parametrize("kind", ["Dataset", "IterableDataset", "list", "DataFrame"])
def test_data_in_memory(kind):
    rows = [{"prompt": f"q{i}", "answer": str(i), "id": i} for i in range(20)]
    data = {"Dataset": lambda: datasets.Dataset.from_list(rows),
            "IterableDataset": lambda: datasets.Dataset.from_list(rows).to_iterable_dataset(),
            "list": lambda: rows,
            "DataFrame": lambda: datasets.Dataset.from_list(rows).to_pandas()}[kind]()
    task = load_dataset_task(data, eval_path=rows[:3])
    assert task.name == "dataset" and sorted(e.fields["id"] for e in task.train) == list(range(20))
    assert [e.answer for e in task.eval] == ["0", "1", "2"]
    split = load_dataset_task(data if kind != "IterableDataset" else rows, eval_fraction=0.25)
    assert len(split.train) + len(split.eval) == 20 and split.eval
    with pytest.raises(DataError, match=r"row 2 of the data is a str, not a dict"):
        load_dataset_task([{"prompt": "q"}, "oops"])
    with pytest.raises(ConfigError, match="eval_split picks a split"):
        load_dataset_task(rows, eval_split="test")
