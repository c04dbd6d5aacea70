"""`python -m eagle2_cli` = `eagle2`."""
from .main import run

run()
