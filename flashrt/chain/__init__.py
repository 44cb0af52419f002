"""The local chain: stages joined by bounded queues, streaming, cancel, errors naming the stage.

See `flashrt.chain.chain` for the semantics and `flashrt.chain.channel` for the bounded link.
"""

from flashrt.chain.chain import Chain, ChainFull, Request, SlowConsumer, Stage, StageError
from flashrt.chain.channel import Channel

__all__ = ["Chain", "ChainFull", "Request", "SlowConsumer", "Stage", "StageError", "Channel"]
