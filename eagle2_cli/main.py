"""`eagle2`: lossless EAGLE-2 speculative decoding for Hugging Face causal LMs."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from importlib.metadata import PackageNotFoundError, version

import click

from .chat_cmd import chat
from .compare_cmd import compare
from .generate_cmd import generate
from .options import UserInputError


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


def _register_optional(module: str, name: str) -> None:
    """Add a command from a module that may not exist yet (another developer's `train`)."""
    if importlib.util.find_spec(f"eagle2_cli.{module}") is None:
        return
    try:
        mod = importlib.import_module(f"eagle2_cli.{module}")
    except Exception as e:  # a broken optional command must not break the others
        err = f"{type(e).__name__}: {e}"

        @click.command(name, help=f"(unavailable: {err})", context_settings={"ignore_unknown_options": True})
        @click.argument("args", nargs=-1, type=click.UNPROCESSED)
        def unavailable(args):
            raise click.ClickException(f"`eagle2 {name}` could not be loaded: {err}")

        cli.add_command(unavailable)
        return
    cmd = getattr(mod, name, None)
    if not isinstance(cmd, click.Command):
        cmd = next((v for v in vars(mod).values() if isinstance(v, click.Command) and v.name == name), None)
    if isinstance(cmd, click.Command):
        cli.add_command(cmd, name)


_register_optional("train_cmd", "train")
_register_optional("tune_cmd", "tune")
_register_optional("serve_cmd", "serve")
