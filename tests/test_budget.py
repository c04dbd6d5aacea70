"""The per-cycle budget chooser (pure), the measured cost profile's cache, and identity with
`budget="auto"` on the tiny models."""
from __future__ import annotations

import json
import random

import pytest
import torch

from eagle2_core import Eagle2Decoder, GenerationSettings, TreeSettings
from eagle2_core.budget import choose_budget, expected_tokens
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
    """With a cost step after 4 rows, the chooser keeps 4 nodes when the draft is unsure and
    goes past the step when it is confident; the text is the target's either way."""
    model = tiny_lm("llama", vocab_size=VOCAB, max_position_embeddings=MAXPOS)
    head = fitted_head(model)
    prof = fake_profile({1: 10.0, 4: 10.5, 5: 16.0, 12: 17.0})
    dec = Eagle2Decoder(model, head, tree=TreeSettings(total_tokens=12, depth=4, top_k=3, budget="auto"), costs=prof)
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


def test_profile_cache_remeasures_on_a_new_key_and_ignores_a_corrupt_file(tmp_path, monkeypatch, tiny_lm, fitted_head):
    import eagle2_core.costs as costs

    monkeypatch.setenv("EAGLE2_CACHE", str(tmp_path))
    model = tiny_lm("llama", vocab_size=VOCAB, max_position_embeddings=MAXPOS)
    head = fitted_head(model)
    calls = []
    real = costs.measure_profile

    def counting(m, h, **kw):
        calls.append(1)
        return real(m, h, verify_rows=(1, 2, 4), draft_rows=(1, 2), reps=1)

    monkeypatch.setattr(costs, "measure_profile", counting)
    a = costs.load_or_measure(model, head)
    b = costs.load_or_measure(model, head)
    assert len(calls) == 1 and b.verify_ms == pytest.approx(a.verify_ms, abs=1e-3)  # cached (rounded to the microsecond)
    assert sorted(b.lm_head_ms) == list(costs.LM_HEAD_ROWS) and b.key["version"] == costs.PROFILE_VERSION
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # another thread count is another machine as far as costs go
    try:
        costs.load_or_measure(model, head)
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 2
    path = costs._cache_path(costs.profile_key(model, head))
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.warns(UserWarning, match="unreadable cost profile"):
        costs.load_or_measure(model, head)
    assert len(calls) == 3
    assert json.load(open(path))["verify_ms"]  # rewritten whole


def test_cli_tune_and_compare_against_auto(tmp_path, monkeypatch, tiny_model_dir, tiny_head_dir):
    from click.testing import CliRunner

    from eagle2_cli.main import cli

    monkeypatch.setenv("EAGLE2_CACHE", str(tmp_path / "cache"))
    r = CliRunner().invoke(cli, ["tune", "--model", tiny_model_dir, "--draft", tiny_head_dir, "--json", str(tmp_path / "p.json")])
    assert r.exit_code == 0, r.stderr
    assert "verify ms" in r.stdout and "draft step ms" in r.stdout
    prof = json.load(open(tmp_path / "p.json"))
    assert set(prof["verify_ms"]) >= {"1", "4", "16", "64"} and prof["key"]["threads"] == torch.get_num_threads()
    out = tmp_path / "c.json"
    r = CliRunner().invoke(cli, ["compare", "--limit", "2", "-n", "8", "--model", tiny_model_dir, "--draft", tiny_head_dir,
                                 "--depth", "3", "--tree-top-k", "3", "--against", "auto,auto:8/3/3", "--json", str(out)])
    assert r.exit_code == 0, r.stderr
    data = json.load(open(out))
    assert data["settings"]["cost_profile"]["verify_ms"] == prof["verify_ms"]  # the cached profile, not a new one
    assert data["auto"]["identical"] == 2 and data["auto:8/3/3"]["identical"] == 2
    assert data["auto:8/3/3"]["mean_tree_size"] <= 8 and "calibration" in data["eagle2"]
    r = CliRunner().invoke(cli, ["chat", "--prompt", "Hi", "-n", "4", "--no-calibrate", "--model", tiny_model_dir,
                                 "--draft", tiny_head_dir, "--total-tokens", "auto"])
    assert r.exit_code == 0, r.stderr
    r = CliRunner().invoke(cli, ["chat", "--prompt", "Hi", "--total-tokens", "many"])
    assert r.exit_code == 2 and "neither a number nor 'auto'" in r.stderr
