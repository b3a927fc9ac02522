"""Finds the Triton kernels package, `minivllm_kernels`, whose source is the top-level `kernels/` folder.

Installed (`pip install -e .` or a wheel), setuptools maps `kernels/` to `minivllm_kernels`. From a bare
checkout with no install, this loads `kernels/` under the same name. Either way nothing named `kernels`
is ever imported: that name belongs to Hugging Face's kernel hub, which transformers probes for.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

try:
    import minivllm_kernels as kernels
except ImportError:  # a checkout that was never pip-installed
    _folder = Path(__file__).resolve().parents[2] / "kernels"
    _spec = importlib.util.spec_from_file_location(
        "minivllm_kernels", _folder / "__init__.py", submodule_search_locations=[str(_folder)])
    kernels = importlib.util.module_from_spec(_spec)
    sys.modules["minivllm_kernels"] = kernels
    _spec.loader.exec_module(kernels)

__all__ = ["kernels"]
