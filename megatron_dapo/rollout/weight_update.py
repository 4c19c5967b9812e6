"""Where a vLLM engine's weights and KV cache are between sleep(), a weight update and wake(): the states and
every transition between them.

    AWAKE --sleep()--> ASLEEP --first update bucket (GPU)--> WEIGHTS_AWAKE --wake()--> AWAKE
                       ASLEEP --wake()--> AWAKE

Only an engine with sleep mode (GPU) ever leaves AWAKE; generate() and streaming need AWAKE.
"""

from __future__ import annotations

import enum


class WeightState(enum.Enum):
    AWAKE = "awake"
    """Weights and KV cache resident: the engine may generate."""
    ASLEEP = "asleep"
    """sleep() freed the KV cache and offloaded (sleep_level 1) or dropped (2) the weights."""
    WEIGHTS_AWAKE = "weights_awake"
    """GPU: the weights were woken to load an update; the KV cache stays asleep until wake()."""


class WeightEvent(enum.Enum):
    SLEEP = "sleep"
    """sleep() on an engine with sleep mode."""
    LOAD = "load"
    """An update bucket is about to be loaded into the model (GPU)."""
    WAKE = "wake"
    """wake()."""


TRANSITIONS: dict[tuple[WeightState, WeightEvent], WeightState] = {
    (WeightState.AWAKE, WeightEvent.SLEEP): WeightState.ASLEEP,
    (WeightState.ASLEEP, WeightEvent.LOAD): WeightState.WEIGHTS_AWAKE,
    (WeightState.ASLEEP, WeightEvent.WAKE): WeightState.AWAKE,
    (WeightState.WEIGHTS_AWAKE, WeightEvent.WAKE): WeightState.AWAKE,
}
"""{(state, event): the state after it}. An event missing here changes nothing (sleep() while asleep, a bucket
loaded while the weights are already awake, wake() while awake)."""


def next_state(state: WeightState, event: WeightEvent) -> WeightState | None:
    """The state `event` moves `state` to; None when the event changes nothing (see TRANSITIONS)."""
    return TRANSITIONS.get((state, event))
