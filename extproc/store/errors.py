"""The store's one error: raised for anything that keeps a command from completing in time."""


class StoreUnavailable(Exception):
    """The store could not be read or written: refuse rather than admit unmetered traffic."""
