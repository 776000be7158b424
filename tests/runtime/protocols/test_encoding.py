"""Unit tests of the value helpers' encoding (``_runtime/protocols/encoding.py``): a value
becomes a 4-slot header (and, for non-scalars, a payload) that ``decode`` turns back into the
same value, bit for bit; scalars ride in the header alone, unpicklable values raise a
``TypeError`` naming what was sent, and a failure report decodes to the sender's
``RankFailedError``. No process group, no process."""

from __future__ import annotations

import math
import struct
import threading

import pytest
import torch

from axolotl_dist._runtime.protocols import encoding
from axolotl_dist._runtime.protocols.encoding import (BIGINT, BOOL, DEVICE, ERROR, FLOAT, INT,
                                                      NONE, PICKLE, TENSOR, decode,
                                                      decode_scalar, encode, encode_error,
                                                      payload_len, scalar_header, tensor_bytes)
from axolotl_dist.errors import RankFailedError

#: A tensor's description (records.tensor_description): 24-byte dtype name, 16-byte device
#: type, 1-byte ndim, 1-byte requires_grad, then 8 bytes per dimension.
META = 42


def _round_trip(value, **kwargs):
    sent = encode(value, **kwargs)
    return decode(sent.header, sent.payload, data=sent.data)


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


# --------------------------------------------------------------------------- the header kinds
def test_the_kinds_are_the_wire_codes_of_the_design_table():
    assert (NONE, BOOL, INT, FLOAT, PICKLE, TENSOR, ERROR, BIGINT, DEVICE) == tuple(range(9))


@pytest.mark.parametrize("value, header", [
    (None, (0, 0, 0, 0)),
    (True, (1, 1, 0, 0)),
    (False, (1, 0, 0, 0)),
    (0, (2, 0, 0, 0)),
    (-7, (2, -7, 0, 0)),
    (2 ** 63 - 1, (2, 9223372036854775807, 0, 0)),
    (-(2 ** 63), (2, -9223372036854775808, 0, 0)),
    (1.0, (3, 0x3FF0_0000_0000_0000, 0, 0)),
    (1.5, (3, 0x3FF8_0000_0000_0000, 0, 0)),
    (-0.0, (3, -0x8000_0000_0000_0000, 0, 0)),  # the sign bit alone
    (math.inf, (3, 0x7FF0_0000_0000_0000, 0, 0)),
    (-math.inf, (3, -0x0010_0000_0000_0000, 0, 0)),  # 0xFFF0... as int64
])
def test_a_scalar_rides_in_the_header_alone(value, header):
    assert scalar_header(value) == header
    sent = encode(value)
    assert sent.header == list(header) and sent.payload is None and sent.data is None
    assert payload_len(sent.header) == 0


@pytest.mark.parametrize("value", [
    2 ** 63, -(2 ** 63) - 1, "text", b"bytes", [1], (1,), {"a": 1}, 1 + 2j, torch.tensor(1.0),
])
def test_anything_else_has_no_scalar_header(value):
    assert scalar_header(value) is None


@pytest.mark.parametrize("value", [
    None, True, False, 0, 1, -1, 2 ** 63 - 1, -(2 ** 63), 0.1, -2.5, 1e308, 5e-324, math.inf,
    -math.inf, -0.0, 0.0,
])
def test_a_scalar_decodes_to_the_same_value_and_type(value):
    header = scalar_header(value)
    got = decode_scalar(header[0], header[1])
    assert type(got) is type(value) and got == value
    if type(value) is float:
        assert _float_bits(got) == _float_bits(value)  # -0.0 is not 0.0
    assert decode(list(header), None) == value


@pytest.mark.parametrize("bits", [
    0x7FF8_0000_0000_0000,  # the usual quiet nan
    0x7FF8_0000_0000_0123,  # a nan with a payload
    -0x0008_0000_0000_0000,  # a negative nan (0xFFF8...)
])
def test_a_nan_keeps_its_bits(bits):
    value = struct.unpack("<d", struct.pack("<q", bits))[0]
    assert math.isnan(value)
    assert scalar_header(value) == (FLOAT, bits, 0, 0)
    assert _float_bits(decode_scalar(FLOAT, bits)) == bits
    assert _float_bits(_round_trip(value)) == bits


def test_a_bool_stays_a_bool_and_an_int_an_int():
    assert decode_scalar(BOOL, 1) is True and decode_scalar(BOOL, 0) is False
    assert decode_scalar(BOOL, 5) is True  # any nonzero slot
    one = decode_scalar(INT, 1)
    assert one == 1 and type(one) is int
    assert decode_scalar(NONE, 123) is None  # a NONE header's slots are not read


@pytest.mark.parametrize("value", [None, True, 7, -0.0, float("nan"), 1.5])
def test_encode_result_of_a_scalar_hands_back_the_value_itself(value):
    # the sender of a broadcast returns it as it is: what its header decodes to elsewhere
    header, encoded, exc, back = encoding.encode_result(lambda: value, 0, "x", None)
    assert (encoded, exc) == (None, None) and back is value
    assert tuple(header) == scalar_header(value)


def test_encode_result_of_a_payload_or_a_failure_hands_back_no_value():
    header, encoded, exc, back = encoding.encode_result(lambda: [1, 2], 0, "x", None)
    assert header[0] == PICKLE and encoded is not None and (exc, back) == (None, None)
    header, encoded, exc, back = encoding.encode_result(lambda: 1 // 0, 2, "x", None)
    assert header[0] == ERROR and isinstance(exc, ZeroDivisionError) and back is None


# --------------------------------------------------------------------------- big ints
@pytest.mark.parametrize("value, text", [
    (2 ** 63, b"8000000000000000"),
    (-(2 ** 63) - 1, b"-8000000000000001"),
    (16 ** 30, b"1" + b"0" * 30),
])
def test_an_int_beyond_int64_goes_as_its_hexadecimal_text(value, text):
    sent = encode(value)
    assert sent.header == [BIGINT, len(text), 0, 0]
    assert tensor_bytes(sent.payload) == text
    assert payload_len(sent.header) == sent.payload.numel()
    got = decode(sent.header, sent.payload)
    assert got == value and type(got) is int


def test_an_int_of_thousands_of_digits_round_trips():
    # past 4,300 digits Python refuses to turn an int into decimal text or back
    for value in (-(10 ** 5000) - 17, 7 ** 20_000):
        assert _round_trip(value) == value


# --------------------------------------------------------------------------- pickled objects
@pytest.mark.parametrize("value", [
    "", "text with ünïcödé", b"", b"\x00\xffbytes", [], [1, 2.5, None, True],
    (1, (2, (3,))), {"a": [1, {"b": (None, "c")}], 2: -0.0}, {1, 2, 3},
    [2 ** 100, -(2 ** 70)], 1 + 2j,
])
def test_an_object_is_pickled_and_comes_back_equal(value):
    sent = encode(value)
    assert sent.header[0] == PICKLE and sent.header[2:] == [0, 0]
    assert sent.header[1] == sent.payload.numel() == payload_len(sent.header)
    got = decode(sent.header, sent.payload)
    assert got == value and type(got) is type(value)


def test_a_nested_structure_keeps_its_types_and_its_floats_bits():
    value = {"xs": [(1, 2.0), (float("nan"), -0.0)], "t": (True, None)}
    got = _round_trip(value)
    assert type(got["xs"][0]) is tuple and type(got["t"]) is tuple
    assert _float_bits(got["xs"][1][0]) == _float_bits(value["xs"][1][0])
    assert _float_bits(got["xs"][1][1]) == _float_bits(-0.0)
    assert got["t"] == (True, None) and got["xs"][0] == (1, 2.0)


def test_tensors_inside_a_structure_are_pickled_with_it():
    value = [torch.arange(3), {"w": torch.ones(2, 2, dtype=torch.bfloat16)}]
    sent = encode(value)
    assert sent.header[0] == PICKLE
    got = decode(sent.header, sent.payload)
    assert torch.equal(got[0], value[0]) and torch.equal(got[1]["w"], value[1]["w"])
    assert got[1]["w"].dtype == torch.bfloat16


def test_a_tensor_subclass_is_pickled_not_sent_as_raw_bytes():
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    sent = encode(param)
    assert sent.header[0] == PICKLE
    got = decode(sent.header, sent.payload)
    assert type(got) is torch.nn.Parameter and torch.equal(got, param) and got.requires_grad


# --------------------------------------------------------------------------- tensors
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
SHAPES = [(), (0,), (5,), (2, 3), (0, 3), (2, 1, 4)]


def _sample(dtype: torch.dtype, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8,
                        generator=gen)
    if dtype == torch.bool:
        raw = raw % 2  # a bool byte other than 0 or 1 is not a bool
    return raw.view(dtype).reshape(shape)  # every bit pattern: nans, infs, subnormals


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_cpu_tensor_comes_back_bit_for_bit(dtype, shape):
    tensor = _sample(dtype, shape)
    sent = encode(tensor)
    nbytes = math.prod(shape) * dtype.itemsize
    assert sent.header == [TENSOR, META + 8 * len(shape), nbytes, 0]
    assert sent.payload.dtype == torch.uint8 and sent.payload.dim() == 1
    assert payload_len(sent.header) == sent.payload.numel()
    got = decode(sent.header, sent.payload)
    assert got.dtype == dtype and got.shape == tensor.shape and got.device.type == "cpu"
    assert not got.requires_grad
    assert _same_bits(got, tensor)


@pytest.mark.parametrize("tensor, header", [
    (torch.zeros(2, 3), [TENSOR, 58, 24, 0]),
    (torch.tensor(7), [TENSOR, 42, 8, 0]),  # 0-d int64
    (torch.empty(0, 3, dtype=torch.float64), [TENSOR, 58, 0, 0]),
    (torch.ones(4, dtype=torch.bfloat16), [TENSOR, 50, 8, 0]),
    (torch.ones(2, 2, 2, dtype=torch.bool), [TENSOR, 66, 8, 0]),
])
def test_a_tensors_header_counts_its_description_and_its_bytes(tensor, header):
    sent = encode(tensor)
    assert sent.header == header
    assert sent.payload.numel() == header[1] + header[2] == payload_len(sent.header)


def test_bfloat16_specials_keep_their_bits():
    bits = torch.tensor([0x7FC0, 0x7F81, -0x8000, 0x7F80, -0x0080, 0x0001, 0x3F80],
                        dtype=torch.int16)  # nan, nan with a payload, -0.0, inf, -inf, tiny, 1
    tensor = bits.view(torch.bfloat16)
    got = _round_trip(tensor)
    assert got.dtype == torch.bfloat16
    assert got.view(torch.int16).tolist() == [0x7FC0, 0x7F81, -0x8000, 0x7F80, -0x0080, 1,
                                              0x3F80]


def test_a_strided_view_comes_back_as_its_values_contiguous():
    base = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    view = base.t()[1:, ::2]  # shape (3, 2), neither contiguous nor at offset 0
    got = _round_trip(view)
    assert got.shape == (3, 2) and got.is_contiguous()
    assert got.tolist() == [[1, 9], [2, 10], [3, 11]]


def test_a_conjugate_view_is_sent_resolved():
    tensor = torch.tensor([1 + 2j, -3 - 4j], dtype=torch.complex64).conj()
    got = _round_trip(tensor)
    assert not got.is_conj()
    assert got.tolist() == [1 - 2j, -3 + 4j]


def test_requires_grad_is_kept_and_the_result_is_a_leaf():
    tensor = torch.tensor([1.0, 2.0], requires_grad=True) * 2  # not a leaf, in a graph
    got = _round_trip(tensor)
    assert got.requires_grad and got.is_leaf and got.grad_fn is None
    assert got.tolist() == [2.0, 4.0]


def test_the_decoded_tensor_owns_its_memory():
    tensor = torch.tensor([1.0, 2.0, 3.0])
    sent = encode(tensor)
    tensor.fill_(0)  # the payload is a copy of the sender's tensor
    got = decode(sent.header, sent.payload)
    sent.payload.fill_(0)  # and the result a copy of the payload
    assert got.tolist() == [1.0, 2.0, 3.0]


def test_a_meta_tensor_sends_its_description_alone():
    tensor = torch.empty(3, 5, dtype=torch.float16, device="meta")
    sent = encode(tensor)
    assert sent.header == [TENSOR, META + 16, 0, 0]
    assert sent.payload.numel() == META + 16 == payload_len(sent.header)
    got = decode(sent.header, sent.payload)
    assert got.device.type == "meta" and got.shape == (3, 5) and got.dtype == torch.float16


def test_a_device_value_keeps_its_bytes_apart_from_its_description():
    # an accelerator group's device stands in as "cpu": the path is the same, bytes copied
    tensor = torch.tensor([[1.5, -0.0], [math.inf, 2.0]], dtype=torch.float64)
    sent = encode(tensor, device=torch.device("cpu"))
    assert sent.header == [DEVICE, META + 16, 32, 0]
    assert sent.payload.numel() == META + 16 == payload_len(sent.header)  # the bytes ride apart
    assert sent.data.dtype == torch.uint8 and sent.data.numel() == 32
    assert sent.data.data_ptr() != tensor.data_ptr()  # a copy, never the user's tensor
    got = decode(sent.header, sent.payload, data=sent.data)
    assert got.shape == (2, 2) and _same_bits(got, tensor)
    empty = encode(torch.empty(0, 2), device=torch.device("cpu"))
    assert empty.header == [DEVICE, META + 16, 0, 0]
    assert decode(empty.header, empty.payload, data=empty.data).shape == (0, 2)


# --------------------------------------------------------------------------- failures
def _caught(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - a report of whatever was raised
        return caught


def test_an_error_payload_decodes_to_the_senders_failure_and_raises_it():
    sent = encode_error(3, _caught(ValueError("bad shard 17")), "barrier")
    assert sent.header[0] == ERROR and sent.header[2:] == [0, 0]
    assert sent.header[1] == sent.payload.numel() == payload_len(sent.header)
    with pytest.raises(RankFailedError) as info:
        decode(sent.header, sent.payload)
    error = info.value
    assert error.args[0] == "rank 3 failed in barrier: ValueError: bad shard 17"
    assert (error.rank, error.exc_type, error.exc_message, error.where, error.ranks) == \
        (3, "ValueError", "bad shard 17", "barrier", (3,))
    assert "ValueError: bad shard 17" in error.remote_traceback
    assert error.site is not None and "test_encoding.py:" in error.site


def test_an_error_whose_message_cannot_be_had_still_decodes():
    class Broken(Exception):
        def __str__(self):
            raise RuntimeError("no message")

    sent = encode_error(0, _caught(Broken()), "gather_object")
    with pytest.raises(RankFailedError,
                       match=r"^rank 0 failed in gather_object: Broken: <exception str\(\) "
                             r"failed>$"):
        decode(sent.header, sent.payload)


def test_a_header_of_no_kind_is_refused():
    with pytest.raises(ValueError, match=r"^corrupt header \[9, 4, 0, 0\]: ranks are running "
                                         r"different helpers$"):
        decode([9, 4, 0, 0], torch.zeros(4, dtype=torch.uint8))


# --------------------------------------------------------------------------- refusals
def test_an_unpicklable_value_raises_a_type_error_naming_what_it_was():
    with pytest.raises(TypeError) as info:
        encode(threading.Lock(), "the result of fn")
    message = str(info.value)
    assert message.startswith("the result of fn (<unlocked _thread.lock object at 0x")
    assert ", of type lock) cannot be pickled (TypeError: cannot pickle '_thread.lock' " \
           "object): return or pass plain data (numbers, strings, lists, dicts, tensors) or " \
           "make the object picklable" in message
    assert isinstance(info.value.__cause__, TypeError)  # pickle's own error, chained


def test_an_unpicklable_item_deep_in_a_structure_names_the_whole_value():
    with pytest.raises(TypeError, match=r"^value \(\{'a': \[1, <unlocked _thread\.lock .*, of "
                                        r"type dict\) cannot be pickled"):
        encode({"a": [1, threading.Lock()]})


def test_a_value_whose_repr_raises_is_still_named():
    class Opaque:
        def __repr__(self):
            raise RuntimeError("no repr")

        def __reduce__(self):
            raise TypeError("not today")

    # reprlib stands in for a repr that raises: its own "<type instance at 0x...>"
    with pytest.raises(TypeError, match=r"^obj \(<Opaque instance at 0x[0-9a-f]+>, of type "
                                        r"Opaque\) cannot be pickled \(TypeError: not today\): "):
        encode(Opaque(), "obj")


def test_a_long_repr_is_cut_to_80_characters():
    class Wordy:
        def __repr__(self):
            return "W" * 500

        def __reduce__(self):
            raise TypeError("no")

    with pytest.raises(TypeError) as info:
        encode(Wordy(), "x")
    shown = str(info.value)[len("x ("):str(info.value).index(", of type Wordy")]
    assert len(shown) == 80 and shown.startswith("WWW") and "..." in shown


def test_tensor_bytes_reads_a_uint8_tensor_without_numpy():
    assert tensor_bytes(torch.tensor([0, 1, 255], dtype=torch.uint8)) == b"\x00\x01\xff"
    assert tensor_bytes(torch.empty(0, dtype=torch.uint8)) == b""
    assert tensor_bytes(torch.arange(6, dtype=torch.uint8)[::2]) == b"\x00\x02\x04"


def test_resolved_applies_lazy_conjugation_and_negation():
    plain = torch.ones(2)
    assert encoding.resolved(plain) is plain
    conj = torch.tensor([1 + 1j]).conj()
    assert not encoding.resolved(conj).is_conj()
    assert encoding.resolved(conj).tolist() == [1 - 1j]
