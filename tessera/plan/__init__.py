"""The planner: will a layout fit, and how fast will it run? (``tessera plan``)."""
