"""``runtime.init(backend=...)`` once a group exists keeps that group and says so when the
backend asked for is not its backend (it returned silently; errors audit)."""

from harness import run_ranks


def _init_again(_):
    import warnings

    import shardkit.runtime as xr

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        xr.init(backend="gloo")  # the group's own backend: nothing to say
        quiet = len(caught)
        xr.init(backend="nccl")
    return quiet, [str(w.message) for w in caught]


def test_init_with_another_backend_after_the_group_exists_warns():
    for quiet, messages in run_ranks(_init_again, 2, None, timeout=60):
        assert quiet == 0
        assert len(messages) == 1 and "backend='nccl'" in messages[0]
        assert "already initialized with backend 'gloo', which stays" in messages[0]
