"""Reuse the compatibility suite's fixtures (``amqp_url``, ``names``, ...) for the example tests.

``amqp_url`` starts a Leveret node on free ports for the session, or uses the
broker named by ``LEVERET_TEST_AMQP_URL`` (e.g. a RabbitMQ on 5672).
"""

import sys
from pathlib import Path

# examples/ is not a package, so pytest puts examples/ (not the repository root)
# on sys.path; make ``compat_tests`` importable however pytest was started.
REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from compat_tests.conftest import *  # noqa: E402, F401, F403
