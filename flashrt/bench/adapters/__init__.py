"""Benchmark adapters: one module per family (`flashrt.bench.registry`'s `Benchmark` protocol), above the
frontends and runners; nothing below the bench package imports them."""
