"""Training a draft head (EAGLE-1/2 or EAGLE-3) on cached target features.

The loss comes from the head (`head.objective`). EAGLE-1/2 (EAGLE paper, section 3.2): smooth-L1
regression of the next feature plus 0.1 x the cross-entropy against the target's next-token
distribution, with uniform noise on the input features. EAGLE-3 (its section 3.1): the
cross-entropy alone, over steps of training-time test, renormalised over the draft vocabulary
and counted where the target's top token is drafted. Two additions, each there for a measured
reason:
  * the distribution term is computed over a pruned draft vocabulary (the most frequent target
    tokens) against the cached top-k target probabilities, so no step touches the full lm_head;
  * training-time test (EAGLE-3 section 3.3, HASS): steps j >= 1 feed the head its own predicted
    features, with the attention pattern it meets at tree depth j+1, so deeper draft tokens are
    trained on the inputs they see at inference.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from .. import atomic
from ..eagle3 import Eagle3Head, Eagle3Spec, default_feature_layers, num_target_layers
from ..head import DraftHead, HeadSpec
from ..headfiles import build_head, check_fits, read_head_folder
from ..tree import additive
from .parallel import World, check_replicas_agree, sync_gradients, world

ARCHS = ("eagle2", "eagle3")


@dataclass
class TrainConfig:
    arch: str = "eagle2"          # eagle2: EAGLE-1/2 head and format; eagle3: EAGLE-3
    epochs: int = 10
    lr: float = 5e-4
    warmup_steps: int = 100
    batch_tokens: int = 2048
    max_len: int = 1024
    noise: float | None = None    # uniform noise on input features, relative to their RMS (None: the head's objective)
    p_weight: float | None = None # weight of the distribution loss (None: EAGLE 0.1, EAGLE-3 1)
    v_weight: float | None = None # weight of the feature regression (None: EAGLE 1, EAGLE-3 0)
    ttt_steps: int = 3            # 1 = plain EAGLE-1 training
    ttt_decay: float = 0.8        # weight of step j is decay**j
    draft_vocab: int = 16384      # 0 = full vocabulary
    grad_clip: float = 0.5
    weight_decay: float = 0.0
    seed: int = 0
    eval_every_epochs: int = 1
    time_budget_s: float | None = None   # stop (and save) after this much training time
    schedule_s: float | None = None      # the learning rate decays over this much training time (None: time_budget_s);
                                         # a run trained in slices between rounds of distillation spans all of them
    max_steps: int | None = None
    init_head: str | None = None  # warm start from this head folder (e.g. to go on with more data)

    def loss_settings(self, head) -> dict:
        """The head's objective, with any weight set explicitly in this config taking precedence."""
        out = dict(head.objective)
        out.update({k: getattr(self, k) for k in ("noise", "p_weight", "v_weight") if getattr(self, k) is not None})
        return out


def feature_key(arch: str) -> str:
    """Which stored feature a head of this kind reads: the final hidden state or EAGLE-3's fused layers."""
    return "fused" if arch == "eagle3" else "hidden"


def feature_layers_for(arch: str, target_config) -> tuple[int, ...] | None:
    return default_feature_layers(num_target_layers(target_config)) if arch == "eagle3" else None


def new_head(arch: str, model, draft_vocab: torch.Tensor | None):
    """A fresh head of the given kind shaped for `model`, bound to it, with its draft vocabulary."""
    if arch not in ARCHS:
        raise ValueError(f"--arch must be one of {', '.join(ARCHS)}, not {arch!r}")
    if arch == "eagle2":
        return DraftHead(HeadSpec.for_target(model.config), draft_vocab).bind(model)
    spec = Eagle3Spec.for_target(model.config, draft_vocab_size=len(draft_vocab) if draft_vocab is not None else 0)
    head = Eagle3Head(spec)
    head.set_draft_vocab(draft_vocab)
    head.bind(model)
    head.init_lm_head_from(model)
    return head


def build_draft_vocab(seqs: list[dict], size: int, always: set[int] = frozenset(), vocab_size: int | None = None) -> torch.Tensor | None:
    """The `size` target tokens most often ranked first by the target on the training data."""
    if not size or (vocab_size is not None and size >= vocab_size):
        return None
    counts = Counter()
    for s in seqs:
        counts.update(s["top_ids"][:, 0].tolist())
        counts.update(s["input_ids"].tolist())
    chosen = [t for t in always] + [t for t, _ in counts.most_common(size)]
    # Tokens never seen in the data fill the rest in id order: BPE vocabularies number their
    # tokens roughly by merge frequency, so low ids are the likelier ones.
    chosen += range(vocab_size or size)
    ids: list[int] = []
    seen: set[int] = set()
    for t in chosen:
        if t not in seen:
            seen.add(t)
            ids.append(t)
            if len(ids) == size:
                break
    return torch.tensor(sorted(ids), dtype=torch.long)


def make_batches(seqs: list[dict], batch_tokens: int, max_len: int, rng: random.Random) -> list[list[int]]:
    order = sorted(range(len(seqs)), key=lambda i: min(len(seqs[i]["input_ids"]), max_len))
    batches, cur, width = [], [], 0
    for i in order:
        n = min(len(seqs[i]["input_ids"]), max_len)
        if n < 3:
            continue
        if cur and max(width, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, width = [], 0
        cur.append(i)
        width = max(width, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(seqs: list[dict], idx: list[int], max_len: int, t2d: torch.Tensor | None, key: str = "hidden"):
    """Pad a batch: input features (`key`), next features for regression (`hidden`, when the
    head regresses them, else empty), tokens, loss mask, valid mask, top-k labels."""
    L = max(min(len(seqs[i]["input_ids"]), max_len) for i in idx)
    B = len(idx)
    H = seqs[idx[0]][key].shape[-1]
    K = seqs[idx[0]]["top_ids"].shape[-1]
    feat = torch.zeros(B, L, H)
    ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.bool)
    valid = torch.zeros(B, L, dtype=torch.bool)
    pv = torch.zeros(B, L, K)
    pi = torch.zeros(B, L, K, dtype=torch.long)
    for b, i in enumerate(idx):
        s = seqs[i]
        n = min(len(s["input_ids"]), L)
        feat[b, :n] = s[key][:n].float()
        ids[b, :n] = s["input_ids"][:n]
        mask[b, :n] = s["loss_mask"][:n]
        valid[b, :n] = True
        pv[b, :n] = s["top_probs"][:n].float()
        pi[b, :n] = s["top_ids"][:n].long()
    if t2d is not None:
        pi = t2d[pi]  # -1 where the target's token is outside the draft vocabulary
    return feat, ids, mask, valid, pv, pi


def ttt_mask(L: int, step: int, valid: torch.Tensor, dtype) -> torch.Tensor:
    """Additive mask for step `step` rows over keys of steps 0..step (each L rows).

    Row a of step j stands for a tree node at depth j+1 whose context ends at pair a-j: it sees
    step-0 keys s <= a-j (true features) and, for 1 <= i <= j, the key of its own ancestor at
    step i (row a-j+i). Step 0 is the ordinary causal mask.
    """
    dev = valid.device
    a = torch.arange(L, device=dev)
    blocks = [a[None, :] <= (a[:, None] - step)]
    for i in range(1, step + 1):
        blocks.append(a[None, :] == (a[:, None] - step + i))
    allowed = torch.cat(blocks, dim=1)[None] & valid.repeat(1, step + 1)[:, None, :]
    allowed |= torch.cat([torch.zeros(L, L * step, dtype=torch.bool, device=dev), torch.eye(L, dtype=torch.bool, device=dev)], 1)[None]
    return additive(allowed, dtype)


def batch_loss(head, batch, cfg: TrainConfig, gen: torch.Generator) -> tuple[torch.Tensor, dict]:
    """Training-time test over `cfg.ttt_steps` unrolled draft steps; the loss is the head's objective."""
    from transformers import DynamicCache

    feat, ids, mask, valid, pv, pi = batch
    obj = cfg.loss_settings(head)
    B, L, H = feat.shape
    # Pair a = (feature_a, token_{a+1}); predicts feature_{a+1} and the target's distribution there.
    in_feat, in_ids = feat[:, :-1], ids[:, 1:]
    tgt_feat, tgt_pv, tgt_pi = feat[:, 1:], pv[:, 1:], pi[:, 1:]
    in_vocab = tgt_pi >= 0
    row_ok = (mask[:, 1:] & valid[:, 1:]).float()
    if obj["renormalise"]:
        # EAGLE-3: the target's distribution restricted to the draft vocabulary, renormalised,
        # and only where the target's top token can be drafted at all.
        tgt_pv = tgt_pv * in_vocab
        tgt_pv = tgt_pv / tgt_pv.sum(-1, keepdim=True).clamp(min=1e-6)
        row_ok = row_ok * in_vocab[..., 0]
    n = L - 1
    if obj["noise"]:
        rms = in_feat.pow(2).mean().sqrt()
        in_feat = in_feat + (torch.rand(in_feat.shape, generator=gen, device=gen.device) - 0.5) * 2 * obj["noise"] * rms
    pos = torch.arange(n, device=feat.device)[None].expand(B, n)
    cache = DynamicCache()
    total = torch.zeros((), device=feat.device)
    stats = {}
    x = head.project(in_feat)
    for j in range(cfg.ttt_steps):
        out = head(in_ids, x, pos, attention_mask=ttt_mask(n, j, valid[:, 1:], feat.dtype), cache=cache)
        w = row_ok.clone()
        w[:, :j] = 0
        denom = w.sum().clamp(min=1)
        logq = torch.log_softmax(head.draft_logits(out).float(), dim=-1)
        ce = -(logq.gather(-1, tgt_pi.clamp(min=0)) * tgt_pv * in_vocab).sum(-1)
        ploss = (ce * w).sum() / denom
        step_loss = obj["p_weight"] * ploss
        if obj["v_weight"]:
            vloss = (F.smooth_l1_loss(out, tgt_feat, reduction="none").mean(-1) * w).sum() / denom
            step_loss = step_loss + obj["v_weight"] * vloss
        top1 = (logq.argmax(-1) == tgt_pi[..., 0]) & in_vocab[..., 0]
        stats[f"acc{j}"] = ((top1.float() * w).sum() / denom).item()
        total = total + (cfg.ttt_decay ** j) * step_loss
        if j == 0:
            stats.update(ploss=ploss.item(), **({"vloss": vloss.item()} if obj["v_weight"] else {}))
        # Next step's input at row a is this step's prediction at row a-1 (its parent's feature).
        x = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
    return total, stats


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    tokens_seen: int = 0
    train_s: float = 0.0
    best_tau: float = -1.0
    history: list[dict] = field(default_factory=list)


def lr_schedule(cfg: TrainConfig, step: int, total_steps: int, train_s: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak.

    With a time budget the decay follows whichever runs out first, steps or time, so a run
    cut by its budget still ends at a low learning rate instead of mid-schedule.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    span = cfg.schedule_s or cfg.time_budget_s
    if span:
        t = max(t, train_s / span)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def init_from(head: DraftHead, folder: str, target_model) -> dict:
    """Copy a trained head's layer weights into `head` (its draft vocabulary is rebuilt from the data).

    Returns the starting head's metadata, whose compute counts towards the new head.
    """
    spec, sd, _, meta = read_head_folder(folder)
    where = f"--init-head {folder}"
    check_fits(spec, target_model, where=where)
    start = build_head(spec, sd, where=where)
    if start.kind != head.kind:
        raise ValueError(f"{where} is an {start.kind} head; this run trains an {head.kind} head (--arch)")
    own = start.head_state_dict()
    if head.kind == "eagle3" and not torch.equal(start.d2t.cpu(), head.d2t.cpu()):
        # The draft vocabulary comes from the data; the start head's lm_head rows fit only its own.
        own = {k: v for k, v in own.items() if k not in ("d2t", "t2d", "lm_head.weight")}
    head.load_state_dict(own, strict=False)
    return meta


def train_head(model, seqs: list[dict], out_dir: str, cfg: TrainConfig, work_dir: str, resume: bool = False,
               eval_fn: Callable[[DraftHead], dict] | None = None, log: Callable[[str], None] = print,
               progress: Callable[[int, int, dict], None] | None = None, metadata: dict | None = None) -> TrainState:
    """Train, checkpoint to work_dir every epoch (and on stop), save the best head to out_dir.

    Under a distributed launcher (`parallel.py`) every process runs this with the same
    arguments: each trains on its share of every batch, and only the first process evaluates,
    logs and writes files."""
    w = world(model.get_output_embeddings().weight.device)
    if not w.main:
        eval_fn, log, progress = None, (lambda m: None), None
    torch.manual_seed(cfg.seed)
    os.makedirs(work_dir, exist_ok=True)
    ckpt_path = os.path.join(work_dir, "checkpoint.pt")
    spec = HeadSpec.for_target(model.config)
    state = TrainState()
    key = feature_key(cfg.arch)
    vocab_path = os.path.join(work_dir, "draft_vocab.pt")
    if resume and os.path.exists(vocab_path):
        draft_vocab = torch.load(vocab_path, weights_only=True)
    else:
        from ..target import model_eos_ids

        draft_vocab = build_draft_vocab(seqs, cfg.draft_vocab, model_eos_ids(model, None), spec.vocab_size)
        if w.main:  # every process builds the same vocabulary from the same data
            torch.save(draft_vocab, vocab_path)
    head = new_head(cfg.arch, model, draft_vocab)
    head.float().train()  # fp32 master weights whatever the target's dtype; evaluation uses a copy in the target's
    dev = head.fc.weight.device
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the head is small; TF32 costs no measurable accuracy here
    t2d = None
    if draft_vocab is not None:
        t2d = torch.full((spec.vocab_size,), -1, dtype=torch.long)
        t2d[draft_vocab] = torch.arange(len(draft_vocab))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    steps_per_epoch = len(make_batches(seqs, cfg.batch_tokens, cfg.max_len, random.Random(0)))
    total_steps = cfg.max_steps or steps_per_epoch * cfg.epochs
    if resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, weights_only=True)
        head.load_state_dict(ck["head"], strict=False)
        opt.load_state_dict(ck["opt"])
        state = TrainState(**json.loads(ck["state"]))
        log(f"resumed at step {state.step}, epoch {state.epoch}")

    if cfg.init_head:
        # On --resume the checkpoint already holds the weights; only the metadata is read again.
        if state.step == 0:
            prior = init_from(head, cfg.init_head, model)
            log(f"warm start from {cfg.init_head}")
        else:
            prior = read_head_folder(cfg.init_head)[3]
        metadata = dict(metadata or {}, init_head=cfg.init_head,
                        init_head_compute={k: prior.get(k) for k in ("tokens_seen", "steps", "train_s", "training_tokens")})

    def lr_at(step):
        return lr_schedule(cfg, step, total_steps, state.train_s)

    def save_checkpoint():
        if not w.main:
            return
        ckpt = {"head": head.state_dict(), "opt": opt.state_dict(), "state": json.dumps(asdict(state))}
        atomic.replace_with(ckpt_path, lambda tmp: torch.save(ckpt, tmp))

    def evaluate_and_keep(mean_loss: float):
        if not w.main:
            return
        result = eval_fn(head) if eval_fn else {}
        head.train()
        entry = {"epoch": state.epoch, "step": state.step, "tokens_seen": state.tokens_seen, "train_s": round(state.train_s, 1),
                 "loss": round(mean_loss, 4), **result}
        state.history.append(entry)
        log(", ".join(f"{k}={v}" for k, v in entry.items()))
        score = result.get("tau", -mean_loss)  # without an evaluator, keep the lowest loss
        if score > state.best_tau:
            state.best_tau = score
            meta = dict(metadata or {}, tokens_seen=state.tokens_seen, steps=state.step, train_s=round(state.train_s, 1),
                        recipe=asdict(cfg), eval=result, learning_curve=state.history)
            head.save(out_dir, metadata=meta)
        save_checkpoint()

    gen = torch.Generator(device=dev).manual_seed(cfg.seed + state.step)
    try:
        _loop(state, cfg, seqs, steps_per_epoch, total_steps, t2d, opt, lr_at, head, key, gen, params, progress,
              save_checkpoint, evaluate_and_keep, w)
    except KeyboardInterrupt:
        save_checkpoint()  # Ctrl-C keeps everything up to the last finished step: --resume goes on from there
        raise
    check_replicas_agree(w, params)
    return state


def _loop(state, cfg, seqs, steps_per_epoch, total_steps, t2d, opt, lr_at, head, key, gen, params, progress, save_checkpoint,
          evaluate_and_keep, w: World):
    stop = False
    carry = 0.0  # the previous step's time after the gradient sync (optimizer step), counted with this one
    while state.epoch < cfg.epochs and not stop:
        batches = make_batches(seqs, cfg.batch_tokens, cfg.max_len, random.Random(cfg.seed + state.epoch))
        skip = state.step - state.epoch * steps_per_epoch
        losses = []
        for b_i, idx in enumerate(batches):
            if b_i < skip:
                continue
            t0 = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = lr_at(state.step)
            opt.zero_grad(set_to_none=True)
            mine = w.share(idx)  # all of it in a single process
            tokens, loss_v, stats = 0.0, 0.0, {}
            if mine:
                batch = tuple(t.to(gen.device, non_blocking=True) for t in collate(seqs, mine, cfg.max_len, t2d, key))
                loss, stats = batch_loss(head, batch, cfg, gen)
                loss.backward()
                tokens, loss_v = float(batch[3].sum()), loss.item()
            # One all-reduce: gradients, tokens, loss and time, so every process takes the same step
            # and makes the same decisions (time budget, schedule) from the same numbers.
            tokens, (loss_sum, dt_sum) = sync_gradients(w, params, tokens, [loss_v * tokens, time.perf_counter() - t0 + carry])
            t1 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            carry = time.perf_counter() - t1
            step_loss = loss_sum / max(tokens, 1.0)
            state.step += 1
            state.tokens_seen += int(tokens)
            state.train_s += dt_sum / w.size
            losses.append(step_loss)
            if progress:
                progress(state.step, total_steps, dict(stats, loss=step_loss))
            if (cfg.time_budget_s and state.train_s >= cfg.time_budget_s) or (cfg.max_steps and state.step >= cfg.max_steps):
                stop = True
                break
            if state.step % 200 == 0:
                save_checkpoint()
        if not stop:
            state.epoch += 1
        if stop or state.epoch % cfg.eval_every_epochs == 0:
            evaluate_and_keep(sum(losses) / max(1, len(losses)))
