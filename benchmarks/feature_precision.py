"""Feature storage precision: does rounding the draft head's input features cost agreement?

The shipped SmolLM2 head, teacher-forced on held-out ShareGPT assistant turns, predicts the
target's next token from features in float32, bf16, float8 e4m3 and int8 (one scale per token);
prints its top-1 agreement with the target under each, and each format's mean relative error.
    SHAREGPT=ShareGPT_V3_unfiltered_cleaned_split.json python3 benchmarks/feature_precision.py
"""
import os
import torch, json, random, time
torch.set_num_threads(1)
from eagle2_core.runtime import Runtime
from eagle2_core.train.data import read_conversations, render, ReadReport
from eagle2_core.tree import additive
rt = Runtime.load(None, None)
model, tok, head = rt.model, rt.tokenizer, rt.head
convs = read_conversations(os.environ["SHAREGPT"], ReadReport())
random.Random(1).shuffle(convs)
samples = []
for c in convs[-400:]:
    r = render(tok, c, 512)
    if r and sum(r[1]) > 50:
        samples.append(r)
    if sum(len(s[0]) for s in samples) > 12000: break
def q_bf16(x): return x.to(torch.bfloat16).float()
def q_fp8(x):
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 448.0
    return (x / s).to(torch.float8_e4m3fn).float() * s
def q_int8(x):
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127.0
    return (x / s).round().clamp(-127, 127) * s
res = {k: [0, 0] for k in ("fp32", "bf16", "fp8", "int8")}
err = {k: [] for k in ("bf16", "fp8", "int8")}
t = time.time()
with torch.no_grad():
    for ids, mask in samples:
        x = torch.tensor([ids])
        out = model(x, output_hidden_states=True)
        h = out.hidden_states[-1][0]                   # final-norm hidden (EAGLE-1/2 feature)
        tgt = out.logits[0].argmax(-1)                 # target's next token at each position
        m = torch.tensor(mask, dtype=torch.bool)
        n = len(ids) - 1
        pos = torch.arange(n)[None]
        bias = additive(torch.ones(n, n, dtype=torch.bool).tril(), torch.float32)  # causal
        for k, f in (("fp32", lambda z: z), ("bf16", q_bf16), ("fp8", q_fp8), ("int8", q_int8)):
            feats = f(h)
            if k != "fp32":
                err[k].append(((feats - h).norm(dim=-1) / h.norm(dim=-1)).mean().item())
            dh = head(x[:, 1:], feats[None, :-1], pos, attention_mask=bias)[0]
            pred = head.to_target_ids(head.draft_logits(dh).argmax(-1))
            # pair (f_t, x_{t+1}) predicts the target's token after x_{t+1}: tgt[t+1]
            ok = (pred == tgt[1:])[m[1:]]
            res[k][0] += int(ok.sum()); res[k][1] += int(ok.numel())
print(json.dumps({"tokens": sum(len(s[0]) for s in samples), "acc0": {k: round(a / b, 4) for k, (a, b) in res.items()},
                  "rel_err": {k: round(sum(v) / len(v), 5) for k, v in err.items()}, "s": round(time.time() - t, 1)}))
