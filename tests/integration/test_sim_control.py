"""`pdserve calibrate --control`'s measurement on a real 1P1D service: the figures land in
the calibration with their sources, and a simulation on it uses them."""

from __future__ import annotations

from engine.costs.calibration import Calibration
from engine.costs.loader import load_costs
from sim.calibrate import calibrate
from sim.measure_control import add_control


def test_control_plane_measured_on_a_real_service_goes_into_the_calibration(
        ray_session, tiny_model, tmp_path) -> None:
    path = tmp_path / "cal.json"
    calibrate(str(tiny_model), out=path, max_model_len=512, max_batch_tokens=128, max_seqs=4,
              quick=True, repeats=2, connectors=("tcp",), rpc_ms=0.5, stat="median",
              log=lambda s: None)
    before = Calibration.load(path)
    assert before.source_of("control.delivery").startswith("assumed")
    lines: list[str] = []
    add_control(path, requests=4, log=lines.append)
    cal = Calibration.load(path)
    c, svc = cal.get("control"), cal.get("control.service")
    assert svc["requests"] >= 2 and svc["dispatch_s_median"] > 0
    assert c["rpc_s"] == svc["dispatch_s_median"] / 3
    assert c["delivery"]["scope"] == "router"  # one message per step, one batch applied
    assert cal.source_of("control.delivery").startswith("measured")
    assert cal.source_of("control.rpc_s").startswith("measured")
    assert cal.get("links.tcp") == before.get("links.tcp")  # reported, not replaced
    assert "kv_handoff_s_median" in svc
    assert "not_measured" not in cal.header() or "control.delivery" not in \
        cal.header()["not_measured"]
    assert any("control plane at idle" in line for line in lines)
    costs = load_costs(cal)  # a simulation reads every figure back
    assert costs.delivery.to_dict() == c["delivery"] and costs.rpc_s == c["rpc_s"]
