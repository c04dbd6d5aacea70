"""Lossless against what the model itself does: the target's generation_config processors.

A model's generation_config may set a repetition penalty, no-repeat n-grams, bad words, minimum
lengths, sampling defaults, ...; `generate` applies all of them. EAGLE-2 must too, to every
tree node with that node's own history (context plus its path), or greedy output stops being
`generate`'s and sampling stops following the processed law. Checked here:
  * the processor list is the one `generate` builds (classes, order, parameters), spied on a
    real `generate` call;
  * `tree_scores` row i equals the processors applied to history + path(i) alone, for any subset
    of nodes; no processor at all returns the logits object itself;
  * greedy: tiny models whose generation_config sets repetition penalty + no-repeat n-grams, or
    bad words, suppressed tokens, a sequence bias, min_new_tokens and an EOS length penalty,
    decode exactly as the model's own `generate()` (dynamic tree, both lm_head plans, graph mode:
    fixed shapes); the processors do change the output, and multi-token paths are accepted;
  * sampling: the exact law of the first 3 tokens under repetition penalty + no-repeat n-grams
    (+ temperature/top-k), from the engine's own trees and probabilities, equals the law
    enumerated from full forwards; processing every node with the root's history only (the
    bug this guards against) is far from it;
  * settings: the model's generation_config is the default, flags override, temperature 0 is
    greedy, compare is greedy by default; fields eagle2 cannot apply are refused in one line.
"""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from click.testing import CliRunner
from transformers import GenerationConfig
from transformers.generation.logits_process import (LogitsProcessorList, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper)

from eagle2_core import Engine, GenerationSettings, TreeSettings
from eagle2_core.sampling import HISTORY_FREE, TargetProcessors, UnsupportedGeneration, generation_config_for, settings_from_model
from eagle2_core.tree import tree_from_parents
from eagle2_core.vanilla import VanillaDecoder


VOCAB, MAXPOS = 12, 40
EOS = 11
TREE = TreeSettings(shape="dynamic", total_tokens=12, depth=4, top_k=3)

# generation_configs a model may ship; each changes what greedy decoding emits
CONFIGS = {
    "penalties": dict(repetition_penalty=1.3, no_repeat_ngram_size=3),
    "constraints": dict(bad_words_ids=[[3], [5, 6]], suppress_tokens=[7], begin_suppress_tokens=[2], sequence_bias={(1,): -2.0, (4, 8): 3.0},
                        min_new_tokens=4, exponential_decay_length_penalty=(3, 1.5), repetition_penalty=0.8),
}


# -- the processor list ------------------------------------------------------------------------
def spy_generate_processors(model, monkeypatch):
    """Record the LogitsProcessorList a real `generate` call builds."""
    from transformers.generation.utils import GenerationMixin

    seen = []
    real = GenerationMixin._get_logits_processor

    def spy(self, *a, **kw):
        out = real(self, *a, **kw)
        seen.append(out)
        return out

    monkeypatch.setattr(GenerationMixin, "_get_logits_processor", spy)
    return seen


@pytest.mark.parametrize("sampling", [False, True])
def test_processor_list_is_generates(tiny_lm, monkeypatch, sampling):
    """Every processor generate builds from a config that sets (almost) everything, same classes,
    same order, same scores; the vanilla side hands generate the same config."""
    model = tiny_lm("llama", vocab_size=VOCAB, max_position_embeddings=MAXPOS)
    model.generation_config = GenerationConfig(
        **CONFIGS["constraints"], no_repeat_ngram_size=2, encoder_repetition_penalty=1.1, encoder_no_repeat_ngram_size=4,
        min_length=3, forced_eos_token_id=EOS, remove_invalid_values=True, renormalize_logits=True,
        typical_p=0.95, epsilon_cutoff=1e-4, eta_cutoff=1e-4, min_p=0.02)
    gen = GenerationSettings(max_new_tokens=6, eos_token_ids=(EOS,), temperature=0.9 if sampling else 0.0, top_k=8, top_p=0.9,
                             min_p=0.02, repetition_penalty=0.8)
    prompt = [1, 2, 3, 4, 8, 1]
    seen = spy_generate_processors(model, monkeypatch)
    VanillaDecoder(model).generate(prompt, gen)
    hf = seen[-1]
    ours = TargetProcessors(gen, model.generation_config, torch.tensor(prompt), {EOS}, gen.max_new_tokens).processors
    assert [type(p).__name__ for p in ours] == [type(p).__name__ for p in hf]
    assert ("TopKLogitsWarper" in [type(p).__name__ for p in ours]) == sampling
    g = torch.Generator().manual_seed(0)
    for extra in range(0, 6):  # prefixes past the prompt, where length-dependent processors switch on and off
        ids = torch.tensor([prompt + [random.Random(extra).randrange(VOCAB) for _ in range(extra)]] * 3)
        ids[1, -1] = 4  # a row that can complete the biased (4, 8) and banned (5, 6) sequences
        ids[2, -1] = 5
        scores = torch.randn(3, VOCAB, generator=g) * 3
        torch.testing.assert_close(ours(ids, scores.clone()), hf(ids, scores.clone()), rtol=0, atol=0)


def test_history_free_processors_ignore_input_ids():
    """Those applied to all tree rows at once never read input_ids (they are called with None)."""
    cfg = GenerationConfig(do_sample=True, temperature=0.7, top_k=3, top_p=0.9, min_p=0.05, typical_p=0.9, epsilon_cutoff=1e-3,
                           eta_cutoff=1e-3, top_h=0.5, suppress_tokens=[1], remove_invalid_values=True, renormalize_logits=True)
    gen = GenerationSettings(temperature=0.7, top_k=3, top_p=0.9, min_p=0.05)
    procs = TargetProcessors(gen, cfg, torch.tensor([1, 2])).processors
    assert len(procs) == 11 and all(isinstance(p, HISTORY_FREE) for p in procs)
    for p in procs:
        p(None, torch.randn(4, VOCAB))


def random_tree(n: int, seed: int):
    rng = random.Random(seed)
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return tree_from_parents(torch.tensor([rng.randrange(VOCAB) for _ in range(n)]), torch.tensor(parents))


def test_tree_scores_use_each_nodes_own_history():
    cfg = GenerationConfig(bad_words_ids=[[4, 5], [9]], min_new_tokens=6, sequence_bias={(2, 3): 2.5})
    gen = GenerationSettings(temperature=0.7, top_k=5, repetition_penalty=1.4, no_repeat_ngram_size=2)
    prompt = torch.tensor([1, 2, 3, 2, 4])
    procs = TargetProcessors(gen, cfg, prompt, {EOS}, 20)
    assert procs.reads_history and procs.sampling
    history = torch.cat([prompt, torch.tensor([3, 7, 2])])  # prompt + emitted tokens before the root
    g = torch.Generator().manual_seed(1)
    for seed in range(5):
        tree = random_tree(14, seed)
        logits = torch.randn(tree.size, VOCAB, generator=g) * 4
        got = procs.tree_scores(logits, history, tree)
        for i in range(tree.size):
            path = tree.tokens[tree.ancestors[i]]  # root..i
            want = procs.scores(logits[i : i + 1], torch.cat([history, path])[None])
            torch.testing.assert_close(got[i : i + 1], want, rtol=0, atol=0)
        nodes = torch.randperm(tree.size, generator=g)[:5]
        torch.testing.assert_close(procs.tree_scores(logits[nodes], history, tree, nodes), got[nodes], rtol=0, atol=0)
    # nothing to apply: the logits themselves, no copy
    plain = TargetProcessors(GenerationSettings(), GenerationConfig(), prompt)
    logits = torch.randn(3, VOCAB)
    assert not plain.active and plain.tree_scores(logits, history, random_tree(3, 0)) is logits


# -- greedy: identical to the model's own generate() ----------------------------------------------
def build_cases(model, seed: int, always_eos: bool = False) -> list[dict]:
    """Random prompts and budgets, half of them (or all) stopping at EOS; references from the
    model's own `generate()` (its generation_config in force) and from plain greedy (no processors)."""
    rng = random.Random(seed)
    cases = []
    for i in range(14):
        ids = [rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, 14))]
        n = rng.randint(4, 26)
        eos = (EOS,) if i % 2 or always_eos else ()
        x = torch.tensor([ids])
        kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=min(n, MAXPOS - len(ids)), do_sample=False,
                  eos_token_id=list(eos) or None, pad_token_id=0)
        ref = model.generate(x, **kw)[0, len(ids):].tolist()
        own = model.generation_config
        model.generation_config = GenerationConfig()
        plain = model.generate(x, **kw)[0, len(ids):].tolist()
        model.generation_config = own
        cases.append(dict(ids=ids, n=n, eos=eos, ref=ref, plain=plain))
    return cases


@pytest.fixture(scope="module")
def greedy_env(tiny_lm, fitted_head):
    model = tiny_lm("llama", vocab_size=VOCAB, max_position_embeddings=MAXPOS)
    return dict(model=model, head=fitted_head(model))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_identity_with_models_generate(greedy_env, config):
    model, head = greedy_env["model"], greedy_env["head"]
    model.generation_config = GenerationConfig(**CONFIGS[config])
    try:
        # generate() itself fails on an EOS length penalty without an EOS id: every constraints case has one
        cases = build_cases(model, seed=list(CONFIGS).index(config), always_eos=config == "constraints")
        assert sum(c["ref"] != c["plain"] for c in cases) >= 4  # the model's config changes what generate emits
        decoders = {"dynamic": Engine(model, head, tree=TREE), "dynamic-two-pass": Engine(model, head, tree=TREE),
                    "graph": Engine(model, head, tree=TREE, graph=True)}
        decoders["dynamic"].one_product, decoders["dynamic-two-pass"].one_product = True, False  # the lm_head plans
        for name, dec in decoders.items():
            hist, bad = [], []
            for c in cases:
                gen = settings_from_model(model.generation_config, {"max_new_tokens": c["n"], "eos_token_ids": c["eos"]})
                out, s = dec.generate(c["ids"], gen)
                if out != c["ref"]:
                    bad.append((c, out))
                for d, k in enumerate(s.accepted_hist):
                    hist.extend([0] * (d + 1 - len(hist)))
                    hist[d] += k
            print(f"\n[processors] {config} {name}: {len(cases) - len(bad)}/{len(cases)} identical to generate(), accepted_hist={hist}")
            assert not bad, bad[:2]
            assert sum(hist[2:]) > 0, hist  # paths of 2+ drafted tokens were accepted under the processors
        # the vanilla side is the same generate()
        van = VanillaDecoder(model)
        for c in cases:
            assert van.generate(c["ids"], settings_from_model(model.generation_config, {"max_new_tokens": c["n"], "eos_token_ids": c["eos"]}))[0] == c["ref"]
    finally:
        model.generation_config = GenerationConfig()


def test_no_generation_config_ignores_the_models_on_both_sides(greedy_env):
    """use_generation_config=False: neither side applies what the model's config sets, even fields
    that generate() would fill in from it by itself (bad_words_ids)."""
    model, head = greedy_env["model"], greedy_env["head"]
    model.generation_config = GenerationConfig(**CONFIGS["constraints"])
    try:
        cases = build_cases(model, seed=5, always_eos=True)
        gen_kw = dict(use_generation_config=False)
        for c in cases:
            gen = settings_from_model(model.generation_config, {"max_new_tokens": c["n"], "eos_token_ids": c["eos"]}, **gen_kw)
            assert gen.repetition_penalty == 1.0
            assert VanillaDecoder(model).generate(c["ids"], gen)[0] == c["plain"]
            assert Engine(model, head, tree=TREE).generate(c["ids"], gen)[0] == c["plain"]
    finally:
        model.generation_config = GenerationConfig()


# -- sampling: the exact processed law ------------------------------------------------------------
SAMPLED = {
    "T1-rep1.5-ngram2": dict(temperature=1.0, repetition_penalty=1.5, no_repeat_ngram_size=2),
    "T0.8-topk3-rep1.3": dict(temperature=0.8, top_k=3, repetition_penalty=1.3),
}


def hf_processors(kw: dict) -> LogitsProcessorList:
    """The reference list, built by hand from transformers' classes in generate's order."""
    procs = LogitsProcessorList()
    if kw.get("repetition_penalty", 1.0) != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"]))
    if kw.get("no_repeat_ngram_size"):
        procs.append(NoRepeatNGramLogitsProcessor(kw["no_repeat_ngram_size"]))
    if kw["temperature"] != 1.0:
        procs.append(TemperatureLogitsWarper(kw["temperature"]))
    if kw.get("top_k"):
        procs.append(TopKLogitsWarper(kw["top_k"]))
    return procs


def exact_processed_law(model, prompt: list[int], V: int, kw: dict) -> dict:
    """P(x1 x2 x3) from full causal forwards, each step's logits processed with its own prefix."""
    procs, law = hf_processors(kw), {}
    with torch.no_grad():
        for a in range(V):
            for b in range(V):
                seq = prompt + [a, b]
                logits = model(torch.tensor([seq])).logits[0, -3:].float()
                rows = [torch.softmax(procs(torch.tensor([seq[: len(prompt) + j]]), logits[j : j + 1]), -1)[0].double() for j in range(3)]
                for c in range(V):
                    q = float(rows[0][a] * rows[1][b] * rows[2][c])
                    if q > 0:
                        law[(a, b, c)] = q
    return law


@pytest.fixture(scope="module")
def sampling_env(tiny_lm):
    from eagle2_core.head import DraftHead, HeadSpec
    from test_sampling_lossless import V

    model = tiny_lm("llama", vocab_size=V, hidden_size=16, num_layers=1, max_position_embeddings=32, initializer_range=0.3, logit_scale=1.0)
    torch.manual_seed(2)
    head = DraftHead(HeadSpec.for_target(model.config)).bind(model)
    return dict(model=model, dec=Engine(model, head, tree=TreeSettings(shape="dynamic", total_tokens=8, depth=3, top_k=3)))


def max_gap(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


@pytest.mark.parametrize("name", list(SAMPLED))
def test_sampling_follows_the_processed_law(sampling_env, name, monkeypatch):
    from test_sampling_lossless import PROMPT, V, engine_rule_law, exact_target_law

    model, dec, kw = sampling_env["model"], sampling_env["dec"], SAMPLED[name]
    gen = GenerationSettings(**kw)
    exact = exact_processed_law(model, PROMPT, V, kw)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-6)  # float32 softmax rows
    unprocessed = exact_target_law(model, GenerationSettings(temperature=kw["temperature"], top_k=kw.get("top_k", 0)))
    assert max_gap(exact, unprocessed) > 1e-2  # the penalties change the law
    p0 = [sum(v for k, v in exact.items() if k[0] == a) for a in range(V)]
    got = engine_rule_law(dec, gen, p0, "keyed", monkeypatch)
    assert sum(got.values()) == pytest.approx(1.0, abs=1e-6)
    assert max_gap(got, exact) < 1e-6, max_gap(got, exact)
    # processing each node with the root's history alone (path tokens dropped) is detectably wrong
    def root_history_only(self, logits, history, tree, nodes=None):
        ids = torch.cat([history, tree.tokens[:1]])[None].expand(logits.shape[0], -1)
        return self.processors(ids, logits.float())

    with monkeypatch.context() as mp:
        mp.setattr(TargetProcessors, "tree_scores", root_history_only)
        broken = engine_rule_law(dec, gen, p0, "keyed", monkeypatch)
    assert max_gap(broken, exact) > 1e-3, max_gap(broken, exact)  # a thousand times the tolerance above


# -- settings: defaults from the model, flags over them, refusals -----------------------------------
QWEN_LIKE = dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)


def test_settings_from_the_models_generation_config():
    cfg = GenerationConfig(**QWEN_LIKE)
    g = settings_from_model(cfg)
    assert (g.temperature, g.top_p, g.top_k, g.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    g = settings_from_model(cfg, {"temperature": 0.0, "top_k": None})  # -t 0: greedy, the penalty stays
    assert g.temperature == 0.0 and g.repetition_penalty == 1.05 and g.top_k == 20
    g = settings_from_model(cfg, sample_by_default=False)  # compare
    assert g.temperature == 0.0 and g.repetition_penalty == 1.05
    assert settings_from_model(cfg, {"temperature": 0.5}, sample_by_default=False).temperature == 0.5
    g = settings_from_model(cfg, {"repetition_penalty": 1.0, "top_p": 0.5})
    assert g.repetition_penalty == 1.0 and g.top_p == 0.5 and g.temperature == 0.7
    g = settings_from_model(cfg, use_generation_config=False)
    assert (g.temperature, g.top_p, g.top_k, g.repetition_penalty, g.use_generation_config) == (0.0, 1.0, 0, 1.0, False)
    # sampling where the config sets no top_k: generate() uses its global default, 50
    assert settings_from_model(GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9)).top_k == 50
    # what both sides run, and the label a table shows
    p = TargetProcessors(settings_from_model(cfg), cfg, torch.tensor([1]))
    assert p.label() == "sampling: temperature 0.7, top_k 20, top_p 0.8, repetition_penalty 1.05"
    assert p.describe()["processors"] == ["RepetitionPenaltyLogitsProcessor", "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"]
    assert TargetProcessors(settings_from_model(cfg, sample_by_default=False), cfg, torch.tensor([1])).label() == "greedy: repetition_penalty 1.05"


@pytest.mark.parametrize("field,value", [("guidance_scale", 1.5), ("num_beams", 3), ("penalty_alpha", 0.6), ("num_return_sequences", 2),
                                         ("watermarking_config", {"greenlist_ratio": 0.25})])
def test_unsupported_fields_are_refused(field, value):
    cfg = GenerationConfig(**{field: value, **({"top_k": 4} if field == "penalty_alpha" else {}),
                              **({"do_sample": True} if field == "num_return_sequences" else {})})
    with pytest.raises(UnsupportedGeneration) as e:
        generation_config_for(GenerationSettings(), cfg)
    msg = str(e.value)
    assert "\n" not in msg and field in msg and "--no-generation-config" in msg
    generation_config_for(GenerationSettings(use_generation_config=False), cfg)  # ignored on request


def model_copy(src: str, dst, **fields) -> str:
    folder = str(dst / "model")
    shutil.copytree(src, folder)
    with open(f"{folder}/generation_config.json", "w") as f:
        json.dump(fields, f)
    return folder


def test_cli_compare_runs_the_models_processors_on_both_sides(tmp_path, tiny_model_dir, tiny_head_dir):
    from eagle2_cli.main import cli

    folder = model_copy(tiny_model_dir, tmp_path, **QWEN_LIKE, no_repeat_ngram_size=3)
    out = tmp_path / "c.json"
    r = CliRunner().invoke(cli, ["compare", "--limit", "3", "--json", str(out), "--warmup-tokens", "0", "--model", folder, "--draft", tiny_head_dir,
                                 "--max-new-tokens", "12", "--device", "cpu"])
    assert r.exit_code == 0, r.output + r.stderr
    d = json.loads(out.read_text())
    assert d["greedy"] and d["identical"] == 3  # greedy by default, though the model's config samples
    gc = d["settings"]["generation_config"]
    assert gc["do_sample"] is False and gc["repetition_penalty"] == 1.05 and gc["no_repeat_ngram_size"] == 3
    assert gc["processors"] == ["RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor"]
    assert "greedy: repetition_penalty 1.05, no_repeat_ngram_size 3" in r.stdout
    r = CliRunner().invoke(cli, ["compare", "--limit", "1", "--json", str(out), "--warmup-tokens", "0", "--model", folder, "--draft", tiny_head_dir,
                                 "--max-new-tokens", "4", "--device", "cpu", "--repetition-penalty", "1", "--no-repeat-ngram-size", "0"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(out.read_text())["settings"]["generation_config"]["processors"] == []


def test_cli_refuses_what_it_cannot_apply(tmp_path, tiny_model_dir, tiny_head_dir):
    from eagle2_cli.main import cli

    folder = model_copy(tiny_model_dir, tmp_path, guidance_scale=1.5)
    args = ["--model", folder, "--draft", tiny_head_dir, "--max-new-tokens", "3", "--device", "cpu"]
    r = CliRunner().invoke(cli, ["chat", "--no-baseline", "--prompt", "Hi"] + args)
    assert r.exit_code == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "guidance_scale=1.5" in lines[0] and "--no-generation-config" in lines[0], r.stderr
    r = CliRunner().invoke(cli, ["chat", "--no-baseline", "--prompt", "Hi", "--no-generation-config"] + args)
    assert r.exit_code == 0, r.stderr


def test_first_token_is_drawn_from_the_processed_law(sampling_env):
    """The prefill's draw (monkeypatched away in the law above): 1000 seeded one-token runs against
    the processed law of token 1, with enough power to reject the unprocessed one."""
    from conftest import chisquare_power, pooled_chisquare
    from test_sampling_lossless import ALPHA, PROMPT, V, exact_target_law, sample_seeds

    kw = dict(temperature=1.0, repetition_penalty=0.3)  # < 1 rewards the prompt's tokens: a large shift of token 1's law
    first = lambda law: {(a,): sum(v for k, v in law.items() if k[0] == a) for a in range(V)}  # noqa: E731
    exact = first(exact_processed_law(sampling_env["model"], PROMPT, V, kw))
    plain = first(exact_target_law(sampling_env["model"], GenerationSettings(temperature=1.0)))
    n, counts = 1000, {}
    for seed in sample_seeds(n):
        out, _ = sampling_env["dec"].generate(PROMPT, GenerationSettings(**kw, max_new_tokens=1, seed=seed, eos_token_ids=()))
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    stat, dof, pval, bins = pooled_chisquare(counts, exact, n)
    power = chisquare_power(exact, plain, bins, n, ALPHA)
    print(f"\n[processors] first token, N={n}: chi2={stat:.1f} df={dof} p={pval:.3f}; power vs unprocessed {power:.4f}")
    assert pval > ALPHA and power >= 0.999
