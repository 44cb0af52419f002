import json

import torch

from flashrt.bench.env import environment, git_revision, package_versions


def test_environment_record_is_complete_and_json():
    env = environment()
    assert {"python", "platform", "packages", "torch_threads", "cpu", "gpu", "git"} <= set(env)
    assert env["packages"]["torch"] == torch.__version__ and env["cpu"]["logical_cores"] >= 1
    assert (env["gpu"] is None) == (not torch.cuda.is_available())
    json.dumps(env, allow_nan=False)


def test_missing_package_and_non_git_folder(tmp_path):
    assert package_versions(("surely-not-a-package-xyz",)) == {"surely-not-a-package-xyz": None}
    assert git_revision(tmp_path) == {"commit": None, "dirty": None}
