"""Synthetic checkpoints in the real layouts (random weights, tiny or full sizes), written for tests,
benchmarks and the demo: Pi0/Pi0.5 (`pi0`), GR00T N1.7 (`groot`), N1.5/N1.6 Eagle (`groot_eagle`), the
vocoders (`vocoders`)."""
