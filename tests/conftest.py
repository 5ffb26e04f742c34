import os

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def pytest_collection_finish(session):
    """Start the doc and example runs of tests/e2e/test_docs_snippets.py in the background:
    they are subprocesses, and fill the cores the in-process tests leave idle."""
    if session.config.option.collectonly:
        return
    for module in {item.module for item in session.items if hasattr(item, "module")}:
        start = getattr(module, "start_runs", None)
        if start is not None:
            start(session.items, session.config)
