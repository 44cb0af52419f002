import pytest
import torch

from flashrt.bench.profiles import check_device, list_profiles, load_profile, parse_profile
from flashrt.errors import ConfigError, DeviceError

REQUIRED = {"cpu-small", "cpu-tiny", "h200-bf16", "h200-fp8", "rtx4090-bf16", "orin-int8"}


def test_shipped_profiles_load():
    names = set(list_profiles())
    assert names >= REQUIRED
    for name in names:
        p = load_profile(name)
        assert p.name == name and p.path.endswith(f"{name}.toml")
        assert p.to_dict()["bench"]["iters"] == p.bench.iters
    assert load_profile("h200-fp8").precision == "fp8"
    assert load_profile("orin-int8").device.model == "orin"


def _write(tmp_path, text, name="mine"):
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, key", [
    ('precison = "fp32"\n', "precison"),
    ('[bench]\nwarmpu = 3\n', "warmpu"),
    ('[device]\nkind = "cpu"\ngpu = "x"\n', "gpu"),
    ('[extras]\na = 1\n', "extras"),
])
def test_unknown_key_rejected_naming_file_and_key(tmp_path, text, key):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_profile(path)
    assert str(path) in str(err.value) and key in str(err.value) and "unknown key" in str(err.value)


@pytest.mark.parametrize("text, key", [
    ('precision = "fp7"\n', "precision"),
    ('[bench]\niters = 0\n', "iters"),
    ('[bench]\nwarmup = -1\n', "warmup"),
    ('[bench]\niters = "many"\n', "iters"),
    ('[bench]\niters = true\n', "iters"),
    ('[bench]\ntarget_rate_hz = nan\n', "target_rate_hz"),
    ('[runtime]\nbackend = "tensorrt"\n', "backend"),
    ('[runtime]\nbackend = "cuda"\n', "backend"),          # cuda backend on a cpu profile
    ('[runtime]\nbackend = "nope"\n', "backend"),
    ('[device]\nkind = "tpu"\n', "kind"),
    ('[device]\nmodel = "h200"\n', "model"),               # cpu kind with a gpu model
    ('[shapes]\nbuckets = [64, 32]\n', "buckets"),
    ('[shapes]\nbuckets = [0, 32]\n', "buckets"),
    ('[quality]\natol = -1.0\n', "atol"),
    ('name = "other"\n', "name"),
    ('[model]\nx = {a = 1}\n', "model.x"),
    ('bench = 3\n', "bench"),
])
def test_bad_value_rejected_naming_file_and_key(tmp_path, text, key):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_profile(path)
    assert str(path) in str(err.value) and key in str(err.value)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="no profile named 'nope'"):
        load_profile("nope")
    with pytest.raises(ConfigError, match="not found"):
        load_profile(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_profile(_write(tmp_path, "[bench\n"))


def test_any_registered_backend_that_runs_on_the_device_kind():
    """[runtime] backend comes from the graph-backend registry (onnxrt on a CPU), not a fixed list."""
    from flashrt.runtime.graphs import backends_for

    p = load_profile("cpu-tiny")
    for name in backends_for("cpu"):
        assert p.with_overrides(runtime={"backend": name}).runtime.backend == name
    assert "onnxrt" in backends_for("cpu")


def test_overrides_are_validated():
    p = load_profile("cpu-tiny")
    q = p.with_overrides(bench={"iters": 7}, runtime={"backend": "trace"})
    assert q.bench.iters == 7 and q.runtime.backend == "trace" and p.bench.iters != 7
    with pytest.raises(ConfigError, match="iters"):
        p.with_overrides(bench={"iters": -3})
    with pytest.raises(ConfigError, match="unknown key"):
        p.with_overrides(bench={"itres": 3})


def test_model_table_passes_through():
    p = parse_profile({"model": {"tokens": 4, "names": ["a", "b"]}}, "x")
    assert p.model == {"tokens": 4, "names": ["a", "b"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("name", ["h200-bf16", "h200-fp8", "rtx4090-bf16", "orin-int8"])
def test_gpu_profiles_refused_without_gpu(name):
    with pytest.raises(DeviceError, match=f"{name}.*needs a CUDA device"):
        check_device(load_profile(name))
    assert check_device(load_profile("cpu-tiny")) == "cpu"
