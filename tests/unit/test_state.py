from __future__ import annotations

import enum
import json
import math
import random
import warnings
from collections import OrderedDict

import msgpack
import numpy as np
import pytest
import torch

from easyckpt.snapshot.state import (
    TensorRef,
    dtype_code,
    flatten,
    numpy_dtype,
    numpy_dtype_code,
    torch_dtype,
    unflatten,
    validate_skeleton,
)


def _assert_same(a: object, b: object, path: str = "state") -> None:
    """Exact structural equality: types at every node, bitwise tensor data."""
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert type(k) is type(next(x for x in b if x == k)), f"{path} key {k!r}"
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
        assert hasattr(a, "_metadata") == hasattr(b, "_metadata"), path
        if hasattr(a, "_metadata"):
            _assert_same(a._metadata, b._metadata, f"{path}._metadata")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    elif isinstance(a, float):
        assert a == b and math.copysign(1, a) == math.copysign(1, b), path
    else:
        assert a == b, path


def _training_state() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(11, 8),
        torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True),
        torch.nn.LayerNorm(8),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    step_sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        loss = model(torch.randint(0, 11, (2, 5))).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        step_sched.step()
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    lambda_sched = torch.optim.lr_scheduler.LambdaLR(sgd, lambda e: 0.9**e)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": {"step": step_sched.state_dict(), "lambda": lambda_sched.state_dict()},
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                "torch": torch.get_rng_state()},
        "misc": {
            "nested": ([1, (2, [3])], ((),), []),
            "bytes": b"\x00\xffabc",
            "big": [2**70, -(2**70), 2**63 - 1, -(2**63), 2**63],
            "floats": [float("nan"), float("inf"), float("-inf"), -0.0, 1e-300],
            "np_scalars": [np.float32(1.5), np.int64(3), np.bool_(True), np.float64(2.5),
                           np.uint8(7), np.str_("hé")],
            "size": torch.Size([2, 3]),
            "dtypes": [torch.float32, torch.bfloat16],
            "device": torch.device("cpu"),
            "bools": [True, False, 1, 0],
            "bf16": torch.randn(3, 4).to(torch.bfloat16),
            "booltensor": torch.tensor([True, False, True]),
            "zero_d": torch.tensor(3.25),
            "empty": torch.empty(0, 5),
            "transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
            "array": np.arange(6, dtype=np.int16).reshape(2, 3),
            "odd_keys": {1: "a", -2: "b", None: "c", (1, "x"): "d", 2.5: "e", b"k": "f",
                         False: "g"},
            "param": torch.nn.Parameter(torch.ones(2)),
        },
    }


def _iter_leaves(x: object):
    if isinstance(x, dict):
        for v in x.values():
            yield from _iter_leaves(v)
    elif isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
        for v in x:
            yield from _iter_leaves(v)
    else:
        yield x


def test_round_trip_realistic_state() -> None:
    state = _training_state()
    skeleton, refs, values = flatten(state)

    assert len(refs) == len(values)
    assert len({r.name for r in refs}) == len(refs)
    assert all(isinstance(r, TensorRef) for r in refs)

    originals = [x for x in _iter_leaves(state) if isinstance(x, (torch.Tensor, np.ndarray))]
    assert len(originals) == len(values)
    for orig, got in zip(originals, values):
        assert got is orig  # no copies: the writer decides when to copy

    assert json.loads(json.dumps(skeleton)) == skeleton
    packed = msgpack.packb(skeleton, use_bin_type=True)
    assert msgpack.unpackb(packed, raw=False, strict_map_key=False) == skeleton
    # json turns NaN into a non-standard token; the skeleton must never contain one.
    json.dumps(skeleton, allow_nan=False)

    # Copies made the way a loader would, so nothing can pass by sharing objects with `state`.
    loaded = [v.detach().clone() if isinstance(v, torch.Tensor) else v.copy() for v in values]
    restored = unflatten(json.loads(json.dumps(skeleton)), loaded)
    expected = dict(state)
    # nn.Parameter is saved as data; a loader hands back a plain tensor.
    expected["misc"] = dict(state["misc"], param=state["misc"]["param"].detach())
    _assert_same(expected, restored)
    assert type(restored["model"]) is OrderedDict
    assert restored["model"]._metadata == state["model"]._metadata
    assert type(restored["optim"]["param_groups"][0]["betas"]) is tuple
    assert all(type(k) is int for k in restored["optim"]["state"])
    assert type(restored["misc"]["bools"][0]) is bool and type(restored["misc"]["bools"][2]) is int
    assert restored["misc"]["zero_d"].shape == () and restored["misc"]["empty"].shape == (0, 5)


def test_restored_state_after_msgpack_with_deep_copies() -> None:
    state = _training_state()
    skeleton, refs, values = flatten(state)
    packed = msgpack.packb(skeleton, use_bin_type=True)
    copies = [v.clone() if isinstance(v, torch.Tensor) else v.copy() for v in values]
    restored = unflatten(msgpack.unpackb(packed, raw=False, strict_map_key=False), copies)
    assert torch.equal(restored["model"]["0.weight"], state["model"]["0.weight"])
    assert restored["model"]["0.weight"] is copies[0]


def test_refs_describe_tensors() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    state = {
        "model": OrderedDict([("layer.0.weight", t)]),
        "optim": {"state": {0: {"exp_avg": torch.zeros(2, dtype=torch.bfloat16)}}},
        "np": np.zeros((2, 2), dtype=np.uint32),
        "scalar": torch.tensor(True),
        "empty": torch.empty(0, 3, dtype=torch.int64),
    }
    _, refs, _ = flatten(state)
    assert refs == [
        TensorRef("model/layer.0.weight", "torch", "F32", (4, 3), 48),
        TensorRef("optim/state/0/exp_avg", "torch", "BF16", (2,), 4),
        TensorRef("np", "numpy", "U32", (2, 2), 16),
        TensorRef("scalar", "torch", "BOOL", (), 1),
        TensorRef("empty", "torch", "I64", (0, 3), 0),
    ]


def test_name_collisions_are_made_unique() -> None:
    state = {"a/b": torch.zeros(1), "a": {"b": torch.zeros(1)}}
    _, refs, _ = flatten(state)
    assert [r.name for r in refs] == ["a/b", "a/b#1"]


def test_python_and_numpy_rng_resume_identically() -> None:
    random.seed(123)
    np.random.seed(456)
    np.random.standard_normal()  # populates numpy's cached gaussian
    state = {"py": random.getstate(), "np": np.random.get_state()}
    skeleton, _, values = flatten(state)
    expected_py = [random.random() for _ in range(5)]
    expected_np = np.random.standard_normal(5)

    restored = unflatten(json.loads(json.dumps(skeleton)), [v.copy() for v in values])
    random.setstate(restored["py"])
    np.random.set_state(restored["np"])
    assert [random.random() for _ in range(5)] == expected_py
    assert np.array_equal(np.random.standard_normal(5), expected_np)


def test_torch_rng_resume() -> None:
    torch.manual_seed(7)
    skeleton, _, values = flatten({"rng": torch.get_rng_state()})
    expected = torch.rand(4)
    torch.set_rng_state(unflatten(skeleton, [v.clone() for v in values])["rng"])
    assert torch.equal(torch.rand(4), expected)


def test_numpy_scalars_keep_their_type() -> None:
    scalars = [np.float32(1.5), np.int64(3), np.float16(-0.0), np.uint64(2**64 - 1),
               np.bool_(False), np.complex128(1 + 2j), np.datetime64("2021-03-04T05:06"),
               np.str_(""), np.bytes_(b"ab")]
    skeleton, _, values = flatten(scalars)
    restored = unflatten(json.loads(json.dumps(skeleton)), values)
    for a, b in zip(scalars, restored):
        assert type(a) is type(b) and a == b


class Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize("odd", [None, math.nan, math.inf, -math.inf, 2**63, -(2**63) - 1, np.float64(0.5), True,
                                 "x", Color.RED, 1e300, -(2**63), 2**63 - 1])
@pytest.mark.parametrize("ints", [0, 100])
def test_a_long_list_of_numbers_is_encoded_as_its_items_are_one_by_one(odd: object, ints: int) -> None:
    """A long list or tuple of plain numbers (a loss history kept in the state) is taken whole, not walked item by
    item: its encoding must be what each item's own is, with any odd item among them (a non-finite float, an int
    past int64, a numpy scalar, a bool, a string, an IntEnum, a huge finite float) anywhere in it."""
    rng = random.Random(7)
    for container in (list, tuple):
        items = [rng.random() * 10 for _ in range(100)] + [rng.randrange(-(2**62), 2**62) for _ in range(ints)]
        rng.shuffle(items)
        items.insert(rng.randrange(len(items)), odd)
        value = container(items)
        if isinstance(odd, enum.Enum):
            with pytest.raises(TypeError, match=r"state\[\d+\]"):
                flatten(value)
            continue
        skeleton, _, values = flatten(value)
        expected = [flatten(item)[0] for item in items]
        assert skeleton == ["l" if container is list else "t", expected], odd
        restored = unflatten(json.loads(json.dumps(skeleton)), values)
        assert [type(v) for v in restored] == [type(v) for v in value]
        assert all(a == b or (a != a and b != b) for a, b in zip(restored, value))


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated, still possible
        return torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.qint8)


@pytest.mark.parametrize(
    ("state", "path", "what"),
    [
        ({"optim": {"param_groups": [{"lr": 1.0, "fn": lambda e: e}]}},
         "state['optim']['param_groups'][0]['fn']", "function"),
        ({"a": [1, {2, 3}]}, "state['a'][1]", "set"),
        ({"a": {"color": Color.RED}}, "state['a']['color']", "Color"),
        ({"x": {7: np.array([object()], dtype=object)}}, "state['x'][7]", "object"),
        ({"z": torch.zeros(2, dtype=torch.complex128)}, "state['z']", "complex128"),   # safetensors has no code
        ({"s": torch.zeros(3).to_sparse()}, "state['s']", "sparse"),
        ({"m": torch.empty(2, device="meta")}, "state['m']", "meta"),
        ({"q": (1, _quantized())}, "state['q'][1]", "qint8"),
        ({"d": {torch.zeros(1): 1}}, "state['d']", "dict key"),
        ({"nt": torch.return_types.max((torch.zeros(1), torch.zeros(1)))}, "state['nt']",
         "subclass"),
        ({"c": 1j}, "state['c']", "complex"),
        ({"np": np.zeros(2, dtype=np.complex128)}, "state['np']", "complex128"),
    ],
)
def test_unsupported_values_name_their_key_path(state: object, path: str, what: str) -> None:
    with pytest.raises(TypeError) as info:
        flatten(state)
    msg = str(info.value)
    assert path in msg and what in msg


def _good_skeleton() -> tuple[object, list[object]]:
    skeleton, _, values = flatten({"a": [torch.zeros(1), (1, 2)], "b": OrderedDict(x=np.zeros(1))})
    return skeleton, values


@pytest.mark.parametrize(
    "bad",
    [
        ["X", 1],  # unknown tag
        [],  # empty list node
        [1, 2],  # non-string tag
        ["T", 5],  # index out of range
        ["T", -1],
        ["T", True],  # bool is not an index
        ["T", "0"],
        ["l", [["T", 0], ["T", 0]]],  # index used twice
        ["l"],  # wrong arity
        ["o", []],
        ["d", [["k"]]],  # pair of wrong arity
        ["d", [["k", 1, 2]]],
        ["d", [[["l", []], 1]]],  # unhashable key
        ["d", {"k": 1}],  # non-list where a list is expected
        {"k": 1},  # non-list node
        ["l", [(1, 2)]],
        ["F", "nope"],
        ["I", "12x"],
        ["B", "***"],
        ["S", [1, -2]],
        ["D", "Tensor"],
        ["D", "nonexistent"],
        ["V", "notadevice:9"],
        ["n", "F32", "AAA="],  # wrong byte count
        ["n", "|O", "AAAAAAAAAAA="],  # object dtype
        ["n", "zzz", "AAAA"],
    ],
)
def test_malformed_skeletons_raise_value_error(bad: object) -> None:
    with pytest.raises(ValueError):
        validate_skeleton(bad, 1)
    with pytest.raises(ValueError):
        unflatten(bad, [torch.zeros(1)])


def test_malformed_nested_in_good_skeleton_names_location() -> None:
    skeleton, values = _good_skeleton()
    skeleton[1][0][1][1][0] = ["T", 9]  # state['a'][0]
    with pytest.raises(ValueError, match=r"state\['a'\]\[0\]"):
        unflatten(skeleton, values)


def test_value_count_must_match() -> None:
    skeleton, values = _good_skeleton()
    validate_skeleton(skeleton, len(values))
    with pytest.raises(ValueError):
        validate_skeleton(skeleton, len(values) + 1)
    with pytest.raises(ValueError):
        unflatten(skeleton, values[:1])


def test_deeply_nested_skeleton_is_value_error() -> None:
    node: object = 1
    for _ in range(100_000):
        node = ["l", [node]]
    with pytest.raises(ValueError):
        validate_skeleton(node, 0)


def test_ten_thousand_tensors() -> None:
    state = {"model": OrderedDict((f"layer.{i}.weight", torch.zeros(2)) for i in range(10_000))}
    state["optim"] = {"state": {i: {"step": torch.tensor(1.0)} for i in range(10_000)}}
    skeleton, refs, values = flatten(state)
    assert len(refs) == len(values) == 20_000
    assert len({r.name for r in refs}) == 20_000
    restored = unflatten(skeleton, values)
    assert restored["optim"]["state"][9_999]["step"] is values[-1]


def test_dtype_maps() -> None:
    for dt in [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.uint16,
               torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64]:
        assert torch_dtype(dtype_code(dt)) is dt
    assert dtype_code(torch.float8_e4m3fn) == "F8_E4M3"
    assert dtype_code(torch.complex64) == "C64"   # safetensors' code: the rank files stay readable by safe_open
    for name, code in [("bool", "BOOL"), ("float64", "F64"), ("uint32", "U32"), ("int8", "I8")]:
        assert numpy_dtype_code(np.dtype(name)) == code
        assert numpy_dtype(code) == np.dtype(name)
    with pytest.raises(TypeError):
        dtype_code(torch.complex128)
    with pytest.raises(TypeError):
        numpy_dtype_code(np.dtype(object))
    with pytest.raises(ValueError):
        torch_dtype("F128")
    with pytest.raises(ValueError):
        numpy_dtype("BF16")


def test_flatten_restores_garbage_collector_state() -> None:
    import gc

    assert gc.isenabled()
    flatten({"a": torch.zeros(1)})
    assert gc.isenabled()
    with pytest.raises(TypeError):
        flatten({"a": {1, 2}})
    assert gc.isenabled()
    gc.disable()
    try:
        flatten({"a": torch.zeros(1)})
        assert not gc.isenabled()  # a caller's choice to disable GC is left alone
    finally:
        gc.enable()


def test_root_values_and_uninitialized_parameter() -> None:
    t = torch.ones(3)
    skeleton, refs, values = flatten(t)
    assert skeleton == ["T", 0] and refs[0].name == "state" and values[0] is t
    assert unflatten(skeleton, values) is t
    assert unflatten(*flatten(5)[::2]) == 5
    with pytest.raises(TypeError, match=r"state\['w'\].*UninitializedParameter"):
        flatten({"w": torch.nn.parameter.UninitializedParameter()})
