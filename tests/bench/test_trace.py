import numpy as np
import pytest
import torch

from flashrt.bench.trace import FrozenTrace, hash_input
from flashrt.errors import InputError

BASE = {"image": np.arange(12, dtype=np.uint8).reshape(3, 4), "state": torch.tensor([0.5, -1.0]),
        "prompt": "pick up the cube", "steps": 10}


def _variant(**changes):
    return {**BASE, **changes}


@pytest.mark.parametrize("changed", [
    _variant(image=np.arange(1, 13, dtype=np.uint8).reshape(3, 4)),        # one value
    _variant(image=np.arange(12, dtype=np.uint8).reshape(4, 3)),           # shape
    _variant(image=np.arange(12, dtype=np.int8).reshape(3, 4)),            # dtype
    _variant(state=torch.tensor([0.5, -1.0], dtype=torch.float64)),        # tensor dtype
    _variant(state=torch.tensor([0.5, -1.0000001])),                       # tiny value change
    _variant(prompt="pick up the cube "),                                  # string
    _variant(steps=11),                                                    # scalar
    _variant(steps=10.0),                                                  # scalar type
    {**{k: v for k, v in BASE.items() if k != "prompt"}, "task": BASE["prompt"]},  # key name
])
def test_hash_changes_when_any_input_changes(changed):
    assert hash_input(changed) != hash_input(BASE)


def test_hash_is_stable_and_array_kind_agnostic():
    assert hash_input(BASE) == hash_input(dict(reversed(list(BASE.items()))))  # key order irrelevant
    arr = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    assert hash_input(arr) == hash_input(torch.from_numpy(arr.copy()))
    assert hash_input(torch.zeros(2, dtype=torch.bfloat16)) != hash_input(torch.zeros(2, dtype=torch.float16))
    assert hash_input([1, 2]) != hash_input([2, 1])


def test_trace_digest_depends_on_every_input_and_order():
    a, b = {"x": torch.ones(2)}, {"x": torch.zeros(2)}
    t1, t2 = FrozenTrace.from_inputs([a, b]), FrozenTrace.from_inputs([b, a])
    assert t1.digest != t2.digest and t1.digests == tuple(reversed(t2.digests))
    assert t1[2] is a  # cycles
    assert t1.record()["inputs"] == list(t1.digests) and t1.record()["length"] == 2


def test_verify_detects_mutation():
    x = {"x": torch.ones(3)}
    trace = FrozenTrace.from_inputs([x])
    trace.verify()
    x["x"][1] = 5.0
    with pytest.raises(InputError, match="changed"):
        trace.verify()


def test_save_load_roundtrip_and_tamper(tmp_path):
    trace = FrozenTrace.from_inputs([BASE, _variant(steps=3)], seed=7)
    path = trace.save(tmp_path / "t.pt")
    back = FrozenTrace.load(path)
    assert back.digests == trace.digests and back.digest == trace.digest and back.seed == 7
    data = torch.load(path, weights_only=True)
    data["inputs"][0]["state"][0] = 9.0
    torch.save(data, path)
    with pytest.raises(InputError, match="digests"):
        FrozenTrace.load(path)


def test_rejects_empty_and_unhashable():
    with pytest.raises(InputError):
        FrozenTrace.from_inputs([])
    with pytest.raises(InputError, match="object"):
        hash_input({"x": object()})
