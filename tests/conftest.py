"""Shared test fixtures: a tiny random-weight Llama with an offline-trained tokenizer and a head.

Everything is built in a temporary folder, without downloads. Add fixtures here; don't remove
any (several test files share this module).
"""
from __future__ import annotations

import os
import tempfile

import pytest

# Cost profiles (and any other cache) go to a folder of this test session, not the user's cache:
# greedy decoding on a CPU measures one per model the first time it runs (measure.py).
os.environ.setdefault("EAGLE2_CACHE", tempfile.mkdtemp(prefix="eagle2-test-cache-"))
# The product plan (rowgemm.py) is pinned to F.linear, so float summation order never follows the
# timings of the moment; each other kernel is forced in turn by the tests that are about it.
os.environ.setdefault("EAGLE2_KERNEL", "linear")

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens with a small head and verifies them with the target model.",
    "def add(a, b):\n    return a + b\n",
    "Write a short poem about the sea. The sea is blue and deep and wide.",
    "Hello! How are you today? I am fine, thank you.",
    "1 2 3 4 5 6 7 8 9 10, counting numbers is easy.",
]


def tiny_chat_target(tiny_lm, fitted_head, folder: str, max_positions: int = 160, extra_rows: int = 0):
    """(model, fitted head, chat tokenizer, end-of-turn id): a tiny Llama chatting through a real
    template, for the server and constraint tests; `extra_rows` lm_head rows past the tokenizer."""
    tok = build_tiny_tokenizer(folder)
    model = tiny_lm("llama", vocab_size=len(tok) + extra_rows, max_position_embeddings=max_positions, hidden_size=32)
    return model, fitted_head(model, steps=60), tok, tok.convert_tokens_to_ids("<|im_end|>")


def build_tiny_tokenizer(folder: str, vocab_size: int = 320):
    """A byte-level BPE tokenizer trained in-process on a few sentences, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TINY_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def build_tiny_model(folder: str, max_position_embeddings: int = 256, seed: int = 0, num_layers: int = 2):
    """Save a random Llama (hidden 64, 2 layers unless told) plus tokenizer to `folder`; returns the config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(folder, exist_ok=True)
    tok = build_tiny_tokenizer(folder)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    return cfg


def build_tiny_head(folder: str, target_config, seed: int = 1) -> None:
    import torch

    from eagle2_core.head import DraftHead, HeadSpec

    torch.manual_seed(seed)
    DraftHead(HeadSpec.for_target(target_config)).save(folder)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """Folder with a tiny random Llama and its tokenizer (chat template included)."""
    folder = str(tmp_path_factory.mktemp("tiny") / "model")
    build_tiny_model(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_head_dir(tiny_model_dir, tmp_path_factory) -> str:
    """Folder with a random EAGLE head shaped for `tiny_model_dir`."""
    from transformers import AutoConfig

    folder = str(tmp_path_factory.mktemp("tiny_head") / "head")
    build_tiny_head(folder, AutoConfig.from_pretrained(tiny_model_dir))
    return folder


@pytest.fixture(scope="session")
def smollm2_runtime():
    from eagle2_core.runtime import Runtime

    return Runtime.load(None)


@pytest.fixture
def smollm2(smollm2_runtime):
    """The embedded default, SmolLM2-135M-Instruct with its shipped head, as `eagle2` loads it
    with no --model / --draft (`Runtime.load(None)`), loaded and its CPU cost profile measured
    once per session into this session's EAGLE2_CACHE, where the CLI (in-process or a
    subprocess, which inherits the variable) finds it again; its arithmetic (process-wide)
    set again for each test. Shared by the slow tests: don't mutate it."""
    from eagle2_core import rowgemm

    rowgemm.set_arithmetic(smollm2_runtime.arithmetic)
    return smollm2_runtime


@pytest.fixture(autouse=True)
def _arithmetic_restored():
    """The products' arithmetic is process-wide (rowgemm.ARITHMETIC): after a test that loaded a
    block target (int8 by default) the next one starts from the default, exact. (Not from what the
    test found: a session fixture set up for it, such as `smollm2_runtime`, sets it first.)"""
    from eagle2_core import rowgemm

    yield
    if rowgemm.arithmetic() != "exact":
        rowgemm.set_arithmetic("exact")


@pytest.fixture(scope="session")
def tiny_target(tiny_model_dir):
    """The tiny model loaded through `load_target` (float32, CPU); shared, don't mutate."""
    from eagle2_core.loading import load_target

    return load_target(tiny_model_dir, dtype="float32", device="cpu")


# ---------------------------------------------------------------------------------------------
# Core engine suite (test_tree, test_accept, test_kvcache, test_decoder_identity,
# test_sampling_lossless, test_checkpoints, test_quant8): tiny random-weight models built from
# configs in-process, for Llama, Qwen2, Mistral (sliding window) and Gemma 3 (hybrid layers).
# ---------------------------------------------------------------------------------------------
import pytest  # noqa: E402,F811  (repeated so this section stands alone)
import torch  # noqa: E402

torch.set_num_threads(1)  # 2 shared cores; tiny models gain nothing from intra-op threads

CORE_ARCHS = ("llama", "qwen2", "mistral", "gemma3")


def make_tiny_lm(arch: str = "llama", vocab_size: int = 12, max_position_embeddings: int = 40, seed: int = 0,
                 hidden_size: int = 32, num_layers: int = 2, initializer_range: float = 0.1, logit_scale: float = 5.0):
    """A tiny random causal LM of the given architecture, eval mode, with no EOS configured.

    `logit_scale` multiplies lm_head so next-token distributions are peaked enough for a trained
    head to be confident (deep dynamic trees); the greedy argmax is unaffected by the scale.
    Mistral gets sliding_window=5; Gemma 3 gets head_dim 16, sliding_window 4 and layer_types
    sliding/full/sliding (3 layers), untied embeddings (tied ones make it echo its input token).
    """
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=5))
    elif arch == "gemma3":
        common["num_hidden_layers"] = max(3, num_layers)
        types = ["sliding_attention", "full_attention"] * common["num_hidden_layers"]
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, head_dim=16, sliding_window=4,
                                                   layer_types=types[: common["num_hidden_layers"] - 1] + ["sliding_attention"]))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(logit_scale)
    model.generation_config.eos_token_id = None
    return model.eval().requires_grad_(False)


def tiny_eagle3_head(model, draft_ids: list[int] | None = None, seed: int = 1):
    """A random EAGLE-3 head for `model` (which needs >= 7 layers), drafting over `draft_ids`
    (target ids; None = the full vocabulary), bound to it."""
    from eagle2_core.eagle3 import Eagle3Head, Eagle3Spec

    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Spec.for_target(model.config, draft_vocab_size=len(draft_ids) if draft_ids else 0))
    head.set_draft_vocab(torch.tensor(draft_ids) if draft_ids else None)
    return head.bind(model)


def model_digest(model) -> str:
    """A hash of what a fit depends on: the model's class, full config and every tensor of its
    state (int8 weights and their scales included), so equal digests mean equal fits."""
    import hashlib

    h = hashlib.sha1(type(model).__name__.encode())
    h.update(model.config.to_json_string(use_diff=False).encode())
    for name, t in model.state_dict().items():
        if isinstance(t, torch.Tensor):
            t = t.detach().cpu().contiguous()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# (model digest, fit arguments) -> (head state, global RNG state right after the fit). The same
# tiny models are built by several files (test_decoder_identity, test_fixed_cycle, test_budget,
# test_eagle3, ...), and each fit is a deterministic function of the model and the arguments.
_FITS: dict = {}


def distill_tiny_head(model, steps: int = 150, seed: int = 1, n_seq: int = 48, seq_len: int = 32, lr: float = 3e-3,
                      arch: str = "eagle2", draft_ids: list[int] | None = None):
    """A draft head (EAGLE-1/2, or EAGLE-3 with `arch="eagle3"`) fitted for a few seconds to
    `model`'s own sampled text, then bound to it.

    A random head rarely drafts more than one matching token; a fitted one gets accepted paths
    of every depth, so the tests exercise multi-token acceptance and KV compaction. Features
    come from `output_hidden_states` here, independently of the engine's layer hooks.

    Memoised per session: a second call for an equal model (same digest) and equal arguments
    returns a new head, bound to the model it is given, holding a copy of the first fit's
    weights, and leaves torch's global RNG where the fit would have left it. Every caller gets
    its own head object, so a test may change its head without touching another test's.
    """
    key = (model_digest(model), steps, seed, n_seq, seq_len, lr, arch, tuple(draft_ids) if draft_ids else None)
    if key in _FITS:
        state, rng = _FITS[key]
        from eagle2_core.head import DraftHead, HeadSpec

        head = tiny_eagle3_head(model, draft_ids, seed) if arch == "eagle3" else DraftHead(HeadSpec.for_target(model.config)).bind(model)
        head.load_state_dict(state)
        torch.set_rng_state(rng)
        return head.eval().requires_grad_(False)
    head = _fit_tiny_head(model, steps, seed, n_seq, seq_len, lr, arch, draft_ids)
    _FITS[key] = ({k: v.detach().clone() for k, v in head.state_dict().items()}, torch.get_rng_state())
    return head


def _fit_tiny_head(model, steps, seed, n_seq, seq_len, lr, arch, draft_ids):
    from eagle2_core.head import DraftHead, HeadSpec
    from eagle2_core.tree import additive

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if arch == "eagle3":
        head = tiny_eagle3_head(model, draft_ids, seed)
    else:
        head = DraftHead(HeadSpec.for_target(model.config)).bind(model)
    vocab = model.get_output_embeddings().weight.shape[0]
    prompts = torch.randint(0, vocab, (n_seq, 4), generator=gen)
    with torch.no_grad():
        seqs = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0, top_p=1.0,
                              max_new_tokens=seq_len - 4, pad_token_id=0, eos_token_id=None)
        out = model(seqs, output_hidden_states=True)
        if arch == "eagle3":
            feats = torch.cat([out.hidden_states[k] for k in head.feature_layers], dim=-1)
        else:
            feats = out.hidden_states[-1]
        target = torch.softmax(out.logits.float(), -1)
        if arch == "eagle3":  # the target's law over the draft vocabulary
            target = target[..., head.draft_ids()]
            target = target / target.sum(-1, keepdim=True)
    inputs, feats, target = seqs[:, 1:], feats[:, :-1], target[:, 1:]  # pairs (f_t, x_{t+1}) -> p(. | x_<=t+1)
    pos = torch.arange(seq_len - 1)[None].expand(n_seq, -1)
    mask = additive(torch.ones(seq_len - 1, seq_len - 1, dtype=torch.bool).tril(), torch.float32)  # causal
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    head.train()
    with torch.enable_grad():
        for _ in range(steps):
            logp = torch.log_softmax(head.draft_logits(head(inputs, head.project(feats), pos, attention_mask=mask)), -1)
            loss = -(target * logp).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def tiny_lm():
    """Factory: `tiny_lm(arch, **kw)` -> a tiny random causal LM (see `make_tiny_lm`)."""
    return make_tiny_lm


@pytest.fixture(scope="session")
def fitted_head():
    """Factory: `fitted_head(model)` -> a draft head fitted to `model` (see `distill_tiny_head`)."""
    return distill_tiny_head


# -- the sampling rule (accept.accept_sampling_keyed), correct and deliberately broken ------------
KEYED_RULES = ("keyed", "stale_uniform")


def _inverse_cdf(row: list[float], u: float) -> int:
    """accept.inverse_cdf in plain floats: the first token whose cumulative mass exceeds u * total."""
    total, acc = sum(row), 0.0
    for x, r in enumerate(row):
        acc += r
        if acc > u * total:
            return x
    return len(row) - 1


def _stale_walk(parents: list[int], tokens: list[int], rows: list[list[float]], u: float) -> tuple[int, ...]:
    """The tokens one cycle emits when one uniform `u` draws at every depth (the stale_uniform bug)."""
    node, out = 0, []
    while True:
        x = _inverse_cdf(rows[node], u)
        out.append(x)
        child = next((c for c in range(1, len(parents)) if parents[c] == node and tokens[c] == x), None)
        if child is None:
            return tuple(out)
        node = child


def keyed_law(parents: list[int], tokens: list[int], probs, rule: str = "keyed", max_tokens: int | None = None) -> dict:
    """Exact law of the tokens one cycle emits (accepted path tokens + bonus) under `rule`,
    truncated to the first `max_tokens`; keys are token tuples, values probabilities.

    keyed:          the rule: the token after the depth-d node is drawn from p at that node with the
                    uniform of its own position, so each emitted token ~ p at its node
    stale_uniform:  a keying bug: the position is not advanced within a cycle, one uniform draws at
                    every depth (exact: the walk is constant between the rows' CDF breakpoints)
    """
    rows = [[float(v) for v in r] for r in probs]
    law: dict[tuple[int, ...], float] = {}

    def add(seq, q):
        key = seq[:max_tokens] if max_tokens else seq
        law[key] = law.get(key, 0.0) + q

    if rule == "stale_uniform":
        cuts = {0.0, 1.0}
        for r in rows:
            total, acc = sum(r), 0.0
            for v in r:
                acc += v
                cuts.add(min(1.0, acc / total))
        cuts = sorted(cuts)
        for lo, hi in zip(cuts, cuts[1:]):
            if hi > lo:
                add(_stale_walk(parents, tokens, rows, (lo + hi) / 2), hi - lo)
        return law
    assert rule == "keyed", rule

    def walk(node, prefix, pr):
        if max_tokens is not None and len(prefix) >= max_tokens:
            add(prefix, pr)
            return
        for x, q in enumerate(rows[node]):
            if q <= 0:
                continue
            child = next((c for c in range(1, len(parents)) if parents[c] == node and tokens[c] == x), None)
            if child is None:
                add(prefix + (x,), pr * q / sum(rows[node]))
            else:
                walk(child, prefix + (x,), pr * q / sum(rows[node]))
    walk(0, (), 1.0)
    return law


def broken_keyed_rule(rule: str):
    """A sampling acceptance function implementing the broken `rule` (same signature as
    accept.accept_sampling_keyed), to show the losslessness tests reject it."""
    from eagle2_core.accept import accept_sampling_keyed

    assert rule == "stale_uniform", rule

    def accept(tree, probs, uniforms):
        return accept_sampling_keyed(tree, probs, [uniforms[0]] * len(uniforms))
    return accept


def pooled_chisquare(counts: dict, law: dict, n: int, min_expected: float = 5.0):
    """Pearson chi-square of observed counts against an exact law, cells with expected < 5 pooled.

    Returns (statistic, dof, p-value, bins) where bins lists the cell groups used, so the same
    binning can be reused for a power calculation. Observations outside the law's support raise.
    """
    from scipy import stats

    outside = {k: c for k, c in counts.items() if law.get(k, 0.0) <= 0}
    if outside:
        raise AssertionError(f"observed outcomes of probability zero: {outside}")
    keys = sorted(k for k in law if law[k] > 0)
    big = [k for k in keys if n * law[k] >= min_expected]
    small = [k for k in keys if n * law[k] < min_expected]
    bins = [[k] for k in big] + ([small] if small else [])
    if len(bins) > 1 and sum(n * law[k] for k in bins[-1]) < min_expected and small:
        bins[-2] = bins[-2] + bins[-1]  # the pooled tail is still small: merge it into the last big cell
        bins.pop()
    obs = [sum(counts.get(k, 0) for k in b) for b in bins]
    exp = [n * sum(law[k] for k in b) for b in bins]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    dof = len(bins) - 1
    return stat, dof, float(stats.chi2.sf(stat, dof)), bins


def chisquare_power(law0: dict, law1: dict, bins, n: int, alpha: float) -> float:
    """Power of the level-`alpha` Pearson test (binned as `bins`) against samples from `law1`,
    from the noncentral chi-square with noncentrality n * sum((p1 - p0)^2 / p0)."""
    from scipy import stats

    p0 = [sum(law0.get(k, 0.0) for k in b) for b in bins]
    p1 = [sum(law1.get(k, 0.0) for k in b) for b in bins]
    outside = 1.0 - sum(p1)  # mass law1 puts where law0 has none: the test fails outright there
    lam = n * sum((b - a) ** 2 / a for a, b in zip(p0, p1))
    dof = len(bins) - 1
    crit = stats.chi2.ppf(1 - alpha, dof)
    power = float(stats.ncx2.sf(crit, dof, lam)) if lam > 0 else alpha
    return 1.0 - (1.0 - power) * (1.0 - outside) ** n if outside > 1e-12 else power


# ---------------------------------------------------------------------------------------------
# Two workers (pytest-xdist, `-n 2` in pyproject's addopts): each test file runs whole on one
# worker, so its module fixtures (trained tiny heads, built models) are made once; the tests on
# the embedded SmolLM2 share one group, so its conversion and cost profile happen once too.
# ---------------------------------------------------------------------------------------------
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = "smollm2" if "smollm2" in getattr(item, "fixturenames", ()) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
