"""Benchmarking: frozen traces, profiles, the bench harness (gate, A/B, roofline), the control-loop
simulator and soak mode. Commands in `flashrt.bench.cli`; the adapter protocol in
`flashrt.bench.registry`. Nothing heavy is imported here."""
