"""`eagle2 train`: train a draft head for a model that has none (a thin wrapper over eagle2_core.train)."""
from __future__ import annotations

import os

import click

from .options import FiniteFloat


@click.command("train")
@click.option("--model", "-m", default=None, metavar="MODEL", help="Target: hub id, local folder or .gguf (default: the embedded SmolLM2).")
@click.option("--data", "-d", "data", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="ShareGPT JSON/JSONL, {'messages': [...]} JSONL or {'prompt': ...} JSONL; repeatable.")
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False), help="Folder for the head (in the published format of its --arch).")
@click.option("--arch", default="eagle2", show_default=True, type=click.Choice(["eagle2", "eagle3"]),
              help="eagle2: EAGLE-1/2 head (last hidden state); eagle3: EAGLE-3 head (three fused target layers, TTT loss only).")
@click.option("--work-dir", type=click.Path(file_okay=False), default=None, help="Features and checkpoints (default: OUTPUT.work).")
@click.option("--resume", is_flag=True, help="Continue a stopped run from its work folder.")
@click.option("--self-distill/--no-self-distill", default=True, show_default=True, help="Let the target answer the prompts itself.")
@click.option("--distill-prompts", default=2000, type=click.IntRange(min=0), show_default=True, help="How many prompts to self-distill.")
@click.option("--distill-max-new-tokens", default=256, type=click.IntRange(min=1), show_default=True)
@click.option("--distill-batch", default=48, type=click.IntRange(min=1), show_default=True, help="Prompts answered together (a GPU takes 256 or more).")
@click.option("--original/--no-original", default=True, show_default=True, help="Also train on the data's own assistant turns.")
@click.option("--original-tokens", default=None, type=click.IntRange(min=0), help="Extract features for at most this many tokens of the data's own turns.")
@click.option("--mix", default="", metavar="SOURCE=W,...",
              help="Weight of each source per epoch, e.g. distill=1,original=0.5 (default 1 each; 0 leaves one out).")
@click.option("--feature-dtype", default="bfloat16", show_default=True, type=click.Choice(["bfloat16", "float8"]),
              help="Storage of extracted features: float8 (e4m3, a scale per token) halves the disk (docs/training.md).")
@click.option("--features-only", is_flag=True, help="Stop after feature extraction; the same command without it trains.")
@click.option("--epochs", default=10, type=click.IntRange(min=1), show_default=True)
@click.option("--lr", default=5e-4, type=FiniteFloat(min=0, min_open=True), show_default=True)
@click.option("--batch-tokens", default=2048, type=click.IntRange(min=1), show_default=True)
@click.option("--max-len", default=1024, type=click.IntRange(min=2), show_default=True)
@click.option("--ttt-steps", default=3, type=click.IntRange(min=1), show_default=True, help="Training-time test steps (1 = plain EAGLE-1 training).")
@click.option("--draft-vocab", default=16384, type=click.IntRange(min=0), show_default=True, help="Pruned draft vocabulary size (0 = full).")
@click.option("--init-head", type=click.Path(exists=True, file_okay=False), default=None,
              help="Start from this head's weights (warm start, e.g. to go on with more data).")
@click.option("--time-budget", default=None, type=FiniteFloat(min=0, min_open=True), help="Stop training after this many minutes (a checkpoint is kept).")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "float32", "bfloat16", "float16"]))
@click.option("--device", default="auto", show_default=True)
@click.option("--trust-remote-code", is_flag=True)
@click.option("--seed", default=0, show_default=True)
def train(model, data, output, arch, work_dir, resume, self_distill, distill_prompts, distill_max_new_tokens, distill_batch, original,
          original_tokens, mix, feature_dtype, features_only, epochs, lr,
          batch_tokens, max_len, ttt_steps, draft_vocab, init_head, time_budget, dtype, device, trust_remote_code, seed):
    """Train an EAGLE draft head for MODEL.

    \b
    Examples:
      eagle2 train --data sharegpt.json -o heads/smollm2
      eagle2 train --arch eagle3 --data sharegpt.json -o heads/smollm2-eagle3
      eagle2 train --model Qwen/Qwen2.5-0.5B-Instruct --data prompts.jsonl --time-budget 60 -o heads/qwen
      eagle2 train ... --resume          # after Ctrl-C or a crash
      accelerate launch --multi_gpu --num_processes 4 $(which eagle2) train ...   # data parallel
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from eagle2_core.loading import LoadError, load_target
    from eagle2_core.train.pipeline import TrainJob, run_training
    from eagle2_core.train.trainer import TrainConfig

    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    # Under `accelerate launch` / `torchrun` every process runs this command; the first one reports.
    console = Console(stderr=True, quiet=rank != 0)
    if device == "auto" and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        import torch

        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    if not data:
        raise click.UsageError("give training data with --data FILE (ShareGPT, messages or prompt JSONL)")
    weights = parse_mix(mix)
    from .options import quiet_transformers

    quiet_transformers()
    try:
        target = load_target(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    except LoadError as e:
        from .options import UserInputError

        raise UserInputError(str(e)) from None
    cfg = TrainConfig(arch=arch, epochs=epochs, lr=lr, batch_tokens=batch_tokens, max_len=max_len, ttt_steps=ttt_steps, draft_vocab=draft_vocab,
                      seed=seed, time_budget_s=time_budget * 60 if time_budget else None, init_head=init_head)
    job = TrainJob(data=list(data), out_dir=output, work_dir=work_dir or output.rstrip("/") + ".work", self_distill=self_distill,
                   distill_prompts=distill_prompts, distill_max_new_tokens=distill_max_new_tokens, distill_batch=distill_batch, use_original=original,
                   max_original_tokens=original_tokens, features_only=features_only, mix=weights, feature_dtype=feature_dtype,
                   max_len=max_len, seed=seed, config=cfg)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=console)
    tasks: dict[str, int] = {}

    def on_progress(stage, done, total, stats):
        if stage not in tasks:
            tasks[stage] = progress.add_task(stage, total=total, info="")
        info = " ".join(f"{k}={v:.3f}" for k, v in stats.items() if isinstance(v, float))
        progress.update(tasks[stage], completed=done, total=total, info=info)
        if not console.is_terminal and (done % 50 == 0 or done == total):  # a log file gets plain lines
            console.print(f"{stage} {done}/{total} {info}", markup=False)

    try:
        with progress:
            result = run_training(target, job, resume=resume, log=lambda m: progress.console.print(m), progress=on_progress)
    except KeyboardInterrupt:
        console.print(f"[yellow]stopped.[/] continue with the same command plus --resume (work folder {job.work_dir})")
        raise SystemExit(130) from None
    except (ValueError, OSError) as e:
        from .options import UserInputError

        raise UserInputError(str(e)) from None
    if result.get("features_only"):
        return
    console.print(f"head saved to {os.path.abspath(result['out_dir'])}: best held-out tau {result['best_tau']:.2f}, "
                  f"{result['tokens_seen']} tokens seen in {result['train_s'] / 60:.1f} min of training")


def parse_mix(text: str) -> dict[str, float]:
    """`distill=1,original=0.5` -> {"distill": 1.0, "original": 0.5}; a bad entry is a usage error."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, w = part.partition("=")
        try:
            value = float(w)
        except ValueError:
            value = -1.0
        if name not in ("distill", "original") or value < 0:
            raise click.BadParameter(f"{part!r}: expected distill=W or original=W with W >= 0", param_hint="--mix")
        out[name] = value
    return out
