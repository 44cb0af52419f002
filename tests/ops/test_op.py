"""Ops, forms, op slots and the one selection pass (`flashrt.ops.op`): the form each slot runs follows
the device, the precision, the platform, the owner's weights and ``prefer``, in the op's order; the
choices are returned and readable; slots survive copies; the portable forms and export tables come
from the registry."""

import contextlib
import copy
import pickle

import pytest
import torch
from torch import nn

from flashrt import ops
from flashrt.errors import ConfigError
from flashrt.ops import op as op_module
from flashrt.ops.op import Form, Op, OpSlot

ASKED: list[str] = []
ENTERED: list[str] = []


def _double(x):
    return x * 2


def _cpu_fast(x):
    return x + x


def _cuda_fast(x):
    return 2 * x


def _available(name: str, answer: bool):
    def ask() -> bool:
        ASKED.append(name)
        return answer
    return ask


@contextlib.contextmanager
def _portable():
    ENTERED.append("test_double")
    yield


TEST_OP = Op("test_double", _double, group="test_group", forms={
    "cuda_fast": Form(_cuda_fast, device="cuda", available=_available("cuda_fast", True)),
    "cpu_fast": Form(_cpu_fast, device="cpu", available=_available("cpu_fast", True),
                     fits=lambda owner: owner.weight.dtype == torch.float32, dtypes=(torch.float32,)),
    "cpu_missing": Form(_cpu_fast, device="cpu", available=_available("cpu_missing", False)),
}, portable=_portable, translations=lambda: {"op": "onnx form"}, export_ops=lambda: {"op": _double})


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    """TEST_OP in the registry for one test only (its tables must not reach a real export)."""
    monkeypatch.setitem(op_module._REGISTRY, TEST_OP.name, TEST_OP)


class Block(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2, dtype=dtype))
        self.double = OpSlot(TEST_OP)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block(torch.bfloat16), Block()])


def test_a_slot_starts_on_the_reference():
    slot = Block().double
    assert slot.form == "aten" and slot.run is _double and repr(slot) == "OpSlot(test_double: aten)"


def test_select_takes_the_first_form_for_the_device_that_is_available_and_fits():
    model = Model()
    ASKED.clear()
    choices = ops.select(model, "cpu", torch.float32)
    assert choices["test_double"] == {"aten": 1, "cpu_fast": 2}  # the bf16 block does not fit
    assert ASKED == ["cpu_fast", "cpu_missing"]  # each asked once per pass, not per slot
    assert model.blocks[0].double.run is _cpu_fast and model.blocks[1].double.run is _double
    assert ops.choices(model) == choices
    assert ops.select(model, "cuda")["test_double"] == {"cuda_fast": 3}
    assert ops.select(model, "meta")["test_double"] == {"aten": 3}   # no form runs on meta
    assert ops.select(model, "cpu", torch.bfloat16)["test_double"] == {"aten": 3}  # not a dtype it runs


def test_a_form_no_slot_fits_is_never_asked_whether_it_is_available():
    """The platform check may build a library (`flashrt.ops.torch_cpu`): a model none of whose slots fit
    the form (here every weight bfloat16, the precision not given) never asks it."""
    model = Model()
    for block in model.blocks:
        block.weight.data = block.weight.data.to(torch.bfloat16)
    ASKED.clear()
    assert ops.select(model, "cpu")["test_double"] == {"aten": 3}  # cpu_missing: asked, not there
    assert ASKED == ["cpu_missing"]


def test_prefer_forces_a_form_by_op_or_group_where_it_fits():
    model = Model()
    assert ops.select(model, "cuda", prefer={"test_group": "cpu_fast"})["test_double"] == \
        {"aten": 1, "cpu_fast": 2}
    assert ops.select(model, "cpu", prefer={"test_double": "aten"})["test_double"] == {"aten": 3}
    assert ops.select(model, "cpu", prefer={"test_double": "cpu_missing"})["test_double"] == \
        {"cpu_missing": 3}
    with pytest.raises(ConfigError, match="no form 'triton'"):
        ops.select(model, "cpu", prefer={"test_group": "triton"})


def test_using_restores_every_slot():
    model = Model()
    ops.select(model, "cpu", torch.float32)
    with ops.using(model, {"test_group": "aten"}):
        assert ops.choices(model)["test_double"] == {"aten": 3}
    assert ops.choices(model)["test_double"] == {"aten": 1, "cpu_fast": 2}


def test_slots_survive_copies_and_pickling_with_their_form():
    model = Model()
    ops.select(model, "cpu", torch.float32)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert ops.choices(twin) == ops.choices(model)
        assert twin.blocks[0].double is not model.blocks[0].double
        assert twin.blocks[0].double.run is _cpu_fast


def test_the_registry_gives_portable_forms_and_export_tables():
    assert ops.register(TEST_OP) is TEST_OP and ops.get("test_double") is TEST_OP
    ENTERED.clear()
    with ops.portable_forms():
        assert ENTERED == ["test_double"]
    assert ops.export_translations()["op"] == "onnx form" and ops.export_ops()["op"] is _double
    with pytest.raises(ConfigError, match="no op 'nothing'"):
        ops.get("nothing")


def test_the_portable_forms_of_the_real_ops_are_entered_together():
    from flashrt.nn import conv1d
    from flashrt.ops import decoder  # noqa: F401  (its ops register on import, as every op's module)
    from flashrt.quant import linear

    with ops.portable_forms():
        assert conv1d._plain() and linear.TABLE.portable
    assert not conv1d._plain() and not linear.TABLE.portable
    assert {"conv1d", "quant_gemm", "rms_norm", "rope_qkv"} <= set(ops.registered())
    assert linear.fp8_qdq._opoverload in ops.export_translations()
    assert ops.export_ops()[torch.ops.flashrt.gelu_mul.default].__name__ == "gelu_mul_ref"
