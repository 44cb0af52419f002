"""Every error flashrt raises on purpose. Each one says what went wrong and, where it can, what to do."""


class FlashRTError(Exception):
    """Base of all flashrt errors."""


class InputError(FlashRTError, ValueError):
    """A hot-path input is unusable (shape, dtype, range, finiteness, size bucket).

    Raised by validation before any static buffer is written, so the previous contents survive.
    """


class CheckpointError(FlashRTError):
    """A checkpoint cannot be loaded: missing, unexpected or mis-shaped keys, corrupt files, wrong family."""


class CaptureError(FlashRTError):
    """A forward cannot be captured as a graph (host sync, data-dependent shape, capture failure).

    ``op`` names the refused operation when one is to blame (set by the trace backend's refusals)."""

    op: str | None = None


class CalibrationError(FlashRTError):
    """A calibration cache entry is corrupt, truncated, tampered with or does not match its key."""


class DeviceError(FlashRTError):
    """The requested device or precision cannot run here."""


class ConfigError(FlashRTError, ValueError):
    """A profile, model card or configuration value is invalid (unknown key, bad value)."""


class NumericalError(FlashRTError):
    """A step produced non-finite outputs (NaN/inf) from inputs that passed every check: broken weights
    or statistics, or a precision that overflows. Nothing is queued or returned."""
