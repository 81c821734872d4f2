"""Exceptions shared by every layer of tinysn."""


class OutOfMemory(MemoryError):
    """A request does not fit in a pool (or a plan does not fit under its cap).

    The message names what was asked for and what the pool had left, so the reader
    can tell a fragmented pool (free bytes enough, largest run too small) from a full one.
    """
