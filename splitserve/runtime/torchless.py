"""Keep torch out of a process that needs none: the gateway.

The gateway's own modules never import torch (an import contract says so), but transformers,
whose tokenizers and chat templates the gateway uses, imports torch whenever it can find it
(`transformers.configuration_utils` pulls in its RoPE helpers, which load torch). That costs a
gateway process about 2.5 s of CPU at start and a few hundred MB of memory, per process, for
nothing: tokenizing and rendering a chat template are torch-free in transformers, which supports
installs without torch. Marking torch as absent before transformers is imported makes it take
that path.
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
