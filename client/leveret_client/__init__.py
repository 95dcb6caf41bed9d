"""leveret-client: the Python client of Leveret's native gRPC API (``leveret.v1.Broker`` and ``Streams``).

``Client``/``AsyncClient`` (queues, channels, push, subscribe; module ``leveret_client.client``) and
``StreamsClient`` (streams; ``leveret_client.streams``). Depends on grpcio and protobuf only.
"""

from leveret_client.client import (
    AsyncClient,
    AsyncStatusSubscriber,
    AsyncSubscriber,
    ChannelInfo,
    Client,
    ClusterEvent,
    Deduplicator,
    LeveretError,
    Message,
    NodeChoice,
    QueueInfo,
    StatusSubscriber,
    Subscriber,
    credentials,
)
from leveret_client.streams import FIRST, LAST, NEXT, StreamMessage, StreamsClient, StreamSubscriber

# The release this client belongs to: the broker's version (leveret.__version__) is the same number.
__version__ = "0.2.0"

__all__ = [
    "FIRST",
    "LAST",
    "NEXT",
    "AsyncClient",
    "AsyncStatusSubscriber",
    "AsyncSubscriber",
    "ChannelInfo",
    "Client",
    "ClusterEvent",
    "Deduplicator",
    "LeveretError",
    "Message",
    "NodeChoice",
    "QueueInfo",
    "StatusSubscriber",
    "StreamMessage",
    "StreamSubscriber",
    "StreamsClient",
    "Subscriber",
    "__version__",
    "credentials",
]
