"""The argument and config layout of inflightllm/gpu/pdl.py's cuLaunchKernelEx launches: the
driver reads each kernel argument through a pointer to its 8-byte slot, and the structs must
match cuda.h's CUlaunchConfig and CUlaunchAttribute. (The launches themselves run in the GPU
tests: tests/gpu/test_gpu_engine.py::test_pdl_launches_give_the_same_tokens.)"""

from __future__ import annotations

import ctypes
import struct

import numpy as np
import pytest

from inflightllm.gpu import pdl


def test_each_argument_goes_in_its_own_8_byte_slot():
    args = (np.uintp(0x1122334455667788), np.int32(-5), np.float32(1.5), np.int64(-7), np.uint64(3))
    layout = pdl._format(tuple(map(type, args)))
    assert layout.size == 8 * len(args)
    buffer = bytearray(layout.size)
    layout.pack_into(buffer, 0, *args)
    assert struct.unpack_from("=Q", buffer, 0)[0] == 0x1122334455667788
    assert struct.unpack_from("=i", buffer, 8)[0] == -5
    assert struct.unpack_from("=f", buffer, 16)[0] == 1.5
    assert struct.unpack_from("=q", buffer, 24)[0] == -7
    assert struct.unpack_from("=Q", buffer, 32)[0] == 3


def test_an_argument_type_it_cannot_pass_is_refused_by_name():
    with pytest.raises(TypeError, match="float64"):
        pdl._format((np.uintp, np.float64))


def test_the_launch_structs_match_the_driver_abi():
    assert ctypes.sizeof(pdl._Attribute) == 72  # id, 4 bytes of padding, a 64-byte union
    assert pdl._Attribute.value.offset == 8
    assert pdl._Config.hStream.offset == 32
    assert pdl._Config.attrs.offset == 40
    assert pdl._Config.numAttrs.offset == 48
    assert ctypes.sizeof(pdl._Config) == 56
    attribute = pdl._attribute()
    assert attribute.id == 6 and attribute.value.flag == 1  # programmatic stream serialization, on
