"""Pin each autotuned kernel of a module to one of its GPU configs, so that a test can check
every config, not only the one a run's autotuner happens to pick.

Every autotuner built by `tinysn.kernels._common.autotune` keeps its full GPU list as
`all_configs`. Under the interpreter the GPU configs run too (their warp and stage counts are
ignored there, their block sizes and flags are not), so CI checks the masking of every tile
shape the GPU may use.
"""
from contextlib import contextmanager

from triton.runtime.autotuner import Autotuner

from tinysn.kernels import _common


def tuners(module):
    """The module's autotuned kernels."""
    return [v for v in vars(module).values() if isinstance(v, Autotuner)]


def config_count(module):
    """The longest config list among the module's autotuners: index range for pinned()."""
    found = tuners(module)
    assert found, f"{module.__name__} has no autotuned kernels"
    return max(len(t.all_configs) for t in found)


@contextmanager
def pinned(module, index):
    """Within the block, every autotuner of `module` runs its config `index` (modulo its list
    length) and nothing else; caches of earlier picks are set aside and restored after."""
    saved = [(t, t.configs, dict(t.cache)) for t in tuners(module)]
    picks = _common._TUNED          # the direct-launch cache of autotuner picks (launch())
    saved_picks = dict(picks)
    try:
        for t, _, _ in saved:
            t.configs = [t.all_configs[index % len(t.all_configs)]]
            t.cache.clear()
            t.best_config = None
        picks.clear()
        yield
        ran = [t for t, _, _ in saved if t.best_config is not None]
        assert ran, f"no autotuned kernel of {module.__name__} ran"
        for t in ran:
            assert t.best_config is t.configs[0], "a kernel ran a config it was not pinned to"
    finally:
        for t, configs, cache in saved:
            t.configs = configs
            t.cache.clear()
            t.cache.update(cache)
        picks.clear()
        picks.update(saved_picks)
