"""VITS weights: from a Piper ``.onnx`` voice (read by graph structure) or a VITS training checkpoint.

Both sources become one state dict with the VITS training names, then pass the same strict maps
(`prior_weight_map`, and HiFi-GAN's own map for ``dec.*``).

Reading an ONNX voice (`onnx_state_dict`). The exporter keeps most initializer names (``enc_p.*``,
``dp.*``, ``flow.*``, ``dec.*``) but not all: weight-norm convs are folded into anonymous
``onnx::Conv_*`` tensors, the phoneme embedding comes out under an unrelated name, and the SDP's
``exp(-logs)`` is constant-folded. So names are never guessed from positions; each tensor is named by
the node that consumes it, whose name is the torch module path (``/flow/flows.6/enc/in_layers.0/Conv``):

* a Conv / ConvTranspose node: its 2nd input is ``<path>.weight``, its 3rd ``<path>.bias``;
* a Gather node reading a 2-D initializer (the embedding lookup): ``<path>.weight``;
* an initializer named ``/<path>/Exp_output_0`` (a folded ``exp`` of a parameter) read by a Mul:
  ``<path>.exp_neg_logs`` (the ElementwiseAffine's reverse factor);
* any other initializer whose name starts with the node's module path keeps its own name (LayerNorm
  gamma/beta, relative-position embeddings, the affine's ``m``).

Shape constants (``/...Constant_*``, ``onnx::Split_*``) are not parameters and are skipped. Two
different tensors claiming one name is a CheckpointError.

Multi-speaker voices add ``emb_g.weight``, ``dp.cond``, ``flow.flows.{f}.enc.cond_layer`` and the
decoder's ``dec.cond``, which goes to the prior as ``dec_cond`` (see `VitsPrior`).

Transforms (training checkpoints): weight-norm g/v folded (``flashrt.io.transforms.weight_norm``);
``dp.flows.0.logs`` -> ``inv_scale = exp(-logs)``. Ignored training-only tensors: the posterior encoder
(``enc_q.*``), the SDP's posterior flows (``dp.post_*``) and its first ConvFlow (``dp.flows.1.*``, unused in
reverse), the discriminator (``model_d.*``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from flashrt.errors import CheckpointError
from flashrt.frontends.vits.config import VitsConfig
from flashrt.frontends.vocoders import hifigan
from flashrt.io.weightmap import Rule, WeightMap
from flashrt.nn.audio import conv_rules

__all__ = ["onnx_state_dict", "prior_weight_map", "decoder_weight_map", "split_state"]

_TOPS = ("enc_p", "dp", "flow", "dec", "emb_g")
_FOLDED_EXP = re.compile(r"^/(.+)/Exp_output_0$")
TRAINING_ONLY = ("enc_q.*", "dp.post_*", "dp.flows.1.*")


def _module_path(node_name: str) -> str | None:
    parts = node_name.strip("/").split("/")
    if len(parts) < 2 or parts[0] not in _TOPS:
        return None
    return ".".join(parts[:-1])


def _claims(node: Any, path: str, inits: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(torch key, initializer name) pairs that one node names (module docstring)."""
    names = [n for n in node.input if n in inits]
    if node.op_type in ("Conv", "ConvTranspose"):
        return [(f"{path}.{slot}", n) for slot, n in zip(("weight", "bias"), node.input[1:]) if n in inits]
    if node.op_type == "Gather" and names and names[0] == node.input[0] and len(inits[names[0]].dims) == 2:
        return [(f"{path}.weight", names[0])]
    out = []
    for n in names:
        folded = _FOLDED_EXP.match(n)
        if folded and node.op_type == "Mul":
            out.append((f"{folded.group(1).replace('/', '.')}.exp_neg_logs", n))
        elif n.startswith(path + "."):
            out.append((n, n))
    return out


ONNX_LIMIT = 2 << 30  # bytes: protobuf's own ceiling for one serialized model


def _read_onnx(onnx: Any, path: str | Path) -> Any:
    """The ModelProto of a regular file of at most `ONNX_LIMIT` bytes; a file that does not parse is a
    CheckpointError naming it (not protobuf's own error)."""
    from flashrt.io.files import read_bytes_capped

    data = read_bytes_capped(path, "voice model (.onnx)", limit=ONNX_LIMIT)
    try:
        return onnx.load_model_from_string(data)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends, whatever their class
        raise CheckpointError(f"voice model (.onnx) {path} is not a valid ONNX model "
                              f"({type(exc).__name__}: {exc})") from None


def onnx_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Every parameter of a Piper/VITS ONNX export under its VITS training name (module docstring)."""
    try:
        import onnx
        from onnx import numpy_helper
    except ModuleNotFoundError:
        raise CheckpointError(
            f"{path}: reading an .onnx voice needs the onnx package (pip install 'flashrt[tts]')"
        ) from None
    model = _read_onnx(onnx, path)
    inits = {i.name: i for i in model.graph.initializer}
    owner: dict[str, str] = {}
    for node in model.graph.node:
        module = _module_path(node.name)
        if module is None:
            continue
        for key, name in _claims(node, module, inits):
            if owner.setdefault(key, name) != name:
                raise CheckpointError(
                    f"{path}: {key} is claimed by two tensors ({owner[key]}, {name}); "
                    "the graph does not look like a VITS export"
                )
    if not owner:
        raise CheckpointError(f"{path}: no node is named like a VITS module (/enc_p/, /dp/, /flow/, /dec/)")
    return {key: torch.from_numpy(numpy_helper.to_array(inits[name]).copy()) for key, name in owner.items()}


def split_state(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(prior tensors, decoder tensors) under bare VITS names: a lightning checkpoint's ``model_g.``
    prefix is dropped, its discriminator (``model_d.*``) left out, ``dec.*`` goes to the decoder."""
    prior, dec = {}, {}
    for key, value in state.items():
        if key.startswith("model_d."):
            continue
        bare = key.removeprefix("model_g.")
        to_decoder = bare.startswith("dec.") and not bare.startswith("dec.cond.")  # cond: speaker -> prior
        (dec if to_decoder else prior)[bare] = value
    return prior, dec


def _exp_neg(t: torch.Tensor) -> torch.Tensor:
    return torch.exp(-t)


def _convs(template: str) -> list[Rule]:
    return conv_rules(template, template)


def _norms(template: str) -> list[Rule]:
    return [Rule(f"{template}.{p}", f"{template}.{p}") for p in ("gamma", "beta")]


def _dds(prefix: str) -> list[Rule]:
    return [
        *_convs(prefix + ".convs_sep.{i}"),
        *_convs(prefix + ".convs_1x1.{i}"),
        *_norms(prefix + ".norms_1.{i}"),
        *_norms(prefix + ".norms_2.{i}"),
    ]


def _encoder_rules() -> list[Rule]:
    attn = "enc_p.encoder.attn_layers.{i}"
    return [
        Rule("enc_p.emb.weight", "enc_p.emb.weight"),
        *_convs(attn + ".conv_{x}"),
        Rule(attn + ".emb_rel_{x}", attn + ".emb_rel_{x}"),
        *_norms("enc_p.encoder.norm_layers_{n}.{i}"),
        *_convs("enc_p.encoder.ffn_layers.{i}.conv_{n}"),
        *_convs("enc_p.proj"),
    ]


def _sdp_rules(cfg: VitsConfig) -> list[Rule]:
    rules = [
        *_convs("dp.pre"),
        *_convs("dp.proj"),
        *_dds("dp.convs"),
        Rule("dp.flows.0.m", "dp.flows.0.m"),
        Rule("dp.flows.0.logs", "dp.flows.0.inv_scale", _exp_neg),
        Rule("dp.flows.0.exp_neg_logs", "dp.flows.0.inv_scale"),
    ]
    for f in range(3, 2 * cfg.sdp_flows + 1, 2):  # flows.1 is unused in reverse
        rules += [*_convs(f"dp.flows.{f}.pre"), *_dds(f"dp.flows.{f}.convs"), *_convs(f"dp.flows.{f}.proj")]
    return rules


def _dp_rules(cfg: VitsConfig) -> list[Rule]:
    return [*_convs("dp.conv_{n}"), *_norms("dp.norm_{n}"), *_convs("dp.proj")]


def _speaker_rules() -> list[Rule]:
    return [
        Rule("emb_g.weight", "emb_g.weight"),
        *conv_rules("dec.cond", "dec_cond"),
        *_convs("dp.cond"),
        *_convs("flow.flows.{f}.enc.cond_layer"),
    ]


def _flow_rules() -> list[Rule]:
    layer = "flow.flows.{f}"
    return [
        *_convs(layer + ".pre"),
        *_convs(layer + ".post"),
        *_convs(layer + ".enc.in_layers.{j}"),
        *_convs(layer + ".enc.res_skip_layers.{j}"),
    ]


def prior_weight_map(cfg: VitsConfig) -> WeightMap:
    """Strict map of the prior (text encoder, duration predictor, flow) from VITS training names."""
    rules = [*_encoder_rules(), *(_sdp_rules(cfg) if cfg.use_sdp else _dp_rules(cfg)), *_flow_rules()]
    if cfg.n_speakers > 1:
        rules += _speaker_rules()
    return WeightMap(rules, ignore=TRAINING_ONLY)


def decoder_weight_map(cfg: VitsConfig, keys: Any = ()) -> WeightMap:
    """HiFi-GAN's own strict map over the ``dec.*`` tensors."""
    return hifigan.weight_map(cfg.decoder, keys)
