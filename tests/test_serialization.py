import numpy as np
import pytest
import torch

from nitro.serialization import SerializationError, dumps_tensors, loads_tensors


def test_round_trip_keeps_dtypes_shapes_and_meta():
    arrays = {"obs": np.arange(12, dtype=np.uint8).reshape(3, 4), "logp": np.array([0.5, -1.0], np.float32),
              "done": np.array([True, False]), "idx": np.array([2], np.int64), "w": torch.ones(2, 2)}
    data = dumps_tensors(arrays, {"format": "nitro.batch/1", "version": 7})
    out, meta = loads_tensors(data, expect_format="nitro.batch/1")
    assert meta == {"format": "nitro.batch/1", "version": "7"}
    for k, v in arrays.items():
        v = v.numpy() if isinstance(v, torch.Tensor) else v
        assert out[k].dtype == v.dtype and np.array_equal(out[k], v)


def test_uint8_frames_stay_uint8_and_small():
    frames = np.zeros((512, 4, 84, 84), np.uint8)
    data = dumps_tensors({"obs": frames})
    assert len(data) < frames.nbytes + 1024  # no float blow-up


@pytest.mark.parametrize("cut", [0, 3, 8, 20, -1, -100])
def test_truncated_bytes_give_a_clear_error(cut):
    data = dumps_tensors({"x": np.ones(64, np.float32)}, {"format": "nitro.batch/1"})
    with pytest.raises(SerializationError) as info:
        loads_tensors(data[:cut])
    assert "\n" not in str(info.value)


def test_corrupt_header_and_wrong_format():
    data = bytearray(dumps_tensors({"x": np.ones(4, np.float32)}, {"format": "nitro.policy/1"}))
    with pytest.raises(SerializationError, match=r"expected a 'nitro\.batch/1' payload"):
        loads_tensors(bytes(data), expect_format="nitro.batch/1")
    data[10] = 0xFF  # inside the JSON header
    with pytest.raises(SerializationError):
        loads_tensors(bytes(data))
    with pytest.raises(SerializationError):
        loads_tensors(
            b"\x10\x00\x00\x00\x00\x00\x00\x00" + b'{"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'
        )


def test_object_arrays_are_refused():
    with pytest.raises(SerializationError):
        dumps_tensors({"x": np.array([object()])})
