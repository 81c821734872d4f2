"""Exceptions shared by every layer of tinysn."""


class OutOfMemory(MemoryError):
    """A request does not fit in a pool (or a plan does not fit under its cap).

    The message names what was asked for and what the pool had left, so the reader
    can tell a fragmented pool (free bytes enough, largest run too small) from a full one.
    `step`: where the planner raised it, the index of the plan step that did not fit (None
    elsewhere).
    """

    def __init__(self, message: str = "", step: int | None = None):
        super().__init__(message)
        self.step = step
