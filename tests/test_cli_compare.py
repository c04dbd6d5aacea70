"""`eagle2 compare` on the tiny model: JSON keys, identical greedy outputs, baselines, plot."""
from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from eagle2_cli.main import cli


def model_args(tiny_model_dir, tiny_head_dir, n=6):
    return ["--model", tiny_model_dir, "--draft", tiny_head_dir, "--max-new-tokens", str(n), "--device", "cpu"]


def test_compare_json_keys(tmp_path, tiny_model_dir, tiny_head_dir):
    out = tmp_path / "c.json"
    r = CliRunner().invoke(cli, ["compare", "--vanilla", "--dataset", "mt-bench", "--limit", "2", "--json", str(out), "--warmup-tokens", "2"]
                           + model_args(tiny_model_dir, tiny_head_dir))
    assert r.exit_code == 0, r.output + r.stderr
    d = json.loads(out.read_text())
    assert d["prompts"] == 2
    assert d["identical"] == 2  # greedy EAGLE-2 reproduces HF generate exactly
    assert isinstance(d["speedup"], float) and isinstance(d["speedup_mean_ratio"], float)
    assert isinstance(d["vanilla"]["tokens_per_s"], float) and isinstance(d["eagle2"]["tokens_per_s"], float)
    assert d["eagle2"]["tau"] >= 1.0 and isinstance(d["eagle2"]["acceptance_by_depth"], list)
    # Where the time goes: per-cycle draft and verify cost, within the method's wall time.
    e, v = d["eagle2"], d["vanilla"]
    assert e["draft_ms_per_cycle"] > 0 and e["verify_ms_per_cycle"] > 0
    assert (e["draft_ms_per_cycle"] + e["verify_ms_per_cycle"]) * e["verify_steps"] / 1000 + e["prefill_s"] <= e["wall_time"] + 1e-3
    # wall_time is rounded to 0.1 ms in the JSON and ms_per_token to 0.01 ms, each from the unrounded time: allow both roundings.
    slack = 0.005 + 1000 * 0.00005 / v["new_tokens"] + 1e-9
    assert abs(v["ms_per_token"] - 1000 * v["wall_time"] / v["new_tokens"]) <= slack and "draft_ms_per_cycle" not in v
    assert re.search(r"^ms: vanilla \d+ per token; plain \d+ per token; eagle2 \d+ draft \+ \d+ verify per cycle$", r.stdout, re.M)
    # On a CPU eagle2's own plain decoding runs too, and the speedup splits: kernels alone (plain
    # over generate) times speculation alone (eagle2 over plain) is the speedup over generate.
    p = d["plain"]
    assert p["identical"] == 2 and "tau" not in p and p["tokens_per_s"] > 0
    # the ratios come from the unrounded speeds, the JSON's speeds are rounded to 3 decimals: the
    # ratio of the rounded ones may differ in the 4th decimal (it did, 1 run in about 10)
    assert d["plain_over_generate"] == p["speedup"] == pytest.approx(p["tokens_per_s"] / v["tokens_per_s"], abs=2e-4)
    assert d["speedup_over_plain"] == e["speedup_over_plain"] == pytest.approx(e["tokens_per_s"] / p["tokens_per_s"], abs=2e-4)
    assert abs(d["plain_over_generate"] * d["speedup_over_plain"] - d["speedup"]) < 1e-3 * d["speedup"]
    assert "speedup_over_plain" not in v and "speedup_over_plain" not in p and "own" in r.stdout  # the "over own plain" column
    assert len(d["per_prompt"]) == 2 and d["settings"]["generation"]["max_new_tokens"] == 6
    assert "vanilla" in r.stdout and "eagle2" in r.stdout and "2/2" in r.stdout
    assert d["per_category"] == {"writing": d["eagle2"]["per_category"]["writing"]}  # MT-bench's first two
    assert [p["question_id"] for p in d["per_prompt"]] == [81, 82]


def test_compare_checks_seeded_samples_against_its_plain_decoding(tmp_path, tiny_model_dir, tiny_head_dir):
    """Sampling with --seed: every eagle2 decoder draws token t from the uniform of (seed, t)
    (accept.accept_sampling_keyed), so its answers equal eagle2's plain decoding's, trees and
    batches whatever; `generate` draws otherwise and is not checked. Without --seed nothing is."""
    out = tmp_path / "c.json"
    args = ["compare", "--vanilla", "--dataset", "mt-bench", "--limit", "3", "--warmup-tokens", "0", "-t", "0.9",
            "--against", "static,batch:2x3"] + model_args(tiny_model_dir, tiny_head_dir, n=10)
    r = CliRunner().invoke(cli, args + ["--seed", "7", "--json", str(out)])
    assert r.exit_code == 0, r.output + r.stderr
    d = json.loads(out.read_text())
    assert d["greedy"] is False and d["identical_to"] == "plain"
    assert d["identical"] == 3 and d["static"]["identical"] == 3 and d["batch:2x3"]["identical"] == 3
    assert d["plain"]["identical"] is None and "same as" in r.stdout and "3/3" in r.stdout
    r = CliRunner().invoke(cli, args + ["--json", str(out)])
    assert r.exit_code == 0, r.output + r.stderr
    d = json.loads(out.read_text())
    assert d["identical_to"] is None and d["identical"] is None and "--seed" in r.stdout


def test_compare_builtin_set_json_to_stdout(tiny_model_dir, tiny_head_dir):
    r = CliRunner().invoke(cli, ["compare", "--limit", "1", "--json", "-", "--warmup-tokens", "0", "--no-plain"]
                           + model_args(tiny_model_dir, tiny_head_dir, 2))
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)  # the table went to stderr
    assert d["prompts"] == 1 and "eagle2" in r.stderr
    assert "plain" not in d and "plain_over_generate" not in d and "own" not in r.stderr  # --no-plain: no "over own plain" column


def test_compare_file_baselines_categories_plot(tmp_path, tiny_model_dir, tiny_head_dir):
    inp, out, png = tmp_path / "q.jsonl", tmp_path / "c.json", tmp_path / "c.png"
    inp.write_text('{"question_id": 1, "category": "math", "turns": ["One plus one?", "And two?"]}\n'
                   '{"question_id": 2, "category": "writing", "turns": ["Write a poem"]}\n'
                   '{"question_id": 3}\n')
    r = CliRunner().invoke(cli, ["compare", "-f", str(inp), "--against", "pld,static,chain", "--json", str(out),
                                 "--plot", str(png), "--warmup-tokens", "1", "--no-plain"] + model_args(tiny_model_dir, tiny_head_dir, 4))
    assert r.exit_code == 1, r.output + r.stderr  # the bad third line is reported, the rest runs
    assert f"{inp}:3: field 'prompt'" in r.stderr
    d = json.loads(out.read_text())
    assert d["prompts"] == 2
    for name in ("vanilla", "eagle2", "pld", "static", "chain"):
        assert name in d and d[name]["tokens_per_s"] > 0
    for name in ("eagle2", "pld", "static", "chain"):
        assert d[name]["identical"] == 2, name
    assert set(d["eagle2"]["per_category"]) == {"math", "writing"} and "tau" in d["eagle2"]["per_category"]["math"]
    assert d["per_category"] == d["eagle2"]["per_category"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_compare_option_errors(tiny_model_dir):
    r = CliRunner().invoke(cli, ["compare", "--against", "sps", "--model", tiny_model_dir])
    assert r.exit_code == 2 and "--assistant" in r.stderr
    r = CliRunner().invoke(cli, ["compare", "--against", "medusa"])
    assert r.exit_code == 2 and "unknown baseline medusa" in r.stderr
    r = CliRunner().invoke(cli, ["compare", "--against", "tree:1/3/2"])
    assert r.exit_code == 2 and "total tokens must be >= 2" in r.stderr
    r = CliRunner().invoke(cli, ["compare", "-f", "x.jsonl", "--dataset", "mt-bench"])
    assert r.exit_code == 2


def test_compare_sweeps_tree_sizes_against_one_baseline(tmp_path, tiny_model_dir, tiny_head_dir):
    out = tmp_path / "c.json"
    r = CliRunner().invoke(cli, ["compare", "--dataset", "mt-bench", "--limit", "2", "--against", "tree:3/2/1,tree:12/4/3",
                                 "--json", str(out), "--warmup-tokens", "0", "--no-plain"] + model_args(tiny_model_dir, tiny_head_dir))
    assert r.exit_code == 0, r.output + r.stderr
    d = json.loads(out.read_text())
    assert d["tree:3/2/1"]["identical"] == 2 and d["tree:12/4/3"]["identical"] == 2
    # each method verifies trees of its own budget (the tree may come out smaller near max_new_tokens)
    assert 1 < d["tree:3/2/1"]["mean_tree_size"] <= 3 < d["tree:12/4/3"]["mean_tree_size"] <= 12
    assert len(d["tree:3/2/1"]["acceptance_by_depth"]) <= 2 and "tree:12/4/3" in r.stdout


def test_compare_graph_mode_and_compiled_generate(tmp_path, tiny_model_dir, tiny_head_dir):
    """The GPU path's graph mode and transformers' static-cache + torch.compile generate, in the
    same run: identical outputs, and aten ops per cycle (with host reads) for each EAGLE method."""
    out = tmp_path / "c.json"
    r = CliRunner().invoke(cli, ["compare", "--vanilla", "--dataset", "mt-bench", "--limit", "2", "--against",
                                 "graph,generate-compiled", "--json", str(out), "--warmup-tokens", "2", "--no-plain"]
                           + model_args(tiny_model_dir, tiny_head_dir))
    assert r.exit_code == 0, r.output + r.stderr
    d = json.loads(out.read_text())
    assert d["graph"]["identical"] == 2 and d["generate-compiled"]["identical"] == 2
    e, f = d["eagle2"]["ops_per_cycle"], d["graph"]["ops_per_cycle"]
    assert f["host_reads"] == 0 < e["host_reads"] and f["draft"] > 0 and f["verify"] > 0
    assert "ops_per_cycle" not in d["vanilla"] and "tau" not in d["generate-compiled"]


def test_compare_batched_rows(tmp_path, tiny_model_dir, tiny_head_dir):
    """--batch-size and --against batch:...: batched rows beside batch-1 vanilla, identical counts against it."""
    import json as _json

    from click.testing import CliRunner

    from eagle2_cli.main import cli

    js = tmp_path / "c.json"
    r = CliRunner().invoke(cli, ["compare", "--model", tiny_model_dir, "--draft", tiny_head_dir, "--device", "cpu", "-n", "6",
                                 "--limit", "4", "--batch-size", "3", "--against", "batch:2x1,batch:4x3", "--json", str(js), "--no-plain"])
    assert r.exit_code == 0, r.output + str(r.exception)
    assert "batch 3" in r.output and "batch 2, plain" in r.output and "batch 4, tree 3" in r.output
    d = _json.loads(js.read_text())
    methods = d["methods"] if "methods" in d else d
    rows = {k: v for k, v in methods.items() if isinstance(v, dict) and "batch_plan" in v}
    assert set(rows) >= {"eagle2", "batch:2x1", "batch:4x3"}
    assert rows["batch:2x1"]["batch_plan"]["tree_tokens"] == 1
    for name in rows:
        assert methods[name]["identical"] == 4, (name, methods[name])


def _figures(d: dict, names: list[str]) -> list[set[str]]:
    """Every figure the compare table shows, as it formats them, from the JSON of the same run:
    each as the set of texts it can have (the JSON rounds the value the table formatted)."""
    def fmt(v: float, digits: int, spec: str) -> set[str]:
        half = 0.5 * 10 ** -digits
        return {format(v + e, spec) for e in (-half, 0.0, half)}

    figs = []
    for name in names:
        m = d[name]
        figs.append(fmt(m["tokens_per_s"], 3, ".1f"))
        for key in ("speedup", "speedup_over_plain"):
            if m.get(key) is not None:
                figs.append({x + "x" for x in fmt(m[key], 4, ".2f")})
        if "tau" in m:
            figs.append(fmt(m["tau"], 4, ".2f"))
        if m.get("identical") is not None:
            figs.append({f"{m['identical']}/{d['prompts']}"})
    return figs


@pytest.mark.parametrize("columns", ["80", "40", None])  # a terminal of 80, a narrow one, and a pipe or log
def test_compare_table_shows_every_figure_whole(monkeypatch, tmp_path, tiny_model_dir, tiny_head_dir, columns):
    """In 80 columns the table fits with nothing cut; narrower, one line per method;
    piped, the table whole (Rich would otherwise assume 80 columns and cut every number)."""
    if columns:
        monkeypatch.setenv("COLUMNS", columns)
    else:
        monkeypatch.delenv("COLUMNS", raising=False)
    out = tmp_path / "c.json"
    r = CliRunner().invoke(cli, ["compare", "--vanilla", "--dataset", "mt-bench", "--limit", "2", "--json", str(out),
                                 "--warmup-tokens", "0", "--against", "tree:6/2/3"] + model_args(tiny_model_dir, tiny_head_dir))
    assert r.exit_code == 0, r.output + r.stderr
    d = json.loads(out.read_text())
    text = r.stdout
    assert "…" not in text and "..." not in text, text
    for fig in _figures(d, ["vanilla", "plain", "eagle2", "tree:6/2/3"]):
        assert any(f in text for f in fig), (fig, text)
    for name in ("eagle2", "tree:6/2/3"):  # acceptance by depth, below the table (none where nothing was accepted)
        accept = " ".join(f"{a:.2f}" for a in d[name]["acceptance_by_depth"])
        flat = " ".join(text.split())  # a narrow terminal wraps the line (a merged tree's path may run deep)
        assert (f"acceptance by depth, {name}: {accept}" in flat) == bool(accept), text
    table = text.split("\nms: ")[0].splitlines()[1:]  # the title and the lines after the table may wrap
    if columns == "80":
        assert max(map(len, table)) <= 80 and any("tok/s" in x and "tau" in x for x in table), text
    elif columns == "40":
        assert any(x.startswith("eagle2: tok/s ") for x in table), text
    else:
        assert any("tok/s" in x and "tau" in x and "identical" in x for x in table), text


def test_tune_tables_fit_80_columns():
    """`tune`'s three tables at 80 columns: every figure whole (the batched one is the widest)."""
    import io

    from rich.console import Console

    from eagle2_cli.tune_cmd import batch_table, products_table, verify_table
    from eagle2_core.costs import BATCH_TREES, BatchCosts, CostProfile

    bc = BatchCosts({}, {(b, n): 1234.5 + b * n for b in (1, 8, 32, 128) for n in BATCH_TREES}, {b: 345.6 for b in (1, 8, 32, 128)})
    est = {(b, n): 1000.0 + b for b in (1, 8, 32, 128) for n in BATCH_TREES}

    class Prof:
        key = {"device_name": "AMD EPYC 9R14 96-Core Processor", "device": "cpu", "threads": 2, "dtype": "torch.float32"}
        verify_ms = {n: 10.0 + n for n in (1, 2, 4, 8, 16, 32, 64)}
        products = {"49152x576": {r: {"linear": 12.34, "packed": 23.45, "stream": 34.56, "transposed": 45.67} for r in (1, 4, 16, 23)},
                    "1536x576": {r: {"linear": 1.23, "packed": 2.34, "stream": 3.45, "transposed": 4.56} for r in (1, 4)}}

        class plan:
            kernels = {"49152x576": {b: "stream" for b in range(64)}, "1536x576": {b: "packed" for b in range(64)}}

    assert CostProfile  # the profile's fields read above are the ones tune_cmd uses
    for table, figs in ((verify_table(Prof), ["74.0", "6.73"]), (products_table(Prof), ["45.67", "4.56", "49152x576"]),
                        (batch_table(bc, est, 3, 2), ["2002", "1128", "346"])):
        buf = io.StringIO()
        Console(file=buf, width=80, color_system=None).print(table)
        text = buf.getvalue()
        assert "…" not in text and max(map(len, text.splitlines()[1:])) <= 80, text
        for fig in figs:
            assert fig in text, (fig, text)


def test_stats_panel_at_80_columns_keeps_every_figure():
    import io

    from rich.console import Console

    from eagle2_cli.ui import stats_panel
    from eagle2_core.events import Summary

    s = Summary()
    s.new_tokens, s.cycles, s.target_forwards, s.wall_s = 12345, 6789, 6790, 123.4
    s.accepted_hist = [4321, 2109, 876, 54, 3, 2, 1, 1, 1]
    buf = io.StringIO()
    Console(file=buf, width=80, color_system=None).print(stats_panel(s, 12.3, 3.456, "vs vanilla generate on the same prompt",
                                                                     extra="3 answers this session"))
    text = buf.getvalue()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80, text
    figs = [f"{s.tau:.2f}", "12.3", f"{s.tokens_per_s:.1f}", "3.46x", "12345", "6789", "3 answers"]
    for fig in figs + [f"{a:.2f}" for a in s.acceptance_by_depth]:
        assert fig in text, (fig, text)
