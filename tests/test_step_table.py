"""benchmarks/step_table: a verify_cost result as docs/benchmarks.md reports it (run 10's PDL A/B on
an H200, whose rows that page quotes)."""

from pathlib import Path

import pytest

from benchmarks.step_table import table

RESULTS = Path(__file__).parent.parent / "benchmarks" / "results"


def test_rows_give_the_decode_step_and_each_verify_over_it():
    file = RESULTS / "verify_cost_llama3_8b_split_skinny_no_pdl_compiled_pdl_ab_h200_run10.json"
    header, rule, batch1, batch8 = table([file]).splitlines()
    assert header.count("|") == rule.count("|") == batch1.count("|") == batch8.count("|") == 6
    name = "llama3_8b_split_skinny_no_pdl_compiled_pdl_ab_h200_run10"
    assert batch1 == f"| {name} | no PDL | 1 | 4.161 (75.8 %) | 2: 1.108×, 4: 1.112×, 8: 1.124× |"
    assert batch8 == f"| {name} | no PDL | 8 | 4.874 (68.7 %) | 2: 1.002×, 4: 1.063×, 8: 1.071× |"


def test_a_file_of_another_benchmark_is_named():
    file = RESULTS / "decode_llama3_8b_b64_h100_run12.json"
    with pytest.raises(ValueError, match=f"{file}: no 'verify_ms'"):
        table([file])
