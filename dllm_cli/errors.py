"""Domain errors: raised by the library, turned into one line + exit code by the CLI."""


class DllmError(Exception):
    """Base class: a user-facing problem with a clear one-line message."""

    exit_code = 1


class ProfileError(DllmError):
    """A profile is missing, malformed, or has unknown keys."""

    exit_code = 2


class SettingsError(DllmError):
    """A decoding setting is out of range or inconsistent."""

    exit_code = 2


class ModelLoadError(DllmError):
    """A checkpoint folder cannot be turned into a model."""

    exit_code = 3


class InputError(DllmError):
    """A prompt cannot be decoded (empty, too long, ...)."""

    exit_code = 4


class DeviceError(DllmError):
    """The requested device does not exist on this machine."""

    exit_code = 5
