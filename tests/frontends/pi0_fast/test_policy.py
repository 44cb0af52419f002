"""Pi0-FAST end to end vs lerobot 0.6.1 (fixtures from tests/fixtures/gen/gen_pi0_fast.py): greedy token
ids identical over the whole decode and un-normalized actions <= 1e-4, 1 and 2 cameras, prompts in two
buckets; the decode graph captured once; refusals leave the next call correct."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
from support import pi0_fast

import flashrt
from flashrt.errors import CheckpointError, InputError
from flashrt.frontends.pi0 import family as pi0_family
from flashrt.frontends.pi0_fast import family as fast_family

ROOT, TOKENIZER, case, observation = pi0_fast.ROOT, pi0_fast.TOKENIZER, pi0_fast.case, pi0_fast.observation
reference_tokens = pi0_fast.reference_tokens
BUCKETS = {"cam1": (40, 73), "cam2": (40, 97)}  # both cases' prompts fall in both buckets


@cache
def policy(name: str, backend: str = "eager"):
    return flashrt.load_policy(ROOT / name / "policy", tokenizer=TOKENIZER, backend=backend,
                               buckets=BUCKETS[name])


@pytest.mark.parametrize("name", ["cam1", "cam2"])
def test_tokens_and_actions_match_lerobot(name):
    pol = policy(name)
    front = pol.frontend
    info, io = case(name)
    stops, buckets = set(), set()
    for i in range(len(info["observations"])):
        out = pol.infer(observation(name, i))
        assert front.tokens == reference_tokens(name, i, front.end_id), f"obs {i}"
        np.testing.assert_allclose(out["actions"], io[f"obs{i}.actions"].numpy(), atol=1e-4, rtol=0)
        assert out["actions"].shape == (info["n_action_steps"], info["action_dim"])
        stops.add(front.decoder.last.finish)
        buckets.add(out["bucket"])
    assert stops == {"stop", "length"}  # early end markers and full-length decodes both covered
    assert len(buckets) == 2


def test_decode_graph_captured_once_across_calls_and_buckets():
    pol = policy("cam1")
    before = pol.frontend.report()
    for i in (0, 1, 0):
        pol.infer(observation("cam1", i))
    after = pol.frontend.report()
    assert after["decode_captures"] == before["decode_captures"] == {"greedy": 1, "sample": 1}
    assert after["prefill"]["captured"] == before["prefill"]["captured"]
    assert after["prefill"]["captured_on_miss"] == [] and after["prefill"]["fallbacks"]["total"] == 0
    assert after["decode_replays"]["greedy"] > before["decode_replays"]["greedy"]


def test_registry_picks_pi0_fast_and_pi0_declines():
    folder = ROOT / "cam1" / "policy"
    fast_family.detect(folder)
    with pytest.raises(CheckpointError, match="pi0_fast"):
        pi0_family.detect(folder)
    assert type(policy("cam1").frontend).__name__ == "Pi0FastPolicyFrontend"


def test_step_pops_the_chunk_in_order():
    pol = policy("cam1")
    pol.reset()
    obs = observation("cam1", 3)
    chunk = pol.infer(obs)["actions"]
    pol.reset()
    rows = [pol.step(obs) for _ in range(pol.frontend.n_action_steps)]
    np.testing.assert_array_equal(np.stack(rows), chunk)


@pytest.mark.parametrize("bad, match", [
    ({"state": np.zeros(3, np.float32)}, "state"),
    ({"prompt": 7}, "prompt"),
    ({"prompt": "pick up the cube " * 20}, "longer"),
    ({"images": {"nope": np.zeros((28, 28, 3), np.uint8)}}, "camera"),
])
def test_bad_observations_are_refused_and_the_next_call_is_right(bad, match):
    pol = policy("cam1")
    with pytest.raises(InputError, match=match):
        pol.infer({**observation("cam1", 0), **bad})
    out = pol.infer(observation("cam1", 0))
    np.testing.assert_allclose(out["actions"], case("cam1")[1]["obs0.actions"].numpy(), atol=1e-4, rtol=0)


def test_noise_is_refused():
    with pytest.raises(InputError, match="noise"):
        policy("cam1").infer(observation("cam1", 0), noise=np.zeros((6, 5), np.float32))


@pytest.mark.parametrize("missing", ["processor_config.json", "tokenizer.json"])
def test_missing_fast_files_name_the_file(tmp_path, missing):
    folder = tmp_path / "policy"
    folder.mkdir()
    for f in (ROOT / "cam1" / "policy").iterdir():
        target = folder / f.name
        if f.is_dir():
            target.mkdir()
            for g in f.iterdir():
                if g.name != missing:
                    target.joinpath(g.name).write_bytes(g.read_bytes())
        else:
            target.write_bytes(f.read_bytes())
    with pytest.raises(CheckpointError, match=missing):
        fast_family.load(folder, tokenizer=TOKENIZER)


def test_missing_text_tokenizer_is_a_checkpoint_error():
    with pytest.raises(CheckpointError, match="tokenizer"):
        fast_family.load(ROOT / "cam1" / "policy")
