"""The cost model: interpolation over calibration tables, and errors that name the entry
when a value is missing, unmeasured or outside the table -- never a silent zero."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.costs.analytic import PROFILES, analytic_calibration
from engine.costs.calibration import Calibration, CalibrationError
from engine.costs.loader import load_costs
from engine.costs.model import Limits, TableCosts
from sim.adapters import ServeConfig
from sim.cluster import Simulation
from sim.synthetic import synthetic_calibration


def linear_cal(**kw) -> Calibration:
    return synthetic_calibration(prefill=lambda c, p: 0.001 + 1e-5 * c + 1e-7 * c * p,
                                 decode=lambda b, L: 0.002 + 1e-4 * b + 1e-7 * b * L, **kw)


def test_tables_are_exact_on_the_grid_and_bilinear_between() -> None:
    costs = TableCosts(linear_cal(chunks=(1, 64, 512), contexts=(0, 1024, 4096)))
    assert costs.prefill_s([(64, 1024)]) == pytest.approx(0.001 + 64e-5 + 1e-7 * 64 * 1024)
    # between grid points, bilinear: exact for a function linear in each coordinate
    assert costs.prefill.__call__(300, 2000) == pytest.approx(
        0.001 + 300e-5 + 1e-7 * 300 * 2000, rel=1e-12)
    # a batch: weights/chunk-local by total tokens, attention over context per chunk
    batch = [(100, 0), (50, 2000)]
    assert costs.prefill_s(batch) == pytest.approx(
        0.001 + 150e-5 + 1e-7 * 50 * 2000, rel=1e-12)
    run = costs.decode_run_s(4, 4 * 100, 130, 3)  # mean context 100, 101, 102
    assert list(run) == pytest.approx([0.002 + 4e-4 + 4e-7 * L for L in (100, 101, 102)])
    # an attention that pads the batch to its longest sequence pays for that one
    padded = TableCosts(linear_cal(context_stat="max"))
    assert list(padded.decode_run_s(4, 4 * 100, 130, 2)) == pytest.approx(
        [0.002 + 4e-4 + 4e-7 * L for L in (130, 131)])


def test_a_query_outside_the_table_is_an_error_naming_the_entry() -> None:
    costs = TableCosts(linear_cal(batches=(1, 8)))
    with pytest.raises(CalibrationError, match=r"decode query batch=9 is outside the calibrated "
                       r"range \[1, 8\] \(entry 'decode.batch'\)"):
        costs.decode_s(9, 9 * 10)
    with pytest.raises(CalibrationError, match=r"'prefill.chunk'"):
        costs.prefill_s([(2000, 0)])
    with pytest.raises(CalibrationError, match=r"kv_export query x=5000.*'kv_export.x'"):
        costs.kv_export_s(5000)


def test_a_missing_or_unmeasured_entry_is_an_error_naming_it(tmp_path: Path) -> None:
    data = dict(linear_cal().data)
    del data["decode"]
    with pytest.raises(CalibrationError, match=r"missing entry 'decode.batch'"):
        TableCosts(Calibration(data, "cal.json"))
    data = json.loads(json.dumps(linear_cal().data))
    data["control"].pop("rpc_s")
    with pytest.raises(CalibrationError, match=r"cal.json: missing entry 'control.rpc_s'"):
        _ = TableCosts(Calibration(data, "cal.json")).rpc_s
    data = json.loads(json.dumps(linear_cal().data))
    data["overheads"].pop("decode_join_s")  # a calibration from before it was measured
    with pytest.raises(CalibrationError, match=r"cal.json: missing entry "
                       r"'overheads.decode_join_s'"):
        TableCosts(Calibration(data, "cal.json"))
    data = json.loads(json.dumps(linear_cal().data))
    data["prefill"]["seconds"][1][1] = None  # a cell that was never measured
    costs = TableCosts(Calibration(data, "cal.json"))
    with pytest.raises(CalibrationError, match=r"'prefill.seconds' at chunk=16, context=4096 "
                       r"was not measured"):
        costs.prefill_s([(10, 3000)])
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"format": "pdserve-calibration/1", "kind": "measured"}))
    with pytest.raises(CalibrationError, match=r"cal.json: missing entry 'prefill.chunk'"):
        load_costs(Calibration.load(path))
    with pytest.raises(CalibrationError, match="cannot read calibration"):
        Calibration.load(tmp_path / "nope.json")


def test_a_configuration_beyond_the_calibration_is_refused_before_the_run() -> None:
    costs = TableCosts(linear_cal(batches=(1, 32)))
    cfg = ServeConfig().with_values({"transfer.connector": "inproc", "cache.num_blocks": 64,
                                     "model.max_model_len": 2048})  # max_num_seqs 64 > 32
    with pytest.raises(CalibrationError, match=r"batch=64 .*'decode.batch'"):
        Simulation(cfg, costs)
    with pytest.raises(CalibrationError, match=r"missing entry 'links.ray'"):
        costs.check_covers(Limits(512, 32, 32, 2048, "ray"))


def test_analytic_profiles_are_labelled_not_measured_and_follow_the_roofline() -> None:
    cal = analytic_calibration("h200", "llama-3-8b")
    assert "analytic, not measured" in cal.label and "H200" in cal.label
    assert "published" in cal.source_of("profile")
    assert cal.header()["not_measured"]  # every assumption is listed as such
    costs = load_costs(cal)
    prof = PROFILES["h200"]
    # bf16 bytes read by one decode step: the dense weights and the LM head (the embedding
    # lookup reads one row); one sequence is memory bound
    weights = 2 * (32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 128256 * 4096)
    step = costs.decode_s(1, 100)
    assert step == pytest.approx(weights / (prof["hbm_bytes_per_s"] * 0.8), rel=0.01)
    big = costs.prefill_s([(4096, 0)])  # 4k tokens: compute bound
    assert big > 2 * 4096 * 7e9 / (prof["bf16_flops"] * 0.6)
    assert costs.decode_s(64, 64 * 2048) > costs.decode_s(64, 64 * 128)  # KV reads grow
    with pytest.raises(CalibrationError, match="analytic, not measured"):
        Calibration({**cal.data, "label": "fast GPU"}, "x")
    with pytest.raises(CalibrationError, match="unknown analytic profile"):
        analytic_calibration("tpu9", "llama-3-8b")
    with pytest.raises(CalibrationError, match=r"links.tcp.*--interconnect"):
        costs.link("tcp")


def test_calibration_tables_are_made_monotone_against_interference() -> None:
    from sim.calibrate import monotone

    raw = [[1.0, 2.0, 9.0], [1.5, 8.0, 4.0], [2.0, 3.0, None]]
    # 9.0 and 8.0 sit above cells of more work (4.0, 3.0): interference, not cost
    assert monotone(raw) == [[1.0, 2.0, 4.0], [1.5, 3.0, 4.0], [2.0, 3.0, None]]


@pytest.mark.parametrize("mfu", [0.6, 0.029, 2e-5])  # memory-bound, near the cross-over, compute
def test_a_roofline_decode_run_equals_the_full_formula_at_every_step(mfu: float) -> None:
    """decode_run_s takes the bytes term alone when it wins at both ends of the run (the
    terms are linear in the context): the same floats, bit for bit, as max() per step."""
    costs = load_costs(analytic_calibration("h200", "llama-3-8b", assumptions={"mfu": mfu}))
    c = costs
    for batch, ctx, steps in [(1, 10, 1), (3, 900, 16), (3, 900, 17), (8, 8 * 2000, 400),
                              (64, 64 * 100, 40), (64, 64 * 3000, 1000)]:
        full = [max((2 * batch * c.dense + batch * c.head_flops + c.attn * x) / c.flops,
                    (c.dense_bytes + c.head_bytes + (x + batch) * c.kv_bytes) / c.bw, c.floor)
                for x in map(float, range(ctx, ctx + batch * steps, batch))]
        assert [float(v) for v in c.decode_run_s(batch, ctx, 0, steps)] == full


def test_a_long_memory_bound_run_reads_the_bytes_term_table_bit_for_bit(monkeypatch) -> None:
    """Long memory-bound runs slice a table of the bytes term per attended-token count:
    the same floats as the term per step, while the table grows, and past its bound."""
    import engine.costs.analytic

    monkeypatch.setattr(engine.costs.analytic, "_TABLE_MAX", 50_000)
    c = load_costs(analytic_calibration("h200", "llama-3-8b"))
    runs = [(3, 900, 17), (8, 8 * 2000, 400), (2, 10, 300), (8, 8 * 2000, 400),
            (64, 64 * 700, 100), (16, 16 * 2900, 200), (5, 5 * 4000, 50)]
    for batch, ctx, steps in runs:
        per_step = [(c.dense_bytes + c.head_bytes + (x + batch) * c.kv_bytes) / c.bw
                    for x in map(float, range(ctx, ctx + batch * steps, batch))]
        run = c.decode_run_s(batch, ctx, 0, steps)
        assert [float(v) for v in run] == per_step
        run[:] = 0.0  # a caller's writes stay its own
        assert [float(v) for v in c.decode_run_s(batch, ctx, 0, steps)] == per_step
    assert 0 < len(c._bytes_s) <= 50_000  # (64 * 800 tokens and more went around it)
