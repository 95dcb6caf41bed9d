"""The native Python client moved to its own distribution, ``leveret-client`` (client/): import
``leveret_client``. This name stays for existing code: it is the very module ``leveret_client.client``
(the same objects, private helpers included), so ``from leveret.client import Client`` keeps working."""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from leveret_client.client import *  # noqa: F403 - what type checkers see of the alias below
else:
    import leveret_client.client

    sys.modules[__name__] = leveret_client.client
