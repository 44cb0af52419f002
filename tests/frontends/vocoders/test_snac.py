"""SNAC frontend: parity with the `snac` package on tiny 24/32/44 kHz-shaped configs (fixtures from
tests/fixtures/gen/gen_vocoders_b.py), weight-norm key forms, noise, streaming == one-shot, bad input."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashrt.errors import CheckpointError, ConfigError, InputError
from flashrt.frontends.vocoders import config_for, get_family, read_card
from flashrt.frontends.vocoders.snac import PRESETS, Snac, SnacConfig, load_config, signature, weight_map
from flashrt.io import Checkpoint, load_module, open_checkpoint
from flashrt.runner.vocoder import load_vocoder

pytestmark = pytest.mark.usefixtures("one_thread")

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vocoders"
NAMES = ("snac_24khz_tiny", "snac_32khz_tiny", "snac_44khz_tiny")
TOL = 1e-5


def _io(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / f"{name}_io.safetensors"))


def _codes(io: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [io[f"codes.{i}"] for i in range(sum(k.startswith("codes.") for k in io))]


def _module(name: str, cfg: SnacConfig | None = None, ckpt=None) -> Snac:
    cfg = cfg or load_config(FIXTURES / name)
    ckpt = ckpt if ckpt is not None else open_checkpoint(FIXTURES / name)
    return load_module(lambda: Snac(cfg), ckpt, weight_map(cfg, ckpt))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


@pytest.fixture(scope="module", params=NAMES)
def fixture(request):
    name = request.param
    return name, load_vocoder(FIXTURES / name, buckets=(4, 8), batch=2, stream_chunk=2)


# ------------------------------------------------------------------------------------------ parity

def test_parity_with_reference(fixture):
    name, voc = fixture
    io = _io(name)
    assert _max_diff(voc(_codes(io)), io["audio"][:, 0]) <= TOL
    assert float(io["audio"].abs().max()) > 0.3  # not silent, not saturated (tanh)


def test_scales_and_frame_unit(fixture):
    name, voc = fixture
    cfg = load_config(FIXTURES / name)
    sig = voc.signature
    assert len(sig.inputs) == len(cfg.vq_strides) == (3 if "24khz" in name else 4)
    assert [s.rate for s in sig.inputs] == [cfg.latents_per_frame // s for s in cfg.vq_strides]
    assert sig.hop_length == cfg.latents_per_frame * torch.tensor(cfg.decoder_rates).prod().item()
    if cfg.attn_window_size:  # one frame = the coarse codes spanning one attention window
        assert cfg.latents_per_frame % cfg.attn_window_size == 0


def test_code_to_latent_path_matches_reference():
    for name in NAMES:
        io = _io(name)
        z = _module(name).quantizer(_codes(io))
        assert _max_diff(z.transpose(1, 2), io["latent"]) <= 1e-6


def test_noise_blocks_match_reference_given_its_noise():
    name = "snac_24khz_noise_tiny"
    io, module = _io(name), _module(name)
    z = module.quantizer(_codes(io))
    noises = [io[f"noise.{i}"].transpose(1, 2) for i in range(3)]
    assert _max_diff(module.decoder(z, noises), io["audio"][:, 0]) <= TOL
    assert _max_diff(module.decoder(z, None), io["audio"][:, 0]) > 1e-3  # the noise path is exercised


def test_trace_backend_equals_reference():
    voc = load_vocoder(FIXTURES / "snac_32khz_tiny", buckets=(8,), batch=2, backend="trace")
    io = _io("snac_32khz_tiny")
    assert _max_diff(voc(_codes(io)), io["audio"][:, 0]) <= TOL


# ------------------------------------------------------------------------------- weight-norm forms

def _renamed(name: str, form: str) -> dict[str, torch.Tensor]:
    sd = torch.load(FIXTURES / name / "pytorch_model.bin", weights_only=True)
    out = {}
    for k, v in sd.items():
        if form == "legacy":
            k = k.replace("parametrizations.weight.original0", "weight_g")
            k = k.replace("parametrizations.weight.original1", "weight_v")
        out[k] = v
    if form == "plain":
        for k in [k for k in out if k.endswith("parametrizations.weight.original0")]:
            g, v = out.pop(k), out.pop(k.replace("original0", "original1"))
            norm = v.flatten(1).norm(dim=1).reshape(-1, *[1] * (v.dim() - 1))
            out[k.replace("parametrizations.weight.original0", "weight")] = g * v / norm
    return out


@pytest.mark.parametrize("form", ["legacy", "plain"])
def test_old_and_plain_weight_norm_keys_load_the_same(form, tmp_path):
    name = "snac_32khz_tiny"
    sd = _renamed(name, form)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    shutil.copy(FIXTURES / name / "config.json", tmp_path / "config.json")
    voc = load_vocoder(tmp_path, buckets=(8,), batch=2)
    io = _io(name)
    assert _max_diff(voc(_codes(io)), io["audio"][:, 0]) <= TOL


def test_weight_map_is_strict_and_complete():
    cfg = load_config(FIXTURES / "snac_24khz_tiny")
    ckpt = open_checkpoint(FIXTURES / "snac_24khz_tiny")
    sd = {k: ckpt[k] for k in ckpt}
    missing = dict(sd)
    missing.pop("decoder.model.3.block.2.block.1.parametrizations.weight.original1")
    with pytest.raises(CheckpointError, match="missing"):
        _module("snac_24khz_tiny", cfg, Checkpoint.from_tensors(missing))
    extra = dict(sd, **{"decoder.model.99.alpha": torch.ones(1, 4, 1)})
    with pytest.raises(CheckpointError, match="unexpected"):
        _module("snac_24khz_tiny", cfg, Checkpoint.from_tensors(extra))
    with pytest.raises(CheckpointError):  # noise blocks declared but absent from the checkpoint
        _module("snac_24khz_tiny", dataclasses.replace(cfg, noise=True), ckpt)


# ------------------------------------------------------------------------------------------- noise

def test_seeded_noise_is_deterministic_and_positional():
    cfg = load_config(FIXTURES / "snac_24khz_noise_tiny")
    cfg = dataclasses.replace(cfg, noise_mode="seeded", noise_seed=5)
    module = _module("snac_24khz_noise_tiny", cfg)
    codes = [torch.randint(0, 64, (1, 30 * s), generator=torch.Generator().manual_seed(s)) for s in (1, 2, 4)]
    full = module(*codes)
    assert torch.equal(module(*codes), full)
    off = _module("snac_24khz_noise_tiny", dataclasses.replace(cfg, noise_mode="off"))
    assert _max_diff(full, off(*codes)) > 1e-3
    # the window [8, 30) decoded with offset=8 sees the one-shot noise: past its left context it matches
    left, hop = signature(cfg).context[0], cfg.hop_length
    window = [c[:, 8 * r:] for c, r in zip(codes, (1, 2, 4))]
    assert _max_diff(module(*window, offset=8)[:, left * hop:], full[:, (8 + left) * hop:]) <= TOL
    assert _max_diff(module(*window, offset=0)[:, left * hop:], full[:, (8 + left) * hop:]) > 1e-3


@pytest.mark.parametrize("exact", [False, True])
def test_seeded_noise_stream_equals_one_shot(exact):
    """The frontend fills the `offset` buffer with each window's absolute start frame, so a seeded-noise
    stream draws the one-shot's noise at every sample (without it each window would restart at 0)."""
    name = "snac_24khz_noise_tiny"
    cfg = dataclasses.replace(load_config(FIXTURES / name), noise_mode="seeded", noise_seed=5)
    frames = 2 * sum(signature(cfg).context) + 5
    voc = load_vocoder(FIXTURES / name, config=cfg, buckets=(frames,), stream_chunk=2, exact_stream=exact)
    assert voc.takes_offset
    codes = _random_codes(cfg, frames, seed=4)
    one = voc(codes)
    rates = [s.rate for s in voc.signature.inputs]
    parts = list(voc.stream(tuple(c[:, f * r:(f + 3) * r] for c, r in zip(codes, rates))
                            for f in range(0, frames, 3)))
    assert len(parts) > 3 and _max_diff(torch.cat(parts, -1), one) <= (0.0 if exact else TOL)
    assert _max_diff(one, voc.module(*codes)) <= TOL                      # one-shot: offset 0, as unpadded
    quiet = dataclasses.replace(cfg, noise_mode="off")
    assert _max_diff(one, load_vocoder(FIXTURES / name, config=quiet)(codes)) > 1e-3   # the noise is there


def test_seeded_noise_needs_noise_blocks():
    with pytest.raises(ConfigError):
        dataclasses.replace(PRESETS["tiny"], noise_mode="seeded")


def test_noise_is_chosen_at_load_and_described():
    """The default drops the released decoder's noise and describe() says so (naming the way to keep it);
    overrides={"noise_mode": "seeded"} keeps it, reproducibly; a decoder without noise blocks says
    nothing, and refuses "seeded"; an unknown override field is refused."""
    name = "snac_24khz_noise_tiny"
    off = load_vocoder(FIXTURES / name, buckets=(16,))
    seeded = load_vocoder(FIXTURES / name, buckets=(16,), overrides={"noise_mode": "seeded", "noise_seed": 3})
    assert off.config.noise_mode == "off" and "noise off: the released decoder's noise is dropped" in \
        off.summary() and "--snac-noise seeded" in off.summary()
    assert "noise seeded (noise_seed 3)" in seeded.summary()
    assert seeded.frontend.describe()["notes"] == get_family("snac").notes(seeded.config)
    codes = _random_codes(off.config, 12, seed=1)
    assert _max_diff(seeded(codes), off(codes)) > 1e-3
    assert torch.equal(seeded(codes), load_vocoder(FIXTURES / name, overrides={"noise_mode": "seeded",
                                                                               "noise_seed": 3})(codes))
    blockless = load_vocoder(FIXTURES / "snac_24khz_tiny", buckets=(16,))
    assert blockless.frontend.describe()["notes"] == [] and "noise" not in blockless.describe()
    with pytest.raises(ConfigError, match="noise blocks"):
        load_vocoder(FIXTURES / "snac_24khz_tiny", overrides={"noise_mode": "seeded"})
    with pytest.raises(ConfigError, match="unknown config keys"):
        load_vocoder(FIXTURES / name, overrides={"noise_mod": "seeded"})


def test_the_loader_and_the_cards_say_how_to_keep_the_noise():
    from flashrt.resources import list_data

    assert 'overrides={"noise_mode": "seeded"' in load_vocoder.__doc__
    for card in ("snac-24khz", "snac-32khz", "snac-44khz"):
        text = Path(list_data("models")[card]).read_text()
        assert read_card(card)["config"]["noise_mode"] == "off"
        assert "--snac-noise seeded" in text and '"noise_mode": "seeded"' in text


# --------------------------------------------------------------------------------------- streaming

def _random_codes(cfg: SnacConfig, frames: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.codebook_size, (1, frames * spec.rate), generator=g)
            for spec in signature(cfg).inputs]


STREAM_CASES = [("snac_24khz_tiny", 1), ("snac_24khz_tiny", 3), ("snac_32khz_tiny", 1),
                ("snac_32khz_tiny", 2), ("snac_44khz_tiny", 3)]


@pytest.mark.parametrize("name,chunk", STREAM_CASES)
def test_stream_equals_one_shot(name, chunk):
    cfg = load_config(FIXTURES / name)
    frames = 2 * sum(signature(cfg).context) + 3  # several windows, each with real context on both sides
    voc = load_vocoder(FIXTURES / name, buckets=(frames,), batch=1, stream_chunk=2)
    codes = _random_codes(cfg, frames, seed=chunk)
    one = voc(codes)
    rates = [s.rate for s in voc.signature.inputs]
    pieces = [tuple(c[:, f * r:(f + chunk) * r] for c, r in zip(codes, rates))
              for f in range(0, frames, chunk)]
    parts = list(voc.stream(pieces))
    assert len(parts) > 3
    assert _max_diff(torch.cat(parts, -1), one) <= TOL


def test_declared_context_is_needed():
    name = "snac_24khz_tiny"
    cfg = load_config(FIXTURES / name)
    module = _module(name)
    left, right = signature(cfg).context
    codes = _random_codes(cfg, 40, seed=9)
    full, hop, rates = module(*codes), cfg.hop_length, [s.rate for s in signature(cfg).inputs]
    for r, exact in ((right, True), (right - 2, False)):
        window = [c[:, (20 - left) * k:(25 + r) * k] for c, k in zip(codes, rates)]
        piece = module(*window)[:, left * hop:(left + 5) * hop]
        assert (_max_diff(piece, full[:, 20 * hop:25 * hop]) <= TOL) == exact


# ------------------------------------------------------------------------------- config / bad input

def test_config_json_and_presets():
    cfg = load_config(FIXTURES / "snac_32khz_tiny" / "config.json")
    assert (cfg.vq_strides, cfg.attn_window_size, cfg.coarse_per_frame) == ((8, 4, 2, 1), 16, 2)
    for name, scales, hop in (("24khz", 3, 2048), ("32khz", 4, 384 * 32), ("44khz", 4, 384 * 32)):
        p = PRESETS[name]
        assert len(signature(p).inputs) == scales and p.hop_length == hop
    assert PRESETS["24khz"].coarse_per_frame == 1 and PRESETS["32khz"].coarse_per_frame == 4
    with pytest.raises(ConfigError, match="unknown"):
        raw = json.loads((FIXTURES / "snac_24khz_tiny" / "config.json").read_text())
        SnacConfig.from_dict(raw | {"x": 1})
    with pytest.raises(CheckpointError):
        load_config(FIXTURES / "vocos_mel_tiny")


def test_wrong_family_is_a_checkpoint_error():
    with pytest.raises(CheckpointError):
        load_vocoder(FIXTURES / "vocos_mel_tiny", family="snac", config="tiny")


def test_bad_inputs_raise_and_next_call_is_correct(fixture):
    name, voc = fixture
    io = _io(name)
    codes = _codes(io)
    top = load_config(FIXTURES / name).codebook_size
    bad = [
        [codes[0], codes[1] + top, *codes[2:]],           # out of range
        [-codes[0] - 1, *codes[1:]],                       # negative
        codes[:-1],                                        # a scale missing
        [codes[0][:, :-1], *codes[1:]],                    # mismatched scale lengths
        [codes[0].float(), *codes[1:]],                    # float codes
        [c[:, :0] for c in codes],                         # empty
    ]
    for c in bad:
        with pytest.raises(InputError):
            voc(c)
    assert _max_diff(voc(codes), io["audio"][:, 0]) <= TOL


# ----------------------------------------------------------------------------------- precision, cards

@pytest.mark.parametrize("name", NAMES)
def test_bf16_precision_stays_close_to_the_fp32_reference(name):
    voc = load_vocoder(FIXTURES / name, precision="bf16", buckets=(8,), batch=2)
    io = _io(name)
    out, ref = voc(_codes(io)), io["audio"][:, 0]
    assert out.dtype == torch.float32
    assert float((out - ref).norm() / ref.norm()) < 0.06  # measured 0.009-0.021


@pytest.mark.parametrize("card,scales", [("snac-24khz", 3), ("snac-32khz", 4), ("snac-44khz", 4)])
def test_model_cards_resolve_to_released_sizes(card, scales):
    c = read_card(card)
    cfg = config_for(get_family(c["family"]), c["preset"], c.get("config"))
    assert len(signature(cfg).inputs) == scales and cfg.noise and cfg.noise_mode == "off"
    with pytest.raises(CheckpointError, match="mis-shaped"):
        load_vocoder(card, checkpoint=FIXTURES / "snac_24khz_tiny")
