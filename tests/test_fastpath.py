"""The fixed-address decode step (dscale_runtime/fastpath.py) and the GPU step benchmark (benchmarks/gpu_step.py).

CPU: the tiny benchmark runs end to end; DScale at full budget with an always-accept predictor is DFlash;
at half budget it keeps exactly min(y, k - 1) of DFlash's drafts; the decision equals the engine's
`_decide` + flat-pack; the packed verify forward equals one forward per request; the throughput
projection on synthetic traces. GPU (marker `gpu`): graph replay == eager for the decision and the
verification at a tiny shape, and no host synchronisation in the decision.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dscale_runtime.attention import build_metadata
from dscale_runtime.dvl.allocate import budget_rows
from dscale_runtime.dvl.features import (
    FeatureSpec,
    acceptance_features,
    hidden_projection,
)
from dscale_runtime.dvl.pack import flat_pack, packed_metadata
from dscale_runtime.dvl.predictor import AcceptancePredictor, predictor_artifact
from dscale_runtime.engine import Engine
from dscale_runtime.fastpath import GraphedCall, decide

_spec = importlib.util.spec_from_file_location("gpu_step", Path(__file__).parents[1] / "benchmarks" / "gpu_step.py")
gpu_step = importlib.util.module_from_spec(_spec)
sys.modules["gpu_step"] = gpu_step
_spec.loader.exec_module(gpu_step)

W = gpu_step.BLOCK


@pytest.fixture(scope="module")
def bench():
    torch.manual_seed(0)
    b = gpu_step.Bench(gpu_step.SHAPES["tiny"], "cpu", torch.float32, max_n=6, context=37, seed=3)
    ws, _ = b.workspace(6, 48)
    with torch.no_grad():
        _, logits, hidden = b.step(ws, "dflash").draft()
        gpu_step.fit_normalisation(b.predictor, acceptance_features(b.spec, logits, hidden, b.projection, ws.context))
        b.predictor.mlp[0].weight.mul_(6.0)  # spread the scores: ragged verify lengths at half budget
    return b


@pytest.fixture(scope="module")
def dflash(bench):
    """(accepted, successor) of one full-width DFlash step over the 6 requests."""
    return run_step(bench, 6, "dflash")[1:3]


def always_accept(spec: FeatureSpec) -> AcceptancePredictor:
    p = AcceptancePredictor(spec, (8,))
    with torch.no_grad():
        for param in p.parameters():
            param.zero_()
        p.mlp[-1].bias.fill_(30.0)  # sigmoid ~ 1 at every position
    return p.eval()


def run_step(bench, n: int, mode: str, rows: int | None = None, predictor=None):
    ws, _ = bench.workspace(n, rows or W * n)
    step = bench.step(ws, mode, rows)
    if predictor is not None:
        step.predictor = predictor
    with torch.no_grad():
        step.build(use_graphs=False)
        accepted, successor, lens = step()
    return step, accepted.clone(), successor.clone(), lens.clone()


def test_verify_rows_rounds_up_to_eight_within_bounds():
    assert [gpu_step.verify_rows(1, r) for r in gpu_step.RATIOS] == [8, 16, 16, 16]
    assert [gpu_step.verify_rows(8, r) for r in gpu_step.RATIOS] == [64, 80, 96, 128]
    assert [gpu_step.verify_rows(3, r) for r in gpu_step.RATIOS] == [24, 32, 40, 48]


def test_full_budget_always_accept_is_dflash(bench, dflash):
    n, (acc_f, succ_f) = 6, dflash
    _, acc_s, succ_s, lens_s = run_step(bench, n, "dscale", W * n, always_accept(bench.spec))
    assert lens_s.tolist() == [W] * n
    assert torch.equal(acc_s, acc_f) and torch.equal(succ_s, succ_f)
    assert acc_f.sum() > 0, "the tiny shape should accept some drafts (test is vacuous otherwise)"


def test_half_budget_keeps_min_of_full_acceptance(bench, dflash):
    n, (acc_f, succ_f) = 6, dflash
    _, acc_s, succ_s, lens = run_step(bench, n, "dscale", gpu_step.verify_rows(n, 0.5))
    assert int(lens.sum()) == gpu_step.verify_rows(n, 0.5) and lens.min() >= 1 and lens.max() <= W
    assert len(set(lens.tolist())) > 1, "random predictor should give ragged verify lengths"
    assert torch.equal(acc_s, torch.minimum(acc_f, lens - 1))
    cut = acc_f < lens - 1  # rejected inside the DScale window: same successor as DFlash
    assert torch.equal(succ_s[cut], succ_f[cut])


def test_decision_equals_engine_decide_and_pack(bench):
    n = 5
    rows = budget_rows(n, W, 0.5)
    step, *_ = run_step(bench, n, "dscale", rows)
    tokens, logits, hidden = step.parts["draft"].outputs
    ws = step.ws
    with torch.no_grad():
        packed, meta = decide(bench.predictor, bench.projection, tokens, logits, hidden, ws, rows)
        features = acceptance_features(bench.spec, logits, hidden, bench.projection, ws.context)
        stub = SimpleNamespace(predictor=bench.predictor, block_size=W, config=SimpleNamespace(budget_ratio=0.5),
                               device=torch.device("cpu"))
        lens, engine_rows = Engine._decide(stub, features, n)
    assert engine_rows == rows and torch.equal(packed.verify_lens, lens)
    ref = flat_pack(lens, tokens, ws.ctx_lens, ws.block_tables, rows, ws.page_size)
    ref_meta = packed_metadata(ref, ws.ctx_lens, ws.block_tables, ws.max_kv, W)
    for name in ("verify_offsets", "token_ids", "positions", "slot_mapping", "row_req", "row_local"):
        assert torch.equal(getattr(packed, name), getattr(ref, name)), name
    starts, qlens = ref_meta.query_bounds()  # derived from row_req, as the kernels would
    assert torch.equal(meta.query_starts[qlens > 0], starts[qlens > 0]) and torch.equal(meta.query_lens, qlens)
    assert torch.equal(meta.kv_lens, ref_meta.kv_lens)


def test_packed_verify_equals_per_request_forward(bench):
    n = 3
    rows = gpu_step.verify_rows(n, 0.5)
    step, *_ = run_step(bench, n, "dscale", rows)
    lens, packed, meta = step.parts["decide"].outputs
    target, caches = bench.target, bench.target_cache.layers
    with torch.no_grad():
        meta.rope.clear()
        packed_logits = target(packed.token_ids, meta, caches)[0]
        for i in range(n):
            k, off, ctx = int(lens[i]), int(packed.verify_offsets[i]), int(step.ws.ctx_lens[i])
            one = build_metadata([k], [ctx], [step.ws.block_tables[i].tolist()], bench.page_size, "cpu")
            logits = target(packed.token_ids[off : off + k], one, caches)[0]
            torch.testing.assert_close(logits, packed_logits[off : off + k], rtol=1e-5, atol=1e-5)


def test_tiny_cli_writes_results(tmp_path):
    out = tmp_path / "step.json"
    gpu_step.main(["--device", "cpu", "--tiny", "--ns", "2", "--reps", "1", "--warmup", "0", "--ratios", "0.5", "1.0",
                   "--sections", "step", "decision", "verify", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["errors"] == [] and res["skipped"] == []
    entry = res["shapes"]["tiny"]["N"]["2"]
    assert {"dflash eager ref", "dscale +DVL", "dscale eager r1.0", "dflash_best"} <= set(entry["step"])
    assert entry["step"]["dscale +DVL"]["rows"] == 16 and entry["step"]["dscale eager r1.0"]["rows"] == 32
    assert entry["verify"]["dflash"]["roofline"]["rows"] == 32 and entry["verify"]["dscale"]["roofline"]["rows"] == 16
    assert "decision_fraction" in entry["derived"] and entry["decision"]["eager"]["ms"] > 0


def write_traces(folder: Path, spec: FeatureSpec, records: int, seed: int = 0) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    (folder / "shards").mkdir(parents=True)
    y = rng.integers(0, W, records)
    for c, part in ((2, slice(0, records // 2)), (4, slice(records // 2, records))):
        m = len(y[part])
        feats = rng.normal(size=(m, spec.width)).astype(np.float32)
        table = pa.table({"features": pa.array(list(feats), type=pa.list_(pa.float32())),
                          "accepted": pa.array(y[part], pa.int32()), "concurrency": pa.array([c] * m, pa.int32()),
                          "prompt_id": [f"p{i % 7}" for i in range(m)], "dataset": ["syn"] * m,
                          "batch_id": [f"b{i // c}" for i in range(m)]})
        pq.write_table(table, folder / "shards" / f"c{c}-chunk0.parquet")
    (folder / "manifest.json").write_text(json.dumps({"feature_width": spec.width}))
    return y


def test_projection_on_synthetic_traces(tmp_path):
    spec = FeatureSpec()
    y = write_traces(tmp_path / "traces", spec, 400)
    torch.manual_seed(0)
    model = AcceptancePredictor(spec, (16,))
    d = 8
    torch.save(predictor_artifact(model, {}, hidden_projection(spec, d)), tmp_path / "p.pt")
    step = lambda mode, ratio, rows, ms, graphs=True: {"mode": mode, "ratio": ratio, "rows": rows, "ms": ms,
                                                       "graphs": graphs}
    times = {"shapes": {"syn": {"N": {"4": {"step": {
        "dflash_best": step("dflash", 1.0, 64, 10.0),
        "dscale +DVL": step("dscale", 0.5, 32, 50.0, graphs=False),
        "dscale +graphs": step("dscale", 0.5, 32, 6.0),
        "dscale graph r1.0": step("dscale", 1.0, 64, 10.5)}}}}}}
    (tmp_path / "t.json").write_text(json.dumps(times))
    res = gpu_step.main(["project", "--step-times", str(tmp_path / "t.json"), "--traces", str(tmp_path / "traces"),
                         "--predictor", str(tmp_path / "p.pt"), "--out", str(tmp_path / "proj.json")])
    row = res["projection"]["syn"]["4"]
    assert row["cohorts"] == 100 and row["dflash"]["tokens_per_step"] == pytest.approx(1 + y.mean(), abs=1e-4)
    assert set(row["dscale"]) == {"0.5", "1.0"}  # the eager record of ratio 0.5 gives way to the captured one
    assert row["dscale"]["1.0"]["tokens_per_step"] == row["dflash"]["tokens_per_step"]
    half = row["dscale"]["0.5"]
    assert 0.0 <= half["retention"] <= 1.0 and half["rows"] == 32 and half["tok_s"] == pytest.approx(4 * half["tokens_per_step"] / 6.0e-3, rel=1e-3)
    best = max([*row["dscale"].values(), row["dflash"]], key=lambda r: r["tok_s"])
    assert row["policy"]["tok_s"] == best["tok_s"] and row["policy"]["gain_vs_dflash"] >= 0
    assert json.loads((tmp_path / "proj.json").read_text())["records"] == 400


# ------------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend,tile", [("ref", None), ("triton", 16)])
def test_graph_replay_equals_eager_on_cuda(backend, tile):
    from dscale_runtime.fastpath import attention_path

    b = gpu_step.Bench(gpu_step.SHAPES["tiny"], "cuda", torch.float32, max_n=4, context=37, seed=3)
    n, rows = 4, gpu_step.verify_rows(4, 0.5)
    ws, _ = b.workspace(n, rows)
    with torch.no_grad(), attention_path(backend, tile):
        eager = b.step(ws, "dscale", rows).build(False)
        e_acc, e_succ, e_lens = (t.clone() for t in eager())
        e_dec = eager.parts["decide"].outputs[1]
        graphed = b.step(ws, "dscale", rows).build(True)
        g_acc, g_succ, g_lens = graphed()
        g_dec = graphed.parts["decide"].outputs[1]
        assert torch.equal(e_lens, g_lens) and torch.equal(e_acc, g_acc) and torch.equal(e_succ, g_succ)
        for name in ("token_ids", "positions", "slot_mapping", "row_req", "verify_offsets"):
            assert torch.equal(getattr(e_dec, name), getattr(g_dec, name)), name
        # verification forward alone: replay == eager logits
        _, packed, meta = graphed.parts["decide"].outputs

        def verify():
            meta.rope.clear()
            return b.target(packed.token_ids, meta, b.target_cache.layers)[0]

        ref = verify().clone()
        graph = GraphedCall(verify, True)
        torch.testing.assert_close(graph(), ref, rtol=1e-5, atol=1e-5)
        # no host synchronisation in the eager decision or the replay
        tokens, logits, hidden = graphed.parts["draft"].outputs
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            decide(b.predictor, b.projection, tokens, logits, hidden, ws, rows)
            graphed.parts["decide"]()
        finally:
            torch.cuda.set_sync_debug_mode(0)
