import pytest
from support.bench_fakes import FakeBenchmark, register_fake

from flashrt.bench.registry import (
    Benchmark,
    available,
    discover,
    get_benchmark,
    register_benchmark,
    unregister_benchmark,
)
from flashrt.errors import ConfigError


def test_builtin_runtime_block_is_discovered():
    discover()
    assert "runtime-block" in available()
    assert "attention" in get_benchmark("runtime-block").description


def test_register_lookup_and_duplicates(fake_name):
    register_fake(fake_name)
    assert get_benchmark(fake_name).description == "test fake"
    with pytest.raises(ValueError, match="already registered"):
        register_benchmark(fake_name, lambda *a: None)
    unregister_benchmark(fake_name)
    with pytest.raises(ConfigError, match=f"no benchmark named '{fake_name}'.*runtime-block"):
        get_benchmark(fake_name)


def test_fake_and_block_satisfy_the_protocol(tiny_profile):
    from flashrt.bench.runtime_block import make_benchmark

    assert isinstance(FakeBenchmark(tiny_profile(), "cpu"), Benchmark)
    assert isinstance(make_benchmark(tiny_profile(), None, "cpu"), Benchmark)
