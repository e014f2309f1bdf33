"""The backend's settings: ``KVSTAGE_SGLANG_*`` environment variables (README, "Settings"),
sglang's own ``SGLANG_DISAGGREGATION_*`` defaults, and the sglang setting kvstage refuses."""

from __future__ import annotations

import os


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value not in (None, "") else default


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def sglang_env(name: str, default: float) -> float:
    """An sglang ``SGLANG_DISAGGREGATION_*`` setting through its own ``envs`` when present."""
    try:
        from sglang.srt.environ import envs

        return float(getattr(envs, name).get())
    except Exception:  # an sglang without that setting
        return env_float(name, default)


def refuse_staging_buffer() -> None:
    """sglang's staging buffer (``SGLANG_DISAGG_STAGING_BUFFER=1``) replaces the sender's chunk
    grid with its own (``get_max_transfer_tokens`` is overridden in prefill.py) and runs its own
    staging handler on the decode: kvstage stages itself, the two cannot be combined."""
    try:
        from sglang.srt.environ import envs

        on = bool(envs.SGLANG_DISAGG_STAGING_BUFFER.get())
    except Exception:
        on = os.environ.get("SGLANG_DISAGG_STAGING_BUFFER", "").lower() in ("1", "true", "yes", "on")
    if on:
        raise ValueError(
            "kvstage backend: SGLANG_DISAGG_STAGING_BUFFER=1 is sglang's own staging path (for the "
            "mooncake/nixl backends); kvstage stages heterogeneous TP itself: unset it"
        )
