"""Package layout: `flashrt/` plus the top-level data folders shipped inside the wheel.

`models/`, `profiles/` and `calibration/` live at the repository root (they are data, edited by people)
and are installed as `flashrt._models`, `flashrt._profiles` and `flashrt._calibration` (folders inside the
installed package). `flashrt.resources.data_dir` finds them beside the flashrt package actually imported:
`flashrt/_<kind>` in a wheel, `<checkout>/<kind>` otherwise; never through importlib, which an editable
install maps to the checkout it was made from (another copy of the tree would read the first one's).
`csrc/` (CUDA sources, compiled on first use where a toolkit is: `flashrt.ops.csrc`; C sources of
CPU kernels, compiled on first use where a C compiler is: `flashrt.ops.csrc_cpu`) ships as
`flashrt._csrc`, found the same way; nothing is compiled at install time.
"""

from setuptools import find_packages, setup

DATA_PACKAGES = {"flashrt._models": "models", "flashrt._profiles": "profiles",
                 "flashrt._calibration": "calibration", "flashrt._csrc": "csrc"}

setup(
    packages=find_packages(include=["flashrt", "flashrt.*"]) + list(DATA_PACKAGES),
    package_dir={"": ".", **DATA_PACKAGES},
)
