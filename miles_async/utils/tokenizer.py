"""Loading a model folder's tokenizer where it is needed without paying for ``AutoTokenizer`` in every process.

``transformers.AutoTokenizer`` imports ``configuration_utils`` and with it torch: about 3 s of CPU in a process
that needs neither (the rollout executor only tokenizes). The driver, which imports torch anyway for the
training workers, resolves the folder's tokenizer class once (``tokenizer_class_path``); the executor loads that
class directly (``load_tokenizer``), which gives the same tokenizer without importing torch.
"""

from __future__ import annotations

import logging
from typing import Any

from miles_async.utils.plugins import load_function

logger = logging.getLogger(__name__)


def tokenizer_class_path(model_path: str) -> str | None:
    """``module:Class`` of the tokenizer ``AutoTokenizer`` builds for ``model_path``; None when this process cannot
    load it (the folder may exist only on the nodes), and the executor then finds it through ``AutoTokenizer``,
    whose error names what is wrong."""
    from transformers import AutoTokenizer

    try:
        cls = type(AutoTokenizer.from_pretrained(model_path))
    except Exception as e:  # noqa: BLE001 - the executor reports it where the run reports its errors
        logger.debug("the tokenizer class of %s is left to the executor: %s", model_path, e)
        return None
    return f"{cls.__module__}:{cls.__qualname__}"


def load_tokenizer(model_path: str, class_path: str | None = None) -> Any:
    """``model_path``'s tokenizer: through ``class_path`` (from ``tokenizer_class_path``) when given, otherwise
    through ``AutoTokenizer``."""
    if class_path is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path)
    return load_function(class_path, "tokenizer class").from_pretrained(model_path)
