"""PrecisionSpec: presets, combination refusals, device validation (flashrt/quant/precision.py)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from flashrt.errors import ConfigError, DeviceError
from flashrt.quant.precision import PRESETS, PrecisionSpec, TensorSpec, cuda_capability, dtype_info

FP8_W = TensorSpec("fp8_e4m3", "per_channel", "dynamic")
FP8_A = TensorSpec("fp8_e4m3", "per_tensor", "calibrated")


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "fp8", "int8"])
def test_presets_are_named_and_consistent(name):
    spec = PrecisionSpec.named(name)
    assert spec.name == name
    assert spec is PRESETS[name]
    assert spec.quantized == (name in ("fp8", "int8"))


def test_preset_contents():
    fp8 = PrecisionSpec.named("fp8")
    assert (fp8.weights.dtype, fp8.activations.dtype, fp8.activations.scale) == ("fp8_e4m3", "fp8_e4m3",
                                                                                 "calibrated")
    assert PrecisionSpec.named("int8").weights.granularity == "per_channel"
    assert PrecisionSpec.named("bf16").tensor_dtypes() == ("bf16", "bf16", "bf16", "bf16")


def test_unknown_preset_and_dtype_refused():
    with pytest.raises(ConfigError, match="unknown precision preset 'fp4'"):
        PrecisionSpec.named("fp4")
    with pytest.raises(ConfigError, match="unknown dtype 'int4'"):
        TensorSpec("int4")


def test_aliases_resolve():
    assert TensorSpec("fp8", scale="dynamic").dtype == "fp8_e4m3"
    assert TensorSpec("bfloat16").dtype == "bf16"
    assert dtype_info("half").torch_dtype is torch.float16


def test_spec_is_frozen_and_hashable():
    spec = PrecisionSpec.named("fp8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.compute = "fp32"
    assert hash(spec) == hash(PrecisionSpec.from_dict(spec.to_dict()))


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "fp8_e4m3"}, "needs a scale source"),
    ({"dtype": "int8", "scale": "none"}, "needs a scale source"),
    ({"dtype": "fp32", "scale": "calibrated"}, "must be 'none'"),
    ({"dtype": "bf16", "granularity": "per_channel"}, "means nothing"),
    ({"dtype": "int8", "granularity": "per_row", "scale": "dynamic"}, "unknown granularity"),
    ({"dtype": "int8", "scale": "static"}, "unknown scale"),
])
def test_tensor_spec_refusals(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TensorSpec(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"weights": FP8_W, "activations": TensorSpec("fp8_e4m3", "per_channel", "calibrated")},
     "per_channel activations are unsupported"),
    ({"weights": TensorSpec("int8", "per_channel", "dynamic"),
      "activations": TensorSpec("int8", "per_channel", "calibrated")}, "per_channel activations"),
    ({"kv": TensorSpec("int8", "per_channel", "calibrated")}, "per_channel kv are unsupported"),
    ({"weights": TensorSpec("int8", "per_channel", "dynamic"), "activations": FP8_A}, "same dtype"),
    ({"activations": FP8_A}, "same dtype"),
    ({"compute": "fp8_e4m3"}, "compute dtype must be"),
])
def test_combination_refusals(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        PrecisionSpec(**kwargs)


def test_weight_only_quantization_is_allowed():
    spec = PrecisionSpec(weights=FP8_W, activations=TensorSpec("bf16"), compute="bf16")
    assert spec.quantized and not spec.activations.quantized


def test_from_dict_preset_overrides_and_unknown_keys():
    spec = PrecisionSpec.from_dict({"preset": "fp8", "kv": {"dtype": "fp8_e4m3", "scale": "calibrated"}})
    assert spec.kv.dtype == "fp8_e4m3" and spec.weights == PRESETS["fp8"].weights
    assert spec.name == ""  # modified preset is not the preset any more
    assert PrecisionSpec.from_dict({"preset": "bf16"}) == PRESETS["bf16"]
    with pytest.raises(ConfigError, match=r"unknown precision keys \['wieghts'\]"):
        PrecisionSpec.from_dict({"wieghts": "bf16"})
    with pytest.raises(ConfigError, match=r"unknown keys \['scales'\] in precision.kv"):
        PrecisionSpec.from_dict({"kv": {"dtype": "bf16", "scales": "none"}})
    with pytest.raises(ConfigError, match="needs a scale source"):
        PrecisionSpec.from_dict({"preset": "fp8", "kv": "fp8"})


def test_cache_fields_ignore_the_display_name():
    renamed = dataclasses.replace(PRESETS["fp8"], name="my-fp8")
    assert renamed.cache_fields() == PRESETS["fp8"].cache_fields()
    assert PRESETS["fp8"].cache_fields() != PRESETS["int8"].cache_fields()


# ------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_cpu_refuses_quantized_without_reference(name):
    with pytest.raises(DeviceError, match=r"cannot run natively on the CPU.*reference=True"):
        PrecisionSpec.named(name).validate("cpu")
    assert PrecisionSpec.named(name).validate("cpu", reference=True) is PRESETS[name]


def test_cpu_runs_fp32_and_bf16_silently(caplog):
    with caplog.at_level(logging.WARNING, logger="flashrt.quant.precision"):
        PrecisionSpec.named("fp32").validate("cpu")
        PrecisionSpec.named("bf16").validate("cpu")
    assert caplog.records == []


def test_cpu_fp16_is_allowed_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="flashrt.quant.precision"):
        PrecisionSpec.named("fp16").validate("cpu")
    assert any("fp16 on CPU" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("name, sm, ok", [
    ("fp8", (8, 6), False), ("fp8", (8, 9), True), ("fp8", (9, 0), True), ("fp8", (12, 0), True),
    ("bf16", (7, 5), False), ("bf16", (8, 0), True), ("fp16", (7, 0), True),
    ("int8", (7, 0), False), ("int8", (8, 0), True),
])
def test_cuda_capability_rules(name, sm, ok):
    spec = PrecisionSpec.named(name)
    if ok:
        assert spec.validate("cuda:0", capability=sm) is spec
    else:
        with pytest.raises(DeviceError, match=rf"sm{sm[0]}{sm[1]}; .*needs sm"):
            spec.validate("cuda:0", capability=sm)


def test_cuda_error_names_the_requirement():
    with pytest.raises(DeviceError, match="fp8_e4m3 needs sm89"):
        PrecisionSpec.named("fp8").validate("cuda", capability=(8, 6))


def test_cuda_reference_path_skips_quantized_requirements():
    PrecisionSpec.named("fp8").validate("cuda", capability=(8, 0), reference=True)
    with pytest.raises(DeviceError, match="bf16 needs sm80"):  # compute dtype still checked
        PrecisionSpec.named("fp8").validate("cuda", capability=(7, 5), reference=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when CUDA is absent")
def test_cuda_without_cuda_is_a_device_error():
    with pytest.raises(DeviceError, match="is_available"):
        PrecisionSpec.named("bf16").validate("cuda")
    with pytest.raises(DeviceError):
        cuda_capability("cuda")


def test_other_device_types():
    PrecisionSpec.named("fp32").validate("mps")
    with pytest.raises(DeviceError, match="only fp32"):
        PrecisionSpec.named("bf16").validate("mps")
    with pytest.raises(DeviceError, match="cannot run natively"):
        PrecisionSpec.named("fp8").validate("mps")
