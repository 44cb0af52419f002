"""lerobot plugin: ``--policy.type=flashrt`` runs a flashrt policy in lerobot's own tools.

lerobot (0.6) imports every installed distribution named ``lerobot_policy_*`` at the start of its
scripts (``register_third_party_plugins``); importing this package registers `FlashRTConfig` under
the policy type ``flashrt``. lerobot then finds the rest by its naming convention: `FlashRTPolicy` in
the sibling ``modeling_flashrt``, ``make_flashrt_pre_post_processors`` in ``processor_flashrt``.

    pip install ./packages/lerobot_policy_flashrt          # beside lerobot and flashrt
    lerobot-record --policy.type=flashrt --policy.checkpoint=path/to/pi05_policy --policy.device=cuda ...
    python -m lerobot_policy_flashrt path/to/pi05_policy out/flashrt_pi05 --device cuda
    lerobot-rollout --policy.path=out/flashrt_pi05 ...      # rollout wants a folder (--policy.path)
"""

from lerobot_policy_flashrt.configuration_flashrt import FlashRTConfig

__all__ = ["FlashRTConfig"]
