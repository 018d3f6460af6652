"""Data-only wire format for weights and trajectory batches: safetensors plus string metadata.

Nothing that crosses a process boundary is ever unpickled. ``loads_tensors`` checks the bytes
before safetensors sees them, so corrupt or truncated input raises ``SerializationError`` with one
clear line instead of failing deep inside a parser.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load, save as st_save

if TYPE_CHECKING:
    import torch

MAX_HEADER_BYTES = 100 * 1024 * 1024


class SerializationError(ValueError):
    """Bytes that are not a valid Nitro payload."""


def _to_numpy(value: np.ndarray | torch.Tensor) -> np.ndarray:
    if not isinstance(value, np.ndarray) and hasattr(value, "detach"):  # a torch.Tensor (not imported: actors lack it)
        value = value.detach().cpu().numpy()
    arr = np.ascontiguousarray(value)
    if arr.dtype == object:
        raise SerializationError("object arrays cannot be serialised")
    return arr


def dumps_tensors(tensors: Mapping[str, np.ndarray | torch.Tensor], meta: Mapping[str, object] | None = None) -> bytes:
    """Serialise named arrays and JSON-able metadata. Scalars in ``meta`` are stored as strings."""
    arrays = {name: _to_numpy(v) for name, v in tensors.items()}
    metadata = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (meta or {}).items()}
    return st_save(arrays, metadata=metadata)


def loads_tensors(data: bytes | bytearray | memoryview, *,
                  expect_format: str | None = None) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse bytes from ``dumps_tensors``. Raises SerializationError on anything malformed."""
    data = bytes(data)
    if len(data) < 8:
        raise SerializationError(f"payload too short ({len(data)} bytes): truncated or empty")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > MAX_HEADER_BYTES or 8 + header_len > len(data):
        raise SerializationError(
            f"payload header claims {header_len} bytes but only {len(data) - 8} follow: truncated or corrupt")
    try:
        header = json.loads(data[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SerializationError("payload header is not valid JSON: corrupt or not a Nitro payload") from None
    if not isinstance(header, dict):
        raise SerializationError("payload header is not a mapping: corrupt or not a Nitro payload")
    meta = header.get("__metadata__") or {}
    if expect_format is not None and meta.get("format") != expect_format:
        raise SerializationError(f"expected a {expect_format!r} payload, got format {meta.get('format')!r}")
    try:
        arrays = st_load(data)
    except (SafetensorError, ValueError, TypeError) as exc:
        raise SerializationError(f"payload is corrupt: {str(exc).splitlines()[0]}") from None
    return arrays, dict(meta)
