"""What int8 arithmetic does to a GGUF target's next-token distributions, against --exact's.

Along --exact's greedy answers (eagle2's plain decoding, float32 over the dequantized blocks) on
MT-bench first turns, the logits of every answer position from one forward over prompt + answer:
exact, int8 (rowgemm.ARITHMETICS), and llama.cpp's on the same file (`logits_all`, where
llama-cpp-python is installed). Reported: how often int8's top-1 is exact's, and the mean
KL(exact || int8) beside KL(exact || llama.cpp).

    python3 benchmarks/int8_quality.py                      # the embedded SmolLM2 (Q4_1)
    python3 benchmarks/int8_quality.py --model FILE.gguf --prompts 16 --tokens 96
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from batch_bench import cpu_name  # noqa: E402


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, in nats, from logits (float64)."""
    lp = torch.log_softmax(p_logits.double(), -1)
    lq = torch.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


@torch.no_grad()
def logits_of(model, ids: list[int], arithmetic: str) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of one forward, every product through eagle2's kernels in `arithmetic`."""
    from eagle2_core import rowgemm

    with rowgemm.using_arithmetic(arithmetic), rowgemm.row_linears(rowgemm.plain_linears(model)):
        return model(torch.tensor([ids])).logits[0].float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from eagle2_core import GenerationSettings, rowgemm
    from eagle2_core.loading import resolve_model
    from eagle2_core.methods import BatchedEagle
    from eagle2_core.prompts import read_prompt_file
    from eagle2_core.runtime import Runtime

    rt = Runtime.load(args.model, None, dtype="float32", device="cpu", need_head=False, sample_by_default=False, exact=True)
    where, gguf = resolve_model(args.model)
    path = os.path.join(where, gguf)
    items = list(read_prompt_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "mt16.jsonl")))[: args.prompts]
    plain = BatchedEagle(rt, 1, 1)
    gen = GenerationSettings(max_new_tokens=args.tokens)
    llm = None
    if not args.no_llamacpp:
        try:
            from llama_cpp import Llama

            llm = Llama(model_path=path, n_ctx=2048, n_threads=args.threads, logits_all=True, verbose=False)
        except ImportError:
            print("llama-cpp-python not installed: llama.cpp's column skipped")
    agree = n = agree_llama = 0
    kls, kls_llama = [], []
    for item in items:
        ids = rt.encode(item.messages)
        with rowgemm.using_arithmetic("exact"):
            answer = plain.generate(ids, gen)[0]
        seq = ids + answer
        rows = slice(len(ids) - 1, len(seq) - 1)  # the positions that predict each answer token
        exact = logits_of(rt.model, seq, "exact")[rows]
        int8 = logits_of(rt.model, seq, "int8")[rows]
        agree += int((exact.argmax(-1) == int8.argmax(-1)).sum())
        n += exact.shape[0]
        kls.append(kl(exact, int8))
        if llm is not None:
            llm.reset()
            llm.eval(seq)
            lg = torch.tensor(llm.scores[: len(seq)], dtype=torch.float32)[rows][:, : exact.shape[1]]
            kls_llama.append(kl(exact, lg))
            agree_llama += int((exact.argmax(-1) == lg.argmax(-1)).sum())
    out = {"cpu": cpu_name(), "date": datetime.date.today().isoformat(), "model": os.path.basename(path), "prompts": len(items),
           "positions": n, "top1_agreement": round(agree / n, 4), "mean_kl_int8": float(torch.cat(kls).mean()),
           "mean_kl_llamacpp": float(torch.cat(kls_llama).mean()) if kls_llama else None,
           "top1_agreement_llamacpp": round(agree_llama / n, 4) if kls_llama else None}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
