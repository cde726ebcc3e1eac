"""The L3 policy of the hierarchical cache: what works on tree nodes (prefetch into L2, backup from L2,
TP agreement on their progress, fetch-or-recompute costs). Page stores, the page format and the I/O
workers live in :mod:`tierkv.storage`, which knows nothing of the tree."""


_SUBMODULES = {"backup", "controller", "cost_model", "pacing", "prefetch"}


def __getattr__(name: str) -> object:
    """The old ``tierkv.cache.l3`` module's names (now :mod:`tierkv.cache.l3.controller`), with one
    DeprecationWarning, for one release."""
    if name in _SUBMODULES:  # not imported yet: the import system imports it next
        raise AttributeError(name)
    from tierkv._moved import moved_names

    for key, value in moved_names(__name__, f"{__name__}.controller", name).items():
        globals().setdefault(key, value)
    return globals()[name]
