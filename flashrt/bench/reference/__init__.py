"""Reference implementations the benchmarks compare against (imported only for ``--vs``; each needs its
own package, e.g. lerobot 0.6.1 for `flashrt.bench.reference.lerobot_pi0`)."""
