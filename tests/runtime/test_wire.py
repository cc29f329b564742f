import pytest
import torch

from hpipe.core.errors import InputError
from runtime.wire.messages import bytes_to_tensor, tensor_bytes, tensor_from_proto, tensor_to_proto


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_round_trip(dtype):
    t = (torch.randn(2, 3, 5) * 100).to(dtype)
    assert torch.equal(tensor_from_proto(tensor_to_proto(t)), t)
    assert torch.equal(bytes_to_tensor(tensor_bytes(t), (2, 3, 5), dtype), t)


def test_size_mismatch_is_refused():
    data = tensor_bytes(torch.zeros(2, 4))
    with pytest.raises(InputError, match="payload has 31 bytes"):
        bytes_to_tensor(data[:-1], (2, 4), torch.float32)
    with pytest.raises(InputError):
        bytes_to_tensor(data, (2, 4), torch.bfloat16)  # right bytes for a different dtype: refused
    with pytest.raises(InputError, match="negative"):
        bytes_to_tensor(data, (-2, -4), torch.float32)


def test_no_pickle_anywhere_on_the_wire():
    import pathlib

    for path in pathlib.Path("runtime").rglob("*.py"):
        text = path.read_text()
        assert "import pickle" not in text and "torch.load" not in text, path
