"""Input parsing, prompt building, resume bookkeeping and statistics behind the CLI (no decoding)."""
from __future__ import annotations

import gzip
import json

import pytest

from eagle2_core.batch import prepare_output
from eagle2_core.chat import IncrementalDetokenizer, LiveStats, apply_setting
from eagle2_core.datasets import dataset_items
from eagle2_core.events import GenerationSettings, StepEvent, Summary
from eagle2_core.prompts import InputError, apply_overrides, encode_chat, ident, load_chat_template, parse_line, read_prompt_file
from eagle2_core.stats import Comparison, MethodRun, acceptance_rate, first_difference
from eagle2_core.treesettings import TreeSettings


def test_parse_all_formats():
    a = parse_line('{"id": "a", "prompt": "Hi", "max_new_tokens": 5, "stop": "x"}', 1)
    assert (a.key, a.id, a.messages, a.overrides) == ("id", "a", [{"role": "user", "content": "Hi"}], {"max_new_tokens": 5, "stop_strings": ("x",)})
    m = parse_line('{"id": 2, "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]}', 2)
    assert m.messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    q = parse_line('{"question_id": 81, "category": "writing", "turns": ["t1", "t2"]}', 3)
    assert q.multi_turn and q.key == "question_id" and q.followups == ["t2"] and q.category == "writing"
    o = parse_line('{"custom_id": "r1", "method": "POST", "body": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 7, "temperature": 0.5}}', 4)
    assert o.key == "custom_id" and o.overrides == {"max_new_tokens": 7, "temperature": 0.5}
    noid = parse_line('{"prompt": "p"}', 9)
    assert (noid.key, noid.id) == ("line", 9)
    g = apply_overrides(GenerationSettings(max_new_tokens=100), o.overrides)
    assert g.max_new_tokens == 7 and g.temperature == 0.5


@pytest.mark.parametrize("text,field,key", [
    ("{not json", None, "line"),
    ('["a"]', None, "line"),
    ('{"id": "x"}', "prompt", "id"),
    ('{"id": "x", "prompt": 3}', "prompt", "id"),
    ('{"id": "x", "prompt": ""}', "prompt", "id"),
    ('{"id": 1.5, "prompt": "p"}', "id", "line"),
    ('{"id": "x", "messages": "hi"}', "messages", "id"),
    ('{"id": "x", "messages": [{"role": "bot", "content": "c"}]}', "messages[0].role", "id"),
    ('{"id": "x", "messages": [{"role": "user"}]}', "messages[0].content", "id"),
    ('{"id": "x", "prompt": "p", "temperature": "hot"}', "temperature", "id"),
    ('{"id": "x", "prompt": "p", "max_new_tokens": -1}', "max_new_tokens", "id"),
    ('{"id": "x", "prompt": "p", "top_p": 0}', "top_p", "id"),
    ('{"question_id": 1, "turns": ["ok", 5]}', "turns[1]", "question_id"),
    ('{"custom_id": "c", "body": {"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}}', "body.max_tokens", "custom_id"),
    ('{"custom_id": "c", "body": {}}', "body.messages", "custom_id"),
])
def test_parse_errors_name_the_field(text, field, key):
    with pytest.raises(InputError) as ei:
        parse_line(text, 7)
    e = ei.value
    e.path = "in.jsonl"
    assert e.field == field and e.line == 7
    assert e.describe().startswith("in.jsonl:7:")
    if field:
        assert repr(field) in e.describe()
    rec = e.record()
    assert "error" in rec and (key in rec)


def test_read_prompt_file_gz_and_duplicates(tmp_path):
    p = tmp_path / "in.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write('{"id": 1, "prompt": "a"}\n\n{"id": 1, "prompt": "b"}\n{"id": 2, "prompt": "c"}\n')
    out = list(read_prompt_file(str(p)))
    assert [type(x).__name__ for x in out] == ["PromptItem", "InputError", "PromptItem"]
    assert out[1].line == 3 and "duplicate" in out[1].message
    with pytest.raises(FileNotFoundError):
        list(read_prompt_file(str(tmp_path / "missing.jsonl")))


def test_encode_chat_template_system_and_fallback(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    msgs = [{"role": "user", "content": "Hi"}]
    ids = encode_chat(tok, msgs, system_prompt="Be brief.")
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}ANSWER:")
    assert tok.decode(encode_chat(tok, msgs, chat_template=load_chat_template(str(tpl)))) == "[user] Hi\nANSWER:"
    js = tmp_path / "tokenizer_config.json"
    js.write_text(json.dumps({"chat_template": "Q: {{ messages[-1]['content'] }} A:"}))
    assert tok.decode(encode_chat(tok, msgs, chat_template=load_chat_template(str(js)))) == "Q: Hi A:"
    tok.chat_template = None
    assert tok.decode(encode_chat(tok, msgs)) == "Hi"


def test_prepare_output_drops_failures_torn_lines_and_duplicates(tmp_path):
    p = tmp_path / "out.jsonl"
    p.write_text('{"id": "a", "text": "A"}\n{"id": "b", "error": "bad"}\n{"id": "a", "text": "again"}\n'
                 '{"line": 4, "text": "L"}\n{"question_id": 81, "turns": ["x", "y"]}\n{"id": "c", "te')
    done = prepare_output(str(p))
    assert done == {ident("id", "a"), ident("line", 4), ident("question_id", 81)}
    lines = p.read_text().splitlines()
    assert [json.loads(x).get("text") for x in lines] == ["A", "L", None]
    assert p.read_text().endswith("\n")
    assert prepare_output(str(tmp_path / "none.jsonl")) == set()


def test_apply_setting():
    gen, tree = GenerationSettings(), TreeSettings()
    gen, tree, key = apply_setting(gen, tree, "temperature=0.7")
    assert key == "temperature" and gen.temperature == 0.7
    gen, tree, key = apply_setting(gen, tree, "tree-top-k=7")
    assert key == "tree_top_k" and tree.top_k == 7 != TreeSettings().top_k
    gen, tree, _ = apply_setting(gen, tree, "shape=chain")
    assert tree.shape == "chain"
    gen, tree, _ = apply_setting(gen, tree, "seed=none")
    assert gen.seed is None
    gen, tree, _ = apply_setting(gen, tree, "total_tokens=auto", auto_max=16)
    assert tree.budget == "auto" and tree.total_tokens == 16 and tree.shape == "dynamic"
    from eagle2_core.chat import settings_view

    assert settings_view(gen, tree)["total_tokens"] == "auto (up to 16)"
    gen, tree, _ = apply_setting(gen, tree, "total_tokens=6")
    assert tree.budget == "constant" and tree.total_tokens == 6
    for bad in ("temperature", "nope=1", "depth=x", "draft_shape=round", "top_p=2", "temperature=-1", "total_tokens=1"):
        with pytest.raises(ValueError):
            apply_setting(gen, tree, bad)


def test_incremental_detokenizer_marks_draft_text(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "The sea is blue, ünïcødé ✓ and deep."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok)
    pieces = []
    events = [StepEvent(ids[:1], 0, 1, 0, 0)] + [StepEvent(ids[i:i + 3], 2, 10, 0, 0) for i in range(1, len(ids), 3)]
    live = LiveStats()
    for ev in events:
        pieces += detok.push(ev)
        live.update(ev)
    pieces.append((detok.flush(), False))
    assert "".join(p for p, _ in pieces) == text == detok.text
    assert any(d for _, d in pieces) and any(not d for _, d in pieces)
    assert live.summary.new_tokens == len(ids) and live.summary.target_forwards == len(events)


def test_comparison_statistics():
    def s(n, wall, hist=None):
        x = Summary(new_tokens=n, wall_s=wall, target_forwards=n, cycles=len(hist or []), accepted_hist=hist or [])
        return x

    items = [parse_line('{"id": 1, "prompt": "a", "category": "x"}', 1), parse_line('{"id": 2, "prompt": "b", "category": "y"}', 2)]
    runs = {"vanilla": MethodRun("vanilla", [s(10, 1.0), s(10, 2.0)], [[1, 2, 3], [4, 5]], speculative=False),
            "eagle2": MethodRun("eagle2", [s(10, 0.5, [1, 1]), s(10, 0.5, [0, 2])], [[1, 2, 3], [4, 6]])}
    comp = Comparison(items, runs, GenerationSettings())
    assert comp.speedup("eagle2") == pytest.approx((20 / 1.0) / (20 / 3.0))
    assert comp.mean_speedup("eagle2") == pytest.approx((2.0 + 4.0) / 2)
    assert comp.identical("eagle2") == 1 and comp.differences("eagle2")[0][1] == 1
    d = comp.to_json()
    assert d["prompts"] == 2 and d["identical"] == 1 and set(d["eagle2"]["per_category"]) == {"x", "y"}
    assert first_difference([1, 2], [1, 2]) is None and first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([], [1]) == 0
    assert acceptance_rate(Summary(cycles=2, accepted_hist=[0, 1, 1]), depth=3) == pytest.approx(0.5)



def test_without_generate_outputs_are_checked_against_our_plain_decoding():
    """`compare --no-vanilla` (a tree sweep) still checks every speculative method's answers,
    against eagle2's own plain decoding; speedups stay against `generate` only (none here)."""
    items = [parse_line('{"id": 1, "prompt": "a"}', 1), parse_line('{"id": 2, "prompt": "b"}', 2)]
    runs = {"plain": MethodRun("plain", [Summary(new_tokens=3, wall_s=1.0)] * 2, [[1, 2, 3], [4, 5]], speculative=False),
            "eagle2": MethodRun("eagle2", [Summary(new_tokens=3, wall_s=0.5)] * 2, [[1, 2, 3], [4, 6]]),
            "tree:4/2/2": MethodRun("tree:4/2/2", [Summary(new_tokens=3, wall_s=0.5)] * 2, [[1, 2, 3], [4, 5]])}
    comp = Comparison(items, runs, GenerationSettings(), baseline=None)
    assert comp.reference == "plain" and comp.identical("plain") is None
    assert comp.identical("eagle2") == 1 and comp.differences("eagle2") == [(items[1], 1)] and comp.identical("tree:4/2/2") == 2
    assert comp.speedup("eagle2") is None and comp.over_plain("eagle2") == pytest.approx(2.0)
    d = comp.to_json()
    assert d["identical"] == 1 and d["identical_to"] == "plain" and d["eagle2"]["first_difference"] == {"2": 1}
    with_generate = Comparison(items, {"vanilla": MethodRun("vanilla", runs["plain"].summaries, [[1, 2, 3], [4, 6]], speculative=False),
                                       **runs}, GenerationSettings())
    assert with_generate.reference == "vanilla" and with_generate.identical("eagle2") == 2 and with_generate.identical("plain") == 1
    # seeded sampling: eagle2's decoders against its plain decoding (one uniform per position);
    # generate, or a decoder that is not eagle2's (no backend), is not expected to match
    for r in runs.values():
        r.backend_used = "eager"
    sampled = Comparison(items, {"vanilla": with_generate.runs["vanilla"], **runs}, GenerationSettings(temperature=0.8, seed=3))
    assert sampled.reference == "plain" and sampled.identical("eagle2") == 1 and sampled.identical("tree:4/2/2") == 2
    assert sampled.identical("vanilla") is None and sampled.identical("plain") is None
    runs["tree:4/2/2"].backend_used = None
    assert sampled.identical("tree:4/2/2") is None
    unseeded = Comparison(items, runs, GenerationSettings(temperature=0.8), baseline=None)
    assert unseeded.reference is None and unseeded.identical("eagle2") is None and unseeded.to_json()["identical_to"] is None

def test_vendored_datasets():
    mt = dataset_items("mt-bench")
    assert len(mt) == 80 and all(it.category for it in mt) and mt[0].messages[0]["role"] == "user"
    he = dataset_items("humaneval")
    assert len(he) == 164 and he[0].id == "HumanEval/0" and "def " in he[0].messages[0]["content"]


def test_tree_option_help_states_the_real_defaults():
    # The CLI hard-codes these in --help (importing the engine would make --help slow); keep them true.
    from click.testing import CliRunner

    from eagle2_cli.main import cli

    text = " ".join(CliRunner().invoke(cli, ["generate", "--help"]).output.split())
    cpu, half, gpu = TreeSettings(), TreeSettings.cpu_half(), TreeSettings.gpu()
    assert f"incl. root [CPU {cpu.total_tokens}, CPU bf16 {half.total_tokens}, GPU {gpu.total_tokens}]" in text
    assert f"Longest draft path [CPU {cpu.depth}, CPU bf16 {half.depth}, GPU {gpu.depth}]" in text
    assert f"per expanded node [CPU {cpu.top_k}, CPU bf16 {half.top_k}, GPU {gpu.top_k}]" in text


def test_tree_defaults_follow_device_dtype_and_measured_costs():
    import torch

    from eagle2_core.costs import CostProfile

    # lm_head ms by rows: AVX512-BF16 Zen 5 as the issue measured it (1.72 ms one row, 2.55 ms 16
    # rows), and a CPU where every row costs in full
    flat = CostProfile(key={}, verify_ms={1: 1.0}, draft_ms={1: 1.0}, lm_head_ms={1: 1.72, 8: 2.2, 16: 2.55, 32: 3.6})
    linear = CostProfile(key={}, verify_ms={1: 1.0}, draft_ms={1: 1.0}, lm_head_ms={1: 2.0, 8: 16.0, 16: 32.0, 32: 64.0})
    assert flat.rows_are_cheap(16) and not linear.rows_are_cheap(16) and linear.rows_are_cheap(1)
    for costs in (None, flat, linear):
        assert TreeSettings.for_device("cpu", costs=costs) == TreeSettings.for_device("cpu", torch.float32, costs) == TreeSettings()
    # a bf16 target on a CPU gets the larger tree only where the measured lm_head rows are cheap
    assert TreeSettings.for_device("cpu", torch.bfloat16, flat) == TreeSettings.cpu_half() != TreeSettings()
    assert TreeSettings.for_device("cpu", torch.bfloat16, linear) == TreeSettings()
    assert TreeSettings.for_device("cpu", torch.bfloat16) == TreeSettings()  # nothing measured yet: the small tree
    assert TreeSettings.for_device("cuda:0", torch.bfloat16) == TreeSettings.for_device("cuda", torch.float32) == TreeSettings.gpu()


def test_greedy_acceptances_lm_head_plan_follows_each_trees_rows():
    """Where every lm_head row costs in full, a tree of a few rows still takes one product (two
    passes would read lm_head twice) and a larger tree its internal rows first; a plan set by
    hand (a GPU, the tests' two-pass mode) holds for every tree."""
    from eagle2_core.costs import CostProfile
    from eagle2_core.verifier import Verifier

    linear = CostProfile(key={}, verify_ms={1: 1.0}, draft_ms={1: 1.0}, lm_head_ms={1: 2.0, 8: 16.0, 16: 32.0, 32: 64.0})
    v = Verifier.__new__(Verifier)
    v.one_product, v.cheap = None, linear.rows_are_cheap
    assert [v.one_product_for(r) for r in (1, 2, 3, 4, 8, 16)] == [True, True, True, False, False, False]
    for forced in (True, False):
        v.one_product = forced
        assert {v.one_product_for(r) for r in (1, 3, 16)} == {forced}
