"""Package layout: `flashrt/` plus the top-level data folders shipped inside the wheel.

`models/`, `profiles/` and `calibration/` live at the repository root (they are data, edited by people)
and are installed as `flashrt._models`, `flashrt._profiles` and `flashrt._calibration`, so
`flashrt.resources` finds them the same way in a wheel and in an editable checkout.
"""

from setuptools import find_packages, setup

DATA_PACKAGES = {"flashrt._models": "models", "flashrt._profiles": "profiles",
                 "flashrt._calibration": "calibration"}

setup(
    packages=find_packages(include=["flashrt", "flashrt.*"]) + list(DATA_PACKAGES),
    package_dir={"": ".", **DATA_PACKAGES},
)
