"""Keys and values as MLflow accepts them: cleaned keys, params and tags within MLflow's limits,
the whole config as params, and batches no larger than one ``log_batch`` call takes.

The limits are MLflow's own (``mlflow.utils.validation``); a value over one is cut, never
refused, since the full config is logged as ``config/config.yaml`` beside the params.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any, TypeVar

from nitro.config import NitroConfig

__all__ = [
    "MAX_KEY",
    "MAX_PARAM_VALUE",
    "MAX_TAG_VALUE",
    "METRICS_PER_BATCH",
    "PARAMS_PER_BATCH",
    "chunks",
    "clean_key",
    "filter_value",
    "param_value",
    "params_from_config",
    "tag_value",
]

MAX_PARAM_VALUE = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
MAX_TAG_VALUE = 8000  # MAX_TAG_VAL_LENGTH
MAX_KEY = 250  # MAX_ENTITY_KEY_LENGTH
PARAMS_PER_BATCH = 100  # MAX_PARAMS_TAGS_PER_BATCH
METRICS_PER_BATCH = 1000  # MAX_METRICS_PER_BATCH
_TRUNCATED = "...[truncated; full value in config/config.yaml]"
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")

T = TypeVar("T")


def clean_key(key: str) -> str:
    """A metric, param or tag key MLflow accepts: bad characters become ``_``, no empty or
    doubled path segments, at most ``MAX_KEY`` characters."""
    key = _BAD_KEY_CHARS.sub("_", str(key)).strip("/") or "_"
    key = re.sub(r"/+", "/", key).replace("/./", "/")
    return key[:MAX_KEY]


def param_value(value: Any) -> str:
    """A param value as text (JSON for lists and mappings), cut to ``MAX_PARAM_VALUE``."""
    if isinstance(value, str):
        text = value
    elif value is None or isinstance(value, (bool, int, float)):
        text = str(value)
    else:
        text = json.dumps(value, sort_keys=True, default=str)
    if len(text) > MAX_PARAM_VALUE:
        text = text[: MAX_PARAM_VALUE - len(_TRUNCATED)] + _TRUNCATED
    return text


def params_from_config(config: NitroConfig) -> dict[str, str]:
    """The whole config as MLflow params: dotted keys, valid characters, values within limits."""
    out: dict[str, str] = {}
    for key, value in config.to_flat_dict().items():
        k = clean_key(key)
        while k in out:  # two keys that cleaned to the same name: keep both
            k = (k[: MAX_KEY - 1] + "_")
        out[k] = param_value(value)
    return out


def tag_value(value: Any) -> str:
    """A tag value as text, cut to ``MAX_TAG_VALUE``."""
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= MAX_TAG_VALUE else text[: MAX_TAG_VALUE - 3] + "..."


def filter_value(value: str) -> str:
    """``value`` as a quoted string literal of an MLflow search filter."""
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def chunks(items: list[T], n: int) -> Iterable[list[T]]:
    """``items`` in consecutive slices of at most ``n``."""
    for i in range(0, len(items), n):
        yield items[i : i + n]
