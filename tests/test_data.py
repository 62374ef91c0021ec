from __future__ import annotations

import json
import random

import pytest
from conftest import GSM8K_DIR

from grpo_kit import data
from grpo_kit.reward import gsm8k_reward


def test_gsm8k_local_jsonl_loads_both_splits():
    train = data.load_gsm8k(str(GSM8K_DIR), "train")
    test = data.load_gsm8k(str(GSM8K_DIR), "test")
    assert (len(train), len(test)) == (7473, 1319)
    p = train[0]
    assert p.id == "gsm8k-train-0" and p.gold == "72" and "Natalia" in p.question
    assert all("," not in q.gold for q in train)
    assert data.load_gsm8k(str(GSM8K_DIR / "test.jsonl"), "test", limit=5)[4].id == "gsm8k-test-4"


def test_gsm8k_malformed_rows_named_or_skipped(tmp_path):
    rows = [
        {"question": "ok?", "answer": "so 3\n#### 3"},
        {"question": "no marker?", "answer": "it is 4"},  # no #### line
        {"answer": "#### 5"},  # no question
        {"question": "comma?", "answer": "#### 1,200"},
    ]
    f = tmp_path / "train.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(data.MalformedRow, match="row 1"):
        data.load_gsm8k(str(tmp_path), "train")
    got = data.load_gsm8k(str(tmp_path), "train", skip_malformed=True)
    assert [p.gold for p in got] == ["3", "1200"] and got.skipped == [1, 2]


def test_gsm8k_folder_loads_only_its_split_files_not_the_socratic_ones(tmp_path):
    """OpenAI's grade_school_math/data holds train.jsonl and train_socratic.jsonl (the same questions
    with other solutions): only the first is the split; HF's parquet shards are too."""
    for name, answer in (("train", "x\n#### 3"), ("train_socratic", "How? x\n#### 3"), ("test", "y\n#### 4")):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"question": "Q1?", "answer": answer}) + "\n")
    got = data.load_gsm8k(str(tmp_path), "train")
    assert [(p.id, p.gold) for p in got] == [("gsm8k-train-0", "3")]
    assert len(data.load_gsm8k(str(tmp_path), "test")) == 1


def test_a_gold_the_reward_cannot_read_is_a_malformed_row(tmp_path):
    """Review finding (2026-12-03): float() took these golds, the '####' reward refused them, and the
    reward call holding the row failed for every completion in it (right answers scored 0)."""
    golds = ["72", "5.", "1e3", "1_000", "nan", "\u0663"]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"question": f"Q{i}?", "answer": f"x\n#### {g}"}) + "\n"
                                                  for i, g in enumerate(golds)))
    got = data.load_gsm8k(str(tmp_path), "train", skip_malformed=True)
    assert [p.gold for p in got] == ["72"] and got.skipped == [1, 2, 3, 4, 5]
    with pytest.raises(data.MalformedRow, match="row 1: '#### 5.' is not a number the '####' reward reads"):
        data.load_gsm8k(str(tmp_path), "train")


def test_a_single_gsm8k_file_is_split_by_question_not_read_twice(tmp_path, monkeypatch):
    """Review finding (2026-12-03): dataset=<one file> held out the first rows of the training file
    (256 of 256 held-out questions were training questions). Also a "~/" path (it went to the hub)
    and a split in two formats (every row twice)."""
    from grpo_kit.tasks import gsm8k

    rows = [{"question": f"What is {i} + 1?", "answer": f"x\n#### {i + 1}"} for i in range(200)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("HOME", str(tmp_path))
    t = gsm8k.task("~/train.jsonl")
    train, held = t.problems("train", 1000, 0), t.problems("heldout", 1000, 0)
    assert {p.question for p in train}.isdisjoint(p.question for p in held)
    assert len(train) + len(held) == 200 and 5 <= len(held) <= 40  # about gsm8k.HELDOUT_FRACTION
    assert t.problems("heldout", 3, 0) == held[:3]
    assert len(data.load_gsm8k("~", "train")) == 200
    (tmp_path / "train.json").write_text((tmp_path / "train.jsonl").read_text())
    with pytest.raises(ValueError, match=r"train split in more than one format \(\['train.json', 'train.jsonl'\]\)"):
        data.load_gsm8k(str(tmp_path), "train")


def test_gsm8k_missing_path_is_clear():
    with pytest.raises(FileNotFoundError, match="neither"):
        data.load_gsm8k("./no/such/dir", "train")


def test_synthetic_splits_disjoint_and_seeded():
    train = data.synthetic_problems(3000, split="train", seed=0)
    held = data.synthetic_problems(500, split="heldout", seed=0)
    assert not {p.question for p in train} & {p.question for p in held}
    assert len({p.question for p in train}) == 3000
    assert [p.id for p in data.synthetic_problems(50, seed=3)] == [p.id for p in data.synthetic_problems(50, seed=3)]
    assert [p.id for p in data.synthetic_problems(50, seed=3)] != [p.id for p in data.synthetic_problems(50, seed=4)]
    # Another seed draws other training questions, but never a held-out one.
    other = data.synthetic_problems(3000, split="train", seed=9)
    assert not {p.question for p in other} & {p.question for p in held}


@pytest.mark.parametrize("n_digits, n_terms", [(1, 3), (2, 2), (3, 2), (3, 3), (4, 4)])
def test_demonstrations_are_correct_gsm8k_answers(n_digits, n_terms):
    for p in data.synthetic_problems(200, seed=1, n_digits=n_digits, n_terms=n_terms):
        assert p.solution.splitlines()[-1] == f"#### {p.gold}"
        assert gsm8k_reward(p.solution, p.gold).score == 1.0
        assert sum(data.parse_terms(p.question)) == int(p.gold)


def test_slips_make_consistently_wrong_traces():
    rng = random.Random(0)
    wrong = 0
    for p in data.synthetic_problems(300, seed=2):
        terms = data.parse_terms(p.question)
        demo = data.demonstration(terms, slip_rate=1.0, rng=rng)
        # Every slip drops a carry: the answer is the carry-less column sum.
        width = max(len(str(t)) for t in terms)
        cols = [sum(int(str(t).zfill(width)[c]) for t in terms) for c in range(width)]
        expect = int(str(cols[0]) + "".join(str(c % 10) for c in cols[1:]))
        assert demo.endswith(f"#### {expect}")
        wrong += expect != int(p.gold)
    assert 150 < wrong < 300  # most 3-digit sums have a carry somewhere


def test_too_many_problems_is_a_clear_error():
    with pytest.raises(ValueError, match="distinct"):
        data.synthetic_problems(100, split="heldout", n_digits=1)


def test_prompt_template_asks_for_marker():
    assert "'#### <integer>'" in data.format_prompt("What is 1 + 1?")
    assert data.synthetic_problems(3, split="heldout")[0].prompt.startswith("Question: What is")
