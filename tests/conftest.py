"""Suite-wide hooks: what each test leaves behind is released (tests/memory.py), and the
per-test RSS log when ONCE_TEST_RSS_LOG names a file."""

import os

from tests.memory import LOG_ENV, Releaser, RssLog


def pytest_configure(config) -> None:
    config.pluginmanager.register(Releaser(), "once-releaser")
    path = os.environ.get(LOG_ENV)
    if path:  # registered last, so it reads the RSS after the releaser ran
        config.pluginmanager.register(RssLog(path), "once-rss-log")
