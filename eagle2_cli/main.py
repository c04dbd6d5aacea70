"""`eagle2`: lossless EAGLE-2 speculative decoding for Hugging Face causal LMs."""
from __future__ import annotations

import os
import sys
from importlib.metadata import PackageNotFoundError, version

import click

from .chat_cmd import chat
from .compare_cmd import compare
from .generate_cmd import generate
from .options import UserInputError
from .serve_cmd import serve
from .train_cmd import train
from .tune_cmd import tune


def _version() -> str:
    try:
        return version("eagle2")
    except PackageNotFoundError:
        return "0+unknown"


def user_error_message(e: BaseException) -> str | None:
    """One line for the errors a user can fix (bad model, head, file); None for anything else.

    Engine classes are looked up in sys.modules, so this never imports torch itself.
    """
    mods = {name: sys.modules.get(name) for name in ("eagle2_core.loading", "eagle2_core.head", "eagle2_core.prompts")}
    loading, head, prompts = mods.values()
    if prompts is not None and isinstance(e, prompts.InputError):
        return e.describe()
    if loading is not None and isinstance(e, loading.LoadError):
        return str(e)
    if head is not None and isinstance(e, head.HeadMismatchError):
        return str(e)
    if isinstance(e, (FileNotFoundError, IsADirectoryError, PermissionError, NotADirectoryError)):
        return str(e) if not e.filename else f"{e.filename}: {e.strerror}"
    return None


class Eagle2Group(click.Group):
    """Turns user-fixable errors into one `Error: ...` line and exit code 2 (EAGLE2_DEBUG=1 or
    --debug shows the traceback instead)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort, KeyboardInterrupt, EOFError):
            raise
        except Exception as e:
            msg = user_error_message(e)
            if msg is None or os.environ.get("EAGLE2_DEBUG"):
                raise
            raise UserInputError(msg) from None


@click.group(cls=Eagle2Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(_version(), "--version", "-V", prog_name="eagle2", message="%(prog)s %(version)s")
@click.option("--debug", is_flag=True, expose_value=False, is_eager=True, help="Show tracebacks and library logs (or set EAGLE2_DEBUG=1).",
              callback=lambda ctx, p, v: os.environ.__setitem__("EAGLE2_DEBUG", "1") if v else None)
def cli():
    """Lossless EAGLE-2 speculative decoding for Hugging Face causal language models.

    Same output as the model's own greedy or sampled decoding, several times fewer target
    forward passes. Without --model, runs the embedded SmolLM2-135M-Instruct.

    \b
    Examples:
      eagle2 chat --prompt "Hi" --max-new-tokens 32
      eagle2 generate -f prompts.jsonl -o out.jsonl
      eagle2 compare --vanilla --dataset mt-bench --limit 10
    """


cli.add_command(chat)
cli.add_command(generate)
cli.add_command(compare)
cli.add_command(train)
cli.add_command(tune)
cli.add_command(serve)


# Set by a command whose output is all written and closed when it returns (`chat`): the process
# may then end without the interpreter's teardown (`run`).
TEARDOWN_FREE = {"ok": False}


def run() -> None:
    """The `eagle2` command (`python -m eagle2_cli`): `cli`, then, where the command allows it,
    an exit without the interpreter's teardown. A loaded model is millions of objects and
    thousands of modules that the interpreter would free one by one before the process ends
    (a measurable share of a one-turn chat's time, docs/benchmarks.md), where the kernel frees
    the memory at once. Exit handlers still run and stdout/stderr are flushed; with a thread
    still running, a failed flush or an error exit, the ordinary exit."""
    try:
        cli(prog_name="eagle2")
        code = 0
    except SystemExit as e:
        code = e.code
    if code in (0, None) and TEARDOWN_FREE["ok"]:
        import atexit
        import threading

        if not any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
            atexit._run_exitfuncs()
            try:
                for stream in (sys.stdout, sys.stderr):
                    if stream is not None:
                        stream.flush()
            except (OSError, ValueError):
                pass  # the ordinary exit reports it
            else:
                os._exit(0)
    sys.exit(code)

