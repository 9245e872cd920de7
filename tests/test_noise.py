"""The report's rules for what a figure and a comparison may claim (experiments/noise.py)."""
from hetflow.experiments import noise
from hetflow.experiments.report import stat


def rows(*values, busy=()):
    return [{"t": v, "busy": i in busy} for i, v in enumerate(values)]


def test_overlapping_spreads_compare_as_within_noise_not_as_a_ratio():
    base = rows(10.0, 10.4, 11.0)
    assert noise.compare(base, rows(10.9, 11.5, 12.0), "t", noise.ratio) == "within noise"
    assert noise.compare(base, rows(11.1, 11.44, 12.0), "t", noise.ratio) == "1.10x"
    assert noise.compare(base, rows(5.0, 5.2, 5.1), "t", noise.ratio) == "0.49x"


def test_fewer_than_three_repeats_is_no_comparison_and_is_marked():
    assert noise.compare(rows(1.0, 1.1), rows(3.0, 3.1, 3.2), "t", noise.ratio) == "n<3"
    assert noise.compare([], rows(1.0), "t", noise.ratio) == "–"
    assert stat(rows(2.0), "t") == "2.00 (n=1)"
    assert stat(rows(2.0, 3.0, 4.0), "t") == "3.00 [2.00–4.00]"


def test_a_figure_with_a_repeat_on_a_busy_machine_is_marked():
    assert stat(rows(2.0, 3.0, 4.0, busy=(1,)), "t") == f"3.00 [2.00–4.00] {noise.BUSY_MARK}"
    assert noise.marks(rows(1.0, busy=(0,)), "t") == f" (n=1) {noise.BUSY_MARK}"
