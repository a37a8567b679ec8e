"""The dLLM task rewards: GSM8K/MATH answers, Countdown, Sudoku — hand-made cases and fuzzing with any text."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmrl.reward import RewardError, RewardInput
from mmrl.rewards import reward_functions
from mmrl.rewards.countdown import InvalidExpression, countdown, countdown_score, evaluate_expression, extract_equation
from mmrl.rewards.math_answers import extract_final_answer, gsm8k_answer
from mmrl.rewards.sudoku import parse_grid, sudoku, sudoku_score


def _batch(texts, **columns):
    rows = [{key: values[i] for key, values in columns.items()} for i in range(len(texts))]
    return RewardInput(rows=rows, payload={"completions": list(texts)})


# ---------------------------------------------------------------------------------------------------- GSM8K / MATH
@pytest.mark.parametrize(("text", "answer"), [
    ("so the total is \\boxed{\\frac{3}{4}} dollars", "\\frac{3}{4}"),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
    ("<reasoning>12 * 3 = 36</reasoning>\n<answer>\n36\n</answer>", "36"),
    ("First 3 + 4 = 7, then 7 * 2 = 14.", "14"),
    ("The answer is 1,234.5 meters", "1,234.5"),
    ("#### 5\n and \\boxed{6}", "6"),  # \boxed{} wins over ####
    ("no number here", None),
    ("", None),
])
def test_final_answer_extraction(text, answer):
    assert extract_final_answer(text) == answer


def test_gsm8k_answer_checks_numeric_equivalence():
    references = ["Janet sells 16 - 3 - 4 = 9 duck eggs.\n#### 18", "#### 0.5", "\\boxed{\\frac{1}{2}}", "72",
                  "#### 1,000", "42"]
    texts = ["She makes 9 * 2 = $18 every day.", "<answer>1/2</answer>", "The answer is 0.5", "#### 72.0",
             "\\boxed{1000}", "The answer is 41, not 42... no, 43"]
    scores = gsm8k_answer(_batch(texts, solution=references))
    assert scores == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert reward_functions.get("gsm8k_answer") is gsm8k_answer
    assert gsm8k_answer(_batch(["7"], solution=[7])) == [1.0]  # numeric references work too


@pytest.mark.parametrize(("prediction", "reference", "score"), [
    ("10001", "#### 10000", 0.0),  # within rel_tol 1e-4, but an integer answer must match exactly
    ("1000001", "1000000", 0.0),
    ("#### 10,000", "#### 10000", 1.0),
    ("0.33333", "\\boxed{\\frac{1}{3}}", 1.0),  # not an integer: the relative tolerance applies
    ("12345678901234567", 12345678901234568, 0.0),
])
def test_gsm8k_integer_answers_match_exactly(prediction, reference, score):
    assert gsm8k_answer(_batch([prediction], solution=[reference])) == [score]


BOTH = "Step: \\boxed{5} is wrong.\n#### 6\n<answer>7</answer>"


@pytest.mark.parametrize(("answer_format", "prompt", "answer"), [
    ("answer", "", "7"),
    ("boxed", "", "5"),
    ("hashes", "", "6"),
    ("auto", "Write the final number inside <answer> </answer> tags.", "7"),
    ("auto", "Put your final answer within \\boxed{}.", "5"),
    ("auto", "End with #### and the answer.", "6"),
    ("auto", "How many apples?", "7"),  # names no format: <answer> first
    ("auto", "Put \\boxed{} inside <answer> tags.", "7"),  # names two: <answer> first
    ("auto", [{"role": "system", "content": "Answer in \\boxed{}."}, {"role": "user", "content": "2+3?"}], "5"),
    ("auto", [{"role": "user", "content": [{"type": "text", "text": "Use ####."}]}], "6"),
    ("auto", None, "7"),
])
def test_gsm8k_reads_the_format_the_prompt_asked_for(answer_format, prompt, answer):
    for value in ("5", "6", "7"):
        batch = _batch([BOTH], solution=[value], prompt=[prompt])
        assert gsm8k_answer(batch, answer_format=answer_format) == [float(value == answer)]


def test_gsm8k_answer_format_details():
    # The asked-for format wins only when present; otherwise the default order applies.
    assert extract_final_answer("#### 6\n<answer>7</answer>", "boxed") == "7"
    assert extract_final_answer("<answer>\\boxed{8} or 9</answer>", "answer") == "8"  # \boxed inside the block
    assert extract_final_answer("<answer> </answer> \\boxed{4}", "answer") == "4"  # blank block: next format
    with pytest.raises(RewardError, match="answer_format must be answer, boxed or hashes"):
        extract_final_answer("1", "xml")
    with pytest.raises(RewardError, match="answer_format"):
        gsm8k_answer(_batch(["1"], solution=["1"]), answer_format="latex")


def test_gsm8k_batch_scores_equal_one_row_at_a_time():
    # The reward reads each distinct reference, prompt and (text, format, reference) once per call; a batch with
    # repeats of every kind must score exactly as the rows scored alone, where nothing can be shared.
    rows = [
        ("18", "#### 18", "How many?"), ("18", "#### 18", "How many?"), ("<answer>18</answer>", "#### 18", "How many?"),
        ("\\boxed{5} #### 6", "5", "Answer in \\boxed{}."), ("\\boxed{5} #### 6", "5", "End with ####."),
        ("\\boxed{5} #### 6", "6", "End with ####."), ("7", 7, None), ("7", "7", None), ("7.0", 7.0, None),
        ("0", -0.0, None), ("-0", 0.0, None), ("nan", math.nan, None), ("1/2", 0.5, None), ("1/2", "0.5", None),
        ("2", "2", [{"role": "user", "content": "Use ####."}]),
        ("#### 2", "2", [{"role": "user", "content": "Use ####."}]),
        ("", "3", None), ("3", "", None), ("10001", "10000", None), ("10001", 10000.0, None),
    ]
    texts, solutions, prompts = zip(*rows, strict=True)
    together = gsm8k_answer(_batch(list(texts), solution=list(solutions), prompt=list(prompts)))
    alone = [gsm8k_answer(_batch([t], solution=[s], prompt=[p]))[0] for t, s, p in rows]
    assert together == alone
    assert together[:6] == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0]  # the prompt picks the format


def test_gsm8k_reads_only_the_last_max_chars():
    batch = _batch(["\\boxed{12}" + " words" * 4, "\\boxed{12}"], solution=["12", "12"])
    assert gsm8k_answer(batch) == [1.0, 1.0]
    assert gsm8k_answer(batch, max_chars=24) == [0.0, 1.0]
    assert extract_final_answer("so 3 then 4", max_chars=4) == "4"
    assert extract_final_answer("so 3 then", max_chars=4) is None


# ---------------------------------------------------------------------------------------------------- Countdown
def test_expression_parser_is_exact_and_rejects_anything_else():
    assert evaluate_expression("(3 + 5) * 2 - 7 / 7") == (Fraction(15), [3, 5, 2, 7, 7])
    assert evaluate_expression("7 / 2")[0] == Fraction(7, 2)
    assert evaluate_expression("2 × [3 − 1] ÷ 4")[0] == Fraction(1)
    assert evaluate_expression("6 \\times 4 \\div 3")[0] == Fraction(8)
    for bad in ("3 ** 2", "__import__('os')", "2 +", "(1 + 2", "1 / 0", "-3 + 5", "3.5 * 2", "", "1" * 13,
                "(" * 40 + "1" + ")" * 40, "x + 1"):
        with pytest.raises(InvalidExpression):
            evaluate_expression(bad)


@pytest.mark.parametrize(("text", "numbers", "target", "score"), [
    ("<answer>(25 - 5) * 3</answer>", [25, 5, 3], 60, 1.0),
    ("<answer>3 * (25 - 5) = 60</answer>", [3, 25, 5], 60, 1.0),
    ("60 = 3*(25-5)", [25, 5, 3], 60, 1.0),
    ("So we get 25 * 3 - 5 - 10 at the end", [25, 3, 5, 10], 60, 1.0),
    ("<answer>(25 - 5) * 3</answer>", [25, 5, 3], 61, 0.1),   # wrong value
    ("<answer>25 * 3 - 15</answer>", [25, 5, 3], 60, 0.1),    # 15 is not a given number
    ("<answer>(25 - 5) * 3 * 3</answer>", [25, 5, 3], 180, 0.1),  # 3 used twice
    ("<answer>25 - 5</answer>", [25, 5, 3], 20, 0.1),         # 3 unused (require_all)
    ("I give up", [25, 5, 3], 60, 0.0),
    ("<answer>import os</answer>", [25, 5, 3], 60, 0.1),
])
def test_countdown_by_hand(text, numbers, target, score):
    assert countdown_score(text, numbers, target, format_score=0.1) == score


def test_countdown_options_and_columns():
    texts = ["<answer>25 - 5</answer>", "<answer>50 / 4 * 8</answer>", "nothing"]
    batch = _batch(texts, numbers=[[25, 5, 3], "4 8 50", [1, 2]], target=[20, 100, 3])
    assert countdown(batch) == [0.0, 1.0, 0.0]
    assert countdown(batch, require_all=False, format_score=0.1) == [1.0, 1.0, 0.0]
    with pytest.raises(RewardError, match="target"):
        countdown(_batch(["1+1"], numbers=[[1, 1]], target=["two"]))
    assert extract_equation("<answer>\\boxed{2 \\times 3}</answer>") == "2 * 3"


def test_countdown_reads_only_the_last_max_chars():
    text = "<answer>50 / 4 * 8</answer>" + " " * 10
    batch = _batch([text], numbers=[[4, 8, 50]], target=[100])
    assert countdown(batch) == [1.0]
    assert countdown(batch, max_chars=28) == [0.0]  # "0 / 4 * 8</answer>" + spaces: no <answer>, 0 not given
    assert countdown(batch, max_chars=28, format_score=0.1) == [0.1]
    assert extract_equation(text, max_chars=28) == "0 / 4 * 8"
    with pytest.raises(RewardError, match="max_chars"):
        countdown(batch, max_chars=0)


# ---------------------------------------------------------------------------------------------------- Sudoku
PUZZLE = "1030" "0001" "3000" "0203"   # 0 = empty; 10 empty cells
SOLUTION = "1432" "2341" "3124" "4213"


def test_sudoku_partial_credit_counts_only_the_empty_cells():
    perfect = "<answer>\n1432\n2341\n3124\n4213\n</answer>"
    with_separators = "<answer>1 4 3 2 | 2 3 4 1 | 3 1 2 4 | 4 2 1 3</answer>"
    assert sudoku_score(perfect, PUZZLE, SOLUTION) == 1.0
    # Change two empty cells (positions 1 and 4) and one given cell (position 0): 8 of 10 empty cells right.
    grid = list(SOLUTION)
    grid[0], grid[1], grid[4] = "4", "1", "1"
    assert sudoku_score("".join(grid), PUZZLE, SOLUTION) == pytest.approx(8 / 10)
    assert sudoku_score(with_separators, PUZZLE, SOLUTION) == 1.0
    assert sudoku_score("1432 2341", PUZZLE, SOLUTION) == 0.0  # malformed: too few cells
    assert sudoku_score("no digits", PUZZLE, SOLUTION) == 0.0


@pytest.mark.parametrize("text", [
    "1432234131244213.",  # a full stop after the grid (was read as a blank cell, shifting the grid: 0.1)
    "1432\n2341\n3124\n4213 (4x4 grid)",  # digits after the grid
    "The solution is 1432 2341 3124 4213.",
    "<answer>The solution is:\n1 4 3 2\n2 3 4 1\n3 1 2 4\n4 2 1 3\n(4x4 grid).</answer>",
    "<think>the 4x4 puzzle</think><answer>1432|2341|3124|4213</answer> Done in 2 steps.",
])
def test_sudoku_reads_the_first_complete_grid_of_digits(text):
    assert sudoku_score(text, PUZZLE, SOLUTION) == 1.0


def test_sudoku_grid_is_digits_only():
    # "." and "_" are not cells in a completion (d1 keeps digits only): the first 16 digits are the grid.
    assert parse_grid("1.3_ 0001 3000 0203 45", 16) == "1300013000020345"
    assert parse_grid("1.3_ 0001 3000 0203", 16) is None  # 14 digits
    # A restated puzzle comes first, so it is the grid: its blanks (0) score nothing.
    assert sudoku_score("The puzzle 1030000130000203 becomes 1432234131244213", PUZZLE, SOLUTION) == 0.0
    # Hand-worked partial credit: empty cells of PUZZLE are 1, 3, 4, 5, 6, 9, 10, 11, 12, 14; this grid gets cells
    # 1, 3, 4, 5, 6 right and 9, 10, 11, 12, 14 wrong ("0") → 5 / 10.
    assert sudoku_score("<answer>1432 2341 3000 0003</answer>", PUZZLE, SOLUTION) == pytest.approx(0.5)


def test_sudoku_reads_only_the_last_max_chars():
    text = "<answer>1432234131244213</answer>" + " " * 20
    batch = _batch([text], puzzle=[PUZZLE], solution=[SOLUTION])
    assert sudoku(batch) == [1.0]
    assert sudoku(batch, max_chars=44) == [0.0]  # "432234131244213</answer>" + spaces: 15 digits
    assert sudoku(batch, max_chars=45) == [1.0]  # "<answer>" is cut off, the 16 digits are whole


def test_sudoku_reads_columns_and_rejects_bad_datasets():
    batch = _batch(["1432234131244213", ""], puzzle=[PUZZLE, "1.3..0013...0203".replace("1.3..", "1.3.0")],
                   solution=[SOLUTION, SOLUTION])
    assert sudoku(batch) == [1.0, 0.0]
    with pytest.raises(RewardError, match="16 or 81"):
        sudoku(_batch(["x"], puzzle=["123"], solution=[SOLUTION]))
    with pytest.raises(RewardError, match="contradicts"):
        sudoku(_batch(["x"], puzzle=["2" + PUZZLE[1:]], solution=[SOLUTION]))
    nine = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"
    puzzle9 = "".join("0" if i % 3 == 0 else ch for i, ch in enumerate(nine))
    assert sudoku(_batch([nine], puzzle=[puzzle9], solution=[nine])) == [1.0]


# ---------------------------------------------------------------------------------------------------- fuzzing
ANY_TEXT = st.one_of(
    st.text(max_size=300),
    st.text(alphabet="0123456789+-*/×÷()[]{}=.,%$# \n<>/answerboxed\\frac", max_size=300),
    st.lists(st.sampled_from(["<answer>", "</answer>", "\\boxed{", "}", "####", "=", "(", ")", "12", "3/4", "-",
                              "\n", " ", "1.5", "9" * 30, "\\frac{1}{0}", "÷", "[", "]"]),
             max_size=40).map("".join),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=ANY_TEXT, cap=st.integers(1, 40))
def test_capped_rewards_score_the_capped_text(text, cap):
    def scores(completion, max_chars):
        return (gsm8k_answer(_batch([completion], solution=["#### 12"]), max_chars=max_chars)
                + countdown(_batch([completion], numbers=[[3, 4, 5]], target=[12]), format_score=0.1,
                            max_chars=max_chars)
                + sudoku(_batch([completion], puzzle=[PUZZLE], solution=[SOLUTION]), max_chars=max_chars))

    assert scores(text, cap) == scores(text[-cap:], 10_000)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=ANY_TEXT)
def test_rewards_never_raise_and_stay_in_range(text):
    scores = (
        gsm8k_answer(_batch([text, text], solution=["#### 12", "\\boxed{\\frac{3}{4}}"]))
        + countdown(_batch([text], numbers=[[3, 4, 5]], target=[12]), format_score=0.1)
        + sudoku(_batch([text], puzzle=[PUZZLE], solution=[SOLUTION]))
    )
    assert all(math.isfinite(s) and 0.0 <= s <= 1.0 for s in scores)
