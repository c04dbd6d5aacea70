"""eagle2_core.importtrims: transformers imported with the trims does what it did without them,
and the trims happen (each checked in a fresh interpreter, as a command starts)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

PROBE = r"""
import inspect, json, sys
import eagle2_core  # installs the trims (unless EAGLE2_IMPORT_TRIMS=0)
import transformers.models.llama.modeling_llama
import transformers.loss.loss_for_object_detection as detr
from transformers.utils import import_utils
out = {"scipy_optimize_imported": "scipy.optimize" in sys.modules,
       "scan_cache": import_utils.create_import_structure_from_path.cache_info().maxsize,
       "source_readable": "linear_sum_assignment" in inspect.getsource(detr)}
import numpy as np
cost = np.array([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]])
rows, cols = detr.linear_sum_assignment(cost)
out["assignment"] = [rows.tolist(), cols.tolist()]
import scipy.optimize
out["real_scipy_after"] = hasattr(scipy.optimize, "minimize") and scipy.optimize.linear_sum_assignment is not detr.linear_sum_assignment
out["scipy_assignment"] = [a.tolist() for a in scipy.optimize.linear_sum_assignment(cost)]
print(json.dumps(out))
"""


def run_probe(trims: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EAGLE2_IMPORT_TRIMS": "1" if trims else "0"}
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, cwd=str(ROOT), env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_trims_defer_scipy_and_keep_what_transformers_does():
    pytest.importorskip("scipy")
    on, off = run_probe(True), run_probe(False)
    # without the trims, the loss module imports scipy.optimize and the walk's cache is bounded: the check can fail
    assert off["scipy_optimize_imported"] and off["scan_cache"] is not None
    assert not on["scipy_optimize_imported"], "the loss modules' scipy import was not deferred"
    assert on["scan_cache"] is None, "transformers' folder walk still has a bounded cache"
    assert on["source_readable"] and on["real_scipy_after"]
    # the forwarder answers as scipy's own function does, with or without the trims
    assert on["assignment"] == off["assignment"] == on["scipy_assignment"] == [[0, 1, 2], [1, 0, 2]]
