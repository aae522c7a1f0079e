"""The arithmetic task, the character tokenizer and the JSONL loader."""

import json
import re

import pytest

from megatron_rl.data.arithmetic import ArithmeticTask
from megatron_rl.data.jsonl import JsonlDataset
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


def test_jsonl_order_is_seeded_and_the_cursor_resumes_exactly(tmp_path):
    path = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": f"q{i}", "answer": str(i), "level": i % 3})
                                         for i in range(10)] + [""])
    a = JsonlDataset(path, seed=1)
    first = [r["answer"] for r in a.next(7)]
    state = a.state_dict()
    b = JsonlDataset(path, seed=1)
    b.load_state_dict(state)
    rest = [r["answer"] for r in b.next(3)]
    assert sorted(first + rest, key=int) == [str(i) for i in range(10)]  # every record once per epoch
    assert first != [str(i) for i in range(7)]  # shuffled
    second_epoch = [r["answer"] for r in b.next(10)]
    assert sorted(second_epoch, key=int) == [str(i) for i in range(10)] and second_epoch != first + rest
    assert JsonlDataset(path, seed=1).next(7) == JsonlDataset(path, seed=1).next(7)
    assert a.record(0)["level"] == 0 and a.record(0)["id"] == 0
    with pytest.raises(ValueError, match="saved for 10 records with seed 1; .* --seed is 2"):
        JsonlDataset(path, seed=2).load_state_dict(state)


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "q", "answer": "1"', r"d.jsonl:2: invalid JSON"),
    ('{"prompt": "q"}', r"d.jsonl:2: field 'answer' is missing"),
    ('{"prompt": "q", "answer": 3}', r"d.jsonl:2: field 'answer' must be a string, got int"),
    ('["q", "1"]', r"d.jsonl:2: a record must be a JSON object, got list"),
    ('{"prompt": "  ", "answer": "1"}', r"d.jsonl:2: field 'prompt' is empty"),
])
def test_malformed_lines_name_line_and_field(tmp_path, line, message):
    path = _write(tmp_path / "d.jsonl", ['{"prompt": "ok", "answer": "1"}', line])
    with pytest.raises(ValueError, match=message):
        JsonlDataset(path)


def test_missing_file_names_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data-path"):
        JsonlDataset(str(tmp_path / "nope.jsonl"))
