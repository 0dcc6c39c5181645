"""ringshm: pipeline-parallel LLM inference over lock-free shared-memory rings (and, between hosts, bridges
over torch.distributed).

``import ringshm`` is light: it loads the ring and the exception tree only. ``Engine``, ``AsyncEngine`` and
the result types import torch, so they load on first use (PEP 562 module ``__getattr__``)::

    from ringshm import Engine, AsyncEngine, GenerationResult, StageDied
"""

from __future__ import annotations

from importlib import import_module

from ringshm.errors import (
    ClusterRefused,
    DispatcherFailed,
    EdgeError,
    EngineClosed,
    EngineOwned,
    InvalidCheckpoint,
    InvalidParameter,
    KVCacheOverflow,
    MissingChatTemplate,
    MissingTensor,
    PeerDied,
    QueueFull,
    QueueTimeout,
    RecordTooLarge,
    RequestFailed,
    ResourceShortage,
    RingCorrupt,
    RingshmError,
    RingTimeout,
    StageDied,
    StageError,
    StageStalled,
    StageStartupError,
    UnsupportedArchitecture,
    UnsupportedQuantType,
)
from ringshm.transport.ring import Ring
from ringshm.version import __version__

# name -> module that defines it; imported on first access (they pull in torch).
_LAZY = {
    "Engine": "ringshm.engine.engine",
    "BatchStream": "ringshm.engine.engine",
    "AsyncEngine": "ringshm.engine.async_engine",
    "Chunk": "ringshm.engine.request_stream",
    "RequestStream": "ringshm.engine.request_stream",
    "GenerationResult": "ringshm.engine.results",
    "BatchResult": "ringshm.engine.results",
    "TokenEvent": "ringshm.engine.coordinator",
    "TokenLogprob": "ringshm.engine.logprobs",
    "EngineConfig": "ringshm.config",
    "GenerationParams": "ringshm.generation_params",
    "run_worker": "ringshm.runtime.worker",
}

__all__ = ["Ring", "__version__", *_LAZY, "ClusterRefused", "DispatcherFailed", "EdgeError", "EngineClosed",
           "EngineOwned", "InvalidCheckpoint", "InvalidParameter", "KVCacheOverflow", "MissingChatTemplate",
           "MissingTensor", "PeerDied", "QueueFull", "QueueTimeout", "RecordTooLarge", "RequestFailed",
           "ResourceShortage", "RingCorrupt", "RingshmError", "RingTimeout", "StageDied", "StageError",
           "StageStalled", "StageStartupError", "UnsupportedArchitecture", "UnsupportedQuantType"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ringshm' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # cache: the next access does not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
