"""Which install extra brings each optional package flashrt imports lazily.

A command that needs an optional package and finds it missing is a user error, not a bug: the CLI turns
the `ModuleNotFoundError` into one line naming the extra (``pip install 'flashrt[serve]'``). The table
maps the import name to (distribution, extra); a test checks it against pyproject.toml's extras.
"""

from __future__ import annotations

__all__ = ["OPTIONAL", "missing_package_hint"]

OPTIONAL: dict[str, tuple[str, str]] = {  # import name -> (distribution, extra that installs it)
    "uvicorn": ("uvicorn", "serve"),
    "starlette": ("starlette", "serve"),
    "prometheus_client": ("prometheus-client", "serve"),
    "soxr": ("soxr", "serve"),
    "soundfile": ("soundfile", "serve"),
    "websockets": ("websockets", "robot"),
    "msgpack": ("msgpack", "robot"),
    "onnx": ("onnx", "onnx"),
    "onnxruntime": ("onnxruntime", "onnx"),
    "onnxscript": ("onnxscript", "onnx"),
    "tensorrt": ("tensorrt", "trt"),
    "cuda": ("cuda-python", "cuda"),
    "nvtx": ("nvtx", "cuda"),
    "matplotlib": ("matplotlib", "plot"),
    "huggingface_hub": ("huggingface_hub", "hub"),
    "cv2": ("opencv-python-headless", "groot"),
    "PIL": ("pillow", "groot"),
    "piper": ("piper-tts", "tts"),
    "ray": ("ray", "ray"),
}


def missing_package_hint(exc: ModuleNotFoundError) -> str | None:
    """'the X package is missing: pip install 'flashrt[extra]' installs it', or None when the missing
    module is not one of flashrt's optional packages (then it is a bug)."""
    top = (exc.name or "").split(".")[0]
    if top not in OPTIONAL:
        return None
    dist, extra = OPTIONAL[top]
    return f"the optional package {dist!r} is not installed (pip install 'flashrt[{extra}]' installs it)"
