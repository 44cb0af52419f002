"""The lerobot plugin (packages/lerobot_policy_flashrt): the distribution lerobot's
``register_third_party_plugins`` imports by name, the naming conventions lerobot resolves the policy
and processor classes by, and the config -> load options; where lerobot imports (the reference
environment), found by lerobot's own registry and run through its control-loop call."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support import pi0_e2e as E2E

from flashrt.errors import ConfigError
from flashrt.integrations.lerobot import FlashRTPolicy as DropIn
from flashrt.integrations.lerobot import plugin_options

PLUGIN = Path(__file__).resolve().parents[2] / "packages" / "lerobot_policy_flashrt"
NAME = "lerobot_policy_flashrt"
CASE = "pi05_cam1"


def _source(module: str) -> ast.Module:
    return ast.parse((PLUGIN / NAME / f"{module}.py").read_text())


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


# ----------------------------------------------------------------------------------- without lerobot


def test_the_distribution_is_named_as_lerobot_imports_it():
    """lerobot imports each distribution whose name starts with "lerobot_policy_" by that name: it
    must be spelled with underscores and be the package's own name."""
    project = tomllib.loads((PLUGIN / "pyproject.toml").read_text())
    name = project["project"]["name"]
    assert name == NAME and name.startswith("lerobot_policy_") and name.isidentifier()
    assert project["tool"]["setuptools"]["packages"] == [NAME]
    assert "flashrt" in project["project"]["dependencies"]
    init = _source("__init__")
    imported = {node.module for node in ast.walk(init) if isinstance(node, ast.ImportFrom)}
    assert f"{NAME}.configuration_flashrt" in imported  # importing the package registers the type


def test_lerobot_finds_config_policy_and_processors_by_its_naming_convention():
    """lerobot's rules: the config class registered under the type ends in "Config"; the policy is
    "<X>Policy" in the module named with "modeling_" for "configuration_"; the processors are
    "make_<type>_pre_post_processors" in the "processor_" module."""
    config = _classes(_source("configuration_flashrt"))["FlashRTConfig"]
    (decorator,) = [d for d in config.decorator_list if isinstance(d, ast.Call)]
    assert ast.unparse(decorator) == "PreTrainedConfig.register_subclass('flashrt')"
    assert [ast.unparse(b) for b in config.bases] == ["PreTrainedConfig"]
    policy = _classes(_source("modeling_flashrt"))["FlashRTConfig".removesuffix("Config") + "Policy"]
    fields = {t.id: ast.unparse(node.value) for node in policy.body if isinstance(node, ast.Assign)
              for t in node.targets}
    assert fields == {"config_class": "FlashRTConfig", "name": "'flashrt'"}
    functions = {node.name for node in _source("processor_flashrt").body if isinstance(node, ast.FunctionDef)}
    assert "make_flashrt_pre_post_processors" in functions


def _config(**fields):
    base = {"checkpoint": "", "device": "cpu", "precision": "float32", "tokenizer": None,
            "embodiment": None, "pretrained_path": None}
    return SimpleNamespace(**{**base, **fields})


def test_the_config_becomes_load_options(tmp_path):
    (tmp_path / "pi05").mkdir()
    folder, options = plugin_options(_config(checkpoint="pi05", pretrained_path=tmp_path, tokenizer="t.model",
                                             embodiment="7", precision="bfloat16"))
    assert folder == tmp_path / "pi05"  # relative to the folder of the config that names it
    assert options == {"device": "cpu", "precision": "bfloat16", "tokenizer": "t.model", "embodiment": 7}
    folder, _ = plugin_options(_config(checkpoint=str(tmp_path / "pi05")))
    assert folder == tmp_path / "pi05"
    with pytest.raises(ConfigError, match="--policy.checkpoint"):
        plugin_options(_config())


# ------------------------------------------------------------------------------------- with lerobot


@pytest.fixture
def lerobot(tmp_path, monkeypatch):
    """lerobot, with the plugin installed as a distribution (its metadata on the path, as pip leaves
    it), its plugins imported the way lerobot's scripts do."""
    pytest.importorskip("lerobot", reason="lerobot is not installed here (it lives in the reference env; "
                        "the tests above cover the plugin's contract without it)")
    info = tmp_path / f"{NAME}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {NAME}\nVersion: 0.1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(PLUGIN))
    from lerobot.utils.import_utils import register_third_party_plugins

    register_third_party_plugins()
    import lerobot.policies.factory as factory

    return factory


def _robot_observation(t: int) -> tuple[dict, str]:
    c = E2E.case(CASE)
    obs = {f"observation.images.{cam}": img for cam, img in c.images(t).items()}
    obs["observation.state"] = c.tensor(t, "state").numpy().astype(np.float32)
    return obs, c.prompt(t)


def test_found_by_lerobots_registry_and_run_by_its_control_loop(lerobot, one_thread, tmp_path):
    from lerobot.common.control_utils import predict_action
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.utils import prepare_observation_for_inference

    assert "flashrt" in PreTrainedConfig.get_known_choices()
    cls = lerobot.get_policy_class("flashrt")
    config = lerobot.make_policy_config("flashrt", checkpoint=str(E2E.case(CASE).policy_dir),
                                        tokenizer=str(E2E.TOKENIZER), device="cpu")
    pre, post = lerobot.make_pre_post_processors(config)
    policy = cls(config)
    dropin = DropIn.from_pretrained(E2E.case(CASE).policy_dir, tokenizer=E2E.TOKENIZER)
    obs, task = _robot_observation(0)
    batch = prepare_observation_for_inference(dict(obs), torch.device("cpu"), task, "")
    noise = load_file(str(Path(__file__).resolve().parents[1] / "fixtures" / "lerobot_dropin"
                          / "io.safetensors"))[f"{CASE}.noise"][:1]
    got = post(policy.predict_action_chunk(pre(dict(batch)), noise=noise))
    want = dropin.predict_action_chunk(batch, noise=noise)
    assert torch.equal(got, want)  # the processors pass everything through, the policy is the drop-in
    action = predict_action(dict(obs), policy, torch.device("cpu"), pre, post, False, task=task)
    assert action.shape == (1, want.shape[-1])
    assert torch.isfinite(action).all()

    from lerobot_policy_flashrt.__main__ import main  # the --policy.path folder lerobot-rollout takes

    folder = main([str(E2E.case(CASE).policy_dir), str(tmp_path / "wrapped"), "--tokenizer",
                   str(E2E.TOKENIZER)])
    loaded = PreTrainedConfig.from_pretrained(folder)
    assert loaded.type == "flashrt" and loaded.checkpoint == str(E2E.case(CASE).policy_dir)
    again = cls.from_pretrained(folder)
    overrides = {"device_processor": {"device": "cpu"}, "rename_observations_processor": {"rename_map": {}}}
    pre2, post2 = lerobot.make_pre_post_processors(loaded, pretrained_path=str(folder),
                                                   preprocessor_overrides=overrides)  # as rollout calls it
    assert torch.equal(post2(again.predict_action_chunk(pre2(dict(batch)), noise=noise)), want)
