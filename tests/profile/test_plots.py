import numpy as np

from flashrt.profile.plots import plot_latency


def test_plot_renders_png(tmp_path):
    rng = np.random.default_rng(0)
    per_call = [{"validate": 0.1 + rng.random() * 0.02, "replay": 2.0 + rng.gamma(2.0, 0.1)}
                for _ in range(200)]
    stages = {k: [row[k] for row in per_call] for k in ("validate", "replay")}
    stages["total"] = [sum(row.values()) for row in per_call]
    path = plot_latency(tmp_path / "lat.png", stages, per_call, title="test", deadline_ms=2.5,
                        compare={"B total": (np.asarray(stages["total"]) * 1.3).tolist()})
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
