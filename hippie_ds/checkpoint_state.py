# Checkpoints saved before the move to hippie_ds.adapter pickled InFlightState's reducer by this path.
from .adapter.checkpoint.state import InFlightState, _unwrap

__all__ = ["InFlightState", "_unwrap"]
