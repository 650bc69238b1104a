"""Keep torch out of a process that needs none: the gateway, and a worker's front (its engine
core, a process of its own, is where torch runs).

Neither imports torch through our own modules (the gateway's import contract says so; a front
reaches the engine only through the core's entry point, which imports it in the core's process),
but transformers, whose tokenizers and chat templates both use, imports torch whenever it can
find it (`transformers.configuration_utils` pulls in its RoPE helpers, which load torch). That
costs a process about 2.5 s of CPU at start and a few hundred MB of memory, for nothing:
tokenizing and rendering a chat template are torch-free in transformers, which supports installs
without torch. Marking torch as absent before transformers is imported makes it take that path.
"""

from __future__ import annotations

import logging
import sys


def keep_torch_out() -> bool:
    """Make `import torch` fail in this process from now on, and transformers see no torch.
    Returns False (and changes nothing) if torch is already loaded, e.g. by a GGUF conversion
    at start-up."""
    if "torch" in sys.modules and sys.modules["torch"] is not None:
        return False
    # NOTE: a None entry makes `importlib.util.find_spec("torch")` answer None (transformers'
    # availability check) and `import torch` raise ModuleNotFoundError.
    sys.modules["torch"] = None  # type: ignore[assignment]
    # NOTE: transformers says once, at import, that it found no torch: expected here.
    logging.getLogger("transformers").addFilter(_NoTorchNotice())
    return True


class _NoTorchNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")
