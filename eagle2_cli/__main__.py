"""`python -m eagle2_cli` = `eagle2`."""
from .main import cli

cli(prog_name="eagle2")
