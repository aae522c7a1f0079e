"""The arithmetic task, the character tokenizer, and prompt datasets (JSONL and parquet)."""

import json
import re

import pytest

from megatron_rl.data.dataset import PromptDataset
from megatron_rl.data.records import RecordFields
from megatron_rl.data.tasks.arithmetic import ArithmeticTask
from megatron_rl.data.tokenizer import build_char_tokenizer


def _left_to_right(prompt: str) -> int:
    tokens = re.findall(r"\d+|[+-]", prompt.rstrip("="))
    value = int(tokens[0])
    for op, num in zip(tokens[1::2], tokens[2::2]):
        value = value + int(num) if op == "+" else value - int(num)
    return value


def test_arithmetic_is_deterministic_correct_and_splits_are_disjoint():
    task = ArithmeticTask(seed=3, min_digits=1, max_digits=3, num_operands=3)
    train = task.problems(0, 300)
    assert train == ArithmeticTask(seed=3, min_digits=1, max_digits=3, num_operands=3).problems(0, 300)
    assert train != ArithmeticTask(seed=4, min_digits=1, max_digits=3, num_operands=3).problems(0, 300)
    for p in train:
        assert int(p["answer"]) == _left_to_right(p["prompt"])
        assert len(re.findall(r"\d+", p["prompt"])) == 3
    evals = {p["prompt"] for p in task.problems(0, 300, "eval")}
    assert evals and not evals & {p["prompt"] for p in train}
    assert task.problem(150) == train[150]  # any index directly: a resumable cursor is an integer
    with pytest.raises(ValueError, match="operators must be"):
        ArithmeticTask(operators="%")


def test_held_out_problems_are_distinct_unseen_and_the_space_is_counted():
    task = ArithmeticTask(seed=5, min_digits=1, max_digits=2)
    held_out = task.distinct_problems(300)
    prompts = [p["prompt"] for p in held_out]
    assert len(set(prompts)) == 300
    assert held_out == ArithmeticTask(seed=5, min_digits=1, max_digits=2).distinct_problems(300)
    assert not set(prompts) & {p["prompt"] for p in task.problems(0, 20_000)}  # never a training draw
    assert all(int(p["answer"]) == _left_to_right(p["prompt"]) for p in held_out)
    # 1-digit operands: 10 x 10 x 2 = 200 expressions, enumerated; the whole eval split can be asked for, not more.
    small = ArithmeticTask(seed=5, min_digits=1, max_digits=1)
    size = sum(small._split_of(f"{a}{o}{b}") == "eval" for a in range(10) for b in range(10) for o in "+-")
    assert small.space_size() == 200 and small.split_size() == size
    assert len({p["prompt"] for p in small.distinct_problems(size)}) == size
    with pytest.raises(ValueError, match=f"--eval-size {size + 1}: .* only {size} distinct"):
        small.distinct_problems(size + 1)
    assert ArithmeticTask(min_digits=1, max_digits=3, num_operands=3).space_size() == 1000 ** 3 * 4
    assert ArithmeticTask(min_digits=2, max_digits=2).space_size() == 90 * 90 * 2
    assert ArithmeticTask(min_digits=1, max_digits=3).split_size() is None  # too many to list: drawn, not counted


def test_char_tokenizer_round_trips_and_loads_with_transformers(tmp_path):
    from transformers import AutoTokenizer

    tok = build_char_tokenizer()
    text = "12+7=19"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text) and tok.decode(ids) == text
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").exists()
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.encode(text, add_special_tokens=False) == ids
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _write_parquet(path, rows, row_group_size=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return str(path)


def test_jsonl_order_is_seeded_and_the_cursor_resumes_exactly(tmp_path):
    path = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": f"q{i}", "answer": str(i), "level": i % 3})
                                         for i in range(10)] + [""])
    a = PromptDataset(path, seed=1)
    first = [r["answer"] for r in a.next(7)]
    state = a.state_dict()
    b = PromptDataset(path, seed=1)
    b.load_state_dict(state)
    rest = [r["answer"] for r in b.next(3)]
    assert sorted(first + rest, key=int) == [str(i) for i in range(10)]  # every record once per epoch
    assert first != [str(i) for i in range(7)]  # shuffled
    second_epoch = [r["answer"] for r in b.next(10)]
    assert sorted(second_epoch, key=int) == [str(i) for i in range(10)] and second_epoch != first + rest
    assert PromptDataset(path, seed=1).next(7) == PromptDataset(path, seed=1).next(7)
    assert a.record(3) == {"id": "3", "prompt": "q3", "answer": "3", "metadata": {}}  # fields not asked for drop
    with pytest.raises(ValueError, match="saved for 10 records with seed 1; .* --seed is 2"):
        PromptDataset(path, seed=2).load_state_dict(state)


# Records with their own field names: a question (a string or a chat), a solution, and an info object.
ROWS = [{"question": [{"role": "system", "content": "Reply with a number."}, {"role": "user", "content": f"{i}+1?"}],
         "solution": str(i + 1), "info": {"level": i % 3, "source": f"s{i}"}} for i in range(11)]
FIELDS = RecordFields("question", "solution", "info")


def _expected(rows):
    return [{"id": str(i), "prompt": r["question"], "answer": r["solution"], "metadata": r["info"]}
            for i, r in enumerate(rows)]


def test_jsonl_and_parquet_give_the_records_under_custom_keys(tmp_path):
    rows = ROWS[:5] + [dict(ROWS[5], question="5+1?")] + ROWS[6:]  # JSONL prompts may mix strings and chats
    jsonl = PromptDataset(_write(tmp_path / "d.jsonl", map(json.dumps, rows)), fields=FIELDS)
    assert [jsonl.record(i) for i in range(len(rows))] == _expected(rows)
    assert jsonl.first_message_prompt == f"{tmp_path / 'd.jsonl'}:1"
    # Several row groups: records are found across them.
    parquet = PromptDataset(_write_parquet(tmp_path / "d.parquet", ROWS, row_group_size=4), fields=FIELDS)
    assert parquet.reader.table.num_columns == 3 and len(parquet) == len(ROWS)
    assert [parquet.record(i) for i in range(len(ROWS))] == _expected(ROWS)
    assert sorted(r["id"] for r in parquet.next(len(ROWS))) == sorted(str(i) for i in range(len(ROWS)))
    with_ids = [dict(r, id=f"q-{i}") for i, r in enumerate(ROWS[:3])] + [dict(ROWS[3], id=7)]
    assert [PromptDataset(_write(tmp_path / "ids.jsonl", map(json.dumps, with_ids)), fields=FIELDS).record(i)["id"]
            for i in range(4)] == ["q-0", "q-1", "q-2", "7"]


def test_a_parquet_cursor_resumes_exactly(tmp_path):
    path = _write_parquet(tmp_path / "d.parquet", ROWS, row_group_size=3)
    whole = [r["id"] for r in PromptDataset(path, seed=5, fields=FIELDS).next(30)]  # across epochs
    a = PromptDataset(path, seed=5, fields=FIELDS)
    first = [r["id"] for r in a.next(13)]
    b = PromptDataset(path, seed=5, fields=FIELDS)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # as a checkpoint stores it
    assert first + [r["id"] for r in b.next(17)] == whole


@pytest.mark.parametrize("record,message", [
    ({"solution": "1"}, r"d.jsonl:2: field 'question' is missing"),
    ({"question": "q"}, r"d.jsonl:2: field 'solution' is missing"),
    ({"question": "q", "solution": None}, r"d.jsonl:2: field 'solution' is null"),
    ({"question": "q", "solution": 3}, r"d.jsonl:2: field 'solution' must be a string, got int"),
    ({"question": {"text": "q"}, "solution": "1"},
     r"d.jsonl:2: field 'question' must be a string or a list of messages, got dict"),
    ({"question": [], "solution": "1"}, r"d.jsonl:2: field 'question': the message list is empty"),
    ({"question": [{"role": "user", "content": "q"}, {"role": "robot", "content": "x"}], "solution": "1"},
     r"d.jsonl:2: field 'question'\[1\]\.role: must be one of \['system', 'user', 'assistant', 'tool'\], "
     r"got 'robot'"),
    ({"question": [{"role": "user"}], "solution": "1"},
     r"d.jsonl:2: field 'question'\[0\]\.content: must be a string, got NoneType"),
    ({"question": ["hi"], "solution": "1"}, r"d.jsonl:2: field 'question'\[0\]: a message must be an object"),
    ({"question": "q", "solution": "1", "info": [1]}, r"d.jsonl:2: field 'info' must be an object, got list"),
    ({"question": "q", "solution": "1"}, r"d.jsonl:2: field 'info' is missing"),
    ({"question": "q", "solution": "1", "info": {}, "id": 1.5}, r"d.jsonl:2: field 'id' must be a string or an "
                                                                r"integer, got float"),
    ({"question": "q", "solution": "1", "info": {}, "id": "a"}, r"d.jsonl:2: field 'id' 'a' repeats the id at "
                                                                r".*d.jsonl:1"),
])
def test_bad_records_name_file_line_and_field(tmp_path, record, message):
    path = _write(tmp_path / "d.jsonl", [json.dumps({"question": "ok", "solution": "1", "info": {}, "id": "a"}),
                                         json.dumps(record)])
    with pytest.raises(ValueError, match=message):
        PromptDataset(path, fields=FIELDS)


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "q", "answer": "1"', r"d.jsonl:2: invalid JSON"),
    ('["q", "1"]', r"d.jsonl:2: a record must be a JSON object, got list"),
    ('{"prompt": "  ", "answer": "1"}', r"d.jsonl:2: field 'prompt' is empty"),
])
def test_malformed_lines_name_line_and_field(tmp_path, line, message):
    path = _write(tmp_path / "d.jsonl", ['{"prompt": "ok", "answer": "1"}', line])
    with pytest.raises(ValueError, match=message):
        PromptDataset(path)


def test_bad_parquet_rows_and_files_are_named(tmp_path):
    rows = [dict(r) for r in ROWS[:4]]
    rows[2]["solution"] = None
    with pytest.raises(ValueError, match=r"d.parquet:row 2: field 'solution' is null"):
        PromptDataset(_write_parquet(tmp_path / "d.parquet", rows, row_group_size=2), fields=FIELDS)
    rows = [dict(r) for r in ROWS[:4]]
    rows[3]["question"] = [{"role": "user", "content": "q"}, {"role": "robot", "content": "x"}]
    with pytest.raises(ValueError, match=r"e.parquet:row 3: field 'question'\[1\]\.role: .* got 'robot'"):
        PromptDataset(_write_parquet(tmp_path / "e.parquet", rows), fields=FIELDS)
    with pytest.raises(ValueError, match=r"f.parquet: field 'answer' is missing \(the file's columns: \['question'"):
        PromptDataset(_write_parquet(tmp_path / "f.parquet", ROWS), fields=RecordFields("question"))
    with pytest.raises(ValueError, match=r"g.parquet: not a readable parquet file"):
        PromptDataset(_write(tmp_path / "g.parquet", ['{"prompt": "q", "answer": "1"}']))
    with pytest.raises(ValueError, match=r"--prompt-data '.*d.csv': unknown extension '.csv'"):
        PromptDataset(_write(tmp_path / "d.csv", ["prompt,answer"]))


def test_a_chat_prompt_without_apply_chat_template_fails_at_start(tmp_path):
    from megatron_rl.config.arguments import parse_args
    from megatron_rl.controller.prompt_source import PromptSource

    path = _write(tmp_path / "d.jsonl", [json.dumps({"question": "1+1?", "solution": "2"})]
                  + [json.dumps(r) for r in ROWS])
    flags = ["--prompt-data", path, "--input-key", "question", "--label-key", "solution"]
    with pytest.raises(ValueError, match=r"d.jsonl:2: field 'question' is a message list, which needs "
                                         r"--apply-chat-template"):
        PromptSource(parse_args(flags))
    source = PromptSource(parse_args([*flags, "--apply-chat-template", "--tokenizer", str(tmp_path)]))
    assert len({r["id"] for r in source.next(12)}) == 12


def test_missing_file_names_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--prompt-data"):
        PromptDataset(str(tmp_path / "nope.jsonl"))
