"""The per-cycle budget chooser (pure), the measured cost profile's cache, and identity with
`budget="auto"` on the tiny models."""
from __future__ import annotations

import json
import random

import pytest
import torch

from eagle2_core import Engine, GenerationSettings, TreeSettings
from eagle2_core.budget import BudgetChooser, bin_counts, calibrate, calibration_gap, choose_budget, expected_tokens
from eagle2_core.costs import CostProfile

from test_decoder_identity import MAXPOS, VOCAB, build_cases


def brute_force(p: list[float], t: list[float], d: float) -> int:
    best, arg = -1.0, 0
    for n in range(1, len(p) + 2):
        r = (1 + sum(p[: n - 1])) / (t[n - 1] + d)
        if r > best + 1e-12:
            best, arg = r, n
    return arg


def test_chooser_is_the_argmax_of_expected_tokens_per_ms():
    rng = random.Random(0)
    for _ in range(300):
        m = rng.randint(0, 12)
        p = sorted((rng.random() for _ in range(m)), reverse=True)
        t = sorted(rng.uniform(5, 50) for _ in range(m + 1))
        d = rng.uniform(0, 20)
        assert choose_budget(torch.tensor(p), torch.tensor(t), d) == brute_force(p, t, d)


def test_chooser_on_monotone_and_degenerate_tables():
    p = torch.tensor([0.9, 0.6, 0.3, 0.1])
    assert choose_budget(p, torch.full((5,), 10.0)) == 5               # free rows: verify everything drafted
    assert choose_budget(p, torch.arange(1, 6) * 10.0) == 1           # every row costs a whole forward: just the root
    assert choose_budget(p, torch.tensor([10.0, 11.0, 30.0, 31.0, 32.0])) == 2  # a step after 2 rows
    assert choose_budget(torch.tensor([]), torch.tensor([10.0])) == 1  # one node: the root alone
    assert choose_budget(torch.full((4,), 0.5), torch.full((5,), 10.0)) == 5  # equal scores, flat costs
    assert choose_budget(torch.zeros(4), torch.full((5,), 10.0)) == 1  # nothing expected: ties go to the smaller tree
    assert expected_tokens(p).tolist() == pytest.approx([1.0, 1.9, 2.5, 2.8, 2.9])
    with pytest.raises(ValueError):
        choose_budget(p, torch.ones(3))


def fake_profile(verify: dict[int, float], draft: float = 1.0) -> CostProfile:
    return CostProfile(key={}, verify_ms=verify, draft_ms={1: draft, 4: draft})


def test_cost_table_interpolates_between_measured_sizes():
    prof = fake_profile({1: 10.0, 4: 16.0, 8: 40.0})
    assert prof.verify_table(10).tolist() == pytest.approx([10, 12, 14, 16, 22, 28, 34, 40, 46, 52])


def test_auto_budget_is_lossless_and_varies_per_cycle(tiny_lm, fitted_head):
    """With a cost step after 4 rows (a quarter of a forward), the chooser keeps 4 nodes when
    the draft is unsure and drafts deeper and goes past the step when it is confident; the text
    is the target's either way."""
    model = tiny_lm("llama", vocab_size=VOCAB, max_position_embeddings=MAXPOS)
    head = fitted_head(model)
    prof = fake_profile({1: 10.0, 4: 10.5, 5: 13.0, 12: 14.0})
    dec = Engine(model, head, tree=TreeSettings(total_tokens=12, depth=4, top_k=3, budget="auto"), costs=prof)
    dec.chooser.learn_costs = False  # the tiny model's own timings would replace the cost step
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


def test_calibration_correction_scales_each_bin_by_its_measured_acceptance():
    p = torch.tensor([0.05, 0.15, 0.12, 0.55], dtype=torch.float64)
    empty = torch.zeros(3, 10, dtype=torch.float64)
    assert calibrate(p, empty, prior_nodes=50).tolist() == pytest.approx(p.tolist())  # no evidence: the draft's confidence stands
    # Bin 1 (0.1-0.2): 1,000 nodes of mean confidence 0.15, 300 accepted (twice as often as claimed).
    counts = empty.clone()
    counts[:, 1] = torch.tensor([1000.0, 300.0, 150.0])
    out = calibrate(p, counts, prior_nodes=50)
    r = (300 + 50 * 0.15) / (150 + 50 * 0.15)
    assert out.tolist() == pytest.approx([0.05, 0.15 * r, 0.12 * r, 0.55])  # other bins untouched
    assert out[1] > out[2]  # order within a bin kept
    counts[:, 9] = torch.tensor([100.0, 100.0, 95.0])
    assert calibrate(torch.tensor([0.99], dtype=torch.float64), counts, 50).item() == 1.0  # capped at 1
    # Shrinkage: ten nodes move the estimate less than a thousand
    few = empty.clone()
    few[:, 1] = torch.tensor([10.0, 3.0, 1.5])
    assert p[1] < calibrate(p, few, 50)[1] < out[1]


def test_bin_counts_and_gap_on_a_hand_made_example():
    p = torch.tensor([0.05, 0.08, 0.45, 0.41, 0.95], dtype=torch.float64)
    on = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    c = bin_counts(p, on, 10)
    assert c[0, [0, 4, 9]].tolist() == [2, 2, 1] and c[1, [0, 4, 9]].tolist() == [1, 2, 1]
    assert c[2, 0].item() == pytest.approx(0.13)
    # |0.13 - 1| + |0.86 - 2| + |0.95 - 1| over 5 nodes
    assert calibration_gap(c) == pytest.approx((0.87 + 1.14 + 0.05) / 5)
    assert calibration_gap(torch.zeros(3, 10)) == 0.0


def test_budget_chooser_learns_costs_and_calibration_from_cycles():
    prof = fake_profile({1: 10.0, 2: 10.5, 4: 20.0, 8: 24.0}, draft=2.0)
    ch = BudgetChooser(prof, 8, step_ms=2.0, prior_cycles=4)
    assert ch.verify_table().tolist() == pytest.approx(prof.verify_table(8).tolist())
    # Cycles of 2 rows run at twice the profile's cost: every size is scaled, the seen one moves to its mean.
    for _ in range(12):
        ch.observe(torch.tensor([0.5]), torch.tensor([1.0]), draft_ms=8.0, verify_ms=21.0, steps=2)
    t = ch.verify_table()
    assert t[1].item() == pytest.approx(21.0) and t[3].item() == pytest.approx(40.0)
    # All cycles took 2 steps: nothing tells the step from the overhead, so the step stays the
    # profile's and the rest of the 8 ms is overhead, shrunk toward 0 with 4 pseudo-cycles.
    assert ch.draft_fit() == pytest.approx(((12 * 8.0 - 2.0 * 24) / (4 + 12), 2.0))
    # An under-confident head: nodes at 0.1-0.2 accepted every other time. With that evidence a
    # larger tree pays where the uncorrected confidence would keep the root and one node.
    p = torch.tensor([0.55, 0.15, 0.15, 0.14, 0.13, 0.12, 0.11], dtype=torch.float64)
    before = ch.choose(p, steps=2)
    for _ in range(100):
        ch.observe(torch.full((4,), 0.15), torch.tensor([1.0, 1.0, 0.0, 0.0]), draft_ms=8.0, verify_ms=40.0, steps=2)
    assert ch.gap > 0.3 and ch.choose(p, steps=2) > before
    frozen = BudgetChooser(prof, 8, step_ms=2.0)
    frozen.learn_costs = False
    frozen.observe(torch.tensor([0.5]), torch.tensor([1.0]), draft_ms=4.0, verify_ms=99.0)
    assert frozen.verify_table().tolist() == pytest.approx(prof.verify_table(8).tolist()) and frozen.step_cost() == 2.0


def test_chooser_keeps_costs_per_batch_size_and_serves_every_row():
    """One chooser serves every batch size (continuous batching shrinks the batch): each size has
    its own cost table (the profile's B x N rows until cycles of that size are timed), a run's
    plain-or-draft evidence starts afresh with `start_run`, and [rows, m] inputs are each row's
    best path probabilities, averaged (one tree size serves the whole batch)."""
    from eagle2_core.budget import mean_row

    prof = fake_profile({1: 10.0, 2: 10.5, 4: 20.0, 8: 24.0, 16: 40.0}, draft=2.0)
    ch = BudgetChooser(prof, 8, step_ms=2.0, prior_cycles=4)
    one = ch.verify_table().clone()
    ch.start_run(2)
    assert ch.verify_table().tolist() == pytest.approx(prof.verify_table(16)[1::2][:8].tolist())  # n rows for each of 2
    for _ in range(12):
        ch.observe(torch.full((2, 1), 0.5), torch.zeros(2, 1), draft_ms=8.0, verify_ms=50.0, steps=2)
    assert ch.verify_table()[1].item() == pytest.approx(50.0) and ch.obs_n[1].item() == 12
    assert ch.run_tokens == 24  # nothing accepted: each row's bonus token only
    assert not ch.drafting_pays  # 2 tokens per 58 ms against 2 rows per profile root verify
    ch.start_run(1)
    assert ch.drafting_pays and torch.equal(ch.verify_table(), one) and ch.obs_n.sum() == 0  # batch 1: untouched
    ch.start_run(2)
    assert ch.obs_n[1].item() == 12  # batch 2's timings kept across runs
    fresh = BudgetChooser(prof, 8, step_ms=2.0)  # no calibration evidence: confidences stand
    rows = torch.tensor([[0.9, 0.05, 0.6, 0.0], [0.2, 0.1, 0.7, 0.3]], dtype=torch.float64)
    assert mean_row(rows).tolist() == pytest.approx([0.8, 0.45, 0.125, 0.05])  # each row sorted, then averaged
    assert fresh.choose(rows, steps=2) == choose_budget(mean_row(rows), fresh.verify_table(), fresh.draft_cost(2))
    assert fresh.choose(rows[:1], steps=2) == fresh.choose(rows[0], steps=2)
    front = torch.log(torch.tensor([[0.6, 0.3], [0.6, 0.3]]))
    pool = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.6, 0.3, 0.1]]))
    assert fresh.worth_expanding(pool, front, steps=1, remaining=2) == fresh.worth_expanding(pool[0], front[0], steps=1, remaining=2)


def test_depth_is_chosen_per_cycle_from_confidence_and_step_cost():
    """Drafting deeper pays when the front is confident and steps are cheap against rows."""
    prof = fake_profile({1: 10.0, 2: 10.2, 8: 11.0}, draft=1.0)   # rows nearly free
    ch = BudgetChooser(prof, 8, step_ms=1.0)
    sure, unsure = torch.log(torch.tensor([0.9, 0.05])), torch.log(torch.tensor([0.02, 0.01]))
    assert ch.worth_expanding(sure, sure, steps=1, remaining=2)
    assert not ch.worth_expanding(unsure, unsure, steps=1, remaining=2)  # 2% more tokens for 10% more time
    dear = BudgetChooser(fake_profile({1: 10.0, 2: 18.0, 8: 60.0}), 8, step_ms=1.0)  # each row nearly a forward
    assert not dear.worth_expanding(torch.log(torch.tensor([0.5, 0.3])), torch.log(torch.tensor([0.5, 0.3])), steps=1, remaining=2)
    # the measured share a child keeps of its parent moves the decision
    ch.note_children(torch.log(torch.full((2, 2), 1e-3)))
    for _ in range(50):
        ch.note_children(torch.log(torch.full((2, 2), 1e-3)))
    mid = torch.log(torch.tensor([0.3, 0.2]))
    assert not ch.worth_expanding(mid, mid, steps=1, remaining=1)
    fresh = BudgetChooser(prof, 8, step_ms=1.0)
    assert fresh.worth_expanding(mid, mid, steps=1, remaining=1)


def test_the_share_a_child_keeps_is_weighted_by_its_parents_path_probability():
    """One likely front node whose best child is sure and nine unlikely ones whose children are
    not (top-k 10): the share kept where the mass is (0.67) decides depth, not the mean over
    nodes (0.16)."""
    prof = fake_profile({1: 40.0, 2: 40.5, 8: 42.0}, draft=4.0)
    front = torch.log(torch.tensor([0.6] + [0.01] * 9))
    children = torch.log(torch.tensor([[0.7, 0.2]] + [[0.1, 0.05]] * 9))
    weighted, flat = BudgetChooser(prof, 8, step_ms=4.0), BudgetChooser(prof, 8, step_ms=4.0)
    for _ in range(40):
        weighted.note_children(children, front)
        flat.note_children(children)
    assert weighted.keep_sum / weighted.keep_n == pytest.approx((0.6 * 0.7 + 0.009) / 0.69, rel=1e-4)
    assert flat.keep_sum / flat.keep_n == pytest.approx(0.16, rel=1e-4)
    pool = front
    assert weighted.worth_expanding(pool, front, steps=1, remaining=1)
    assert not flat.worth_expanding(pool, front, steps=1, remaining=1)


def test_draft_overhead_is_not_charged_per_step():
    """A cycle's drafting is an overhead plus one head step per level; only the step is paid
    again for a deeper level. Charging the whole draft per step (the old model: 10 ms cycles of
    one step = 10 ms a level) made every level look dear and kept trees at depth 1."""
    prof = fake_profile({1: 20.0, 2: 20.5, 8: 22.0}, draft=2.0)
    ch = BudgetChooser(prof, 8, step_ms=2.0, prior_cycles=4)
    for _ in range(60):  # depth-1 cycles: 8 ms of bookkeeping + the 2 ms absorb step
        ch.observe(torch.tensor([0.5]), torch.tensor([1.0]), draft_ms=10.0, verify_ms=20.5, steps=1)
    overhead, step = ch.draft_fit()
    assert step == pytest.approx(2.0) and overhead == pytest.approx(60 * 8.0 / 64)
    front = torch.log(torch.tensor([0.6, 0.3]))
    assert ch.worth_expanding(front, front, steps=1, remaining=1)
    # What the old model would decide: 10 ms a step.
    old = BudgetChooser(fake_profile({1: 20.0, 2: 20.5, 8: 22.0}, draft=10.0), 8, step_ms=10.0)
    assert not old.worth_expanding(front, front, steps=1, remaining=1)
    # Cycles of several depths identify the step: 8 ms + 3 ms per step.
    ch = BudgetChooser(prof, 8, step_ms=2.0, prior_cycles=4)
    for steps in (1, 2, 3) * 40:
        ch.observe(torch.tensor([0.5]), torch.tensor([1.0]), draft_ms=8.0 + 3.0 * steps, verify_ms=20.5, steps=steps)
    overhead, step = ch.draft_fit()
    assert 2.9 < step < 3.0 and 7.0 < overhead < 8.0 and ch.draft_cost(2) == pytest.approx(overhead + 2 * step)


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


def test_drafting_stops_when_it_buys_less_than_plain_decoding():
    """Plain decoding is one of the chooser's choices: after a run's first `patience` cycles,
    drafting goes on only while it has produced more tokens per ms than the root alone would.
    The plain cost is the monotone table's first size, so one noisy size (here one row measured
    dearer than two to four) decides nothing: the four pooled, 24.25 ms, not 30 or 20."""
    ch = BudgetChooser(fake_profile({1: 30.0, 2: 20.0, 3: 25.0, 4: 22.0, 8: 40.0}), 8, step_ms=5.0)
    assert ch.plain_ms() == pytest.approx(24.25)
    for tokens, pays in ((1, False), (2, True)):  # a useless draft (1 token per 32 ms), a useful one (2)
        ch.start_run(1)
        for _ in range(ch.patience):
            assert ch.drafting_pays
            ch.observe(torch.full((1, 2), 0.3), torch.zeros(1, 2), draft_ms=10.0, verify_ms=22.0, steps=1, tokens=tokens)
        assert ch.drafting_pays == pays


def test_earlier_runs_stand_behind_a_runs_judgment_of_drafting():
    """`drafting_pays` weighs a run's few cycles with `patience` pseudo-cycles of the earlier runs'
    drafted ones: after runs where drafting paid (3 tokens per 32 ms against a root verify of
    24.25 ms), a run whose first cycles give slightly less than plain goes on drafting; a clearly
    useless run still stops; with no earlier runs the run's own cycles decide alone."""
    prof = fake_profile({1: 30.0, 2: 20.0, 3: 25.0, 4: 22.0, 8: 40.0})

    def run(ch, tokens: float, cycles: int | None = None) -> bool:
        ch.start_run(1)
        for _ in range(cycles or ch.patience):
            ch.observe(torch.full((1, 2), 0.3), torch.zeros(1, 2), draft_ms=10.0, verify_ms=22.0, steps=1, tokens=tokens)
        return ch.drafting_pays

    assert not run(BudgetChooser(prof, 8, step_ms=5.0), 1.25)  # 1.25 / 32 < 1 / 24.25, nothing behind it
    ch = BudgetChooser(prof, 8, step_ms=5.0)
    for _ in range(3):
        assert run(ch, 3.0)
    assert run(ch, 1.25)      # (8 x 1.25 + 8 x 3) / (16 x 32) = 0.066 tokens per ms: on
    assert not run(ch, 0.25, cycles=40)  # 40 cycles of almost nothing outweigh them
    assert ch._state()["life"][2] == pytest.approx(3 * 8 + 8)  # the runs before the last one


def test_the_cost_table_never_falls_with_the_tree_size():
    """A dip in a timed table is noise (a smaller verify could always be padded to the larger one):
    pooled with its neighbours at their evidence-weighted mean, so one noisy size does not decide
    which trees look cheap. A table that already rises is left exactly as it is."""
    from eagle2_core.budget import monotone

    ones = torch.ones(8, dtype=torch.float64)
    rising = torch.tensor([10.0, 10.0, 11.0, 12.5, 12.5, 13.0, 20.0, 21.0], dtype=torch.float64)
    assert torch.equal(monotone(rising, ones), rising)
    noisy = torch.tensor([47.1, 48.9, 56.4, 54.3, 52.5, 51.1, 54.7, 55.0], dtype=torch.float64)  # a measured bf16 profile
    fit = monotone(noisy, ones)
    assert (fit[1:] >= fit[:-1]).all() and fit[:2].tolist() == [47.1, 48.9]
    assert fit[2:6].tolist() == pytest.approx([53.575] * 4) and fit[6:].tolist() == [54.7, 55.0]
    # weights: the size with more timed cycles moves less
    heavy = monotone(torch.tensor([12.0, 10.0], dtype=torch.float64), torch.tensor([1.0, 3.0], dtype=torch.float64))
    assert heavy.tolist() == pytest.approx([10.5, 10.5])
    # in the chooser: a profile whose 3 rows measured dearer than 6 gets a table that rises
    ch = BudgetChooser(fake_profile({1: 47.1, 2: 48.9, 3: 56.4, 4: 54.3, 5: 52.5, 6: 51.1, 7: 54.7, 8: 55.0}, draft=2.0), 8, step_ms=2.0)
    t = ch.verify_table()
    assert (t[1:] >= t[:-1]).all() and t[2].item() == pytest.approx(53.575)


def test_the_head_is_kept_only_where_it_adds_more_than_it_costs():
    """budget.head_pays: with the head T tokens in C ms, without it T - m in C - d."""
    from eagle2_core.budget import head_pays

    assert head_pays(200, 1000, 60, 200)        # 0.2 tok/ms with it, 0.175 without: kept
    assert not head_pays(200, 1000, 20, 200)    # 0.2 with it, 0.225 without: dropped
    assert head_pays(10, 5, 0, 5)               # no time left without it: nothing to compare


def test_backoff_tries_again_later_and_later():
    """After a stop, drafting is tried again `first` cycles later, then twice as long after each
    further stop; `due` says so once."""
    from eagle2_core.budget import Backoff

    b = Backoff(16)
    assert not b.due(100)  # nothing stopped
    b.stopped(5)
    assert not b.due(20) and b.due(21) and not b.due(22)
    b.stopped(30)
    assert not b.due(61) and b.due(62)
    b.stopped(70)
    assert not b.due(133) and b.due(134)


def test_the_head_gate_judges_each_bin_of_the_head_free_trees_worth():
    """HeadGate: per bin of the head-free tree's expected tokens, the head drafts until it has
    `patience` cycles of evidence there, then where it paid; a bin where it did not still drafts
    one cycle in `explore + 1`; a bin keeps about its last `window` cycles."""
    from eagle2_core.budget import HeadGate

    g = HeadGate(patience=4, explore=3)
    low, high = g.bin(1.1), g.bin(3.0)
    assert low == 0 and high > low and g.bin(100.0) == len(g.EDGES)
    for _ in range(4):
        assert g.wants(low) and g.wants(high)
        g.record(low, 2.0, 10.0, 0.8, 2.0)    # 0.2 tok/ms with the head, 0.15 without: it pays
        g.record(high, 4.0, 10.0, 0.1, 2.0)   # 0.4 with it, 0.4875 without: it does not
    assert all(g.wants(low) for _ in range(10))
    assert [g.wants(high) for _ in range(8)] == [False, False, False, True] * 2
    g.new_run()
    assert not g.wants(high)  # a new run keeps the evidence
    for _ in range(g.window):
        g.record(high, 4.0, 10.0, 2.0, 2.0)  # the text changed: now 0.4 with it, 0.25 without
    assert g.tallies[high]["cycles"] == g.window and g.wants(high)


def test_the_head_gate_judges_a_bin_with_every_bins_evidence_behind_it():
    """HeadGate.judged: a bin whose first `patience` head cycles happened to owe the head nothing
    keeps drafting where the other bins show the head paying (their pooled evidence stands behind
    it as `patience` pseudo-cycles); a window of its own such cycles outweighs them and the bin
    skips. Without other bins' evidence a bin is judged on its own."""
    from eagle2_core.budget import HeadGate

    g = HeadGate(patience=8, explore=100)
    low, mid = g.bin(1.1), g.bin(1.8)
    for _ in range(24):
        g.record(low, 2.0, 20.0, 0.6, 2.0)   # 0.1 tok/ms with the head, 1.4 / 18 = 0.078 without
    for _ in range(8):
        g.record(mid, 2.0, 20.0, 0.0, 2.0)   # by chance nothing owed to the head here
    assert g.wants(mid)
    for _ in range(g.window):
        g.record(mid, 2.0, 20.0, 0.0, 2.0)
    assert not g.wants(mid)
    alone = HeadGate(patience=8, explore=100)
    for _ in range(8):
        alone.record(mid, 2.0, 20.0, 0.0, 2.0)
    assert not alone.wants(mid)


def test_the_choosers_host_arrays_compute_the_tensor_functions():
    """The chooser runs its per-cycle choices on arrays (budget.py: several times a cycle over a
    few dozen numbers); they are the pure tensor functions: its size for the head's raw
    confidences is `choose_budget` over `mean_row` of `calibrate`d rows, for merged trees over
    `calibrate_by_depth`, and its evidence is `bin_counts` (per depth for merged trees)."""
    from eagle2_core.budget import MERGED_DEPTHS, calibrate_by_depth, calibration_ratio, mean_row

    rng = random.Random(11)
    prof = fake_profile({1: 10.0, 2: 10.5, 4: 13.0, 8: 17.0, 16: 30.0}, draft=2.0)
    ch = BudgetChooser(prof, 12, step_ms=1.5, prior_nodes=5.0)
    counts, merged = torch.zeros(3, 10, dtype=torch.float64), torch.zeros(MERGED_DEPTHS, 3, 10, dtype=torch.float64)
    for _ in range(40):
        rows, m = rng.randint(1, 3), rng.randint(2, 11)
        p = torch.tensor([[rng.random() ** 2 for _ in range(m)] for _ in range(rows)], dtype=torch.float64)
        on = torch.tensor([[float(rng.random() < 0.3) for _ in range(m)] for _ in range(rows)], dtype=torch.float64)
        depth = torch.tensor([[rng.randint(1, 5) for _ in range(m)] for _ in range(rows)])
        head = torch.rand(rows, m) < 0.5
        raw = torch.rand(rows, m, dtype=torch.float64)
        steps = rng.randint(0, 3)
        table, d = ch.verify_table(), ch.draft_cost(steps)
        assert ch.choose(p, steps) == choose_budget(mean_row(calibrate(p, counts, 5.0))[:11], table, d)
        assert ch.choose(p, steps, depth) == choose_budget(mean_row(calibrate_by_depth(p, depth, merged, 5.0))[:11], table, d)
        ch.observe(raw, on, draft_ms=3.0, verify_ms=12.0, steps=steps, head_nodes=head, merged=(p, depth))
        counts += bin_counts(raw[head], on[head], 10)
        bucket = depth.clamp(1, MERGED_DEPTHS) - 1
        for k in range(MERGED_DEPTHS):
            merged[k] += bin_counts(p[bucket == k], on[bucket == k], 10)
        assert torch.allclose(ch.counts, counts) and torch.allclose(ch.merged_counts, merged)
    assert calibration_ratio(merged, 5.0).shape == (MERGED_DEPTHS, 10)


def test_the_rows_a_larger_tree_adds_are_priced_from_the_measured_table():
    """TreePolicy.rows_ms: what verifying `larger` nodes per row costs over `smaller` (the head
    gate charges the head the rows its nodes add over the head-free tree's own size)."""
    from eagle2_core.budget import TreePolicy

    prof = fake_profile({1: 10.0, 2: 12.0, 4: 16.0, 8: 40.0})
    pol = TreePolicy(BudgetChooser(prof, 8, step_ms=1.0))
    assert pol.rows_ms(1, 4) == pytest.approx(6.0) and pol.rows_ms(2, 8) == pytest.approx(28.0)
    assert pol.rows_ms(4, 4) == 0.0 and pol.rows_ms(4, 2) == 0.0  # never negative
    assert pol.rows_ms(1, 20) == pytest.approx(30.0)  # past the table: its largest size
