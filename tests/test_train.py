"""Training pipeline: data readers, chat-template loss masks, self-distillation, resume, end to end."""
from __future__ import annotations

import json
import os

import pytest
import torch

from eagle2_core.train.data import ReadReport, first_user_prompts, read_conversations, render

# SmolLM2-135M-Instruct's chat template, as its GGUF carries it (ChatML with a default system turn).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "Hi! How are you?"},
                                  {"from": "human", "value": "Fine."}, {"from": "gpt", "value": "Good to hear."}]},
    {"id": "b", "conversations": [{"from": "human", "value": "Count to three"}, {"from": "gpt", "value": "1 2 3"}]},
    {"id": "c", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Name a fox"},
                                  {"from": "gpt", "value": "The quick brown fox."}]},
]


def write_truncated_sharegpt(path, records, cut_record):
    text = json.dumps(records + [cut_record], indent=2)
    cut = text.rindex('"value"')  # cut inside the last record, as the public dump is cut
    with open(path, "w") as f:
        f.write(text[:cut])


def test_truncated_sharegpt_yields_whole_records_and_counts_skips(tmp_path):
    path = tmp_path / "sharegpt.json"
    bad = {"id": "x", "conversations": [{"from": "alien", "value": "?"}]}
    write_truncated_sharegpt(path, SHAREGPT + [bad], {"id": "cut", "conversations": [{"from": "human", "value": "lost"}]})
    rep = ReadReport()
    convs = read_conversations(str(path), rep)
    assert len(convs) == 3 and rep.records == 3
    assert rep.skipped == 1 and "record 4" in rep.reasons[0]
    assert rep.truncated_tail
    assert convs[2][0] == {"role": "system", "content": "Be brief."}


def test_jsonl_messages_and_prompts_with_bad_lines(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                    'not json\n{"prompt": "just a prompt"}\n{"prompt": 3}\n')
    rep = ReadReport()
    convs = read_conversations(str(path), rep)
    assert [len(c) for c in convs] == [2, 1]
    assert rep.skipped == 2 and rep.reasons[0].endswith("invalid JSON (Expecting value)") and ":2" in rep.reasons[0]
    assert first_user_prompts(convs) == [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "just a prompt"}]]


def test_assistant_only_loss_mask_on_smollm2_template(tiny_target):
    tok = tiny_target.tokenizer
    conv = read_conversations_from(SHAREGPT[0])
    ids, mask = render(tok, conv, chat_template=SMOLLM2_TEMPLATE)
    full = tok.apply_chat_template(conv, tokenize=False, chat_template=SMOLLM2_TEMPLATE)
    assert tok.decode(ids) == full
    assert "You are a helpful AI assistant named SmolLM" in full
    # The masked tokens are exactly the two assistant replies, each with its end-of-turn marker.
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    if cur:
        spans.append(tok.decode(cur))
    assert spans == ["Hi! How are you?<|im_end|>\n", "Good to hear.<|im_end|>\n"]


def read_conversations_from(rec):
    from eagle2_core.train.data import _record_to_messages

    return _record_to_messages(rec)


def _tiny_job(tmp_path, data_path, **cfg_overrides):
    from eagle2_core.train.pipeline import TrainJob
    from eagle2_core.train.trainer import TrainConfig

    cfg = TrainConfig(epochs=2, lr=1e-3, warmup_steps=2, batch_tokens=256, max_len=128, ttt_steps=2, draft_vocab=64, **cfg_overrides)
    return TrainJob(data=[str(data_path)], out_dir=str(tmp_path / "head"), work_dir=str(tmp_path / "work"), distill_prompts=6,
                    distill_max_new_tokens=12, distill_batch=4, eval_prompts=2, eval_max_new_tokens=8, max_len=128, config=cfg)


def test_train_end_to_end_then_decode_losslessly(tiny_target, tmp_path):
    from eagle2_core import Engine, GenerationSettings, TreeSettings
    from eagle2_core.headfiles import load_head_folder
    from eagle2_core.train.pipeline import run_training

    data = tmp_path / "sharegpt.json"
    write_truncated_sharegpt(data, SHAREGPT * 4, {"id": "cut", "conversations": []})
    job = _tiny_job(tmp_path, data)
    result = run_training(tiny_target, job, log=lambda m: None)
    assert result["steps"] > 0 and result["tokens_seen"] > 0
    # Self-distilled answers were written, with features captured during generation.
    assert os.path.getsize(os.path.join(job.work_dir, "distill.jsonl")) > 0
    assert any(f.startswith("distill-") for f in os.listdir(os.path.join(job.work_dir, "features")))
    # The head is in the published EAGLE-1/2 format plus our metadata.
    files = set(os.listdir(job.out_dir))
    assert {"config.json", "model.safetensors", "eagle2.json", "eagle2_draft_vocab.safetensors"} <= files
    meta = json.load(open(os.path.join(job.out_dir, "eagle2.json")))
    assert meta["steps"] > 0 and "tau" in meta["eval"] and meta["learning_curve"]
    model = tiny_target.model
    head = load_head_folder(job.out_dir, model)
    assert head.draft_vocab is not None and head.draft_vocab.numel() <= 64 + 4
    prompt = tiny_target.tokenizer("Write a short poem about")["input_ids"]
    out, _ = Engine(model, head, tiny_target.tokenizer, TreeSettings(total_tokens=10, depth=3, top_k=3)).generate(
        prompt, GenerationSettings(max_new_tokens=20, eos_token_ids=()))
    ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=20,
                         do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out == ref


def check_resume_reaches_the_same_step_count(target, tmp_path, cfg, layers=None, keys=None) -> None:
    """Train fully; train again, interrupted at step 5, then resumed: same steps and epochs."""
    from eagle2_core.train.data import render
    from eagle2_core.train.features import extract_features, load_features
    from eagle2_core.train.trainer import train_head

    samples = [render(target.tokenizer, read_conversations_from(r)) for r in SHAREGPT * 6]
    extract_features(target.model, samples, str(tmp_path / "feat"), shard_tokens=200, layers=layers)
    seqs = load_features(str(tmp_path / "feat"), *([keys] if keys else []))
    full = train_head(target.model, seqs, str(tmp_path / "h_full"), cfg, str(tmp_path / "w_full"), log=lambda m: None)

    def interrupt(step, total, stats):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_head(target.model, seqs, str(tmp_path / "h"), cfg, str(tmp_path / "w"), log=lambda m: None, progress=interrupt)
    assert os.path.exists(tmp_path / "w" / "checkpoint.pt")
    resumed = train_head(target.model, seqs, str(tmp_path / "h"), cfg, str(tmp_path / "w"), resume=True, log=lambda m: None)
    assert full.step > 5
    assert resumed.step == full.step and resumed.epoch == full.epoch == 3


def test_resume_after_interrupt_reaches_the_same_step_count(tiny_target, tmp_path):
    from eagle2_core.train.trainer import TrainConfig

    check_resume_reaches_the_same_step_count(
        tiny_target, tmp_path, TrainConfig(epochs=3, warmup_steps=2, batch_tokens=128, max_len=128, ttt_steps=2, draft_vocab=0))


def test_training_time_test_mask_matches_tree_attention():
    """Step j row a sees true context up to pair a-j and its own ancestors at steps 1..j."""
    from eagle2_core.train.trainer import ttt_mask

    L = 5
    valid = torch.ones(1, L, dtype=torch.bool)
    m = ttt_mask(L, 2, valid, torch.float32)[0, 0] == 0
    a = 4
    seen = {(blk, s) for blk in range(3) for s in range(L) if m[a, blk * L + s]}
    assert seen == {(0, 0), (0, 1), (0, 2), (1, 3), (2, 4)}
    assert torch.equal(ttt_mask(L, 0, valid, torch.float32)[0, 0] == 0, torch.tril(torch.ones(L, L, dtype=torch.bool)))


def test_warm_start_copies_the_head_layer_and_records_prior_compute(tiny_target, tmp_path):
    from safetensors.torch import load_file

    from eagle2_core.train.data import render
    from eagle2_core.train.features import extract_features, load_features
    from eagle2_core.train.trainer import TrainConfig, train_head

    samples = [render(tiny_target.tokenizer, read_conversations_from(r)) for r in SHAREGPT * 4]
    extract_features(tiny_target.model, samples, str(tmp_path / "feat"))
    seqs = load_features(str(tmp_path / "feat"))
    cfg = TrainConfig(epochs=1, warmup_steps=1, batch_tokens=128, max_len=128, ttt_steps=1, draft_vocab=0)
    train_head(tiny_target.model, seqs, str(tmp_path / "h1"), cfg, str(tmp_path / "w1"), log=lambda m: None)
    first = load_file(str(tmp_path / "h1" / "model.safetensors"))
    # Learning rate 0: the warm-started head must come out exactly as it went in ...
    cfg0 = TrainConfig(epochs=1, warmup_steps=1, lr=0.0, batch_tokens=128, max_len=128, ttt_steps=1, draft_vocab=0,
                       init_head=str(tmp_path / "h1"), seed=1)
    train_head(tiny_target.model, seqs, str(tmp_path / "h2"), cfg0, str(tmp_path / "w2"), log=lambda m: None)
    second = load_file(str(tmp_path / "h2" / "model.safetensors"))
    assert set(first) == set(second) and all(torch.equal(first[k], second[k]) for k in first)
    # ... while the same run without the warm start differs, and the prior compute is on record.
    train_head(tiny_target.model, seqs, str(tmp_path / "h3"), TrainConfig(**{**cfg0.__dict__, "init_head": None}),
               str(tmp_path / "w3"), log=lambda m: None)
    third = load_file(str(tmp_path / "h3" / "model.safetensors"))
    assert not torch.equal(first["fc.weight"], third["fc.weight"])
    meta = json.load(open(tmp_path / "h2" / "eagle2.json"))
    assert meta["init_head"] == str(tmp_path / "h1") and meta["init_head_compute"]["steps"] > 0


def test_lr_schedule_decays_by_steps_or_by_time_whichever_ends_first():
    from eagle2_core.train.trainer import TrainConfig, lr_schedule

    cfg = TrainConfig(lr=1.0, warmup_steps=10)
    assert lr_schedule(cfg, 0, 1000) == pytest.approx(0.1)          # warm-up
    assert lr_schedule(cfg, 10, 1000) == pytest.approx(1.0)         # peak
    assert lr_schedule(cfg, 1000, 1000) == pytest.approx(0.1)       # floor at the end
    timed = TrainConfig(lr=1.0, warmup_steps=10, time_budget_s=100.0)
    assert lr_schedule(timed, 20, 1000, train_s=0.0) > 0.99
    assert lr_schedule(timed, 20, 1000, train_s=50.0) == pytest.approx(0.55)  # half the time: half-way down the cosine
    assert lr_schedule(timed, 20, 1000, train_s=100.0) == pytest.approx(0.1)
    # trained in slices (each call stops at its own budget), the decay spans the whole run
    sliced = TrainConfig(lr=1.0, warmup_steps=10, time_budget_s=50.0, schedule_s=200.0)
    assert lr_schedule(sliced, 20, 1000, train_s=50.0) == pytest.approx(lr_schedule(TrainConfig(lr=1.0, warmup_steps=10, time_budget_s=200.0), 20, 1000, train_s=50.0))
    assert lr_schedule(sliced, 20, 1000, train_s=50.0) > 0.8


def test_prefill_extraction_equals_a_plain_forward_and_resumes_shard_by_shard(tiny_target, tmp_path):
    """Features and labels are those of a plain forward over the same text; an extraction
    interrupted after its first shard and run again writes the same shards; a larger token budget
    redoes only the shard whose samples changed (each shard carries a fingerprint of its samples)."""
    from safetensors.torch import load_file

    from eagle2_core.train.features import extract_features, load_features

    model = tiny_target.model
    samples = [render(tiny_target.tokenizer, read_conversations_from(r)) for r in SHAREGPT * 4]
    full = tmp_path / "full"
    n = extract_features(model, samples, str(full), shard_tokens=150, topk=8)
    assert n >= 3
    for seq, (ids, mask) in zip(load_features(str(full)), samples):
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        probs = torch.softmax(out.logits[0].float(), -1)
        v, i = torch.topk(probs, 8, dim=-1)
        assert seq["input_ids"].tolist() == ids and seq["loss_mask"].tolist() == [bool(m) for m in mask]
        torch.testing.assert_close(seq["hidden"].float(), out.hidden_states[-1][0], atol=2e-2, rtol=1e-2)  # stored in bf16
        assert torch.equal(seq["top_ids"].long(), i)
        torch.testing.assert_close(seq["top_probs"].float(), v, atol=1e-3, rtol=1e-3)      # stored in fp16

    part = tmp_path / "part"
    calls = []

    def stop_after_first(done, total):
        calls.append(done)
        if done == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        extract_features(model, samples, str(part), shard_tokens=150, topk=8, progress=stop_after_first)
    assert sorted(os.listdir(part)) == ["features-00000.safetensors"]
    extract_features(model, samples, str(part), shard_tokens=150, topk=8)
    names = sorted(f for f in os.listdir(full) if f.endswith(".safetensors"))
    assert names == sorted(f for f in os.listdir(part) if f.endswith(".safetensors"))
    for f in names:
        a, b = load_file(str(full / f)), load_file(str(part / f))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # More samples: the earlier full shards are kept as they are, the reshaped last one is redone.
    before = {f: os.path.getmtime(part / f) for f in names}
    more = samples + samples[:3]
    m = extract_features(model, more, str(part), shard_tokens=150, topk=8)
    kept = [f for f in names if os.path.getmtime(part / f) == before[f]]
    assert len(kept) >= n - 1 and m >= n
    assert sum(len(s["input_ids"]) for s in load_features(str(part))) == sum(len(s[0]) for s in more)


def test_a_weighted_mix_of_sources_trains_end_to_end(tiny_target, tmp_path):
    """Self-distilled and original features in one run, weighted per epoch by --mix."""
    import dataclasses
    import random

    from click.testing import CliRunner

    from eagle2_cli.main import cli
    from eagle2_core.train.features import load_features
    from eagle2_core.train.pipeline import run_training, weighted

    seqs = list(range(10))
    assert len(weighted(seqs, 2.5, random.Random(0))) == 25 and weighted(seqs, 0, random.Random(0)) == []
    assert sorted(set(weighted(seqs, 0.5, random.Random(0)))) != seqs and len(set(weighted(seqs, 1.5, random.Random(0)))) == 10

    data = tmp_path / "sharegpt.json"
    write_truncated_sharegpt(data, SHAREGPT * 4, {"id": "cut", "conversations": []})
    job = dataclasses.replace(_tiny_job(tmp_path, data), mix={"distill": 2.0, "original": 0.5})
    result = run_training(tiny_target, job, log=lambda m: None)
    assert result["steps"] > 0
    meta = json.load(open(os.path.join(job.out_dir, "eagle2.json")))
    base = {s: [len(x["input_ids"]) for x in load_features(os.path.join(job.work_dir, d))]
            for s, d in (("distill", "features"), ("original", "features-original"))}
    assert meta["tokens_by_source"]["distill"] == 2 * sum(base["distill"])
    assert meta["tokens_by_source"]["original"] < sum(base["original"]) and meta["mix"] == {"distill": 2.0, "original": 0.5}
    r = CliRunner().invoke(cli, ["train", "--data", str(data), "-o", str(tmp_path / "x"), "--mix", "original=-1"])
    assert r.exit_code == 2 and "--mix" in r.output


def test_float8_feature_storage_halves_the_bytes_and_stays_close(tiny_target, tmp_path):
    from eagle2_core.train.features import extract_features, load_features

    samples = [render(tiny_target.tokenizer, read_conversations_from(r)) for r in SHAREGPT * 2]
    extract_features(tiny_target.model, samples, str(tmp_path / "bf"), topk=8)
    extract_features(tiny_target.model, samples, str(tmp_path / "f8"), topk=8, feature_dtype="float8")
    a, b = load_features(str(tmp_path / "bf")), load_features(str(tmp_path / "f8"))
    for x, y in zip(a, b):
        assert y["hidden"].dtype == torch.bfloat16 and y["hidden"].shape == x["hidden"].shape
        rel = ((y["hidden"].float() - x["hidden"].float()).norm(dim=-1) / x["hidden"].float().norm(dim=-1)).max()
        assert 0 < rel < 0.06  # e4m3 keeps 3 mantissa bits: about 2-3% per row (SmolLM2: 2.2% mean)
        assert torch.equal(x["top_ids"], y["top_ids"])
    from safetensors import safe_open

    with safe_open(str(tmp_path / "f8" / "features-00000.safetensors"), "pt") as f:
        assert f.get_slice("hidden").get_dtype() == "F8_E4M3"
    with pytest.raises(ValueError, match="feature dtype"):
        extract_features(tiny_target.model, samples, str(tmp_path / "x"), feature_dtype="int4")
