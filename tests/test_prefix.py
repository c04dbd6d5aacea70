"""Kept sequences (prefix.py; engine.py's lookup, cycle.py's `admit` restoring them).

On a tiny Llama (vocabulary 12, context 128) with a head fitted to it:
  * a request continuing a kept one gives the same answer as without reuse, greedy and seeded
    sampling, live and fixed mode, one row and three (rows refilled mid-run, each reusing);
  * what is drafted after a reuse, every tree's tokens and parents, is what is drafted after a
    full prefill, and so are the path scores to within float32 rounding (a wrong head cache would
    change only these; one wrong head cell is caught);
  * the common prefix ending at every position of a kept sequence, and the restored length
    forced to every value from 1 to the most allowed: same answers, same trees;
  * eviction (least recently used, byte budget), superseded entries, an entry over the budget;
  * a stream closed between events (a chat's Ctrl-C) keeps what it emitted, with its cache;
  * Mistral and Gemma 3 (sliding windows) and an EAGLE-3 head reuse identically too;
  * chat: turns continue the ids seen (answers spliced in), prefill only what is new, /stats, /reset;
  * generate: an item's second turn restores its first (cached_tokens), batch 1 and 3;
  * a long prompt beside a decoding row is prefilled a chunk per cycle, with the same answers.
"""
from __future__ import annotations

import collections
import random

import pytest
import torch

from eagle2_core import Engine, GenerationSettings, TreeSettings
from eagle2_core.costs import CostProfile
from eagle2_core.cycle import Cycle
from eagle2_core.engine import Request
from eagle2_core.prefix import Kept, PrefixCache, common_prefix

VOCAB, MAXPOS = 12, 128
TREE = TreeSettings(shape="dynamic", total_tokens=12, depth=4, top_k=3)
FLAT = CostProfile(key={}, verify_ms={1: 10.0, 16: 12.0}, draft_ms={1: 1.0, 4: 1.0})


@pytest.fixture(scope="module")
def lm(tiny_lm, fitted_head):
    model = tiny_lm("llama", vocab_size=VOCAB, max_position_embeddings=MAXPOS)
    return model, fitted_head(model)


def engine(lm, prefix: bool, mode: str = "live", batch: int = 1, budget_mb: float = 64) -> Engine:
    model, head = lm
    return Engine(model, head, tree=TREE, costs=FLAT, batch=batch, graph=mode == "fixed",
                  prefix_cache=PrefixCache(budget_mb) if prefix else None)


def run_all(eng: Engine, reqs) -> dict:
    out = {}
    eng.run(collections.deque(reqs), lambda key, tokens, summary: out.__setitem__(key, (tokens, summary)))
    return out


@pytest.fixture
def drafts(monkeypatch):
    """Every tree the cycles draft, per request key in the order drafted: (tokens, parents, scores), copied."""
    seen = collections.defaultdict(list)
    real = Cycle.draft_fn

    def draft_fn(self, *args):
        out = real(self, *args)
        tokens, parents, _, _, scores, _ = out
        for b, s in enumerate(self.rows.slots):
            if s is not None:
                seen[s.key].append((tokens[b].clone(), parents[b].clone(), None if scores is None else scores[b].clone()))
        return out

    monkeypatch.setattr(Cycle, "draft_fn", draft_fn)
    return seen


# Path scores to within float32 rounding, not bitwise: attention sums over the cells a forward
# reads, and a kept cell was computed reading fewer of them than a full prefill reads (measured on
# this model: layer 0's K/V bitwise equal, layer 1's 5e-7 apart). A wrong head cell moves the
# scores by far more (test_a_wrong_head_cell_is_caught), and the tree's tokens and shape must match.
ATOL = 1e-5


def same_trees(a, b, atol: float = ATOL) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and
                                    (x[2] is None and y[2] is None or torch.allclose(x[2], y[2], rtol=0, atol=atol))
                                    for x, y in zip(a, b))


def conversation(seed: int, turns: int = 3):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 7))] for _ in range(turns)]


def play(eng: Engine, parts, gen, keep: bool = True):
    """A conversation as a chat runs it: turn k's prompt is every earlier prompt and answer plus
    its own new ids. Returns [(answer, summary)] per turn."""
    ids, out = [], []
    for part in parts:
        ids = ids + part
        tokens, summary = eng.generate(ids, gen, keep=keep)
        out.append((tokens, summary))
        ids = ids + tokens
    return out


@pytest.mark.parametrize("mode", ["live", "fixed"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_conversation_reusing_its_cache_is_identical(lm, mode, temperature, drafts):
    gen = GenerationSettings(max_new_tokens=14, temperature=temperature, seed=11, eos_token_ids=())
    for seed in range(3):
        parts = conversation(seed)
        drafts.clear()
        plain = play(engine(lm, False, mode), parts, gen)
        plain_trees = list(drafts[0])
        drafts.clear()
        kept = play(engine(lm, True, mode), parts, gen)
        assert [t for t, _ in kept] == [t for t, _ in plain]
        assert same_trees(drafts[0], plain_trees)
        cached = [s.cached_tokens for _, s in kept]
        assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
        # all but the last answer's tail (its last token is the next root; the head lags by the pending pairs)
        for k in range(1, len(parts)):
            before = sum(len(p) for p in parts[:k]) + sum(len(t) for t, _ in kept[:k])
            assert before - 1 - TREE.depth - 1 <= cached[k] <= before - 1
            assert kept[k][1].prompt_tokens == before + len(parts[k])


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "eagle3"])
def test_other_architectures_reuse_identically(tiny_lm, fitted_head, arch, drafts):
    """Sliding windows (Mistral; Gemma 3's hybrid layers) resume at any cut, since every cell is
    kept and windows are masks; an EAGLE-3 head's features (fused layer inputs) come from the
    re-run part. Same answers and trees as without reuse."""
    from test_eagle3 import DRAFT_IDS, LAYERS

    if arch == "eagle3":
        model = tiny_lm("qwen2", vocab_size=VOCAB, max_position_embeddings=MAXPOS, num_layers=LAYERS)
        head = fitted_head(model, arch="eagle3", draft_ids=DRAFT_IDS, steps=60)
    else:
        model = tiny_lm(arch, vocab_size=VOCAB, max_position_embeddings=MAXPOS)
        head = fitted_head(model, steps=60)  # a short fit: drafts of some depth are enough here
    gen = GenerationSettings(max_new_tokens=14, eos_token_ids=())
    parts = conversation(7)
    drafts.clear()
    plain = play(engine((model, head), False), parts, gen)
    plain_trees = list(drafts[0])
    drafts.clear()
    kept = play(engine((model, head), True), parts, gen)
    assert [t for t, _ in kept] == [t for t, _ in plain]
    assert same_trees(drafts[0], plain_trees)
    assert all(s.cached_tokens > 0 for _, s in kept[1:])


def test_rows_of_a_batch_reuse_and_match(lm):
    """Three rows, six conversations queued at once: each second turn continues its own first,
    alongside other conversations' turns; the answers are those of no reuse at one row."""
    gen = GenerationSettings(max_new_tokens=10, eos_token_ids=())
    firsts = [conversation(s, 2) for s in range(10, 16)]
    eng, ref = engine(lm, True, "live", batch=3), engine(lm, False)
    out = run_all(eng, [Request(i, p[0], gen, keep=True) for i, p in enumerate(firsts)])
    seconds = [p[0] + out[i][0] + p[1] for i, p in enumerate(firsts)]
    out2 = run_all(eng, [Request(i, ids, gen) for i, ids in enumerate(seconds)])
    for i, ids in enumerate(seconds):
        assert out2[i][0] == ref.generate(ids, gen)[0]
        assert out2[i][1].cached_tokens > 0
    assert eng.prefix.stats()["hits"] >= len(seconds)  # first turns may share a few ids with another conversation


def test_every_boundary_of_the_common_prefix(lm, drafts):
    """A kept sequence of 30 ids; new prompts share its first j ids for every j, then differ:
    same answers and same drafted trees as a full prefill, restoring min(j - 1, head) cells."""
    gen = GenerationSettings(max_new_tokens=8, eos_token_ids=())
    eng, ref = engine(lm, True), engine(lm, False)
    first = [3, 1, 4, 1, 5, 9, 2, 6]
    tokens, _ = eng.generate(first, dataclasses_replace(gen, max_new_tokens=23), keep=True)
    kept_ids = list(next(iter(eng.prefix.entries.values())).ids)
    head_len = next(iter(eng.prefix.entries.values())).head_len
    assert kept_ids == (first + tokens)[: len(kept_ids)] and len(kept_ids) >= 28
    for j in range(1, len(kept_ids) + 1):
        other = (kept_ids[j] + 1) % VOCAB if j < len(kept_ids) else 7
        prompt = kept_ids[:j] + [other, 2]
        drafts.clear()
        got, summary = eng.generate(prompt, gen)  # not kept: the store keeps the one entry
        trees = list(drafts[0])
        drafts.clear()
        want = ref.generate(prompt, gen)[0]
        assert got == want, j
        assert same_trees(trees, drafts[0]), j
        assert summary.cached_tokens == max(0, min(j - 1, head_len)), j
    assert len(eng.prefix) == 1


def test_a_wrong_head_cell_is_caught(lm, drafts, monkeypatch):
    """The rule's off-by-one (restoring the head's cell L - 1, which paired f_{L-1} with the kept
    sequence's next id, not the new prompt's): the text is still right, the trees are not."""
    gen = GenerationSettings(max_new_tokens=10, eos_token_ids=())
    eng, ref = engine(lm, True), engine(lm, False)
    first = [3, 1, 4, 1, 5, 9, 2, 6]
    tokens, _ = eng.generate(first, gen, keep=True)
    (kept,) = eng.prefix.entries.values()
    monkeypatch.setattr(eng, "_reusable", lambda cycle, ids, *a, **kw: (kept, min(common_prefix(kept.ids, ids), kept.head_len)))
    caught = 0
    for j in range(2, kept.head_len + 1):
        prompt = list(kept.ids[:j]) + [(kept.ids[j] + 1) % VOCAB, 2]
        drafts.clear()
        got, summary = eng.generate(prompt, gen)
        trees = list(drafts[0])
        drafts.clear()
        assert got == ref.generate(prompt, gen)[0] and summary.cached_tokens == j
        caught += not same_trees(trees, drafts[0])
    assert caught == kept.head_len - 1, caught  # every one (measured: scores 0.07 to 1.2 apart, against 1e-6 of rounding)


def test_every_restored_length(lm, drafts, monkeypatch):
    """The restored length forced to every value from 1 to the most the rule allows."""
    gen = GenerationSettings(max_new_tokens=8, eos_token_ids=())
    eng, ref = engine(lm, True), engine(lm, False)
    first = [5, 5, 0, 2, 8, 1]
    tokens, _ = eng.generate(first, gen, keep=True)
    prompt = first + tokens + [4, 4]
    drafts.clear()
    want = ref.generate(prompt, gen)[0]
    want_trees = list(drafts[0])
    most = eng._reusable(eng.cycle, prompt, eng.prefix)[1]
    assert most > len(first)
    real = Engine._reusable
    for r in range(1, most + 1):
        monkeypatch.setattr(Engine, "_reusable", lambda self, cycle, ids, *a, r=r, **kw: (real(self, cycle, ids, *a, **kw)[0], r))
        drafts.clear()
        got, summary = eng.generate(prompt, gen)
        assert (got, summary.cached_tokens) == (want, r)
        assert same_trees(drafts[0], want_trees), r


def test_a_closed_stream_keeps_what_it_emitted(lm):
    gen = GenerationSettings(max_new_tokens=20, eos_token_ids=())
    eng, ref = engine(lm, True), engine(lm, False)
    prompt = [1, 2, 3, 4, 5]
    stream = eng.stream(prompt, gen, keep=True)
    emitted = []
    for ev in stream:
        emitted += ev.token_ids
        if len(emitted) >= 6:
            break
    stream.close()
    (entry,) = eng.prefix.entries.values()
    assert list(entry.ids) == (prompt + emitted)[: len(entry.ids)] and len(entry.ids) >= len(prompt) + len(emitted) - 1
    nxt = prompt + emitted + [6, 6]
    got, summary = eng.generate(nxt, gen)
    assert summary.cached_tokens > len(prompt)
    assert got == ref.generate(nxt, gen)[0]


def test_no_prefix_cache_and_no_keep_reuse_nothing(lm):
    gen = GenerationSettings(max_new_tokens=6, eos_token_ids=())
    eng = engine(lm, True)
    tokens, _ = eng.generate([1, 2, 3], gen)  # keep not asked
    assert len(eng.prefix) == 0
    assert eng.generate([1, 2, 3] + tokens, gen)[1].cached_tokens == 0
    off = engine(lm, False)
    tokens, _ = off.generate([1, 2, 3], gen, keep=True)
    assert off.generate([1, 2, 3] + tokens, gen)[1].cached_tokens == 0


# -- the store ---------------------------------------------------------------------------------

def fake(ids, cells_bytes: int = 1024) -> Kept:
    n = len(ids)
    t = torch.zeros(cells_bytes // 4 // 2)
    return Kept(tuple(ids), [(t, t.clone())], None, 0) if n else None


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([9], [1]) == 0


def test_least_recently_used_goes_first_within_the_budget():
    store = PrefixCache(budget_mb=3 * 1024 / 2**20)  # room for three 1 KB entries
    for i in range(3):
        assert store.add(fake([i, i, i]))
    assert store.lookup([0, 0, 0, 5]) [1] == 3  # entry 0 is now the most recently used
    assert store.add(fake([7, 7]))
    assert set(store.entries) == {(0, 0, 0), (2, 2, 2), (7, 7)} and store.evictions == 1
    assert store.bytes == 3 * 1024
    assert not store.add(fake([8], cells_bytes=4096))  # alone over the budget: refused, nothing dropped
    assert len(store) == 3
    assert store.add(fake([7, 7, 1, 2]))  # supersedes (7, 7): a conversation keeps its latest turn
    assert (7, 7) not in store.entries and (7, 7, 1, 2) in store.entries and len(store) == 3
    best, n = store.lookup([7, 7, 1, 9])
    assert best.ids == (7, 7, 1, 2) and n == 3
    assert store.lookup([5])[0] is None


def test_engine_evicts_under_its_budget(lm):
    """A budget that holds about one conversation: the older one is evicted, and continuing it
    prefills everything again, with the same answer."""
    gen = GenerationSettings(max_new_tokens=10, eos_token_ids=())
    eng = engine(lm, True)
    a, b = [1, 1, 2, 3], [4, 4, 5, 6]
    ta, _ = eng.generate(a, gen, keep=True)
    entry = next(iter(eng.prefix.entries.values()))
    eng.prefix.budget = int(entry.nbytes * 1.5)
    tb, _ = eng.generate(b, gen, keep=True)
    assert len(eng.prefix) == 1 and eng.prefix.evictions == 1
    got, summary = eng.generate(a + ta + [2], gen)
    assert summary.cached_tokens == 0
    assert got == engine(lm, False).generate(a + ta + [2], gen)[0]
    assert eng.generate(b + tb + [2], gen)[1].cached_tokens > 0


def dataclasses_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


# -- chat: the conversation as token ids --------------------------------------------------------

def chat_app(model_dir, head_dir, prefix: bool, n: int = 12):
    import io

    from rich.console import Console

    from eagle2_cli.chat_cmd import ChatApp
    from eagle2_core.runtime import Runtime

    rt = Runtime.load(model_dir, head_dir, device="cpu", dtype="float32", gen=GenerationSettings(max_new_tokens=n))
    rt.prefix_cache = PrefixCache() if prefix else None
    return ChatApp(rt, Console(file=io.StringIO(), width=200), Console(file=io.StringIO(), width=200))


def test_chat_turns_prefill_only_what_is_new(tiny_model_dir, tiny_head_dir):
    """Three turns: the same answers with and without the kept cache; turns 2 and 3 continue the
    ids seen (the answers' own ids spliced in), restoring all but a few of them; /stats says so;
    /reset drops the kept cache."""
    turns = ["Hello! How are you?", "Write a short poem.", "1 2 3"]
    kept, plain = chat_app(tiny_model_dir, tiny_head_dir, True), chat_app(tiny_model_dir, tiny_head_dir, False)
    for text in turns:
        kept.handle(text)
        plain.handle(text)
    assert kept.conv.messages == plain.conv.messages
    assert kept.conv.spliced == plain.conv.spliced == 2
    summaries = kept.conv.turns
    assert summaries[0].cached_tokens == 0 and all(s.cached_tokens == 0 for s in plain.conv.turns)
    for k in (1, 2):
        before = summaries[k - 1].prompt_tokens + summaries[k - 1].new_tokens  # the ids seen after turn k - 1
        new = summaries[k].prompt_tokens - before + 1  # the user's message, its template and the answer's end token
        assert summaries[k].cached_tokens >= before - 1 - 8, (k, summaries[k].cached_tokens, before)  # all but the head's lag
        assert summaries[k].prompt_tokens - summaries[k].cached_tokens <= new + 8
    kept.command("/stats")
    err = kept.err.file.getvalue()
    assert f"turn 2: prompt {summaries[1].prompt_tokens} tokens: {summaries[1].cached_tokens} reused" in err
    assert len(kept.rt.prefix_cache) == 1  # one conversation, one entry: its latest turn
    kept.command("/reset")
    assert len(kept.rt.prefix_cache) == 0 and kept.conv.ids.seen_ids == []


def test_a_spliced_answer_keeps_the_ids_generated(tiny_model_dir):
    """Where the answer's text encodes to other ids than were generated, the next prompt holds the
    generated ones; the template's text after the answer is encoded on its own."""
    from transformers import AutoTokenizer

    from eagle2_core.chat import Conversation
    from eagle2_core.prompts import encode_chat

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    conv = Conversation()
    conv.add_user("Hi")
    first = conv.encode(tok)
    answer_text = "The sea"
    # the same text as single characters: other ids, same text
    generated = [i for ch in answer_text for i in tok(ch, add_special_tokens=False)["input_ids"]]
    assert tok.decode(generated) == answer_text and generated != tok(answer_text, add_special_tokens=False)["input_ids"]
    conv.add_assistant(answer_text, None, generated + [tok.eos_token_id], tok)
    conv.add_user("More")
    second = conv.encode(tok)
    assert second[: len(first) + len(generated)] == first + generated
    assert second[len(first) + len(generated)] == tok.eos_token_id  # the template's end of turn, the generated id
    assert tok.decode(second) == tok.decode(encode_chat(tok, conv.full()))  # the same text as encoding it whole
    conv.system_prompt = "Be brief."  # the rendering no longer starts with what was seen: encoded afresh
    assert conv.encode(tok) == encode_chat(tok, conv.full())


# -- prompt files: an item's later turns continue its earlier ones --------------------------------

@pytest.mark.parametrize("batch", ["1", "3"])
def test_generate_second_turns_reuse_the_first(tmp_path, tiny_model_dir, tiny_head_dir, batch):
    import json

    from click.testing import CliRunner

    from eagle2_cli.main import cli

    items = [{"question_id": i, "turns": [t, "Shorter, please."]} for i, t in
             enumerate(["Write a poem about the sea.", "Hello! How are you today?", "def add(a, b):", "Count to ten."])]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in items))
    records = {}
    for flag in ([], ["--no-prefix-cache"]):
        out = tmp_path / f"out{len(flag)}.jsonl"
        args = ["generate", "-f", str(inp), "-o", str(out), "--batch-size", batch, "--total-tokens", "6", "--model", tiny_model_dir,
                "--draft", tiny_head_dir, "--max-new-tokens", "10", "--device", "cpu", "--dtype", "float32", "-t", "0"] + flag
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 0, r.output
        records[bool(flag)] = {x["question_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    for i in range(len(items)):
        with_cache, without = records[False][i], records[True][i]
        assert with_cache["turns"] == without["turns"]
        assert without["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        first_turn = with_cache["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert first_turn > 10, with_cache["usage"]  # the first turn's prompt at least, restored for the second
        one, two = with_cache["usage"]["turns"]  # per turn: the second restores all but the answer's last tokens
        assert one["cached_tokens"] + two["cached_tokens"] == first_turn
        # the answer's ids spliced (prompts.SplicedIds), so the restored part runs into the answer (the random
        # model's answers do not survive decoding and encoding again: unspliced, it stopped at the first prompt)
        assert two["cached_tokens"] > one["prompt_tokens"], with_cache["usage"]
        assert one["prompt_tokens"] + two["prompt_tokens"] == with_cache["usage"]["prompt_tokens"]


# -- long prompts beside decoding rows: prefilled a chunk per cycle ------------------------------

@pytest.mark.parametrize("prefix", [True, False])
def test_a_long_prompt_is_prefilled_in_chunks_between_cycles(lm, prefix, monkeypatch):
    """Two rows: a short request decodes while a 60-token prompt joins; with chunks of 16 its
    prefill runs 16 new tokens at a time with a cycle of the other row between them, and every
    answer is the one of a whole prefill (greedy, and a seeded sample)."""
    log = []
    real_admit, real_step = Cycle.admit, Cycle.step
    monkeypatch.setattr(Cycle, "admit", lambda self, b, ids, *a, **kw: log.append(("admit", len(ids), kw.get("reuse", a[3] if len(a) > 3 else 0)))
                        or real_admit(self, b, ids, *a, **kw))
    monkeypatch.setattr(Cycle, "step", lambda self: log.append(("step",)) or real_step(self))
    rng = random.Random(3)
    long_ids = [rng.randrange(VOCAB) for _ in range(60)]
    for gen in (GenerationSettings(max_new_tokens=12, eos_token_ids=()),
                GenerationSettings(max_new_tokens=12, temperature=0.9, seed=5, eos_token_ids=())):
        ref = engine(lm, False)
        want = {0: ref.generate([1, 2, 3], dataclasses_replace(gen, max_new_tokens=30))[0], 1: ref.generate(long_ids, gen)[0]}
        eng = engine(lm, prefix, batch=2)
        eng.prefill_chunk = 16
        log.clear()
        out = run_all(eng, [Request(0, [1, 2, 3], dataclasses_replace(gen, max_new_tokens=30)), Request(1, long_ids, gen)])
        assert {k: v[0] for k, v in out.items()} == want
        admits = [e for e in log if e[0] == "admit"]
        # the short one, then chunks ending at 16, 31, 46 (each restores all but the last cell of the one before), then the rest
        assert [a[1] for a in admits] == [3, 16, 31, 46, 60] and [a[2] for a in admits][1:] == [0, 15, 30, 45]
        between = [i for i, e in enumerate(log) if e[0] == "admit"]
        assert all(any(e[0] == "step" for e in log[i + 1 : j]) for i, j in zip(between[1:], between[2:]))  # a cycle between chunks
        assert out[1][1].cached_tokens == 0 and out[1][1].target_forwards >= 4
        if not prefix:
            assert len(eng._chunks) == 0  # its chunks are dropped once it runs
