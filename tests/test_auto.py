"""The drafting policy on a model: identity with `budget="auto"` on the tiny models, the measured
cost profile's cache, the calibration report."""
from __future__ import annotations

import json
import random

import pytest
import torch

from eagle2_core import Engine, GenerationSettings, TreeSettings
from eagle2_core.policy import bin_counts, calibration_gap
from eagle2_core.costs import CostProfile

from test_decoder_identity import MAXPOS, VOCAB, build_cases


def fake_profile(verify: dict[int, float], draft: float = 1.0) -> CostProfile:
    return CostProfile(key={}, verify_ms=verify, draft_ms={1: draft, 4: draft})


def test_auto_budget_is_lossless_and_varies_per_cycle(tiny_lm, fitted_head):
    """With a cost step after 4 rows (a quarter of a forward), the chooser keeps 4 nodes when
    the draft is unsure and drafts deeper and goes past the step when it is confident; the text
    is the target's either way."""
    model = tiny_lm("llama", vocab_size=VOCAB, max_position_embeddings=MAXPOS)
    head = fitted_head(model)
    prof = fake_profile({1: 10.0, 4: 10.5, 5: 13.0, 12: 14.0})
    dec = Engine(model, head, tree=TreeSettings(total_tokens=12, depth=4, top_k=3, budget="auto"), costs=prof)
    dec.policy.costs.frozen = True  # the tiny model's own timings would replace the cost step
    sizes = []
    for case in build_cases(model, seed=21):
        out = []
        for ev in dec.stream(case["ids"], GenerationSettings(max_new_tokens=case["n"], eos_token_ids=case["eos"])):
            if hasattr(ev, "tree_size"):
                sizes.append(ev.tree_size)
                out.extend(ev.token_ids)
        assert out == case["ref"], case
    chosen = set(sizes[1:])  # the first event is the prefill
    assert {4} & chosen and any(s > 5 for s in chosen), sorted(chosen)


def test_bin_counts_and_gap_on_a_hand_made_example():
    p = torch.tensor([0.05, 0.08, 0.45, 0.41, 0.95], dtype=torch.float64)
    on = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    c = bin_counts(p, on, 10)
    assert c[0, [0, 4, 9]].tolist() == [2, 2, 1] and c[1, [0, 4, 9]].tolist() == [1, 2, 1]
    assert c[2, 0].item() == pytest.approx(0.13)
    # |0.13 - 1| + |0.86 - 2| + |0.95 - 1| over 5 nodes
    assert calibration_gap(c) == pytest.approx((0.87 + 1.14 + 0.05) / 5)
    assert calibration_gap(torch.zeros(3, 10)) == 0.0


def test_profile_cache_remeasures_on_a_new_key_and_ignores_a_corrupt_file(tmp_path, monkeypatch, tiny_lm, fitted_head):
    import eagle2_core.costs as costs
    import eagle2_core.measure as measure

    monkeypatch.setenv("EAGLE2_CACHE", str(tmp_path))
    model = tiny_lm("llama", vocab_size=VOCAB, max_position_embeddings=MAXPOS)
    head = fitted_head(model)
    calls = []
    real = measure.measure_profile

    def counting(m, h, **kw):
        calls.append(1)
        return real(m, h, verify_rows=(1, 2, 4), draft_rows=(1, 2), reps=1)

    monkeypatch.setattr(measure, "measure_profile", counting)
    a = measure.load_or_measure(model, head)
    b = measure.load_or_measure(model, head)
    assert len(calls) == 1 and b.verify_ms == pytest.approx(a.verify_ms, abs=1e-3)  # cached (rounded to the microsecond)
    assert sorted(b.lm_head_ms) == list(costs.LM_HEAD_ROWS) and b.key["version"] == costs.PROFILE_VERSION
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # another thread count is another machine as far as costs go
    try:
        measure.load_or_measure(model, head)
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 2
    path = measure._cache_path(costs.profile_key(model, head))
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.warns(UserWarning, match="unreadable cost profile"):
        measure.load_or_measure(model, head)
    assert len(calls) == 3
    assert json.load(open(path))["verify_ms"]  # rewritten whole


def test_quick_probes_measure_few_sizes_once_and_serve_later_loads(tmp_path, monkeypatch, tiny_lm):
    """What a command measures before its first answer (load_or_measure(quick=True)): the quick
    sizes, one timing each after a short prompt, no stream floor; cached and marked so, it serves
    the next load of either kind, and `eagle2 tune`'s remeasure replaces it with the whole grid."""
    import eagle2_core.measure as measure
    from eagle2_core.cycle import Cycle
    from eagle2_core.verifier import Verifier

    monkeypatch.setenv("EAGLE2_CACHE", str(tmp_path))
    model = tiny_lm("llama", vocab_size=VOCAB, max_position_embeddings=MAXPOS)
    verifies, prompts = [], []
    real_verify, real_admit = Verifier.tree_argmax, Cycle.admit
    monkeypatch.setattr(Verifier, "tree_argmax", lambda self, ids, *a, **k: verifies.append(ids.shape[-1]) or real_verify(self, ids, *a, **k))
    monkeypatch.setattr(Cycle, "admit", lambda self, row, ids, *a, **k: prompts.append(len(ids)) or real_admit(self, row, ids, *a, **k))
    quick = measure.load_or_measure(model, None, quick=True)
    assert quick.quick and sorted(quick.verify_ms) == list(measure.QUICK_VERIFY_ROWS) and quick.stream_floor_ms is None
    # no warm-up per size; one timing each, or 1 + RECHECK_ROUNDS of each where the tiny model's timings contradicted each other
    rounds = len(verifies) // len(measure.QUICK_VERIFY_ROWS)
    assert rounds in (1, 1 + measure.RECHECK_ROUNDS) and sorted(verifies) == sorted(measure.QUICK_VERIFY_ROWS * rounds)
    assert prompts == [measure.QUICK_CONTEXT]
    assert sorted(quick.lm_head_ms) == [n for n in measure.LM_HEAD_ROWS if n in measure.QUICK_VERIFY_ROWS]
    verifies.clear()
    again = measure.load_or_measure(model, None)  # a later load, quick or not, finds it cached
    assert again.quick and again.verify_ms == pytest.approx(quick.verify_ms, abs=1e-3) and not verifies
    full = measure.load_or_measure(model, None, remeasure=True)
    assert not full.quick and len(full.verify_ms) > len(measure.QUICK_VERIFY_ROWS) and full.stream_floor_ms is not None


def test_quick_probes_recheck_timings_that_contradict_each_other(monkeypatch):
    """A quick probe is timed once; where the timings contradict the row counts' order (a burst of
    other work during one of them), each is timed RECHECK_ROUNDS more times and the least kept."""
    import eagle2_core.measure as measure

    clock = {"t": 0.0}
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock["t"])
    burst = {1: [0.221, 0.040, 0.041], 4: [0.070, 0.069, 0.090], 16: [0.140, 0.150, 0.139]}  # the one-row timing hit first

    def fn(n):
        def run():
            clock["t"] += burst[n].pop(0)
        return run

    got = measure._timed({n: fn(n) for n in (1, 4, 16)}, 1, warm=False, recheck=True)
    assert got == pytest.approx({1: 40.0, 4: 69.0, 16: 139.0}) and all(not v for v in burst.values())
    steady = {1: [0.040], 4: [0.070], 16: [0.140]}  # consistent timings: once each, as before
    burst.update(steady)
    assert measure._timed({n: fn(n) for n in (1, 4, 16)}, 1, warm=False, recheck=True) == pytest.approx({1: 40.0, 4: 70.0, 16: 140.0})
    assert measure.implausible({1: 40.0, 4: 30.0}) and measure.implausible({1: 10.0, 4: 60.0}) and not measure.implausible({1: 40.0, 4: 44.0, 16: 140.0})
    burst.update({1: [0.221], 4: [0.070]})  # without `recheck` (the full grid's median of rounds): once each
    assert measure._timed({1: fn(1), 4: fn(4)}, 1, warm=False) == pytest.approx({1: 221.0, 4: 70.0})


def test_cli_tune_and_compare_against_auto(tmp_path, monkeypatch, tiny_model_dir, tiny_head_dir):
    from click.testing import CliRunner

    from eagle2_cli.main import cli

    from eagle2_core import rowgemm

    monkeypatch.setenv("EAGLE2_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("EAGLE2_KERNEL")  # the suite pins linear; tune measures the kernels when nothing is forced
    monkeypatch.setenv("COLUMNS", "80")  # an 80-column terminal: every table whole
    r = CliRunner().invoke(cli, ["tune", "--model", tiny_model_dir, "--draft", tiny_head_dir, "--json", str(tmp_path / "p.json")])
    monkeypatch.delenv("COLUMNS")
    assert "…" not in r.stdout, r.stdout
    monkeypatch.setenv("EAGLE2_KERNEL", "linear")  # and the measured plan does not outlive the tune
    rowgemm.install_plan(rowgemm.ProductPlan())
    assert r.exit_code == 0, r.stderr
    assert "verify ms" in r.stdout and "draft step ms" in r.stdout
    prof = json.load(open(tmp_path / "p.json"))
    assert set(prof["verify_ms"]) >= {"1", "4", "16", "64"} and prof["key"]["threads"] == torch.get_num_threads()
    # the weight-streaming floor beside verify, and every product's kernels with the plan they give
    assert prof["stream_floor_ms"] > 0 and prof["weight_bytes"] > 0 and "stream floor" in r.stdout
    assert prof["verify_over_stream_floor"]["1"] == pytest.approx(prof["verify_ms"]["1"] / prof["stream_floor_ms"], rel=1e-2)
    assert prof["products"] and set(prof["plan"]["kernels"]) == set(prof["products"]) and "plan:" in r.stdout
    assert isinstance(prof["packed_bytes"], int)
    out = tmp_path / "c.json"
    r = CliRunner().invoke(cli, ["compare", "--limit", "2", "-n", "8", "--model", tiny_model_dir, "--draft", tiny_head_dir,
                                 "--total-tokens", "4", "--depth", "3", "--tree-top-k", "3", "--against", "auto,auto:8/3/3", "--json", str(out)])
    assert r.exit_code == 0, r.stderr
    data = json.load(open(out))
    assert data["settings"]["cost_profile"]["verify_ms"] == prof["verify_ms"]  # the cached profile, not a new one
    assert data["auto"]["identical"] == 2 and data["auto:8/3/3"]["identical"] == 2
    assert data["auto:8/3/3"]["mean_tree_size"] <= 8 and "calibration" in data["eagle2"]
    assert data["settings"]["tree"]["budget"] == "constant" and data["settings"]["tree"]["total_tokens"] == 4
    # Without --total-tokens the CPU default is the per-cycle budget, its expansion from the profile
    r = CliRunner().invoke(cli, ["compare", "--limit", "1", "-n", "4", "--model", tiny_model_dir, "--draft", tiny_head_dir, "--json", str(out)])
    assert r.exit_code == 0, r.stderr
    tree = json.load(open(out))["settings"]["tree"]
    assert tree["budget"] == "auto" and tree["top_k"] == CostProfile.from_json(prof).draft_width() and "tree auto (up to" in r.stdout
    r = CliRunner().invoke(cli, ["chat", "--prompt", "Hi", "-n", "4", "--no-baseline", "--model", tiny_model_dir,
                                 "--draft", tiny_head_dir, "--total-tokens", "auto"])
    assert r.exit_code == 0, r.stderr
    r = CliRunner().invoke(cli, ["chat", "--prompt", "Hi", "--total-tokens", "many"])
    assert r.exit_code == 2 and "neither a number nor 'auto'" in r.stderr


def test_auto_expansion_width_follows_the_measured_draft_step():
    flat = CostProfile(key={}, verify_ms={1: 1.0}, draft_ms={1: 10.4, 2: 8.1, 4: 8.4, 8: 12.3, 10: 17.6})  # fp32, AVX2 Zen 3
    linear = CostProfile(key={}, verify_ms={1: 1.0}, draft_ms={1: 5.7, 2: 7.2, 4: 11.8, 8: 20.6, 10: 25.2})  # bf16 there
    gpu = CostProfile(key={}, verify_ms={1: 1.0}, draft_ms={1: 1.0, 2: 1.0, 4: 1.01, 8: 1.02, 10: 1.03})
    assert (flat.draft_width(), linear.draft_width(), gpu.draft_width()) == (4, 1, 10)


def test_runtime_auto_tree_takes_its_expansion_from_the_profile_unless_given(tmp_path, monkeypatch, tiny_model_dir, tiny_head_dir):
    from eagle2_core.runtime import Runtime
    from eagle2_core.treesettings import AUTO_DEPTH_CPU, AUTO_MAX_CPU

    monkeypatch.setenv("EAGLE2_CACHE", str(tmp_path))
    rt = Runtime.load(tiny_model_dir, tiny_head_dir, device="cpu", tree={"total_tokens": "auto"})
    assert rt.tree == rt.auto_tree and rt.tree.budget == "auto" and rt.tree.total_tokens == AUTO_MAX_CPU
    assert rt.tree.top_k == rt.costs.draft_width() and rt.tree.depth == AUTO_DEPTH_CPU
    rt = Runtime.load(tiny_model_dir, tiny_head_dir, device="cpu", tree={"total_tokens": 5, "depth": 3, "top_k": 7})
    assert rt.tree.budget == "constant" and rt.tree.total_tokens == 5
    assert (rt.auto_tree.depth, rt.auto_tree.top_k, rt.auto_tree.budget) == (3, 7, "auto")  # what the user gave stands

