"""Core's codecs pass the codec conformance suite; DeviceStagingCodec and `for_device` do what they say."""

import pytest
import torch

from openprime.core.codec import DeviceStagingCodec, Float32Codec, for_device
from openprime.core.testing import CodecConformance


class TestFloat32Codec(CodecConformance):
    make_codec = staticmethod(Float32Codec)
    max_relative_error = 0.0


class TestFloat32CodecStaged(CodecConformance):
    # On the host the staging is a real copy, so this runs the wrapper's whole path except the device transfer.
    make_codec = staticmethod(lambda: DeviceStagingCodec(Float32Codec()))
    max_relative_error = 0.0


class TestFloat32CodecStagedCuda(TestFloat32CodecStaged):
    device = "cuda"


def test_for_device_wraps_only_off_the_host():
    codec = Float32Codec()
    assert for_device(codec, torch.device("cpu")) is codec
    staged = for_device(codec, torch.device("cuda", 0))  # builds the wrapper; no CUDA needed for that
    assert isinstance(staged, DeviceStagingCodec) and staged.inner is codec and staged.name == "fp32"
    assert for_device(staged, torch.device("cuda", 0)) is staged


def test_staging_codec_refuses_to_wrap_itself():
    with pytest.raises(ValueError, match="not another staging codec"):
        DeviceStagingCodec(DeviceStagingCodec(Float32Codec()))


def test_staged_payload_never_aliases_the_chunk():
    chunk = torch.arange(10, dtype=torch.float32)
    payload = DeviceStagingCodec(Float32Codec()).encode(chunk)
    chunk.add_(1.0)
    assert torch.equal(payload[0], torch.arange(10, dtype=torch.float32))
