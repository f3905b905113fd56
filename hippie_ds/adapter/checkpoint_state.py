# Checkpoints saved before the move to hippie_ds.adapter.checkpoint pickled InFlightState's reducer by this path.
from .checkpoint.state import InFlightState, _unwrap

__all__ = ["InFlightState", "_unwrap"]
