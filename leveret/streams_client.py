"""The stream client moved to ``leveret-client`` (client/): import ``leveret_client.streams``. This name
stays for existing code: it is the very module ``leveret_client.streams``."""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from leveret_client.streams import *  # noqa: F403 - what type checkers see of the alias below
else:
    import leveret_client.streams

    sys.modules[__name__] = leveret_client.streams
