"""benchmarks/step_table: a verify_cost result as docs/benchmarks.md reports it (run 10's PDL A/B on
an H200, whose rows that page quotes)."""

from pathlib import Path

import pytest

from benchmarks.step_table import tables

RESULTS = Path(__file__).parent.parent / "benchmarks" / "results"


def test_rows_give_the_decode_step_and_each_verify_over_it():
    file = RESULTS / "verify_cost_llama3_8b_split_skinny_no_pdl_compiled_pdl_ab_h200_run10.json"
    header, rule, batch1, batch8 = tables([file]).splitlines()
    assert header.count("|") == rule.count("|") == batch1.count("|") == batch8.count("|") == 6
    name = "llama3_8b_split_skinny_no_pdl_compiled_pdl_ab_h200_run10"
    assert batch1 == f"| {name} | no PDL | 1 | 4.161 (75.8 %) | 2: 1.108×, 4: 1.112×, 8: 1.124× |"
    assert batch8 == f"| {name} | no PDL | 8 | 4.874 (68.7 %) | 2: 1.002×, 4: 1.063×, 8: 1.071× |"


def test_projection_checks_get_a_table_of_their_own():
    """Verify costs and projection checks in one call (speed_poll.sh passes both): two tables; a
    check from before the loop's step was replayed (run 13) shows "–" there."""
    verify = RESULTS / "verify_cost_llama3_8b_split_skinny_compiled_projection_h100_run15.json"
    new = RESULTS / "projection_check_llama3_8b_b1_k3_compiled_h100_run15.json"
    old = RESULTS / "projection_check_llama3_8b_b8_k3_compiled_h100_run13.json"
    costs, checks = tables([new, verify, old]).split("\n\n")
    assert len(costs.splitlines()) == 4 and len(checks.splitlines()) == 4
    header, rule, run15, run13 = checks.splitlines()
    assert header.count("|") == rule.count("|") == run15.count("|") == run13.count("|") == 11
    assert run15 == (
        "| llama3_8b_b1_k3_compiled_h100_run15 | rmsnorm-restored | 1 | 0.599 | 0.684 | +14.1 % "
        "| 8.354 | 7.977 | -4.5 % | 0.138 |"
    )
    assert run13.startswith(
        "| llama3_8b_b8_k3_compiled_h100_run13 | rmsnorm-restored | 8 | 0.679 | 0.743 | +9.4 %"
    )
    assert "| – | – | – |" in run13


def test_a_file_of_another_benchmark_is_named():
    file = RESULTS / "decode_llama3_8b_b64_h100_run12.json"
    with pytest.raises(ValueError, match=f"{file}: neither"):
        tables([file])
