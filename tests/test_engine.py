"""The decoding engine (engine.py, cycle.py, kvcache.py): one cycle with a batch dimension, live and fixed modes, exact.

On the tiny targets of the identity tests (Llama, Qwen2, Mistral with a sliding window, Gemma 3
hybrid; vocabulary 12, context 40) with a draft head fitted to each, and a Qwen2 of 8 layers with
an EAGLE-3 head drafting over a pruned vocabulary:
  * one parametrised identity suite: greedy output equals `generate` for every case of
    `build_cases` (mixed prompt lengths, EOS at different cycles, sequences running into the
    context limit, a prompt that already fills it), all queued on B = 1, 3, 8 rows, so rows are
    refilled mid-run and the batch shrinks at the end; live mode (B = 1 live is
    test_decoder_identity's), fixed mode (fixed tree, capacity buckets), and at B = 3 the
    per-cycle budget, the two-pass lm_head plan and EAGLE-1's static tree (plain batches, N = 1:
    with the processors and sampling below);
  * fixed mode captured by torch.compile (aot_eager, Llama, B = 3 then 1): identical, one
    compile per (batch, capacity) shape, none after;
  * per-row logits processors and stop strings, each row with its own settings;
  * batch composition never changes an answer (alone, beside an idle row, with mates, joining mid-run);
  * a seeded sample is the same at B = 1 and 3, for every tree size, live or fixed, drafted or plain;
  * a fixed-mode cycle at B = 1 and B = 4 dispatches the same ops whatever was accepted and reads
    the host nowhere but its one designated read (`Cycle.read_back`);
  * the KV cache: rows, commit, grow, compact, crop, copy_row, and a committed path equals the sequential cache;
  * the batch-size plan follows the measured costs; a random head stops drafting (per-cycle budget).
"""
from __future__ import annotations

import collections
import dataclasses
import random

import pytest
import torch

from eagle2_core import DraftHead, Engine, GenerationSettings, HeadSpec, TreeSettings
from eagle2_core.costs import BatchCosts, CostProfile
from eagle2_core.costs import plan, prior_expected
from eagle2_core.engine import Cycle, KVCache, Request, Slot, bucket, num_cache_layers
from eagle2_core.events import StopChecker
from eagle2_core.opcount import OpCounter, counting, cycle_ops
from eagle2_core.target import TargetRunner
from eagle2_core.tree import batch_trees, causal_rows, windowed

from conftest import CORE_ARCHS
from test_decoder_identity import MAXPOS, SHAPES, VOCAB, build_cases, check_summary, reference
from test_eagle3 import DRAFT_IDS, LAYERS

TREE = SHAPES["dynamic"]  # 12 nodes, depth 4, top-k 3
# Made-up costs, so no test measures a profile: rows nearly free (lm_head in one product), and
# (test_budget's) a step after 4 rows, which makes the per-cycle budget vary its trees.
FLAT = CostProfile(key={}, verify_ms={1: 10.0, 16: 12.0}, draft_ms={1: 1.0, 4: 1.0})
STEP = CostProfile(key={}, verify_ms={1: 10.0, 4: 10.5, 5: 13.0, 12: 14.0}, draft_ms={1: 1.0, 4: 1.0})
ENVS = CORE_ARCHS + ("eagle3",)  # "eagle3": an 8-layer Qwen2 with an EAGLE-3 head over DRAFT_IDS (6 and 9 never drafted)

_ENVS: dict = {}


def make_env(name: str, tiny_lm, fitted_head) -> dict:
    """Model, head and greedy cases, queued in a shuffled order with the longest answer last (so
    the batch shrinks at the end); built once per session (the fits are memoised in conftest)."""
    if name not in _ENVS:
        if name == "eagle3":
            model = tiny_lm("qwen2", vocab_size=VOCAB, max_position_embeddings=MAXPOS, num_layers=LAYERS)
            head = fitted_head(model, arch="eagle3", draft_ids=DRAFT_IDS, steps=200)  # test_eagle3's fit
        else:
            model = tiny_lm(name, vocab_size=VOCAB, max_position_embeddings=MAXPOS)
            head = fitted_head(model)
        cases = build_cases(model, seed=5000 + ENVS.index(name))
        order = list(range(len(cases)))
        random.Random(ENVS.index(name)).shuffle(order)
        longest = max(order, key=lambda j: len(cases[j]["ref"]))
        order.sort(key=lambda i: i == longest)
        _ENVS[name] = dict(name=name, model=model, head=head, cases=[cases[i] for i in order])
    return _ENVS[name]


@pytest.fixture(scope="module", params=ENVS)
def env(request, tiny_lm, fitted_head):
    return make_env(request.param, tiny_lm, fitted_head)


@pytest.fixture(scope="module")
def llama(tiny_lm, fitted_head):
    return make_env("llama", tiny_lm, fitted_head)


def make_engine(model, head, mode: str, batch: int, tree: TreeSettings = TREE, **kw) -> Engine:
    """live: the CPU default cycle (constant budget here); fixed: graph mode, uncaptured unless
    `compile`; auto: the per-cycle budget on STEP's costs; two-pass: live with internal lm_head
    rows first; static, chain: live with EAGLE-1's static tree or a chain; plain: no head (N = 1)."""
    if mode in ("static", "chain"):
        mode, tree = "live", SHAPES[mode]
    if mode == "plain":
        return Engine(model, None, batch=batch, **kw)
    if mode in ("mixed", "headfree", "mixed-two-pass"):  # the head-free draft sources (sources.py), with the head or alone
        engine = Engine(model, None if mode == "headfree" else head, tree=dataclasses.replace(tree, budget="auto"), costs=STEP,
                        batch=batch, sources=("head", "recycle", "match"), **kw)
        engine.policy.costs.frozen = True
        engine.one_product = mode != "mixed-two-pass"
        return engine
    if mode == "auto":
        engine = Engine(model, head, tree=dataclasses.replace(tree, budget="auto"), costs=STEP, batch=batch, **kw)
        engine.policy.costs.frozen = True  # the tiny model's own timings would replace the cost step
        return engine
    engine = Engine(model, head, tree=tree, costs=FLAT, batch=batch, graph=mode == "fixed", **kw)
    engine.one_product = mode != "two-pass"
    return engine


def requests(cases) -> collections.deque:
    return collections.deque(Request(i, c["ids"], GenerationSettings(max_new_tokens=c["n"], eos_token_ids=c["eos"]))
                             for i, c in enumerate(cases))


def run_all(engine: Engine, reqs) -> dict:
    """key -> (tokens, summary) for every request of `reqs`."""
    out = {}
    engine.run(collections.deque(reqs), lambda key, tokens, summary: out.__setitem__(key, (tokens, summary)))
    return out


def accepted_hist(out: dict) -> collections.Counter:
    return collections.Counter(a for _, s in out.values() for a, n in enumerate(s.accepted_hist) for _ in range(n))


# -- identity ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode,batch", [("live", 3), ("live", 8), ("fixed", 1), ("fixed", 3), ("fixed", 8),
                                        ("auto", 3), ("two-pass", 3), ("static", 3), ("mixed", 1), ("mixed", 3),
                                        ("mixed-two-pass", 3), ("headfree", 1), ("headfree", 3)])
def test_greedy_identity(env, mode, batch, monkeypatch):
    """Every case queued on `batch` rows: each answer, summary and finish reason is `generate`'s."""
    max_pos = []  # no position at or beyond max_position_embeddings is ever computed
    real_forward = TargetRunner.body_forward

    def forward(self, tokens, positions, *args):
        max_pos.append(int(positions.max()))
        return real_forward(self, tokens, positions, *args)

    monkeypatch.setattr(TargetRunner, "body_forward", forward)
    admitted, steps = [], []  # per cycle: (requests admitted so far, busy rows, rows)
    real_admit, real_step = Cycle.admit, Cycle.step
    monkeypatch.setattr(Cycle, "admit", lambda self, *a, **k: admitted.append(1) or real_admit(self, *a, **k))
    monkeypatch.setattr(Cycle, "step", lambda self: steps.append((len(admitted), self.rows.busy, self.rows.batch)) or real_step(self))
    cases = env["cases"]
    assert len(cases) > 2 * batch  # more prompts than rows: rows are refilled mid-run
    engine = make_engine(env["model"], env["head"], mode, batch)
    out = run_all(engine, requests(cases))
    bad = [(c["kind"], c["ids"], c["eos"], out[i][0], c["ref"]) for i, c in enumerate(cases) if out[i][0] != c["ref"]]
    hist, sizes = accepted_hist(out), engine.stats["tree_sizes"]
    print(f"\n[engine] {env['name']:7s} {mode:8s} B={batch}: {len(cases) - len(bad)}/{len(cases)} identical, "
          f"accepted {dict(sorted(hist.items()))}, tree sizes {dict(sorted(sizes.items()))}")
    assert not bad, bad[:2]
    for i, c in enumerate(cases):
        check_summary(out[i][1], out[i][0], c)
    assert max(max_pos) == MAXPOS - 1  # reached (a prompt one short of the limit), never exceeded
    if batch > 1:  # idle rows were dropped once the queue ran dry: no cycle ran half idle after the last admission
        dry = [(busy, rows) for n, busy, rows in steps if n == len(admitted)]
        assert dry and all(busy > rows // 2 for busy, rows in dry), dry
    if mode == "plain":
        assert set(sizes) == {1} and set(hist) == {0}
    else:
        assert max(hist) >= 2  # multi-token commits
        if mode not in ("mixed", "headfree", "mixed-two-pass"):  # (the tiny cases repeat enough that copies may never all miss)
            assert hist[0] > 0  # and full rejections both happened
    if mode in ("auto", "mixed", "headfree", "mixed-two-pass"):
        assert len(sizes) > 1  # the size was chosen per cycle, not fixed
    elif mode != "plain":
        assert set(sizes) == {SHAPES.get(mode, TREE).total_tokens}  # every cycle verified the whole tree
    if env["name"] == "eagle3":  # the layer hooks live for a run only
        assert all(not layer._forward_pre_hooks for layer in env["model"].get_decoder().layers)


def test_captured_cycle_is_identical_and_compiles_once_per_shape(tiny_lm, fitted_head, monkeypatch):
    """aot_eager runs Dynamo's full-graph capture and AOT autograd's functionalisation, as the
    GPU backends do, without code generation. B = 3 decodes the queue (the batch shrinks to the
    bucket of 1 at the end), then B = 1 case by case, as a chat does (the capacity bucket grows between prompts;
    the first prompt is one token, so the head's cache is allocated at its admission, not by a draft:
    every draft runs captured). Each (batch, capacity) shape compiles draft and verify once, whichever
    engine met it first, and a second pass over every case recompiles nothing."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    e = make_env("llama", tiny_lm, fitted_head)
    chat = [dict(ids=[3], n=6, eos=(), ref=reference(e["model"], [3], 6, ()))] + e["cases"]  # a one-token prompt first
    shapes = set()
    real_step = Cycle.step
    monkeypatch.setattr(Cycle, "step", lambda self: shapes.add((self.rows.batch, self.rows.capacity)) or real_step(self))
    drafts = []  # per draft: whether it ran the captured function
    real_call = Cycle._call

    def call(self, stage, fn, *args):
        if stage == "draft":
            drafts.append(getattr(fn, "__func__", None) is not Cycle.draft_fn)
        return real_call(self, stage, fn, *args)

    monkeypatch.setattr(Cycle, "_call", call)
    torch._dynamo.reset()
    counters.clear()
    engines = {b: make_engine(e["model"], e["head"], "fixed", b, compile="aot_eager") for b in (3, 1)}

    def decode_all(batch):
        if batch == 1:
            return [engines[1].generate(c["ids"], GenerationSettings(max_new_tokens=c["n"], eos_token_ids=c["eos"]))[0]
                    for c in chat] == [c["ref"] for c in chat]
        out = run_all(engines[3], requests(e["cases"]))
        return [out[i][0] for i in range(len(e["cases"]))] == [c["ref"] for c in e["cases"]]

    for b in (3, 1):
        assert decode_all(b), b
        assert engines[b].cycle.backend == "aot_eager" and engines[b].capture_failure is None, engines[b].capture_failure
    graphs = counters["stats"]["unique_graphs"]
    print(f"\n[capture] llama: shapes {sorted(shapes)}, {graphs} graphs")
    assert {(3, 128), (1, 128), (1, 64)} <= shapes and graphs == 2 * len(shapes)  # draft and verify, once per shape
    assert drafts and all(drafts)  # the one-token prompt's first draft included
    ptrs = [layer.keys.data_ptr() for layer in engines[1].cycle.rows.cache.layers]
    cycle3 = engines[3].cycle
    assert cycle3.rows.batch < 3  # compacted at the end of the queue
    with torch._dynamo.config.patch(error_on_recompile=True):
        for b in (3, 1):
            assert decode_all(b), b
    assert counters["stats"]["unique_graphs"] == graphs and engines[3].cycle.backend == engines[1].cycle.backend == "aot_eager"
    assert [layer.keys.data_ptr() for layer in engines[1].cycle.rows.cache.layers] == ptrs  # B = 1 keeps its cycle: captured inputs never move
    assert engines[3].cycle is cycle3  # a compacted cycle is widened again for the next run, not rebuilt


# -- per-row settings: processors, stop strings -------------------------------------------------

PROCESSED = [dict(repetition_penalty=1.3, no_repeat_ngram_size=3), dict(no_repeat_ngram_size=2), {}]


def test_logits_processors_per_row_match_generate(llama):
    """Rows with a repetition penalty and no-repeat n-grams, rows with n-grams only and plain
    greedy rows share batches: each equals `generate` given the same settings (the processed rows
    run their host-side steps, the others stay on the greedy path)."""
    model, head = llama["model"], llama["head"]
    rng = random.Random(11)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 10))] for _ in range(9)]
    settings = [PROCESSED[i % 3] for i in range(len(prompts))]
    refs = []
    for p, kw in zip(prompts, settings):
        x = torch.tensor([p])
        refs.append(model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=15, do_sample=False, pad_token_id=0,
                                   eos_token_id=None, **kw)[0, len(p):].tolist())
    bare = [reference(model, p, 15, ()) for p in prompts]
    assert sum(r != b for r, b in zip(refs, bare)) >= 3  # the processors do change the answers
    reqs = [Request(i, p, GenerationSettings(max_new_tokens=15, eos_token_ids=(), **kw))
            for i, (p, kw) in enumerate(zip(prompts, settings))]
    for mode, batch in (("live", 3), ("two-pass", 3), ("fixed", 3), ("live", 8), ("plain", 3)):
        out = run_all(make_engine(model, head, mode, batch), reqs)
        assert [out[i][0] for i in range(len(prompts))] == refs, (mode, batch)
        if mode != "plain":
            assert max(accepted_hist({i: out[i] for i in range(0, len(prompts), 3)})) >= 2  # multi-token paths under processors


class LetterTokenizer:
    """Token i decodes to the letter 'a' + i: what StopChecker needs of a tokenizer for stop strings."""
    eos_token_id = None

    def get_vocab(self) -> dict:
        return {}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(97 + int(i)) for i in ids)


def test_stop_strings_cut_each_row_where_its_text_completes(llama):
    """Each row stops right after the token that completes one of its stop strings (taken from its
    own greedy answer, so it does occur, often inside a cycle's accepted tokens); rows whose
    strings never occur run to their length."""
    model, head, tok = llama["model"], llama["head"], LetterTokenizer()
    rng = random.Random(3)
    cases = [c for c in llama["cases"] if c["kind"] == "random" and len(c["ref"]) >= 6][:8]
    reqs, want = [], []
    for i, c in enumerate(cases):
        text = tok.decode(c["ref"])
        if i % 4 == 3:
            stops, cut = ("zz",), len(c["ref"])  # never emitted (no token decodes to 'z')
        else:
            j = rng.randrange(len(text) - 2)
            stops = (text[j : j + 2], text[j + 1 : j + 4]) if i % 2 else (text[j : j + 2],)
            cut = next(k for k in range(1, len(text) + 1) if any(s in text[:k] for s in stops))
        reqs.append(Request(i, c["ids"], GenerationSettings(max_new_tokens=c["n"], eos_token_ids=(), stop_strings=stops)))
        want.append(c["ref"][:cut])
    assert sum(len(w) < len(c["ref"]) for w, c in zip(want, cases)) >= 4
    for mode, batch in (("live", 3), ("fixed", 3)):
        out = run_all(make_engine(model, head, mode, batch, tokenizer=tok), reqs)
        assert [out[i][0] for i in range(len(cases))] == want, mode
        assert [out[i][1].finish_reason for i in range(len(cases))] == ["stop" if len(w) < len(c["ref"]) else "length"
                                                                       for w, c in zip(want, cases)]


# -- batch composition -----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["live", "fixed"])
def test_batch_composition_never_changes_an_answer(llama, mode):
    model, head = llama["model"], llama["head"]
    rng = random.Random(7)
    probe = [rng.randrange(VOCAB) for _ in range(6)]
    ref = reference(model, probe, 20, ())
    short = [[rng.randrange(VOCAB) for _ in range(2)] for _ in range(5)]
    long = [[rng.randrange(VOCAB) for _ in range(25)] for _ in range(5)]
    layouts = {
        "alone": [probe],
        "two of three rows": [short[0], probe],  # an idle row beside them from the start
        "short mates": short[:2] + [probe] + short[2:],
        "long mates": long[:3] + [probe],
        "joins mid-run": long + short + [probe],  # queued behind ten prompts: takes a freed row
    }
    for name, prompts in layouts.items():
        reqs = [Request(i, p, GenerationSettings(max_new_tokens=20 if p is probe else 3 + i, eos_token_ids=()))
                for i, p in enumerate(prompts)]
        out = run_all(make_engine(model, head, mode, 3), reqs)
        assert out[prompts.index(probe)][0] == ref, name
        assert all(len(out[i][0]) == min(3 + i, MAXPOS - len(p)) for i, p in enumerate(prompts) if p is not probe), name


# -- sampling -------------------------------------------------------------------------------------

def test_seeded_sample_is_the_same_at_every_batch_size_tree_and_mode(tiny_lm, fitted_head):
    """One sampling rule, one uniform per output position (accept.accept_sampling_keyed): a seeded
    answer (temperature 0.8) is the same at B = 1 and at B = 3 beside sampled and greedy mates,
    with trees of 4, 6 and 8 nodes, the per-cycle budget, fixed mode, and plain (no draft);
    seeds past 2^63 and negative ones included. Different seeds give different answers."""
    model = tiny_lm("llama", vocab_size=5, hidden_size=16, num_layers=1, max_position_embeddings=32, initializer_range=0.3,
                    logit_scale=1.0)
    head = fitted_head(model, steps=60)
    prompt = [1, 2, 3, 0]
    tree = lambda n: TreeSettings(total_tokens=n, depth=3, top_k=3)  # noqa: E731
    engines = {"B=1 live N=4": make_engine(model, head, "live", 1, tree(4)), "B=1 live N=8": make_engine(model, head, "live", 1, tree(8)),
               "B=1 auto": make_engine(model, head, "auto", 1, tree(8)), "B=1 fixed N=8": make_engine(model, head, "fixed", 1, tree(8)),
               "B=1 plain": make_engine(model, None, "plain", 1), "B=3 live N=6": make_engine(model, head, "live", 3, tree(6)),
               "B=3 fixed N=8": make_engine(model, head, "fixed", 3, tree(8)), "B=3 plain": make_engine(model, None, "plain", 3),
               # trees mixing the head's nodes with recycled and copied ones (sources.py), and head-free ones alone
               "B=1 mixed": make_engine(model, head, "mixed", 1, tree(8)), "B=3 mixed": make_engine(model, head, "mixed", 3, tree(8)),
               "B=1 head-free": make_engine(model, head, "headfree", 1, tree(8)),
               "B=3 head-free two-pass": make_engine(model, head, "mixed-two-pass", 3, tree(6))}
    seen = set()
    for seed in (7, 2**63 + 5, -3):
        g = GenerationSettings(max_new_tokens=12, temperature=0.8, seed=seed, eos_token_ids=())
        mates = [Request(1, [4, 4, 1], GenerationSettings(max_new_tokens=6, temperature=1.0, seed=101, eos_token_ids=())),
                 Request(2, [0, 2], GenerationSettings(max_new_tokens=14, eos_token_ids=())),  # greedy beside sampled rows
                 Request(3, [3], GenerationSettings(max_new_tokens=5, temperature=0.5, top_k=3, seed=103, eos_token_ids=()))]
        answers = {}
        for name, engine in engines.items():
            out = run_all(engine, mates[:1] + [Request(0, prompt, g)] + mates[1:] if name.startswith("B=3") else [Request(0, prompt, g)])
            answers[name] = tuple(out[0][0])
        assert len(set(answers.values())) == 1, (seed, answers)
        assert len(answers["B=1 live N=4"]) == 12
        seen.add(answers["B=1 live N=4"])
    assert len(seen) == 3


# -- host reads -----------------------------------------------------------------------------------

def batch_cycle_ops(engine: Engine, prompts, gen, cycles: int) -> list[dict]:
    """`opcount.cycle_ops` for a batch: per steady-state cycle of `engine.run` over `prompts`, the
    ops dispatched by stage, the host reads among them, and what each row accepted."""
    counter, out = OpCounter(), []
    real_step = Cycle.step

    def step(self):
        rows = real_step(self)
        out.append({"accepted": tuple(a for _, _, a in rows), "busy": self.rows.busy, "ops": dict(counter.ops),
                    "host_reads": {s: list(v) for s, v in counter.host_reads.items()}})
        counter.ops, counter.host_reads = {}, {}
        return rows

    Cycle.step = step
    try:
        with torch.no_grad(), counting(engine, counter):
            run = engine._run(collections.deque(Request(i, p, gen) for i, p in enumerate(prompts)))
            for _ in run:
                if len(out) > cycles:
                    break
            run.close()
    finally:
        Cycle.step = real_step
    return out[1:]  # the first cycle absorbs the prompts


@pytest.mark.parametrize("batch", [1, 4])
def test_a_fixed_cycle_dispatches_the_same_ops_and_reads_only_its_one_read(tiny_lm, fitted_head, batch, monkeypatch):
    """On a GPU every op is a launch and every host read a sync: a fixed-mode cycle (counted on the
    CPU by opcount.OpCounter) runs the same op sequence whatever each row accepted, with no host
    read but `Cycle.read_back`, once per cycle. The counter is shown to catch the reads of the
    live plans that have them (the per-cycle budget, the two-pass lm_head plan)."""
    model = tiny_lm("llama", vocab_size=VOCAB, max_position_embeddings=256)
    head = fitted_head(model)
    gen = GenerationSettings(max_new_tokens=120, eos_token_ids=())
    prompts = [[1, 5, 2, 7, 3], [4, 4], [0, 1, 2, 3, 4, 5, 6, 7], [9]][:batch]
    reads = []
    real_read = Cycle.read_back
    monkeypatch.setattr(Cycle, "read_back", lambda self, readout: reads.append(1) or real_read(self, readout))
    engine = make_engine(model, head, "fixed", batch)
    if batch == 1:
        fixed = cycle_ops(engine, prompts[0], gen, cycles=12)
    else:
        fixed = batch_cycle_ops(engine, prompts, gen, cycles=12)
        assert {c["busy"] for c in fixed} == {batch}
        assert any(len(set(c["accepted"])) > 1 for c in fixed)  # rows of one cycle accepted different counts
    assert len(fixed) == 12 and len(reads) == 13  # the designated read: once per cycle
    accepted = {c["accepted"] for c in fixed}
    assert len(accepted) >= 2, accepted  # cycles that accepted different numbers of tokens
    assert all(c["ops"] == fixed[0]["ops"] for c in fixed)  # the same op sequence, not just the same count
    assert all(not c["host_reads"] for c in fixed), fixed[0]["host_reads"]
    # The counter does see host reads: the drafting policy and the two-pass lm_head plan have them.
    live = [c for mode in ("auto", "two-pass")
            for c in (cycle_ops(make_engine(model, head, mode, 1), prompts[0], gen, cycles=3) if batch == 1
                      else batch_cycle_ops(make_engine(model, head, mode, batch), prompts, gen, cycles=3))]
    seen = {r for c in live for v in c["host_reads"].values() for r in v}
    assert "nonzero" in seen and len(seen) >= 2, seen
    print(f"\n[ops] B={batch}: fixed draft {len(fixed[0]['ops']['draft'])} verify {len(fixed[0]['ops']['verify'])} ops; "
          f"live host reads {sorted(seen)}")


# -- the KV cache ---------------------------------------------------------------------------------

def test_kv_cache_rows_commit_grow_and_compact():
    c = KVCache(num_layers=2, batch=3, capacity=8)
    lay, unused = c.layers
    cells = torch.arange(8).expand(3, 8)
    val = (100 * torch.arange(3)[:, None] + cells).float()             # row r, cell s holds 100 r + s
    kv = lambda v: v[:, None, :, None].expand(-1, 2, -1, 3).clone()   # noqa: E731  [B, heads, n, dim]
    c.cells, c.view = cells, 8
    keys, values = lay.update(kv(val), -kv(val))                       # every row at its own cells
    assert keys.shape == (3, 2, 8, 3) and torch.equal(keys[:, 0, :, 0], val) and torch.equal(values[:, 1, :, 2], -val)
    assert not unused.is_initialized
    c.row, c.cells, c.view = 1, torch.arange(3), 3                       # one row's prefill: that row only
    keys, values = lay.update(torch.full((1, 2, 3, 3), 7.0), torch.full((1, 2, 3, 3), -7.0))
    c.row = None
    assert keys.shape == (1, 2, 3, 3) and (keys == 7).all() and (values == -7).all()
    val[1, :3] = 7
    assert torch.equal(lay.keys[:, 0, :, 0], val) and torch.equal(lay.values[:, 1, :, 0], -val)
    assert lay.get_mask_sizes(5) == (3, 0) and lay.get_max_length() == 8
    with pytest.raises(RuntimeError, match="per row"):
        lay.get_seq_length()
    # commit: per row, cells src -> dst with overlapping ranges (the right side is gathered first)
    src = torch.tensor([[0, 2, 3, 5], [4, 5, 6, 7], [1, 1, 2, 6]])
    dst = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [2, 3, 4, 5]])
    want = val.clone()
    for r in range(3):
        want[r, dst[r]] = val[r, src[r]]
    c.commit(src, dst)
    assert torch.equal(lay.keys[:, 0, :, 0], want) and torch.equal(lay.values[:, 1, :, 1], -want)
    c.resize(20)                                                         # contents kept, zeros after
    assert c.capacity == 20 and lay.keys.shape[2] == 20 and not unused.is_initialized
    assert torch.equal(lay.keys[:, 0, :8, 0], want) and not lay.keys[:, :, 8:].any()
    c.compact(torch.tensor([2, 0]))                                      # rows 2 and 0, in that order
    assert c.batch == 2 and torch.equal(lay.keys[:, 0, :8, 0], want[[2, 0]]) and torch.equal(lay.values[:, 0, :8, 0], -want[[2, 0]])
    c.cells, c.view = torch.tensor([[8], [9]]), 10                        # the smaller batch writes on
    keys, _ = lay.update(torch.ones(2, 2, 1, 3), torch.ones(2, 2, 1, 3))
    assert keys.shape == (2, 2, 10, 3) and keys[0, 0, 8, 0] == 1 and keys[1, 0, 9, 0] == 1 and keys[0, 0, 9, 0] == 0
    assert (bucket(1), bucket(64), bucket(65), bucket(3, least=1), bucket(1, least=1)) == (64, 64, 128, 4, 1)
    c.resize(6)                                                          # shrunk: the first cells kept
    assert c.capacity == 6 and lay.keys.shape[2] == 6 and torch.equal(lay.keys[:, 0, :6, 0], want[[2, 0], :6])


def test_kv_cache_one_row_commit_moves_only_cells_out_of_place():
    """Live mode, one row (`start` set): the accepted path's cells land at start, start + 1, ...;
    cells already there are not copied, nor is the path's padding (the root again), and nothing
    else changes. A path down the tree's first nodes moves nothing at all."""
    c = KVCache(num_layers=2, batch=1, capacity=16)
    lay = c.layers[0]
    val = torch.arange(16).float()[None]
    kv = lambda v: v[:, None, :, None].expand(-1, 2, -1, 3).clone()   # noqa: E731
    c.cells, c.view = torch.arange(16)[None], 16
    lay.update(kv(val), -kv(val))
    c.start = 5  # the row's committed length: the tree's root at cell 5, its nodes after it
    calls = []
    real = torch.Tensor.index_copy_
    try:
        torch.Tensor.index_copy_ = lambda self, *a: calls.append(1) or real(self, *a)
        c.commit(torch.tensor([[5, 6, 7, 5, 5]]), 5 + torch.arange(5)[None])        # nodes 0, 1, 2 accepted: in place; padded with the root
        assert not calls and torch.equal(lay.keys[0, 0, :, 0], val[0])
        c.commit(torch.tensor([[5, 6, 9, 12, 5]]), 5 + torch.arange(5)[None])       # nodes 1, 4, 7: the last two move to cells 7 and 8
    finally:
        torch.Tensor.index_copy_ = real
    want = val[0].clone()
    want[7], want[8] = val[0, 9], val[0, 12]
    assert calls and torch.equal(lay.keys[0, 0, :, 0], want) and torch.equal(lay.values[0, 1, :, 2], -want)


def test_kv_cache_crop_and_copy_row_keep_the_buffers():
    """`copy_row` makes one row another's copy and `crop` zeroes a row past a length, every layer,
    other rows untouched, in place (a fixed-mode capture reads the same buffers); a layer never
    written stays unmade."""
    c = KVCache(num_layers=2, batch=3, capacity=6, static=True)
    lay, unused = c.layers
    val = (100 * torch.arange(3)[:, None] + torch.arange(6)).float()  # row r, cell s holds 100 r + s
    c.cells, c.view = torch.arange(6).expand(3, 6), 6
    lay.update(val[:, None, :, None].expand(-1, 2, -1, 3).clone(), -val[:, None, :, None].expand(-1, 2, -1, 3).clone())
    ptrs = (lay.keys.data_ptr(), lay.values.data_ptr())
    c.copy_row(0, 2)
    want = val.clone()
    want[2] = val[0]
    assert torch.equal(lay.keys[:, 0, :, 0], want) and torch.equal(lay.values[:, 1, :, 2], -want)
    c.crop(2, 4)
    want[2, 4:] = 0
    assert torch.equal(lay.keys[:, 1, :, 1], want) and torch.equal(lay.values[:, 0, :, 0], -want)
    c.crop(1, 0)  # a whole row
    want[1] = 0
    assert torch.equal(lay.keys[:, 0, :, 2], want) and torch.equal(lay.values[:, 1, :, 1], -want)
    assert (lay.keys.data_ptr(), lay.values.data_ptr()) == ptrs and not unused.is_initialized


def prefill_reference(run: TargetRunner, ids: torch.Tensor, layers: int):
    """The sequential cache: `ids` run causally into a fresh one-row cache; (cache, hidden)."""
    n = ids.numel()
    cache, pos = KVCache(layers, 1, n), torch.arange(n)
    cache.row, cache.cells, cache.view = 0, pos, n
    mask = run.masks(lambda w: windowed(causal_rows(pos[None], n), pos[None], pos[None], w))
    hidden, _ = run.body_forward(ids[None], pos[None], mask, cache, {}, None)
    return cache, hidden[0]


@pytest.mark.parametrize("arch", CORE_ARCHS)
def test_committed_paths_equal_the_sequential_cache(tiny_lm, arch):
    """Two rows with prefixes of different lengths (longer than the sliding windows; the second
    grows the cache, whose first row must survive), prefilled by `Cycle.admit`; a random 12-node
    tree per row verified in one forward (`Verifier.forward_tree`); `KVCache.commit` of a random
    root-to-node path per row: each row's keys and values, every layer, equal those of running its
    prefix + path tokens causally, and the path nodes' hidden states equal the sequential ones."""
    rng = random.Random(CORE_ARCHS.index(arch))
    model = tiny_lm(arch, vocab_size=VOCAB, max_position_embeddings=64)
    run = TargetRunner(model)
    layers = num_cache_layers(model.config)
    cycle = Cycle(run, None, TreeSettings(), batch=2, capacity=4)
    prefixes = [torch.tensor([rng.randrange(VOCAB) for _ in range(n)]) for n in (rng.randint(6, 9), rng.randint(24, 30))]
    with torch.no_grad():
        for b, p in enumerate(prefixes):
            stop = StopChecker(GenerationSettings(max_new_tokens=1), None, set(), 64, p.numel())
            cycle.admit(b, p.tolist(), Slot(key=b, stop=stop), lambda logits: 0)
            if b == 0:
                first = cycle.rows.capacity
        assert cycle.rows.capacity > first  # the second prompt grew the cache
        n = 12
        parents = torch.tensor([[-1] + [rng.randrange(i) for i in range(1, n)] for _ in range(2)])
        tokens = torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        depth, anc = batch_trees(parents, n - 1)
        hidden, _ = cycle.verifier.forward_tree(tokens, depth, anc, cycle.rows.state.seq_len)
        paths = []
        for b in range(2):
            node = max(range(n), key=lambda i: (int(depth[b, i]), rng.random())) if b == 0 else rng.randrange(n)
            path = [node]
            while parents[b, path[-1]] >= 0:
                path.append(int(parents[b, path[-1]]))
            paths.append(path[::-1])
        w = max(len(p) for p in paths)
        src = torch.tensor([p + [0] * (w - len(p)) for p in paths]) + cycle.rows.state.seq_len[:, None]
        cycle.rows.cache.commit(src, cycle.rows.state.seq_len[:, None] + torch.arange(w))
        for b, (prefix, path) in enumerate(zip(prefixes, paths)):
            seq = torch.cat([prefix, tokens[b, path]])
            ref, ref_hidden = prefill_reference(run, seq, layers)
            m = seq.numel()
            for got, want in zip(cycle.rows.cache.layers, ref.layers):
                torch.testing.assert_close(got.keys[b, :, :m], want.keys[0, :, :m], rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(got.values[b, :, :m], want.values[0, :, :m], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(hidden[b, path], ref_hidden[prefix.numel():], rtol=1e-4, atol=1e-5)
    print(f"\n[kvcache] {arch}: prefixes {[p.numel() for p in prefixes]}, kept paths {paths}")


# -- choosing by measured cost --------------------------------------------------------------------

def flat_costs(row_ms: float, base_ms: float = 10.0, draft_ms: float = 3.0) -> BatchCosts:
    """A made-up batch cost table: base + row_ms per row of B x N."""
    verify = {(b, n): base_ms + row_ms * b * n for b in (1, 2, 4, 8) for n in (1, 2, 3, 4, 6)}
    return BatchCosts(key={}, verify_ms=verify, draft_ms={b: draft_ms * b for b in (1, 2, 4, 8)})


def test_plan_follows_the_measured_costs():
    prior = [1.0, 1.6, 1.9, 2.1, 2.2, 2.3]
    b, n, table = plan(flat_costs(row_ms=8.0, base_ms=2.0), 32, prior)  # every row costs: plain, widest batch
    assert (b, n) == (8, 1), table
    b, n, _ = plan(flat_costs(row_ms=0.01, base_ms=50.0, draft_ms=0.1), 32, prior)  # rows nearly free: trees
    assert n >= 4 and b == 8
    b, n, _ = plan(flat_costs(row_ms=8.0), 3, prior)  # never more rows than prompts
    assert b <= 3
    assert plan(flat_costs(1.0), 32, prior, batch=4, tree=3)[:2] == (4, 3)


def test_prior_from_the_heads_metadata():
    class Evaluated:
        metadata = {"eval": {"acceptance_by_depth": [0.6, 0.5]}}

    class Random:
        metadata = {"random": True}

    assert prior_expected(Evaluated(), 4)[:3] == pytest.approx([1.0, 1.6, 1.9])
    assert prior_expected(Random(), 4) == [1.0] * 4 and prior_expected(None, 3) == [1.0] * 3
    assert prior_expected(object(), 5)[:4] == pytest.approx([1.0, 1.5, 1.65, 1.68])  # no evaluation: a cautious guess


@pytest.mark.parametrize("batch", [1, 3])
def test_a_random_head_is_left_out_and_stays_lossless(llama, batch):
    """An untrained head with the drafting policy: its drafts are rarely accepted, so the policy
    soon decodes plain on the measured cycle costs; the text is the target's throughout."""
    model = llama["model"]
    torch.manual_seed(0)
    head = DraftHead(HeadSpec.for_target(model.config)).bind(model)
    head.metadata = {"random": True}
    tree = TreeSettings(budget="auto", total_tokens=8, depth=3, top_k=2)
    engine = Engine(model, head, tree=tree, costs=CostProfile(key={}, verify_ms={1: 10.0, 8: 10.5}, draft_ms={1: 1.0, 2: 1.0}), batch=batch)
    cases = llama["cases"]
    out = run_all(engine, requests(cases))
    assert [out[i][0] for i in range(len(cases))] == [c["ref"] for c in cases]
    stats = engine.stats
    assert stats["arms"].get("plain", 0) > stats["cycles"] // 2, stats  # most cycles ran plain


@pytest.mark.parametrize("mode", ["live", "plain"])
def test_a_run_grows_its_cache_geometrically_and_gives_it_back(tiny_lm, fitted_head, monkeypatch, mode):
    """Live mode holds what the running rows reach, not what they may reach: the cache grows as
    rows grow, at least doubling each time (growing by each cycle's tokens would copy every K/V
    buffer every cycle), and shrinks once the long rows have left, here at the run's end."""
    e = make_env("llama", tiny_lm, fitted_head)
    sizes = []
    real = KVCache.resize
    monkeypatch.setattr(KVCache, "resize", lambda self, cap: sizes.append((self.capacity, cap)) or real(self, cap))
    engine = make_engine(e["model"], e["head"], mode, 3)
    cases = [c for c in e["cases"] if len(c["ids"]) < 8][:3]
    reqs = [Request(i, c["ids"], GenerationSettings(max_new_tokens=10**9, eos_token_ids=())) for i, c in enumerate(cases)]
    out = run_all(engine, reqs)
    assert all(len(ids) + len(out[i][0]) == MAXPOS for i, (ids) in enumerate(c["ids"] for c in cases))  # to the context's end
    grew = [(a, b) for a, b in sizes if b > a]
    assert grew and all(b >= 2 * a or b == engine.cycle.rows._capacity(MAXPOS) for a, b in grew)
    assert engine.cycle.rows.capacity < grew[-1][1] and engine.cycle.rows.cache.layers[0].keys.shape[2] == engine.cycle.rows.capacity


def test_queued_and_cancelled_requests_hold_no_cache_and_a_joining_request_widens_one_row(tiny_lm, fitted_head, monkeypatch):
    """A request waiting for a row (here one that may run to the context's end, then cancelled)
    reserves no cells; a request joining a one-row run gets one more row, not the engine's batch."""
    e = make_env("llama", tiny_lm, fitted_head)
    shapes = []
    real_step = Cycle.step
    monkeypatch.setattr(Cycle, "step", lambda self: shapes.append((self.rows.batch, self.rows.capacity)) or real_step(self))
    short = [c for c in e["cases"] if len(c["ids"]) < 8][:2]
    engine = make_engine(e["model"], e["head"], "live", 2)
    gen = GenerationSettings(max_new_tokens=4, eos_token_ids=())
    queue = collections.deque([Request(0, short[0]["ids"], gen), Request(1, short[1]["ids"], gen),
                               Request(2, short[0]["ids"], GenerationSettings(max_new_tokens=10**9, eos_token_ids=()))])
    ends = {key: ev.finish_reason for key, ev, tokens in engine.serve(queue, lambda q: {2} if shapes else set()) if tokens is not None}
    assert ends == {0: "length", 1: "length", 2: "cancelled"}
    assert max(cap for _, cap in shapes) < engine.cycle.rows._capacity(MAXPOS)
    wide = make_engine(e["model"], e["head"], "live", 4)
    shapes.clear()
    queue = collections.deque([Request(0, short[0]["ids"], GenerationSettings(max_new_tokens=20, eos_token_ids=()))])
    joined = []

    def poll(q):
        if shapes and not joined:
            joined.append(q.append(Request(1, short[1]["ids"], gen)))
        return set()

    assert len([1 for _, _, tokens in wide.serve(queue, poll) if tokens is not None]) == 2
    assert max(b for b, _ in shapes) == 2


def continuation(model, head, ids: list[int], n: int, sampled: bool) -> tuple[list[int], GenerationSettings]:
    """The target's own next `n` tokens after `ids` and the settings that give them: greedy
    (`generate`), or a seeded sample decoded plainly (the keyed rule makes every tree's answer
    this one)."""
    if not sampled:
        return reference(model, ids, n, ()), GenerationSettings(eos_token_ids=())
    g = GenerationSettings(max_new_tokens=n, temperature=0.7, seed=11, eos_token_ids=())
    return run_all(make_engine(model, head, "plain", 1), [Request(0, ids, g)])[0][0], g


@pytest.mark.parametrize("sampled", [False, True])
def test_the_acceptance_estimate_learns_from_every_grown_node_the_target_decided(tiny_lm, fitted_head, monkeypatch, sampled):
    """The acceptance estimate (what the policy ranks and sizes trees on) learns from every grown
    node whose fate given its parent the emitted tokens decide, verified or not: the parent's path
    is the target's tokens and the emitted tokens reach the node. Checked against the target's own
    continuation, greedy and sampled; from the verified nodes alone it would learn nothing of the
    nodes the policy leaves out, which is what it reads to leave them out."""
    from eagle2_core import sources as sources_mod

    env = make_env("llama", tiny_lm, fitted_head)
    model, head = env["model"], env["head"]
    ids, n_new = [3, 1, 4, 1, 5], 40
    ref, g = continuation(model, head, ids, n_new + 12, sampled)
    seen = []
    observe = sources_mod.DraftSources.observe

    def spy(self, rows, summaries, verified, emitted):
        got = observe(self, rows, summaries, verified, emitted)
        seen.append((self.last[0], emitted[0], verified, got))
        return got

    monkeypatch.setattr(sources_mod.DraftSources, "observe", spy)
    engine = make_engine(model, head, "mixed", 1)
    out = run_all(engine, [Request(0, ids, dataclasses.replace(g, max_new_tokens=n_new))])
    assert out[0][0] == ref[:n_new]
    nodes = accepted = verified = learned = learned_accepted = 0
    for tree, emitted, n, got in seen:
        verified += min(n, len(tree.tokens)) - 1
        learned, learned_accepted = learned + len(got), learned_accepted + sum(g for *_, g in got)
        for i in range(1, len(tree.tokens)):
            route, j = [], i
            while j > 0:
                route.append(tree.tokens[j])
                j = tree.parents[j]
            route = route[::-1]
            # decided given its parent: the parent's path is the target's, and the emitted tokens reach the node
            if route[:-1] == emitted[: len(route) - 1] and len(route) <= len(emitted):
                nodes, accepted = nodes + 1, accepted + (route[-1] == emitted[len(route) - 1])
    assert len(seen) >= 5 and nodes > 0
    assert (learned, learned_accepted) == (nodes, accepted)


@pytest.mark.parametrize("name", ["llama", "eagle3"])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_skipping_head_catches_up(tiny_lm, fitted_head, monkeypatch, name, batch):
    """The policy may leave the head out of any cycle. Pinned to skip stretches of cycles, the
    last cycle of the answer among them: the text is the target's, each skipped stretch is
    absorbed by the head's next draft (batch 1) or as it goes (batch 2), and the kept sequence (a
    chat's next turn reuses it) holds every head cell but the last pair's, the cells a head that
    never skipped holds. The same run's next request drafts with the head."""
    from eagle2_core.policy import Policy
    from eagle2_core.prefix import PrefixCache

    env = make_env(name, tiny_lm, fitted_head)
    model, head = env["model"], env["head"]
    ids = [3, 1, 4]
    ref = reference(model, ids, 30, ())
    asked: list[bool] = []

    def run(pin: bool, monkeypatch):
        monkeypatch.setattr(Policy, "head_drafts", lambda self, b: asked.append(len(asked) in (0, 3, 6) or not pin) or asked[-1])
        engine = make_engine(model, head, "mixed", batch, prefix_cache=PrefixCache(64))
        gen = GenerationSettings(max_new_tokens=30, eos_token_ids=())
        out = run_all(engine, [Request(0, ids, gen, keep=True)])
        return engine, out[0]

    engine, (tokens, summary) = run(True, monkeypatch)
    n_asked, skipped = len(asked), asked.count(False)
    asked.clear()
    never, _ = run(False, monkeypatch)
    assert tokens == ref and n_asked >= 5 and skipped >= n_asked - 3, (skipped, n_asked)
    (a,), (b,) = engine.prefix.entries.values(), never.prefix.entries.values()
    assert a.ids == b.ids and a.head_len == len(a.ids) - 1 >= b.head_len  # caught up: every pair but the last
    n = b.head_len
    for la, lb in zip(a.head, b.head):
        torch.testing.assert_close(la[0][..., :n, :], lb[0][..., :n, :], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(la[1][..., :n, :], lb[1][..., :n, :], rtol=1e-5, atol=1e-5)
    assert sum(summary.accepted_hist[1:]) > 0
    if batch > 1:
        return
    # the next request of a run whose last cycle skipped the head: its prompt is absorbed, it drafts
    monkeypatch.setattr(Policy, "head_drafts", lambda self, b: engine.cycle.rows.slots[0].key != 1)  # request 1 skips every cycle
    drafted = collections.Counter()
    c, real = engine.cycle, engine.cycle._draft  # the cycle (and its bound draft) outlive a run
    monkeypatch.setattr(c, "_draft", lambda *a: drafted.update([c.rows.slots[0].key]) or real(*a))
    gen = GenerationSettings(max_new_tokens=12, eos_token_ids=())
    out = run_all(engine, [Request(1, [2, 7], gen), Request(2, [5, 1, 6], gen)])
    assert out[1][0] == reference(model, [2, 7], 12, ()) and out[2][0] == reference(model, [5, 1, 6], 12, ())
    assert drafted[1] == 0 and drafted[2] >= 2
