import numpy as np
import pytest
import torch

from flashrt.errors import InputError
from flashrt.runtime.buffers import Buffers, BufferSpec


def make() -> Buffers:
    return Buffers(
        [
            BufferSpec("x", (2, 3), torch.float32, "input", low=-1.0, high=1.0),
            BufferSpec("ids", (4,), torch.int64, "input", low=0, high=9, accepts=(torch.int32,)),
            BufferSpec("y", (2, 3), torch.float32, "output"),
            BufferSpec("kv", (8, 3), torch.bfloat16, "state"),
        ]
    )


def graph(buf: Buffers) -> None:
    buf["y"].copy_(buf["x"] * 2 + buf["ids"][:3].float().sum())


def test_nbytes_and_summary():
    buf = make()
    assert buf.nbytes("input") == 2 * 3 * 4 + 4 * 8
    assert buf.nbytes() == 24 + 32 + 24 + 8 * 3 * 2
    text = buf.summary()
    assert "kv" in text and "state" in text and f"{buf.nbytes():,d}" in text


def test_allocated_once_and_stable_addresses():
    buf = make()
    ptrs = {n: buf[n].data_ptr() for n in buf.names()}
    for _ in range(3):
        buf.populate({"x": np.full((2, 3), 0.5, np.float32), "ids": np.arange(4)})
    assert ptrs == {n: buf[n].data_ptr() for n in buf.names()}


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"x": np.zeros((3, 2), np.float32)}, "x: expected shape"),
        ({"x": np.zeros((2, 3), np.float64)}, "x: expected dtype"),
        ({"x": np.array([[0, np.nan, 0], [0, 0, 0]], np.float32)}, "x: contains NaN"),
        ({"x": np.array([[0, np.inf, 0], [0, 0, 0]], np.float32)}, "x: contains NaN or inf"),
        ({"x": np.full((2, 3), 1.5, np.float32)}, "x: value 1.5 above"),
        ({"ids": np.array([0, 1, 2, 10])}, "ids: value 10 above"),
        ({"ids": np.array([0, -1, 2, 3])}, "ids: value -1 below"),
        ({"nope": np.zeros(1)}, "unknown input"),
        ({"y": np.zeros((2, 3), np.float32)}, "unknown input"),
    ],
)
def test_bad_input_leaves_buffers_intact_and_next_call_is_correct(bad, field):
    buf = make()
    good = {"x": np.full((2, 3), 0.25, np.float32), "ids": np.array([1, 2, 3, 4])}
    buf.populate(good)
    graph(buf)
    before = {n: buf.read(n) for n in buf.names()}
    # the good field given alongside the bad one must not be written either
    attempt = {**good, "x": np.full((2, 3), -0.75, np.float32), **bad}
    with pytest.raises(InputError, match=field.split(":")[0]) as err:
        buf.populate(attempt)
    assert field in str(err.value)
    for n in buf.names():
        assert torch.equal(buf[n], before[n]), n
    nxt = {"x": np.full((2, 3), -0.5, np.float32), "ids": np.array([0, 0, 1, 9], np.int32)}
    buf.populate(nxt)
    graph(buf)
    assert torch.equal(buf["y"], torch.full((2, 3), -1.0 + 1.0))


def test_missing_input_and_partial():
    buf = make()
    with pytest.raises(InputError, match="missing input"):
        buf.populate({"x": np.zeros((2, 3), np.float32)})
    buf.populate({"x": np.ones((2, 3), np.float32)}, partial=True)
    assert torch.equal(buf["x"], torch.ones(2, 3))


def test_read_is_a_copy():
    buf = make()
    buf.populate({"x": np.ones((2, 3), np.float32), "ids": np.zeros(4, np.int64)})
    kept = buf.read("x")
    buf.populate({"x": np.zeros((2, 3), np.float32), "ids": np.zeros(4, np.int64)})
    assert torch.equal(kept, torch.ones(2, 3))


def test_declaration_errors():
    with pytest.raises(ValueError, match="declared twice"):
        Buffers([BufferSpec("a", (1,), torch.float32), BufferSpec("a", (2,), torch.float32)])
    with pytest.raises(ValueError, match="role"):
        BufferSpec("a", (1,), torch.float32, role="weird")  # type: ignore[arg-type]


def test_write_checks_names_and_shapes_before_copying_anything():
    buf = make()
    buf.populate({"x": np.full((2, 3), 0.5, np.float32), "ids": np.arange(4)})
    before = {n: buf.read(n) for n in buf.names()}
    with pytest.raises(InputError, match="ids: expected shape"):
        buf.write({"x": torch.zeros(2, 3), "ids": torch.zeros(5, dtype=torch.int64)})
    with pytest.raises(InputError, match="y: not an input buffer"):
        buf.write({"x": torch.zeros(2, 3), "y": torch.zeros(2, 3)})
    for n in buf.names():
        assert torch.equal(buf[n], before[n]), n
    buf.write(buf.validate({"x": np.full((2, 3), -0.25, np.float32)}, partial=True))
    assert torch.equal(buf["x"], torch.full((2, 3), -0.25))
    assert torch.equal(buf["ids"], before["ids"])


def test_value_checks_allocate_two_scalars_however_large_the_input():
    """Finiteness and range from one aminmax; the messages as before (NaN, inf, below, above)."""
    from flashrt.profile.alloc import count_allocations
    from flashrt.runtime.buffers import check_value

    big = BufferSpec("big", (256, 256), torch.float32, low=-1.0, high=1.0)
    x = torch.rand(256, 256)
    assert count_allocations(lambda c: check_value(big, x)).allocations == 2
    for value, match in ((float("nan"), "NaN or inf"), (float("-inf"), "NaN or inf"), (-2.0, "below"),
                         (3.0, "above")):
        y = x.clone()
        y[7, 9] = value
        with pytest.raises(InputError, match=match):
            check_value(big, y)
    loose = BufferSpec("loose", (3,), torch.float32, low=0.0, finite=False)
    check_value(loose, torch.tensor([0.0, float("nan"), float("inf")]))  # not checked finite: accepted


def test_host_staging_on_the_cpu_is_the_buffer_itself():
    buf = make()
    assert buf.host("x") is buf["x"] and buf.download("y") is buf["y"] and not buf.staged
    buf.host("x").fill_(0.5)
    buf.upload("x")  # nothing to copy
    assert torch.equal(buf["x"], torch.full((2, 3), 0.5))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_host_staging_on_a_gpu_is_pinned_reused_and_copied_in_and_out():
    buf = Buffers(make().specs, "cuda")
    twin = buf.host("x")
    assert buf.staged and twin.is_pinned() and twin.device.type == "cpu"
    for value in (0.25, -0.5):
        host = buf.host("x")
        assert host is twin  # made once, reused
        host.fill_(value)
        buf.upload("x")
        graph(buf)
        out = buf.download("y")
        assert out.is_pinned() and out is buf.download("y")
        assert torch.equal(out, torch.full((2, 3), value * 2))
